"""The KServe v2 gRPC service (`grpc_service.proto` as Triton ships it) over the same queues as HTTP.

Each call does what its HTTP twin in `sits_api.v2.routes` does, with the same keys (the
`authorization` metadata), tenants, priorities and messages. The event loop never blocks: what
talks to Redis runs on a small thread pool, and a request waiting for its answer holds a future
(`sits_api.grpc.answers`), not a thread. Errors become gRPC statuses in `sits_api.grpc.status_codes`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from broker.errors import BadInput, ModelNotFound, SitsError, error_for_code
from broker.models import registry
from broker.online import requests
from broker.online.requests import RequestSpec
from broker.queueing import workers
from sits_api.grpc.answers import LoopDelivery, wait_for_result
from sits_api.grpc.keys import identity_of
from sits_api.grpc.messages import infer_response, v2_body
from sits_api.grpc.status_codes import status_of
from sits_api.intake import model_repository, services
from sits_api.intake import requests as request_intake
from sits_api.state import AppState
from sits_api.tenancy import ab_routes, tenant_gate
from sits_api.v2.parsing import InferRequest, parse_infer_request
from sits_api.v2.routes import EXTENSIONS, metadata_of, not_done_in_time, package_version, statistics_of, triton_config

log = logging.getLogger(__name__)

T = TypeVar("T")


class _Headers:
    """gRPC metadata read as request headers are (`ab_routes.caller` asks for `X-SITS-User`)."""

    def __init__(self, metadata: Mapping[str, str]) -> None:
        self._metadata = metadata

    def get(self, name: str, default: str | None = None) -> str | None:
        return self._metadata.get(name.lower(), default)


@dataclass(frozen=True)
class _Submitted:
    """A queued request: what was asked, what was queued, and how to give its tenant's waiting slot back."""

    checked: InferRequest
    spec: RequestSpec
    release: Callable[[], None]


class InferenceService(service_pb2_grpc.GRPCInferenceServiceServicer):
    """The servicer: one per process, over the process's `AppState`; blocking work runs on `pool`."""

    def __init__(self, state: AppState, pool: ThreadPoolExecutor) -> None:
        self.state = state
        self._pool = pool
        self._probe = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sits-grpc-ready")

    async def _run(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`function(*args, **kwargs)` on the pool, awaited (it talks to Redis with redis-py's blocking client)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(function, *args,
                                                                                              **kwargs))

    async def _answer(self, context: Any, function: Callable[..., T], *args: Any) -> T:
        """`function(*args)` on the pool, its errors ending the call as statuses (`_guarded`)."""
        return await _guarded(context, self._run(function, *args))

    async def ServerLive(self, request: Any, context: Any) -> Any:
        """The server answers (no key, as GET /v2/health/live)."""
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        """Redis answers, so work can be queued (no key). Asked on a thread of its own, not the pool's: a
        pool busy with one tenant's calls must not make the server look down to its probes."""
        try:
            await asyncio.get_running_loop().run_in_executor(self._probe, self.state.store.ping)
        except Exception:  # any failure to reach Redis means not ready
            return service_pb2.ServerReadyResponse(ready=False)
        return service_pb2.ServerReadyResponse(ready=True)

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        """The server's name, version and protocol extensions (no key)."""
        return service_pb2.ServerMetadataResponse(name="sits", version=package_version(), extensions=EXTENSIONS)

    async def ModelReady(self, request: Any, context: Any) -> Any:
        """Ready: registered, and a worker is alive to run it; not ready (no error) otherwise, as Triton answers."""
        return await self._answer(context, self._model_ready, request, _metadata(context))

    def _model_ready(self, request: Any, metadata: Mapping[str, str]) -> Any:
        state = self.state
        identity_of(state, metadata, "read")
        try:
            registry.get_model(state.store, _ref(request.name, request.version))
        except ModelNotFound:
            return service_pb2.ModelReadyResponse(ready=False)
        alive = workers.live_stream_slots(state.store, now=time.time(),
                                          timeout=state.settings.scheduler.worker_heartbeat_timeout)
        return service_pb2.ModelReadyResponse(ready=bool(alive))

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        """Inputs and outputs with datatype and shape (-1 for a dynamic axis), as GET /v2/models/<m>."""
        return await self._answer(context, self._model_metadata, request, _metadata(context))

    def _model_metadata(self, request: Any, metadata: Mapping[str, str]) -> Any:
        identity_of(self.state, metadata, "read")
        store = self.state.store
        described = metadata_of(store, registry.get_model(store, _ref(request.name, request.version)))
        return service_pb2.ModelMetadataResponse(
            name=described["name"], versions=[str(version) for version in described["versions"]],
            platform=described["platform"],
            inputs=[service_pb2.ModelMetadataResponse.TensorMetadata(**entry) for entry in described["inputs"]],
            outputs=[service_pb2.ModelMetadataResponse.TensorMetadata(**entry) for entry in described["outputs"]])

    async def ModelConfig(self, request: Any, context: Any) -> Any:
        """Triton's model configuration, as GET /v2/models/<m>/config, as a `ModelConfig` message."""
        return await self._answer(context, self._model_config, request, _metadata(context))

    def _model_config(self, request: Any, metadata: Mapping[str, str]) -> Any:
        identity_of(self.state, metadata, "read")
        settings, store = self.state.settings, self.state.store
        record = registry.get_model(store, _ref(request.name, request.version))
        config = triton_config(record, services.model_batching(settings, record),
                               queue=settings.online.batching_for(record.name))
        return service_pb2.ModelConfigResponse(config=json_format.ParseDict(config, model_config_pb2.ModelConfig()))

    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        """Triton's statistics of every model, one model or one version (`metrics` keys and admins)."""
        return await self._answer(context, self._model_statistics, request, _metadata(context))

    def _model_statistics(self, request: Any, metadata: Mapping[str, str]) -> Any:
        identity_of(self.state, metadata, "statistics")
        if request.version and not request.name:
            raise BadInput("a statistics request that names a version must name its model too")
        entries = statistics_of(self.state.store, request.name or None, request.version or None)
        return json_format.ParseDict({"model_stats": entries}, service_pb2.ModelStatisticsResponse())

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        """The models of the Triton model repository and their state, as POST /v2/repository/index (admins)."""
        return await self._answer(context, self._repository_index, request, _metadata(context))

    def _repository_index(self, request: Any, metadata: Mapping[str, str]) -> Any:
        identity_of(self.state, metadata, "admin")
        entries = model_repository.repository_index(self.state.store, ready_only=request.ready)
        return service_pb2.RepositoryIndexResponse(
            models=[service_pb2.RepositoryIndexResponse.ModelIndex(
                name=entry["name"], version=str(entry.get("version", "")), state=entry["state"],
                reason=entry.get("reason") or "") for entry in entries])

    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        """Load, or load again, a repository model from its folder (admins)."""
        return await self._answer(context, self._repository_load, request, _metadata(context))

    def _repository_load(self, request: Any, metadata: Mapping[str, str]) -> Any:
        identity_of(self.state, metadata, "admin")
        if request.parameters:  # (as over HTTP: Triton's `config` and file overrides; the folder is the one source)
            raise BadInput(f"load parameters {sorted(request.parameters)} are not taken: SITS loads a model from "
                           "its folder as it is; change its config.pbtxt there and load it again")
        model_repository.load_model(self.state.settings, self.state.store, request.model_name, now=time.time())
        return service_pb2.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        """Unload a repository model: its versions are not served until it is loaded again (admins)."""
        return await self._answer(context, self._repository_unload, request, _metadata(context))

    def _repository_unload(self, request: Any, metadata: Mapping[str, str]) -> Any:
        identity_of(self.state, metadata, "admin")
        model_repository.unload_model(self.state.store, request.model_name, now=time.time())
        return service_pb2.RepositoryModelUnloadResponse()

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        """Run one inference request through the scheduler, as POST /v2/models/<m>/infer, and answer
        with its outputs as raw contents."""
        return await _guarded(context, self._infer(request, _metadata(context)))

    async def _infer(self, request: Any, metadata: Mapping[str, str]) -> Any:
        delivery = LoopDelivery(asyncio.get_running_loop())
        request_id = requests.new_request_id()
        with self.state.inbox.expecting(request_id, delivery=delivery) as answer:
            queued = self._pool.submit(self._submit, request, metadata, request_id, answer.reply_to)
            try:
                submitted = await asyncio.wrap_future(queued)
            except asyncio.CancelledError:  # the call ended (cancelled, or past its deadline) meanwhile: a submit
                queued.add_done_callback(_release_submitted)  # not begun is cancelled with it; one that runs on
                raise  # gives its tenant's waiting slot back once done
            try:
                result = await wait_for_result(self.state, delivery, submitted.spec, run=self._run,
                                               seconds=self.state.settings.online.max_wait)
            finally:
                submitted.release()
        spec, checked = submitted.spec, submitted.checked
        if result is None:
            raise not_done_in_time(spec)
        if result.status != "succeeded":  # answered with the status of the error that failed it
            raise error_for_code(result.error_code or BadInput.code, result.error or "the request failed")
        outputs = result.outputs or {}
        return infer_response(spec.model_name, str(spec.model_version),
                              spec.request_id if checked.client_id is None else checked.client_id,
                              {output: outputs[output] for output in checked.outputs or outputs})

    def _submit(self, request: Any, metadata: Mapping[str, str], request_id: str, reply_to: str) -> _Submitted:
        """Check the caller, take its tenant's waiting slot, check the request and its tenant's caps, then queue
        it (blocking: on the pool). The slot is held from here until the answer came (`_Submitted.release`),
        and taken before the request's tensors are decoded: a tenant at its cap costs a key check, not a
        decode of up to `api.max_body_bytes` that holds a pool thread every tenant shares."""
        state = self.state
        settings, store = state.settings, state.store
        identity = identity_of(state, metadata, "infer")
        slot = contextlib.ExitStack()
        slot.enter_context(state.waiting_slot(identity, True))
        try:
            body, binary = v2_body(request, max_bytes=settings.api.max_body_bytes)
            model = _ref(request.model_name, request.model_version) if request.model_version else \
                ab_routes.routed(store, request.model_name, identity, _Headers(metadata), "v2")
            checked = parse_infer_request(store, body, model, binary)
            tenant = tenant_gate.check_model(state.tenants, store, identity, checked.model)
            tenant_gate.check_entitlements(identity, tenant, priority=checked.priority, user_tier=checked.user_tier)
            caps = tenant_gate.caps_of(identity, tenant)
            spec = request_intake.submit(settings, store, state.dispatcher, state.policy, model=checked.model,
                                         inputs=checked.inputs, priority=checked.priority,
                                         deadline_ms=checked.deadline_ms, user_tier=checked.user_tier, tokens=None,
                                         owner=identity["name"], now=time.time(), timeout_ms=checked.deadline_ms,
                                         request_id=request_id, reply_to=reply_to,
                                         tenant=tenant_gate.tenant_of(identity), max_queued=caps.max_queued,
                                         max_queued_bytes=caps.max_queued_bytes,
                                         max_priority=tenant_gate.priority_cap(tenant))
        except BaseException:
            slot.close()
            raise
        return _Submitted(checked, spec, slot.close)


def _release_submitted(done: Future[_Submitted]) -> None:
    """Give back the waiting slot of a request queued for a call that ended before it was (its answer goes to
    its hash alone)."""
    if not done.cancelled() and done.exception() is None:
        done.result().release()


def _ref(name: str, version: str) -> str:
    return f"{name}@{version}" if version else name


def _metadata(context: Any) -> dict[str, str]:
    """The call's metadata as text (binary `-bin` entries left out: none is read)."""
    return {key: value for key, value in context.invocation_metadata() or () if isinstance(value, str)}


async def _guarded(context: Any, call: Awaitable[T]) -> T:
    """What `call` returns; its SitsError ends the call as that error's status (`status_codes`), anything
    else as INTERNAL, logged (nothing the client does may end as a bare stack trace)."""
    try:
        return await call
    except SitsError as err:
        code, details, trailing = status_of(err)
        await context.abort(code, details, trailing_metadata=trailing)
    except Exception:
        log.exception("unexpected error in a gRPC call")
        await context.abort(grpc.StatusCode.INTERNAL, "internal error; see the gRPC server's log")
    raise AssertionError("unreachable: abort raises")

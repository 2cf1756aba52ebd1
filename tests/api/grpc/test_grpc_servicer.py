"""The gRPC servicer's intake against a hostile tenant: what a call costs before its tenant's caps refuse it,
and what a call that ends early leaves held."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from tritonclient.grpc import service_pb2

from broker.config.settings import Settings
from broker.errors import QueueFull
from broker.state.store import Store
from broker.tenants.apikeys import create_api_key
from sits_api.grpc.server import process_state
from sits_api.grpc.servicer import InferenceService, _Submitted


def test_a_tenant_at_its_waiting_cap_is_refused_before_its_tensors_are_decoded(settings: Settings,
                                                                               store: Store) -> None:
    state = process_state(settings)
    service = InferenceService(state, ThreadPoolExecutor(1))
    key = create_api_key(store, "capped-user", "user", tenant="capped")
    held = [state.wait_slots.take("capped", settings.api.max_waits_per_tenant)
            for _ in range(settings.api.max_waits_per_tenant)]
    request = service_pb2.ModelInferRequest(model_name="mlp")
    tensor = request.inputs.add(name="features", datatype="FP32", shape=[1, 64])
    tensor.contents.fp32_contents.extend([0.5] * 63)  # (one value short: decoded, a BadInput)
    with pytest.raises(QueueFull, match="tenant 'capped' has 8"):
        service._submit(request, {"authorization": f"Bearer {key}"}, "r0000000000000001", "")
    for release in held:
        release()
    with pytest.raises(Exception, match="63 values"):  # (below its cap, the request itself is what is wrong)
        service._submit(request, {"authorization": f"Bearer {key}"}, "r0000000000000002", "")


def test_a_call_that_ends_while_its_request_is_being_queued_gives_its_tenants_slot_back(settings: Settings) -> None:
    pool = ThreadPoolExecutor(1)
    service = InferenceService(process_state(settings), pool)
    began, go, released = threading.Event(), threading.Event(), []

    def slow_submit(*_: object) -> _Submitted:  # (queued, its slot held, while the call is cancelled)
        began.set()
        go.wait(10)
        return _Submitted(checked=None, spec=None, release=lambda: released.append(1))  # type: ignore[arg-type]

    service._submit = slow_submit  # type: ignore[method-assign]

    async def cancelled_call() -> None:
        call = asyncio.create_task(service._infer(service_pb2.ModelInferRequest(), {}))
        assert await asyncio.get_running_loop().run_in_executor(None, began.wait, 10)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    asyncio.run(cancelled_call())
    go.set()
    pool.shutdown(wait=True)
    assert released == [1]

"""The gRPC server: one `grpc.aio` server on `api.host:api.grpc_port` with the KServe v2 service.

One process, one event loop. Protobuf is parsed in C, a waiting request holds a future rather than
a thread (`sits_api.grpc.answers`), and the calls that talk to Redis with redis-py's blocking client
run on `SUBMIT_THREADS` threads, each with its own held Redis connection (`broker.state.store`).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
from tritonclient.grpc import service_pb2_grpc

from broker.config.settings import Settings
from broker.errors import ConfigError
from broker.queueing import policy
from broker.state.store import Store
from broker.tenants.records import TenantTable
from sits_api.grpc.servicer import InferenceService
from sits_api.intake.result_inbox import ResultInbox
from sits_api.intake.task_sender import Dispatcher
from sits_api.metrics import SitsCollector
from sits_api.state import AppState

log = logging.getLogger(__name__)

SUBMIT_THREADS = 8
"""Threads for the blocking calls (checking a key, queueing a request): each is a few Redis round trips,
so a few threads keep up with many waiting requests."""

MAX_CONCURRENT_CALLS = 256
"""Most calls the server holds at once; one more is refused at once (RESOURCE_EXHAUSTED). Each may hold a
message of up to `api.max_body_bytes`; a tenant's own waiting calls are capped lower
(`api.max_waits_per_tenant`), this bounds all of them together."""

STOP_GRACE_SECONDS = 5.0
"""How long calls in progress may finish after SIGTERM before the server closes."""


def process_state(settings: Settings) -> AppState:
    """The state the service reads, as the HTTP API's process holds it (`sits_api.app.create_app`)."""
    store = Store.of(settings.redis)
    return AppState(settings=settings, store=store, dispatcher=Dispatcher(settings, store),
                    policy=policy.LivePolicy(store, default=policy.default_ordering(settings.scheduler.policy)),
                    inbox=ResultInbox(store), metrics=SitsCollector(store, settings),
                    tenants=TenantTable(settings.tenants))


async def serve(settings: Settings) -> None:
    """Serve the service on `api.grpc_address()` until SIGTERM or SIGINT."""
    address = settings.api.grpc_address()
    if not address:
        raise ConfigError("api.grpc_port is 0, so no gRPC server runs; set it (8001, Triton's) to serve gRPC")
    pool = ThreadPoolExecutor(max_workers=SUBMIT_THREADS, thread_name_prefix="sits-grpc")
    server = grpc.aio.server(maximum_concurrent_rpcs=MAX_CONCURRENT_CALLS,
                             options=[("grpc.max_receive_message_length", settings.api.max_body_bytes),
                                      ("grpc.max_send_message_length", -1),
                                      ("grpc.so_reuseport", 0)])  # (a second server on the port fails to bind)
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceService(process_state(settings), pool),
                                                                server)
    try:
        server.add_insecure_port(address)
    except RuntimeError as err:
        raise ConfigError(f"the gRPC server cannot listen on {address} ({err}): another program may use that "
                          "port; choose another with api.grpc_port") from err
    await server.start()
    print(f"SITS gRPC listening on {address}", flush=True)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
    await server.stop(STOP_GRACE_SECONDS)
    pool.shutdown(wait=False, cancel_futures=True)

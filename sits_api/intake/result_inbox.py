"""Waiting for online results: one waiter thread per API process, for all of its waiting requests.

A request that waits for its answer names this process's inbox (`keys.inbox`) as its `reply_to`;
the worker that completes it pushes the finished request's fields there (`complete_requests.lua`).
One thread blocks on the inbox, hands the result it popped to the request thread that waits for it,
then takes whatever else has arrived in one more call and hands those over. Per waiting request that
is a fraction of one Redis round trip instead of a blocking call of its own, and Redis holds one
blocked client per API process instead of one per waiting request.

Nothing lives only here: the result is stored in the request's hash before it is pushed, so a
result that comes after its waiter gave up (or after this process died) is still there for
`GET /v1/requests/<id>`; an inbox nobody drains expires `requests.INBOX_KEEP_SECONDS` after its last push,
and each copy in it counts against its tenant's `max_queued_bytes` meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import orjson

from broker.errors import SitsError
from broker.online import requests
from broker.online.records import RequestRecord
from broker.state.held_calls import send_held
from broker.state.store import Store, translate_redis_errors

log = logging.getLogger(__name__)

BLOCK_SECONDS = 2.0
"""How long one blocking pop waits (below redis-py's socket timeout, so an idle inbox never trips it)."""

DRAIN_COUNT = 256
"""Results taken per call once the blocking pop has returned one: those that arrived together."""

RETRY_SECONDS = 0.5
"""How long the waiter pauses after Redis failed it, before it tries again (waiters time out as usual)."""


class Delivery:
    """One waiting request's result, as the waiter thread hands it over: a bare lock, held until the
    result is in (the cheapest wake-up between two Python threads). Only the process's one waiter
    thread puts; any number of takes may read."""

    __slots__ = ("_ready", "fields")

    def __init__(self) -> None:
        self._ready = threading.Lock()
        self._ready.acquire()
        self.fields: dict[str, Any] | None = None

    def put(self, fields: dict[str, Any]) -> None:
        """Hand the result over (the first one only; called by the waiter thread alone)."""
        if self.fields is None:
            self.fields = fields
            self._ready.release()

    def take(self, timeout: float) -> dict[str, Any] | None:
        """The result once it is in, waiting up to `timeout` seconds for it; None if it did not come."""
        if not self._ready.acquire(timeout=max(timeout, 0.0)):
            return None
        self._ready.release()  # (a later take returns at once)
        return self.fields


class Answer:
    """What one request holds while it waits: where its result goes, and the result once it is there."""

    def __init__(self, delivery: Delivery | None, reply_to: str) -> None:
        self._delivery = delivery
        self.reply_to = reply_to
        """The request's `reply_to`: this process's inbox, or '' for a request nobody waits for here."""

    def wait(self, timeout: float) -> RequestRecord | None:
        """The finished request as `requests.get_request` reports it, or None if it is not done in
        `timeout` (at once for a request nobody waits for)."""
        if self._delivery is None:
            return None
        fields = self._delivery.take(timeout)
        return None if fields is None else requests.record_from_fields(fields)


class ResultInbox:
    """This process's inbox and the thread that delivers what arrives in it.

    Made once per app. The key belongs to the process that uses it, so a copy inherited through
    `fork` (gunicorn's workers) takes a key of its own on first use. The waiter thread runs while
    requests wait: it stops after a blocking pop that brought nothing while none waited, and the
    next waiting request starts it again.
    """

    def __init__(self, store: Store, *, block_seconds: float = BLOCK_SECONDS) -> None:
        self._store = store
        self._block_seconds = block_seconds
        self._lock = threading.Lock()
        self._pid = -1
        self._key = ""
        self._waiting: dict[str, Delivery] = {}
        self._delivering = False

    @property
    def key(self) -> str:
        """The inbox LIST of this process: the `reply_to` of the requests it waits for."""
        with self._lock:
            return self._own_key()

    @contextlib.contextmanager
    def expecting(self, request_id: str, *, wait: bool = True, delivery: Delivery | None = None) -> Iterator[Answer]:
        """Register `request_id` as waited for (before it is submitted, so no result can come first),
        and forget it on leaving, whether the answer came or not. Without `wait`, nothing is registered
        and the answer says so: the request keeps its result to itself (`GET /v1/requests/<id>`).
        `delivery` is where the result is handed over (a fresh `Delivery` by default; the gRPC server's
        wakes its event loop: `sits_api.grpc.answers`)."""
        if not wait:
            yield Answer(None, "")
            return
        delivery = delivery or Delivery()
        with self._lock:
            key = self._own_key()
            self._waiting[request_id] = delivery
            if not self._delivering:
                self._delivering = True
                threading.Thread(target=self._deliver_while_waited_for, args=(key,), name="sits-result-inbox",
                                 daemon=True).start()
        try:
            yield Answer(delivery, key)
        finally:
            with self._lock:
                self._waiting.pop(request_id, None)

    def waiting(self) -> int:
        """How many requests of this process wait for their result now."""
        with self._lock:
            return len(self._waiting)

    def _own_key(self) -> str:
        """This process's key (made on first use in each process); called with the lock held."""
        if self._pid != os.getpid():  # (in a forked child: the parent's waiters and thread are not its own)
            self._pid = os.getpid()
            self._key = self._store.keys.inbox(f"{socket.gethostname()}:{self._pid}:{secrets.token_hex(4)}")
            self._waiting, self._delivering = {}, False
        return self._key

    def _deliver_while_waited_for(self, key: str) -> None:
        """The waiter thread: block on the inbox, hand over what the pop brought, then drain and hand over
        what came with it; stop once a pop brought nothing and no request waits.

        Nothing stops it while requests wait: a failure (Redis away or busy, an entry it cannot read) is
        logged and the pops go on after a pause, as the waiters' timeouts run meanwhile. Should it end
        anyway, it says so on the way out, so that the next waiting request starts another."""
        stopped = False
        try:
            while True:
                try:
                    first = self._pop(key)
                    if first is not None:
                        self._deliver(first)  # (before the drain: a lone result waits for no second round trip)
                        self._drain(key)
                except SitsError as err:  # Redis unreachable or busy: waiters time out meanwhile, as they would
                    log.warning("result inbox %s: %s", key, err.message)
                    first = None
                    time.sleep(RETRY_SECONDS)
                except Exception:  # (a thread that died here would leave every later waiter of this process unanswered)
                    log.exception("result inbox %s: delivery failed; popping again in %s s", key, RETRY_SECONDS)
                    first = None
                    time.sleep(RETRY_SECONDS)
                with self._lock:
                    if first is None and not self._waiting:
                        self._delivering, stopped = False, True
                        return
        finally:
            if not stopped:  # (ended by what no handler above took: a KeyboardInterrupt, a MemoryError)
                with self._lock:
                    self._delivering = False

    def _pop(self, key: str) -> str | None:
        """The next result in the inbox, waiting up to the block time for one (None: none came)."""
        client = self._store.client
        with translate_redis_errors():
            popped = send_held(client, [("BLPOP", key, self._block_seconds)],
                               lambda: [client.blpop([key], timeout=self._block_seconds)])[0]
        return popped[1] if popped else None

    def _drain(self, key: str) -> None:
        """Hand over what else the inbox holds now, `DRAIN_COUNT` a call, each call's results before the next
        (a call that fails leaves no result it took undelivered)."""
        client = self._store.client
        with translate_redis_errors():
            while more := send_held(client, [("LPOP", key, DRAIN_COUNT)], lambda: [client.lpop(key, DRAIN_COUNT)])[0]:
                for text in more:
                    self._deliver(text)
                if len(more) < DRAIN_COUNT:
                    return

    def _deliver(self, text: str) -> None:
        """Hand one popped result to its waiter; an entry that is no result's fields is logged and dropped
        (the results popped with it are still handed over)."""
        try:
            fields = orjson.loads(text)
        except orjson.JSONDecodeError:
            fields = None
        if not isinstance(fields, dict):
            log.warning("result inbox: dropped an entry that is no result's fields: %.80r", text)
            return
        with self._lock:
            delivery = self._waiting.get(fields.get("id", ""))
        if delivery is not None:  # (none: its waiter gave up; the hash has the result)
            delivery.put(fields)

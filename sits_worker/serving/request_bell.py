"""Whether an online request was queued since a running job chunk last looked.

A chunk looks between its mini-batches for online work to serve first (`between_minibatches.py`): an
outranking request, a tenant taking its share back, riders. Each look is a Redis round trip, and with
a short preemption target it comes every few milliseconds, which costs a chunk a sixth of its rate when
no request comes at all. So every script that makes an online request wait (a submit, a lease returned
or reaped: `lib.lua`'s `announce_waiting`) also publishes on its model's waiting-requests key name, and
a thread of the worker counts those messages: a look with nothing announced since the last one is
skipped, down to one every `scheduler.yield_check_interval` (which also catches what a publish cannot
tell: a waiting request raised by a PSA jump or a re-score).

The thread starts with the first look and ends after `IDLE_SECONDS` without one, so a worker that only
serves online batches holds no subscription. While it is not subscribed (starting, Redis away) every
look goes ahead: a missed message can delay a look, never lose a request.

A message Redis has sent is seen at once, before the thread is scheduled to read it: `unread` tells
when the subscription's socket holds bytes not read yet (a `poll` that reads nothing), and a look then
goes ahead too. On a loaded host the thread's wake-up took up to 4 ms, a look's whole budget under a
5 ms preemption target. (The bytes may be no announcement, a health check's reply: a look too many,
never one missed, since the count itself stays what the thread counted.)

While a chunk's mini-batch runs, the thread also calls the chunk's early look after each announcement
it counts (`calling`): the look that would wait for the mini-batch's end is taken while it runs, and the
batch it leases runs at the boundary.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator

from redis.client import PubSub

from broker.state.store import Store

log = logging.getLogger(__name__)

IDLE_SECONDS = 10.0
"""How long the subscription stays without a look asking for it."""
RETRY_SECONDS = 1.0
"""How long the thread waits before subscribing again after Redis went away."""


class RequestBell:
    """The announcements of waiting online requests, counted for one worker process; thread-safe."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._pattern = store.keys.waiting_requests("*")
        self._rings = 0
        self._listening = False
        self._pubsub: PubSub | None = None
        """The subscription while listening."""
        self._asked_at = time.monotonic()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._hooks: dict[int, Callable[[], bool]] = {}
        """What `calling` registered, by registration number (called in that order)."""
        self._numbers = itertools.count()

    def mark(self) -> int | None:
        """The announcements counted so far, or None when none can be counted now (not subscribed): a
        look compares it with the mark of its last look, and goes ahead when they differ or it is None."""
        self._asked_at = time.monotonic()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._listen, name="sits-request-bell", daemon=True)
                self._thread.start()
        return self.count()

    def count(self) -> int | None:
        """`mark` without asking for the subscription: what a drain loop reads before each lease, which must
        not keep a worker that serves only online batches subscribed. None while not subscribed."""
        return self._rings if self._listening else None

    def unread(self) -> bool:
        """Whether the subscription holds bytes its thread has not read yet: likely an announcement not
        counted yet. The socket is read at each call (redis-py may have connected again meanwhile)."""
        connection = getattr(self._pubsub, "connection", None) if self._listening else None
        return unread_bytes(getattr(connection, "_sock", None))  # (redis-py keeps it as `_sock`)

    @contextlib.contextmanager
    def calling(self, hook: Callable[[], bool]) -> Iterator[None]:
        """Call `hook` on the bell's thread after each announcement counted while the block runs (a running
        mini-batch's early look); the first hook that returns True (it took the announced work) ends that
        announcement's round. A hook that raises is logged and the others go on."""
        number = next(self._numbers)
        self._asked_at = time.monotonic()  # (a chunk whose looks all come early still needs the subscription)
        with self._lock:
            self._hooks[number] = hook
        try:
            yield
        finally:
            with self._lock:
                del self._hooks[number]

    def _call_hooks(self) -> None:
        with self._lock:
            hooks = list(self._hooks.values())
        for hook in hooks:
            try:
                if hook():
                    return
            except Exception:  # (a hook's bug must not take the subscription down)
                log.exception("request bell: a hook failed")

    def _listen(self) -> None:
        while time.monotonic() - self._asked_at < IDLE_SECONDS:
            pubsub = self._store.pooled_client.pubsub()
            try:
                pubsub.psubscribe(self._pattern)
                confirmed = pubsub.get_message(timeout=RETRY_SECONDS)  # (what Redis publishes from its
                if confirmed is None or confirmed["type"] != "psubscribe":  # confirmation on reaches here)
                    raise TimeoutError(f"Redis did not confirm the subscription within {RETRY_SECONDS:g}s")
                self._rings += 1  # (what came before is not known: the next look goes ahead)
                self._pubsub = pubsub
                self._listening = True
                while time.monotonic() - self._asked_at < IDLE_SECONDS:
                    message = pubsub.get_message(timeout=1.0)
                    if message is not None and message["type"] == "pmessage":
                        self._rings += 1
                        if self._hooks:
                            self._call_hooks()
            except Exception as err:  # Redis away: look every time meanwhile, subscribe again soon
                self._listening = False
                log.warning("request bell: %s; running chunks look for online work at every interval meanwhile", err)
                time.sleep(RETRY_SECONDS)
            finally:
                self._listening = False
                self._pubsub = None
                pubsub.close()


def unread_bytes(sock: socket.socket | None) -> bool:
    """Whether `sock` holds bytes not read yet, without reading them (False for None or a closed socket).
    `poll` where there is one: `select` refuses descriptors past 1023, which a busy worker may hold."""
    if sock is None:
        return False
    try:
        if hasattr(select, "poll"):
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            return bool(poller.poll(0))
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):  # (closed meanwhile: the thread is subscribing again)
        return False
    return bool(readable)

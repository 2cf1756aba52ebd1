"""The API's HTTP figures: every answer counted by route, method and status, and timed, for /metrics.

gunicorn runs several API processes, and compose or Kubernetes several replicas: a count kept in one
process would be that process's alone, and a scrape reaches one process. So each process counts its
answers in memory, where an answer costs a dict update and no round trip, and a thread of its own adds
them to Redis every `FLUSH_SECONDS` (`broker.monitoring.http_stats`); the process a scrape reaches adds
its own first. Counts made while Redis is away are added once it is back.

Labels never carry what a client typed: the route is the matched URL rule's template, one label for
every path no rule matches, and an unusual method is `other`, so random paths and methods cannot grow
the series without bound.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref

from flask import Flask, Response, g, request

from broker.errors import SitsError
from broker.monitoring import http_stats
from broker.monitoring.histograms import Tally
from broker.state.store import Store

log = logging.getLogger(__name__)

FLUSH_SECONDS = 1.0
"""How often a process adds its counts to Redis: a scrape sees another process's answers this late at most."""


class HttpCounts:
    """One API process's HTTP answers not yet added to Redis, and the thread that adds them."""

    def __init__(self, store: Store, interval: float | None = None) -> None:
        self._store = store
        self._interval = FLUSH_SECONDS if interval is None else interval
        self._tally = Tally()
        self._lock = threading.Lock()
        self._pid = -1
        self._failing = False

    def record(self, route: str, method: str, status: int, seconds: float) -> None:
        """Count one answer; starts this process's flush thread on its first."""
        http_stats.observe_answer(self._tally, route, http_stats.method_label(method), status, seconds)
        if self._pid != os.getpid():
            self._start_flushing()

    def flush(self) -> None:
        """Add the counts to Redis now; when Redis cannot take them, they wait for the next flush (logged
        once until one succeeds)."""
        try:
            self._tally.flush(self._store, self._store.keys.http_requests)
        except SitsError as err:
            if not self._failing:
                log.warning("HTTP counts not added to Redis (kept for the next try): %s", err.message)
            self._failing = True
            return
        self._failing = False

    def _start_flushing(self) -> None:
        with self._lock:
            if self._pid == os.getpid():
                return
            self._pid = os.getpid()  # (a forked child starts its own: threads do not cross a fork)
        threading.Thread(target=_flush_while_kept, args=(weakref.ref(self), self._interval), name="sits-http-counts",
                         daemon=True).start()


def _flush_while_kept(counts: weakref.ref[HttpCounts], interval: float) -> None:
    """The flush thread: flush every `interval` for as long as the counts' app exists (tests make many)."""
    while True:
        time.sleep(interval)
        kept = counts()
        if kept is None:
            return
        try:
            kept.flush()
        except Exception:  # (a thread that died here would leave the process's later answers uncounted)
            log.exception("HTTP counts: flush failed; trying again in %s s", interval)
        del kept


def instrument_app(app: Flask, counts: HttpCounts) -> None:
    """Count and time each of `app`'s answers in `counts`. Call it before any other request hook is added
    (tracing's aside): its timer then starts first, and its count comes after every other hook, a
    refusal by one of them (a wrong key's 401) included."""

    def start_timer() -> None:
        g.sits_http_started = time.perf_counter()

    def count_answer(response: Response) -> Response:
        started = g.get("sits_http_started")
        rule = request.url_rule
        counts.record(rule.rule if rule is not None else http_stats.UNMATCHED_ROUTE, request.method,
                      response.status_code, time.perf_counter() - started if started is not None else 0.0)
        return response

    app.before_request(start_timer)
    app.after_request(count_answer)

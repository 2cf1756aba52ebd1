"""The API's HTTP figures of /metrics: answers by route, method and status, and their time by route.

Each API process counts its answers in memory and adds them to `keys.http_requests` about every
second (`histograms.Tally.flush`, `sits_api/http/request_metrics.py`), so that every process and
replica is counted and any of them answers a scrape with the fleet's totals. The labels come from
small sets whatever a client sends: the route is the URL rule's template (`/v1/jobs/<job_id>`),
`UNMATCHED_ROUTE` for a path no rule matches, and a method outside `METHODS` is `OTHER_METHOD`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from broker.monitoring.histograms import Histogram, Tally, decode
from broker.monitoring.sla_metrics import LATENCY_BUCKETS

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
"""The methods counted by name."""

OTHER_METHOD = "other"
UNMATCHED_ROUTE = "unmatched"
"""The route of a request whose path matches no rule (a 404 or a redirect before any view)."""

_COUNT, _SECONDS = "count", "seconds"


@dataclass(frozen=True)
class HttpStats:
    """One reading of `keys.http_requests`."""

    answers: dict[tuple[str, str, str], int]
    """(Route, method, status) -> answers given."""
    seconds: dict[tuple[str, str], Histogram]
    """(Route, method) -> the histogram of their time, from the first request hook to the last (seconds)."""


def method_label(method: str) -> str:
    """The method's label: itself when it is one of `METHODS`, else `OTHER_METHOD`."""
    return method if method in METHODS else OTHER_METHOD


def observe_answer(tally: Tally, route: str, method: str, status: int, seconds: float) -> None:
    """Count one answer (its `route` and `method` already labels) into `tally`."""
    tally.add(f"{_COUNT}|{route}|{method}|{status}")
    tally.observe(f"{_SECONDS}|{route}|{method}", seconds, LATENCY_BUCKETS, scale=1e9)


def decode_http(raw: Mapping[str, str]) -> HttpStats:
    """`keys.http_requests` as HGETALL reads it, as `HttpStats`."""
    answers: dict[tuple[str, str, str], int] = {}
    timings: dict[str, str] = {}
    for field, value in raw.items():
        kind, _, rest = field.partition("|")
        if kind == _COUNT:
            route, method, status = rest.rsplit("|", 2)
            answers[(route, method, status)] = int(value)
        elif kind == _SECONDS:
            timings[rest] = value
    seconds = {}
    for series, histogram in decode(timings, len(LATENCY_BUCKETS) + 1, sum_scale=1e9).items():
        route, _, method = series.rpartition("|")
        seconds[(route, method)] = histogram
    return HttpStats(answers, seconds)

"""What each tenant used: the decayed device time fair share ranks by, and the daily bills chargeback
reports.

A worker bills every run it makes (`sits_worker/tenancy/usage_meter.py`): the run's measured device time is
split over the tenants in it by rows (`tenant_shares.attribute`), and each part is added, in one Lua
call (`note_usage.lua`), to the tenant's decayed usage (`keys.tenant_usage`) and to its bill of the
UTC day (`keys.tenant_bill`): totals, and the same by model version, by API key and by device kind.
Jobs are counted on the bill when they are submitted (`count_job`), failed requests when they are
completed (`requests.complete_requests`).

`usage_report` answers `GET /v1/usage` and `sitsctl usage` from the bills: per tenant, or per tenant
and model, key or day, with a cost at a configured price per device-hour of each device kind. A report
by tenant, by day or of one key reads the few fields it needs of each bill; one by model, by device or of
every key reads the whole bills, a few days at a time, and a tenant runs one such at a time, with a
rest after it (`one_report_at_a_time`). `report_for_key` is the report an API key may see.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import orjson

from broker.errors import BadInput, QueueFull
from broker.state.holds import take_hold
from broker.state.store import Store, translate_redis_errors
from broker.tenants.apikeys import key_tenant
from broker.tenants.shares import Usage

BILL_KEEP_SECONDS = 400 * 86_400
"""How long a day's bill is kept after its last change (a year and a month)."""

Breakdown = Literal["tenant", "model", "key", "day", "device"]
BREAKDOWNS: tuple[Breakdown, ...] = ("tenant", "model", "key", "day", "device")
TOTALS = ("device_seconds", "rows", "requests", "failed", "jobs", "queue_seconds")
WHOLE_BILLS_PER_CALL = 32
"""Whole bills read per Redis round trip: each may hold thousands of fields (by model and key), and Redis
serves no other client while it answers one call's reads."""
FIELD_READS_PER_CALL = 512
"""Bills read per round trip when only a few fields of each are read."""
REPORT_HOLD_MS = 30_000
"""How long a tenant's running report of whole bills holds its place (`one_report_at_a_time`) when its API
process dies before giving it back."""
REPORT_REST_FACTOR = 3
"""A report of whole bills keeps its tenant's place this many times as long as it ran, once done: one
tenant's reports in a loop take at most a quarter of one API thread and of what they cost Redis."""
REPORT_RETRY_AFTER_SECONDS = 1
"""The least Retry-After of a report refused its tenant's place: the rest left, where one rests, else this (most
reports of a year end within a second)."""
OWN_KEY_ROWS_ONLY = ("user",)
"""Roles whose keys see only their own key's rows in a report by key (`report_for_key`)."""


@dataclass(frozen=True)
class BillEntry:
    """One tenant's part of one run (or of several runs of the same model, key and device)."""

    tenant: str
    owner: str
    model: str
    device: str
    seconds: float
    rows: int
    requests: int = 0
    queue_seconds: float = 0.0
    billed: bool = True
    """False for a charge to the usage fair share ranks by alone, on no bill: the estimated run of requests a
    worker leased and did not run (`sits_worker.tenancy.usage_meter.UsageMeter.charge`)."""


def day_number(at: float) -> int:
    """The UTC day of the unix time `at`, as days since 1970-01-01."""
    return int(at // 86_400)


def note_usage(store: Store, entries: Sequence[BillEntry], *, now: float, half_life: float) -> None:
    """Add `entries` to their tenants' decayed usage and to their bills of today, in one call."""
    if not entries:
        return
    keys = store.keys
    day = day_number(now)
    with translate_redis_errors():
        store.scripts.note_usage(
            keys=[keys.tenant_usage, keys.usage_tenants, keys.counters,
                  *(keys.tenant_bill(entry.tenant, day) for entry in entries)],
            args=[now, half_life, day, orjson.dumps([asdict(entry) for entry in entries],
                                                    option=orjson.OPT_SERIALIZE_NUMPY), BILL_KEEP_SECONDS])


def count_job(store: Store, *, tenant: str, owner: str, model: str, now: float) -> None:
    """Count a submitted job on its tenant's bill of today (total and by model and key)."""
    keys, day = store.keys, day_number(now)
    bill = keys.tenant_bill(tenant, day)
    with translate_redis_errors(), store.client.pipeline(transaction=True) as pipe:
        pipe.hincrby(bill, "jobs", 1)
        pipe.hincrby(bill, f"model:{model}:jobs", 1)
        pipe.hincrby(bill, f"key:{owner}:jobs", 1)
        pipe.expire(bill, BILL_KEEP_SECONDS)
        pipe.zadd(keys.usage_tenants, {tenant: day})
        pipe.execute()


def read_usage(store: Store) -> dict[str, Usage]:
    """Every tenant's decayed usage as last noted (decay it to now with `tenant_shares.decayed`)."""
    with translate_redis_errors():
        raw = store.client.hgetall(store.keys.tenant_usage)
    usage = {}
    for tenant, text in raw.items():
        try:
            fields = json.loads(text)
            usage[tenant] = Usage(float(fields["value"]), float(fields["at"]))
        except (ValueError, KeyError, TypeError):
            continue
    return usage


def parse_day(text: str | None, what: str, default: int) -> int:
    """A UTC date (YYYY-MM-DD) as a day number; `default` when not given; BadInput saying how to write one."""
    if not text:
        return default
    try:
        date = dt.date.fromisoformat(text.strip())
    except ValueError as err:
        raise BadInput(f"{what} must be a date like 2026-12-01 (UTC), got {text!r}") from err
    return (date - dt.date(1970, 1, 1)).days


def day_text(day: int) -> str:
    """A day number as its UTC date."""
    return (dt.date(1970, 1, 1) + dt.timedelta(days=day)).isoformat()


def billed_tenants(store: Store) -> list[str]:
    """Every tenant with a bill."""
    with translate_redis_errors():
        return sorted(store.client.zrange(store.keys.usage_tenants, 0, -1))


def reads_whole_bills(by: Breakdown, key: str | None = None) -> bool:
    """Whether a report `by` (of one `key` alone, by key) reads whole bills: by model, by device kind and of
    every key it does, for the names in a bill are not known before it is read."""
    return by in ("model", "device") or (by == "key" and key is None)


@contextlib.contextmanager
def one_report_at_a_time(store: Store, tenant: str, *,
                         clock: Callable[[], float] = time.monotonic) -> Iterator[None]:
    """The place of `tenant`'s one report of whole bills (`reads_whole_bills`) for the block's length, and
    `REPORT_REST_FACTOR` times as long after; QueueFull (429) while another of its reports holds it. A year of
    bills by model costs Redis about a tenth of a second and the API half a second: one tenant's reports in a
    loop must not take them from every other tenant."""
    hold = take_hold(store, store.keys.usage_report_hold(tenant), REPORT_HOLD_MS)
    if hold is None:  # (told when its own tenant's place frees: the rest after a report, or about when one ends)
        with translate_redis_errors():
            left_ms = store.client.pttl(store.keys.usage_report_hold(tenant))
        resting = 0 < left_ms < REPORT_HOLD_MS - 2_000  # (a running report's place holds about REPORT_HOLD_MS)
        retry_after = max(REPORT_RETRY_AFTER_SECONDS, math.ceil(left_ms / 1000)) if resting else \
            REPORT_RETRY_AFTER_SECONDS
        raise QueueFull(f"tenant '{tenant}' ran a usage report by model, key or device a moment ago, or runs one; "
                        f"retry after {retry_after} s (Retry-After)", retry_after=retry_after)
    started = clock()
    try:
        yield
    finally:
        rest_ms = int((clock() - started) * REPORT_REST_FACTOR * 1000)
        if rest_ms > 0:
            replace(hold, hold_ms=rest_ms).renew()
        else:
            hold.drop()


def usage_report(store: Store, tenants: Iterable[str], *, first_day: int, last_day: int, by: Breakdown,
                 prices: Mapping[str, float], key: str | None = None) -> list[dict[str, Any]]:
    """Rows of usage from the bills of `tenants` for the days `first_day`..`last_day` (inclusive): one
    per tenant (`by` tenant), or per tenant and model, key, day or device kind; by key, with `key`, only
    that key's rows. Each row has every total (`TOTALS`) and its `cost`: device-seconds of each device kind
    at `prices` per device-hour (a kind without a price costs nothing; a model's or key's part of a day
    costs its share of the day's device-seconds at the day's prices)."""
    if last_day < first_day:
        raise BadInput(f"'from' ({day_text(first_day)}) is after 'to' ({day_text(last_day)})")
    if last_day - first_day > 400:
        raise BadInput("a usage report spans at most 400 days; narrow 'from' and 'to'")
    names = list(tenants)
    days = range(first_day, last_day + 1)
    bills = _read_bills(store, [store.keys.tenant_bill(tenant, day) for tenant in names for day in days],
                        None if reads_whole_bills(by, key) else _fields_read(by, key, prices))
    rows: dict[tuple[str, str], dict[str, float]] = {}
    for index, bill in enumerate(bills):
        tenant, day = names[index // len(days)], days[index % len(days)]
        day_seconds, day_cost = float(bill.get("device_seconds", 0) or 0), _cost(bill, prices)
        for part, totals in _parts(bill, by, day).items():
            row = rows.setdefault((tenant, part), dict.fromkeys((*TOTALS, "cost"), 0.0))
            for name, value in totals.items():
                row[name] = row.get(name, 0.0) + value
            seconds = totals.get("device_seconds", 0.0)
            if by == "device":  # a device kind's own price
                row["cost"] += seconds / 3600 * prices.get(part, 0.0)
            elif day_seconds:  # a share of the day's cost (its device kinds' prices) by device-seconds
                row["cost"] += day_cost * seconds / day_seconds
    return [{"tenant": tenant, **({by: part} if by != "tenant" else {}), **_typed(row)}
            for (tenant, part), row in sorted(rows.items())]


def report_for_key(store: Store, identity: dict[str, Any], tenants: Sequence[str], *, first_day: int, last_day: int,
                   by: Breakdown, prices: Mapping[str, float]) -> list[dict[str, Any]]:
    """The rows of `usage_report` of `tenants` that the API key of `identity` may see (its caller chose
    `tenants`: its own alone for any key but an admin's); QueueFull (429) while another report of whole
    bills of its tenant runs or rests (`one_report_at_a_time`; an admin key's, an operator's, are not counted).

    By key, a user key sees its own key's rows alone: it reads its own work, not its tenant's other keys'
    (nor their names: `GET /v1/keys` refuses it too). A viewer sees every key's: it reads its tenant's
    work, owners included, and submits nothing, so a row of its own would always be empty."""
    role = identity.get("role")
    key = str(identity.get("name") or "") if by == "key" and role in OWN_KEY_ROWS_ONLY else None
    slot: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if role != "admin" and reads_whole_bills(by, key):
        slot = one_report_at_a_time(store, key_tenant(identity))
    with slot:
        return usage_report(store, tenants, first_day=first_day, last_day=last_day, by=by, prices=prices, key=key)


def _fields_read(by: Breakdown, key: str | None, prices: Mapping[str, float]) -> list[str]:
    """The fields of a bill a report `by` tenant, by day or of one `key` reads: the totals, the device-seconds
    of each priced device kind (what the day costs), and the key's own totals."""
    fields = [*TOTALS, *(f"device:{kind}:device_seconds" for kind in prices)]
    if by == "key" and key is not None:
        fields += [f"key:{key}:{total}" for total in TOTALS]
    return fields


def _read_bills(store: Store, bills: Sequence[str], fields: Sequence[str] | None) -> list[dict[str, str]]:
    """Each of `bills` as {field: value}: all its fields (`fields` None) or those of `fields` it has; a few
    bills per round trip, so that Redis serves other clients between them."""
    per_call = WHOLE_BILLS_PER_CALL if fields is None else FIELD_READS_PER_CALL
    read: list[dict[str, str]] = []
    with translate_redis_errors():
        for start in range(0, len(bills), per_call):
            with store.client.pipeline(transaction=False) as pipe:
                for bill in bills[start:start + per_call]:
                    if fields is None:
                        pipe.hgetall(bill)
                    else:
                        pipe.hmget(bill, fields)
                answers = pipe.execute()
            read += answers if fields is None else [
                {field: value for field, value in zip(fields, values, strict=True) if value is not None}
                for values in answers]
    return read


def _parts(bill: Mapping[str, str], by: Breakdown, day: int) -> dict[str, dict[str, float]]:
    """A day's bill as {part: totals}: one part ('') for `tenant`, the day's date for `day`, else one per
    model, key or device kind that it names."""
    if not bill:
        return {}
    if by in ("tenant", "day"):
        return {"" if by == "tenant" else day_text(day): {name: float(bill.get(name, 0)) for name in TOTALS}}
    prefix = {"model": "model:", "key": "key:", "device": "device:"}[by]
    parts: dict[str, dict[str, float]] = {}
    for field, value in bill.items():
        if field.startswith(prefix):
            part, _, total = field[len(prefix):].rpartition(":")
            parts.setdefault(part, {})[total] = float(value)
    return parts


def _cost(bill: Mapping[str, str], prices: Mapping[str, float]) -> float:
    """The cost of a day's bill: each priced device kind's device-seconds at its price per device-hour."""
    return sum(float(bill.get(f"device:{kind}:device_seconds") or 0) / 3600 * price for kind, price in prices.items())


def _typed(row: Mapping[str, float]) -> dict[str, Any]:
    """Counts as whole numbers, times and cost rounded for reading."""
    return {name: int(value) if name in ("rows", "requests", "failed", "jobs") else round(value, 6)
            for name, value in row.items()}

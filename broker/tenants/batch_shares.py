"""Tenants' shares inside one merged batch: how many rows each tenant's online requests may take.

Pure, the clock passed in. `lease_batch.lua` applies the same rule (`lib.lua`'s `share_split`); this
module is its reference, and the tests hold the two to each other.

A merged batch takes every waiting request that fits, so the order of tenants alone decides nothing while
all waiting work fits in one batch. The rule, for a batch headed by an online request:

- The tenants with a share are ranked as fair share ranks them (`shares.fair_order`, the held ones left
  out). The *anchor* is the first of them that is present on the model: it has work waiting there, one
  of its requests there is leased and not yet answered, or one was answered within `present_for` (a
  closed-loop client's requests are away between their answer and the next call; for that moment the
  tenant still counts).
- A leased request keeps its tenant present while its batch runs, on whichever worker and stream slot: the
  lease marks the tenant leased until `in_flight_for` from now, and the answer takes that mark back, marking
  the tenant served at its own time only if one of its requests ran. Presence is had by work that runs alone:
  a request past its `reject` timeout is neither leased nor counted as waiting, and one answered without a
  run (expired between its lease and its run) gives none. A slot held for the anchor charges it the wait in
  the usage fair share ranks by (`sits_worker.serving.drain_loop`), so holding others back is never free.
  Were the lease's mark `now`, a run longer than `present_for` on one slot would let the others' requests
  fill the next slot while the anchor's clients wait for their answers.
  `in_flight_for` is a bound from the model's profile (`in_flight_bound`), not the run itself, so that
  requests never answered (their worker died) hold the others back only that much longer.
- The anchor's requests fill first, without a cap: the lease puts them first even where the fair
  order left it out a moment (taken for absent while its clients were away). Every other tenant with a
  share may add at most
  `floor(anchor_rows * its share / the anchor's share)` rows, so the batch's rows, which bills split
  (`shares.attribute`), follow the shares. A tenant without a share gets none while an anchor exists
  (it lives on idle share). What is left waits for the next batch.
- An anchor with nothing waiting (present only by its running or answered requests) holds the others'
  requests: the slot waits for its work, at most `present_for` after its last answer (`in_flight_for`
  plus `present_for` after the lease of requests never answered).
- Fewer than two tenants with a share present: no caps, the batch takes what fits in the fair order, as
  before. So a tenant alone always gets full batches, and no slot idles while only one tenant has work
  (waiting or running): its own presence never holds it back.
- Requests riding in a job chunk's mini-batch (`lease_riders.lua`) are split the same way (`split_riders`),
  the anchor in the head's place: its riders first, every other tenant's at most its share's part of the
  anchor's rider rows; none while the anchor is present with no request waiting.

Rounding down errs towards the anchor, the tenant below its share; fair share's usage order then
corrects the drift (once the anchor is over its share, the other tenant becomes the anchor).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

IN_FLIGHT_MARGIN = 2.0
"""How many times its expected length a run may take while its requests keep their tenant present without
an answer: profiles are estimates, and a run shares its device with the worker's other stream slots."""
IN_FLIGHT_FLOOR = 0.5
"""The least seconds a leased request keeps its tenant present without an answer: a run slower than its profile
(a device shared with other processes, a profile from another load) still counts while it takes under this."""


@dataclass(frozen=True)
class BatchShares:
    """The `shares` option of `lease_batch.lua`: the tenants with a share, in fair-share order (held tenants
    left out), and how long a tenant stays present on a model after its last request there."""

    ranked: tuple[tuple[str, float], ...]
    """(Tenant, guaranteed share > 0), first-ranked first."""
    present_for: float
    """Seconds a tenant counts as present after one of its requests was answered (`fair_share.present_for`)."""
    in_flight_for: float = 0.0
    """Seconds a leased request keeps its tenant present before its answer comes (`in_flight_bound`): the
    lease marks it served this long from now; the answer marks it again."""

    def to_lua(self) -> dict[str, Any]:
        """The JSON-ready table the script reads."""
        return {"ranked": [{"tenant": tenant, "share": share} for tenant, share in self.ranked],
                "present_for": self.present_for, "in_flight_for": self.in_flight_for}


@dataclass(frozen=True)
class BatchSplit:
    """What one batch may take of each tenant: the anchor's rows uncapped, another tenant's at most
    `quotas[tenant]` (a tenant without a share: 0); with `hold`, nothing at all."""

    anchor: str
    quotas: Mapping[str, int] = field(default_factory=dict)
    hold: bool = False

    def most_rows(self, tenant: str) -> int | None:
        """The most rows `tenant` may add to the batch (None: no cap)."""
        if self.hold:
            return 0
        if tenant == self.anchor:
            return None
        return self.quotas.get(tenant, 0)


def split_batch(shares: BatchShares, *, waiting: Mapping[str, int], served_at: Mapping[str, float],
                head_tenant: str, anchor_rows: int, now: float) -> BatchSplit | None:
    """How a batch headed by a request of `head_tenant` is split between tenants, or None: no caps.

    `waiting`: the tenants with work waiting on the model within the lease's reach (any count above 0
    counts); `served_at`: when each tenant's requests of the model were last answered, or the end of a
    leased batch's bound while it runs (a lease marks `in_flight_for` ahead);
    `anchor_rows`: the rows the head tenant's requests of the head's shape bucket bring to the batch.
    No caps either when the anchor is not the head's tenant (its work waits in another bucket, or behind
    an order that left it out a moment): the batch then goes as the order formed it."""
    present = present_tenants(shares, waiting=waiting, served_at=served_at, now=now)
    if len(present) < 2:
        return None
    name, anchor_share = present[0]
    if waiting.get(name, 0) <= 0:
        return BatchSplit(name, hold=True)
    if name != head_tenant:
        return None
    quotas = {tenant: math.floor(anchor_rows * share / anchor_share + 1e-9)
              for tenant, share in shares.ranked if tenant != name}
    return BatchSplit(name, quotas)


def split_riders(shares: BatchShares, *, waiting: Mapping[str, int], served_at: Mapping[str, float],
                 rider_rows: Mapping[str, int], max_rows: int, now: float) -> BatchSplit | None:
    """How the requests riding in a job chunk's mini-batch are split, or None: no caps. `waiting`: the tenants
    with requests waiting within the riders' reach (any shape bucket); `rider_rows`: each tenant's rows that
    could ride (the mini-batch's bucket). The anchor takes the head's place: its riders go first."""
    present = present_tenants(shares, waiting=waiting, served_at=served_at, now=now)
    anchor = present[0][0] if present else ""
    return split_batch(shares, waiting=waiting, served_at=served_at, head_tenant=anchor,
                       anchor_rows=min(rider_rows.get(anchor, 0), max_rows), now=now)


def in_flight_bound(run_seconds: float, stream_slots: int) -> float:
    """`BatchShares.in_flight_for` of a model whose full batch is expected to run `run_seconds` alone (its
    profile) on a worker of `stream_slots` slots: the slots share the device, `IN_FLIGHT_MARGIN` over, and
    at least `IN_FLIGHT_FLOOR`. Only requests never answered keep their tenant present that long."""
    return max(IN_FLIGHT_MARGIN * max(run_seconds, 0.0) * max(stream_slots, 1), IN_FLIGHT_FLOOR)


def present_tenants(shares: BatchShares, *, waiting: Mapping[str, int], served_at: Mapping[str, float],
                    now: float) -> list[tuple[str, float]]:
    """The ranked tenants present on the model (work waiting, or served within `present_for`: `served_at` is
    in the future while a leased batch of theirs runs), with their shares, in rank order: the first is the
    anchor."""
    return [(tenant, share) for tenant, share in shares.ranked
            if waiting.get(tenant, 0) > 0 or now - served_at.get(tenant, float("-inf")) < shares.present_for]


def ranked_shares(order: Sequence[str], held: Sequence[str] | set[str],
                  guaranteed: Mapping[str, float]) -> tuple[tuple[str, float], ...]:
    """The tenants of a fair `order` that have a share (`guaranteed`, > 0) and are not `held`, in order."""
    return tuple((name, guaranteed[name]) for name in order
                 if guaranteed.get(name, 0.0) > 0 and name not in held)

"""The ready queues as a slot sees them: each model's head, a snapshot of all heads as of one instant,
depths, the company the head request could wait for, and older versions' drained queues pruned.

A queue is one sorted set per model version, scored by the priority key (`broker/queueing/scoring.py`).
Taking items out is a lease (`broker/queueing/leases.py`); waking the slots that take them is the
tickets' and the doorbell's (`broker/queueing/tickets.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from broker.models.registry import split_model_ref
from broker.state.store import Store, translate_redis_errors


def queue_heads(store: Store) -> dict[str, float]:
    """Model ref -> score of its best waiting item, for every queue with waiting work (a one-off read;
    drain loops keep a `QueueWatcher`)."""
    return QueueWatcher(store).snapshot().heads


@dataclass(frozen=True)
class QueueSnapshot:
    """What a drain loop looks at before it chooses its next batch, read in one round trip."""

    heads: dict[str, float]
    """Model ref -> score of its best waiting item, for every queue with waiting work."""
    earliest_deadlines: dict[str, float]
    """Model ref -> the earliest deadline among its waiting items that have one (the PSA index)."""
    raw_policy: str
    """The live policy JSON ('' for the defaults)."""
    head_items: dict[str, str] = field(default_factory=dict)
    """Model ref -> id of its best waiting item (the one `heads` scores)."""
    waiting_requests: dict[str, int] = field(default_factory=dict)
    """Model ref -> how many online requests wait in its queue (`keys.waiting_requests`), for every
    queue with waiting work."""
    unclaimed_rings: bool = False
    """The doorbell held rings since the last snapshot (which empties it): no drain loop was blocked on it
    when they came, so no slot of the fleet sat idle then (an idle one would have taken the ring at once)."""


def queue_refs(store: Store) -> tuple[list[str], str]:
    """The model refs in the set of queues, sorted, and the set's version ('' before it had one), read
    atomically: a call that gets that version back knows it was given every ref."""
    with translate_redis_errors():
        pipe = store.client.pipeline(transaction=True)
        pipe.smembers(store.keys.queues)
        pipe.get(store.keys.queues_version)
        members, version = pipe.execute()
    return sorted(members), version or ""


class QueueWatcher:
    """Reads `QueueSnapshot`s for one process's drain loops.

    The set of model refs with a queue changes seldom (a model's first item, a pruned older
    version), so it is kept between reads and re-read only when its version, read in the same
    round trip as the queue heads, says it changed.
    """

    def __init__(self, store: Store) -> None:
        self._store = store
        self._known: tuple[list[str], str | None] = ([], None)
        """(The refs, the set's version they were read at: None before the first read), one value,
        so that the drain threads sharing the watcher never pair one read's refs with another's version."""

    def snapshot(self) -> QueueSnapshot:
        """Every queue's head, earliest deadline, and the live policy, as of one instant (one script
        call: as a pipeline of commands it cost a quarter more client CPU)."""
        keys = self._store.keys
        rung = False  # (a read again for a new set of refs finds the doorbell emptied by the first)
        with translate_redis_errors():
            while True:
                refs, known_version = self._known
                per_ref = [key for ref in refs
                           for key in (keys.ready(ref), keys.deadlines(ref), keys.waiting_requests(ref))]
                version, raw_policy, unclaimed, *firsts = self._store.scripts.queue_snapshot(
                    keys=[keys.queues_version, keys.policy, keys.doorbell, *per_ref])
                rung = rung or bool(unclaimed)
                if version == known_version:
                    break
                self._known = queue_refs(self._store)
        heads, head_items, deadlines, waiting = {}, {}, {}, {}
        for ref, head_item, head_score, earliest, requests in zip(refs, firsts[0::4], firsts[1::4], firsts[2::4],
                                                                  firsts[3::4], strict=True):
            if head_item:
                heads[ref], head_items[ref], waiting[ref] = float(head_score), head_item, int(requests)
            if earliest:
                deadlines[ref] = float(earliest)
        return QueueSnapshot(heads=heads, earliest_deadlines=deadlines, raw_policy=raw_policy,
                             head_items=head_items, waiting_requests=waiting, unclaimed_rings=rung)


def head_company(store: Store, model_ref: str, *, now: float, window: int,
                 enough: int) -> tuple[int, float] | None:
    """(Rows that could join the head's batch, seconds the head has waited) when the head of
    `model_ref`'s queue is an online request, else None: the rows of the requests of its shape
    bucket among the first `window` waiting items, its own included, counted until they reach
    `enough` (`head_company.lua`)."""
    with translate_redis_errors():
        reply = store.scripts.head_company(keys=[store.keys.ready(model_ref), store.keys.items],
                                           args=[window, enough])
    if not reply:
        return None
    rows, enqueued_at = reply
    return int(rows), now - float(enqueued_at)


def queue_depths(store: Store, *, with_requests: bool = False) -> dict[str, dict[str, int]]:
    """Model ref -> {"ready": n, "inflight": n} for every known queue; `with_requests` adds "requests":
    the online requests among the ready items (`keys.waiting_requests`, what `max_queue_size` counts)."""
    names = ("ready", "inflight", "requests") if with_requests else ("ready", "inflight")
    with translate_redis_errors():
        refs = sorted(store.client.smembers(store.keys.queues))
        pipe = store.client.pipeline(transaction=False)
        for ref in refs:
            pipe.zcard(store.keys.ready(ref))
            pipe.zcard(store.keys.inflight(ref))
            if with_requests:
                pipe.zcard(store.keys.waiting_requests(ref))
        counts = pipe.execute()
    step = len(names)
    return {ref: dict(zip(names, counts[step * i:step * (i + 1)], strict=True)) for i, ref in enumerate(refs)}


def prune_old_queues(store: Store) -> list[str]:
    """Take every empty queue of a model version that is not its model's latest out of the set of
    queues (a reaper pass calls it); returns the refs taken out. Whatever queues an item for one of
    them again puts it back. The latest version's queue stays, however empty: its set entry would
    come and go with every idle spell, and every drain loop would read the set again each time."""
    with translate_redis_errors():
        refs = store.client.smembers(store.keys.queues)
        latest = store.client.hgetall(store.keys.model_latest)
        pruned = []
        for ref in sorted(refs):
            name, version = split_model_ref(ref)
            if version is None or version == latest.get(name):
                continue
            if store.scripts.prune_queue(keys=[store.keys.queues, store.keys.queues_version, store.keys.ready(ref),
                                               store.keys.inflight(ref)], args=[ref]):
                pruned.append(ref)
    return pruned

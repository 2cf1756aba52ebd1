"""Releases against a real Redis: once per slot whoever asks, catch-up after a beat was down, chains.

The beat's sending is the callback `BeatPass.send`; here it records what would be published, and a
test plays the releaser by making the run's job (its fixed id) as `sits_api/schedules/release.py` does.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from broker.errors import Conflict
from broker.jobs import fills as job_fills
from broker.jobs import records as jobs
from broker.jobs import stops as job_stops
from broker.queueing import leases
from broker.schedules import book, passes, runs
from broker.schedules.passes import BeatPass
from broker.schedules.records import Run, Schedule, slot_job_id
from broker.schedules.settings import BeatSettings
from broker.schedules.stats import read_schedule_stats
from broker.state.replies import ClaimReply
from broker.state.store import Store
from tests.broker.broker_helpers import NOW, ack
from tests.leasing import lease_items

START = 1_800_000_000  # a multiple of 10: NOW


def every(name: str, seconds: int = 10, **fields: object) -> Schedule:
    return Schedule(name=name, tenant="acme", owner="alice", every=seconds, generation="g1", created_at=NOW,
                    job={"model": "mlp", "input_batch": "/in/{slot}.npy", "output_dir": "/out/{slot}"},
                    **fields)  # type: ignore[arg-type]


class Beat(BeatPass):
    """A beat whose sends are recorded; `crash_after_claim` makes its sends fail, as a beat killed between
    a slot's claim and its message."""

    def __init__(self, store: Store, holder: str, *, settings: BeatSettings | None = None,
                 always_holds_turn: bool = False) -> None:
        self.sent: list[tuple[str, int]] = []
        self.crash_after_claim = False
        self.always_holds_turn = always_holds_turn
        super().__init__(store, settings or BeatSettings(), holder, self._send)

    def _send(self, member: str, slot: int) -> None:
        if self.crash_after_claim:
            raise SystemExit("killed between the claim and the send")
        self.sent.append((member, slot))

    def take_turn(self) -> bool:
        return True if self.always_holds_turn else super().take_turn()


def release(store: Store, member: str, slot: int, *, now: float) -> Run:
    """What a releaser does once its job is made: the run settled as released, its job created (one row)."""
    run = runs.get_run(store, member, slot)
    assert run is not None and run.status == "releasing"
    spec = jobs.JobSpec(job_id=run.job_id, model_name="mlp", model_version="v1", input_batch="/in/x.npy",
                        input_format="npy", input_checksum="sha256:00", output_dir=f"/out/{slot}",
                        output_names=["logits"], rows_total=1, chunk_size=1, batch_size=1, owner="alice", tenant="acme")
    job_fills.create_job(store, spec, now=now)
    released = replace(run, status="released", released_at=now)
    runs.settle_run(store, member, released, expect=("releasing",))
    return released


def succeed(store: Store, job_id: str, *, now: float) -> None:
    """Run a one-chunk job to success through the real scripts: lease, ack, lease the finalize step, finish."""
    [chunk] = lease_items(store, "mlp@v1", now=now, lease_seconds=60, max_items=1)
    assert chunk.payload["job"] == job_id
    ack(store, chunk, now=now)
    [final] = lease_items(store, "mlp@v1", now=now, lease_seconds=60, max_items=1)
    leases.finish_item(store, final, job_id, now=now, job_status="succeeded")


def test_many_claimers_of_one_slot_make_one_claim(store: Store) -> None:
    schedule = book.add_schedule(store, every("nightly"), now=NOW, most_per_tenant=None)
    run = Run(slot=START + 10, status="releasing", job_id=slot_job_id(schedule, START + 10), due_at=START + 10,
              claimed_at=NOW)
    start = threading.Barrier(8)
    replies: list[ClaimReply] = []

    def claim() -> None:
        start.wait()
        replies.append(runs.claim_slot(store, schedule, run, next_due=START + 20, now=NOW, runs_kept=10).reply)

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert sorted(replies) == [ClaimReply.DUPLICATE] * 7 + [ClaimReply.CLAIMED]


def test_two_beats_passing_at_once_send_each_slot_once_even_both_holding_the_turn(store: Store) -> None:
    book.add_schedule(store, every("tick", seconds=1), now=NOW, most_per_tenant=None)
    patient = BeatSettings(release_timeout=3600)  # (no releaser here: runs stay releasing)
    beats = [Beat(store, "beat-a", settings=patient, always_holds_turn=True),
             Beat(store, "beat-b", settings=patient, always_holds_turn=True)]

    def passes(beat: Beat) -> None:
        for step in range(1, 61):
            beat.run(NOW + step + 0.05)

    threads = [threading.Thread(target=passes, args=(beat,)) for beat in beats]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    sent = beats[0].sent + beats[1].sent
    assert sorted(slot for _, slot in sent) == list(range(START + 1, START + 61))  # each slot once, none missed


def test_a_second_beat_waits_while_the_first_holds_the_turn_and_takes_over_when_it_lapses(store: Store) -> None:
    book.add_schedule(store, every("tick"), now=NOW, most_per_tenant=None)
    short = BeatSettings(turn_timeout=0.3)
    first, second = Beat(store, "beat-a", settings=short), Beat(store, "beat-b", settings=short)

    first.run(NOW + 10.1)
    second.run(NOW + 10.2)
    assert first.sent == [("acme|tick", START + 10)] and second.sent == []

    threading.Event().wait(0.4)  # the first beat stopped passing: its turn lapses
    second.run(NOW + 20.1)
    assert second.sent == [("acme|tick", START + 20)]


def test_a_release_lost_with_its_beat_is_sent_again_once_after_the_release_timeout(store: Store) -> None:
    book.add_schedule(store, every("tick"), now=NOW, most_per_tenant=None)
    killed = Beat(store, "beat-a", always_holds_turn=True)
    killed.crash_after_claim = True
    with pytest.raises(SystemExit):
        killed.run(NOW + 10.1)  # claimed, then killed before the message left
    back = Beat(store, "beat-b", always_holds_turn=True, settings=BeatSettings(release_timeout=30))

    back.run(NOW + 11)  # the slot is decided: nothing sent yet, the run waits for its timeout
    assert back.sent == []
    back.run(NOW + 40.5)  # claimed 30 s ago, still releasing: sent again
    back.run(NOW + 41)

    assert [slot for _, slot in back.sent].count(START + 10) == 1
    assert runs.get_run(store, "acme|tick", START + 10).status == "releasing"  # type: ignore[union-attr]


@pytest.mark.parametrize("catch_up", ["once", "skip"])
def test_a_slot_missed_while_no_beat_ran_is_released_once_under_once_and_not_under_skip(store: Store,
                                                                                       catch_up: str) -> None:
    book.add_schedule(store, every("tick", catch_up=catch_up), now=NOW, most_per_tenant=None)
    short = BeatSettings(turn_timeout=0.05)
    beat = Beat(store, "beat-a", settings=short)
    beat.run(NOW + 10.1)
    release(store, "acme|tick", START + 10, now=NOW + 10.2)

    later = Beat(store, "beat-b", settings=short)
    threading.Event().wait(0.1)  # the first beat was killed: its turn lapsed
    later.run(NOW + 40.1)  # 20 and 30 were missed; 40 is due now
    later.run(NOW + 40.2)

    slots = {run.slot: run for run in runs.recent_runs(store, "acme|tick")}
    totals = read_schedule_stats(store).get(("acme", "tick"))
    assert beat.sent == [("acme|tick", START + 10)]
    if catch_up == "once":
        assert later.sent == [("acme|tick", START + 30), ("acme|tick", START + 40)]
        assert slots[START + 30].catch_up and slots[START + 30].status == "releasing"
    else:
        assert later.sent == [("acme|tick", START + 40)]
        assert slots[START + 30].status == "missed" and totals is not None and totals.get("missed") == 1
    assert START + 20 not in slots  # the missed slots collapse into one run


def test_a_change_that_others_keep_overtaking_ends_as_a_conflict_not_a_loop(store: Store) -> None:
    book.add_schedule(store, every("tick"), now=NOW, most_per_tenant=None)
    book.add_schedule(store, every("other"), now=NOW, most_per_tenant=None)
    tries: list[int] = []

    def overtaken(found: Schedule) -> Schedule:  # (the beat, or another tenant's PATCH, writes meanwhile)
        tries.append(1)
        if len(tries) < 1_000:  # (without a bound, the change would go on this long)
            store.client.hset(store.keys.schedule_cursors, "acme|other", NOW + len(tries))
        return found.changed(paused=True)

    with pytest.raises(Conflict, match="other schedules changed 20 times while it was; send the change again"):
        book.change_schedule(store, "acme", "tick", overtaken, now=NOW + 5)
    assert len(tries) == book.CHANGE_TRIES and not book.get_schedule(store, "acme", "tick").paused


def test_a_paused_schedule_releases_nothing_and_a_changed_one_is_read_again(store: Store) -> None:
    schedule = book.add_schedule(store, every("tick"), now=NOW, most_per_tenant=None)
    beat = Beat(store, "beat-a")
    book.change_schedule(store, "acme", "tick", lambda found: found.changed(paused=True), now=NOW + 5)
    beat.run(NOW + 10.1)
    stale = runs.claim_slot(store, schedule, Run(slot=START + 10, status="releasing", job_id="j000000000000",
                                                 due_at=START + 10, claimed_at=NOW), next_due=None, now=NOW,
                            runs_kept=10)

    book.change_schedule(store, "acme", "tick", lambda found: found.changed(paused=False), now=NOW + 12)
    beat.run(NOW + 20.1)

    assert stale.reply == ClaimReply.STALE
    assert beat.sent == [("acme|tick", START + 20)]  # 10 passed while paused: not caught up on resume


def test_a_chain_step_waits_for_its_step_before_is_held_by_its_failure_and_released_by_its_resume(
        store: Store) -> None:
    book.add_schedule(store, every("extract", seconds=60), now=NOW, most_per_tenant=None)
    book.add_schedule(store, every("score", seconds=60, after=("extract",)), now=NOW, most_per_tenant=None)
    beat = Beat(store, "beat-a")
    slot = START + 60

    beat.run(NOW + 60.1)
    waiting = runs.get_run(store, "acme|score", slot)
    first = release(store, "acme|extract", slot, now=NOW + 60.2)
    job_stops.stop_job(store, first.job_id, status="failed", error="a bad row", now=NOW + 61)
    beat.run(NOW + 62)
    failed = runs.get_run(store, "acme|score", slot)
    job_fills.resume_job(store, first.job_id, now=NOW + 63)
    beat.run(NOW + 64)
    while_resumed = runs.get_run(store, "acme|score", slot)
    succeed(store, first.job_id, now=NOW + 65)
    beat.run(NOW + 66)

    assert beat.sent == [("acme|extract", slot), ("acme|score", slot)]
    assert waiting is not None and waiting.status == "held" and waiting.reason_code == "waiting"
    assert failed is not None and failed.status == "held" and failed.reason_code == "step_failed"
    assert f"job {first.job_id} failed" in failed.reason and f"sitsctl job resume {first.job_id}" in failed.reason
    assert while_resumed is not None and while_resumed.reason_code == "waiting"
    released = runs.get_run(store, "acme|score", slot)
    assert released is not None and released.status == "releasing" and released.due_at == NOW + 66


def test_a_held_run_is_missed_once_its_window_closes(store: Store) -> None:
    book.add_schedule(store, every("extract", seconds=60), now=NOW, most_per_tenant=None)
    book.add_schedule(store, every("score", seconds=60, after=("extract",), window="00:00-23:59"), now=NOW,
                      most_per_tenant=None)
    beat = Beat(store, "beat-a")
    slot = START + 60
    beat.run(NOW + 60.1)
    closes = every("score", window="00:00-23:59").cadence().window_end(slot)
    assert closes is not None

    beat.run(closes + 1)

    run = runs.get_run(store, "acme|score", slot)
    assert run is not None and run.status == "missed" and "window closed" in run.reason


def test_runs_beyond_the_ones_kept_are_dropped_oldest_first(store: Store) -> None:
    book.add_schedule(store, every("tick", seconds=1), now=NOW, most_per_tenant=None)
    beat = Beat(store, "beat-a", settings=BeatSettings(runs_kept=3))
    for step in range(1, 6):
        beat.run(NOW + step + 0.1)

    assert [run.slot for run in runs.recent_runs(store, "acme|tick")] == [START + 5, START + 4, START + 3]
    assert store.client.zcard(store.keys.schedule_runs_releasing) == 3


def test_deleting_a_schedule_drops_its_runs_and_indexes(store: Store) -> None:
    book.add_schedule(store, every("tick"), now=NOW, most_per_tenant=None)
    Beat(store, "beat-a").run(NOW + 10.1)

    book.delete_schedule(store, "acme", "tick")

    assert runs.recent_runs(store, "acme|tick") == []
    assert store.client.zcard(store.keys.schedule_runs_releasing) == 0
    assert store.client.zcard(store.keys.schedules_due) == 0


def test_a_held_run_of_a_paused_schedule_waits_for_its_resume(store: Store) -> None:
    book.add_schedule(store, every("extract", seconds=60), now=NOW, most_per_tenant=None)
    book.add_schedule(store, every("score", seconds=60, after=("extract",)), now=NOW, most_per_tenant=None)
    beat = Beat(store, "beat-a")
    slot = START + 60
    beat.run(NOW + 60.1)
    succeed(store, release(store, "acme|extract", slot, now=NOW + 60.2).job_id, now=NOW + 61)

    book.change_schedule(store, "acme", "score", lambda found: found.changed(paused=True), now=NOW + 61)
    beat.run(NOW + 62)
    while_paused = list(beat.sent)
    book.change_schedule(store, "acme", "score", lambda found: found.changed(paused=False), now=NOW + 63)
    beat.run(NOW + 64)

    assert while_paused == [("acme|extract", slot)]
    assert beat.sent == [("acme|extract", slot), ("acme|score", slot)]


def test_a_long_held_run_is_looked_at_less_often_than_a_new_one(store: Store) -> None:
    """Thousands of runs held for hours behind a step that never succeeds would take the one beat's passes
    if each were looked at every second: a run is looked at again after a quarter of its wait, at most
    every 30 s."""
    book.add_schedule(store, every("extract", seconds=60), now=NOW, most_per_tenant=None)
    book.add_schedule(store, every("score", seconds=60, after=("extract",)), now=NOW, most_per_tenant=None)
    beat = Beat(store, "beat-a")
    slot = START + 60
    beat.run(NOW + 60.1)  # (claimed, and held: its step's job is not made)

    def next_look() -> float:
        return float(store.client.zscore(store.keys.schedule_runs_held, f"acme|score|{slot}"))

    beat.run(NOW + 61.2)
    soon = next_look() - (NOW + 61.2)
    beat.run(NOW + 60.1 + 3600)
    late = next_look() - (NOW + 60.1 + 3600)

    assert soon == pytest.approx(1.0) and late == pytest.approx(30.0)
    assert passes.held_look_after(NOW, now=NOW + 40, tick=0.5) == pytest.approx(10.0)


def test_a_release_place_is_given_back_and_renewed_by_its_own_releaser_only(store: Store) -> None:
    """Places are named by run and hold token: a releaser whose hold lapsed, and whose run another took over,
    frees only its own place, not the other's; a renewal keeps the tenant's key past a long release."""
    from broker.schedules.release_places import (
        give_back_release_place,
        release_id,
        renew_release_place,
        take_release_place,
    )
    first, second = release_id("acme|s|1", "aaaa"), release_id("acme|s|1", "bbbb")
    assert take_release_place(store, "acme", first, most=1, hold_seconds=30, now=NOW)
    assert take_release_place(store, "acme", second, most=1, hold_seconds=30, now=NOW + 31)  # (the first lapsed)
    give_back_release_place(store, "acme", first)  # (the first releaser ends after all)
    renew_release_place(store, "acme", second, hold_seconds=300, now=NOW + 40)

    assert not take_release_place(store, "acme", release_id("acme|s|2", "cccc"), most=1, hold_seconds=30,
                                  now=NOW + 50)
    assert store.client.ttl(store.keys.tenant_releases("acme")) > 300

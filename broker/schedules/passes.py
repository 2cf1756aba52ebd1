"""One pass of the beat: take the beat's turn, decide the slots now due, look at held and lost releases.

The beat that holds the turn (`keys.beat_turn`, renewed every pass; a second beat waits for it to
lapse) claims each due slot in one script (`runs.claim_slot`) and only then sends its release: a
releaser makes the job (`sits_api/schedules/release.py`). Held runs are released here once the steps
before them succeeded (`chains.chain_state`); a run whose release message was lost (a beat killed
between its claim and its send, a failover) is sent again after `beat.release_timeout`. Every
`beat.rescore_every` the beat also sends the queues' re-scoring (`broker/queueing/re_estimate.py`). Sending is
a callback, so this module knows nothing of Celery; every decision about slots is `slots.plan_slots`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from broker.errors import RetryableError
from broker.schedules.book import find_schedule
from broker.schedules.chains import chain_state
from broker.schedules.records import Run, RunStatus, Schedule, slot_job_id
from broker.schedules.runs import claim_slot, get_run, runs_due, settle_run, touch_releasing
from broker.schedules.settings import BeatSettings
from broker.schedules.slots import SlotDecision, plan_slots
from broker.schedules.stats import MISSED
from broker.state.replies import ClaimReply, SettleReply
from broker.state.store import Store, translate_redis_errors

log = logging.getLogger(__name__)

Send = Callable[[str, int], None]
"""Publish the release of run (member, slot) to a releaser."""

RELEASE_TASK = "sits.release_schedule"
"""The Celery task the beat sends and a releaser runs: its arguments are the run's member and slot."""
RESCORE_TASK = "sits.rescore_queues"
"""The Celery task the beat sends every `beat.rescore_every` and a releaser runs: one re-scoring pass over
the queues (`re_estimate.rescore_queues`); no arguments."""

MOST_PER_PASS = 200
"""The most due schedules, held runs or lost releases one pass looks at; the rest wait for the next pass."""
SHORTEST_SLEEP = 0.005
HELD_LOOK_LONGEST = 30.0
"""The longest a held run waits between two looks of the beat (`held_look_after`)."""


def held_look_after(held_since: float, *, now: float, tick: float) -> float:
    """Seconds until the beat looks again at a run held since `held_since` whose steps before it are not
    done: a quarter of how long it has waited, at least a second (or `tick`), at most `HELD_LOOK_LONGEST`.
    A run held for a minute is released within 15 s of its step's success, and thousands held for hours
    (a tenant's chains after a step that never succeeds) cost the one beat a look each every 30 s, not
    every second."""
    return min(HELD_LOOK_LONGEST, max(tick, 1.0, (now - held_since) / 4))


@dataclass
class Periodic:
    """A task the beat sends every `every` seconds while it holds the turn (0: never)."""

    every: float
    send: Callable[[], None]
    sent_at: float = field(default=-math.inf, init=False)

    def send_when_due(self, now: float) -> None:
        """Send it when `every` has passed since this beat last sent it."""
        if self.every <= 0 or 0 <= now - self.sent_at < self.every:
            return
        self.sent_at = now
        self.send()


@dataclass
class BeatPass:
    """The beat's work over Redis; `run(now)` is one pass, and answers how long to sleep before the next."""

    store: Store
    settings: BeatSettings
    holder: str
    """This beat's id in the turn: host, pid and a random part."""
    send: Send
    send_rescore: Callable[[], None] | None = None
    """Publish one re-scoring pass to a releaser (None: this beat sends none)."""
    rescore_sent_at: float = field(default=-math.inf, init=False)
    periodic: list[Periodic] = field(default_factory=list)
    """Other tasks the beat holding the turn sends at a period (the batching controller's steps)."""

    def run(self, now: float) -> float:
        """One pass at `now`; the seconds until the next should start."""
        if not self.take_turn():
            return self.settings.turn_timeout / 4
        for member in self._due(now):
            try:
                self.decide(member, now=now)
            except RetryableError:
                raise
            except Exception:  # a damaged record must not stop the other schedules' releases
                log.exception("schedule %s could not be looked at; the next pass tries again", member)
        self.look_at_held(now)
        self.send_lost_releases(now)
        self.send_rescore_when_due(now)
        for periodic in self.periodic:
            periodic.send_when_due(now)
        return self._sleep(now)

    def take_turn(self) -> bool:
        """Take the beat's turn, or renew it; False while another beat holds it (the same turn-taking as
        the reaper's: `take_reaper_turn.lua`)."""
        with translate_redis_errors():
            return bool(self.store.scripts.take_reaper_turn(
                keys=[self.store.keys.beat_turn], args=[self.holder, int(self.settings.turn_timeout * 1000)]))

    def give_up_turn(self) -> None:
        """Let a waiting beat take over at once (a beat stopping cleanly)."""
        with translate_redis_errors():  # (only its own turn: one taken over meanwhile stays with its holder)
            self.store.scripts.keep_hold(keys=[self.store.keys.beat_turn], args=[self.holder, 0])

    def decide(self, member: str, *, now: float) -> None:
        """Decide the slots of schedule `member` due at `now`, claim each, and send those to release."""
        schedule = find_schedule(self.store, member)
        if schedule is None or schedule.paused:
            with translate_redis_errors():
                self.store.client.zrem(self.store.keys.schedules_due, member)
            return
        with translate_redis_errors():
            cursor = int(self.store.client.hget(self.store.keys.schedule_cursors, member) or now)
        decisions, next_slot = plan_slots(schedule.cadence(), cursor=cursor, now=now, catch_up=schedule.catch_up,
                                          missed_after=self.settings.missed_after)
        next_due = schedule.cadence().due_at(next_slot)
        if not decisions:
            claim_slot(self.store, schedule, None, next_due=next_due, now=now, runs_kept=self.settings.runs_kept)
            return
        for decision in decisions:
            run = self._new_run(schedule, decision, now=now)
            claim = claim_slot(self.store, schedule, run, next_due=next_due, now=now,
                               runs_kept=self.settings.runs_kept)
            if claim.reply in (ClaimReply.STALE, ClaimReply.GONE, ClaimReply.PAUSED):
                return  # changed meanwhile: the next pass reads it again
            if claim.claimed and run.status == "releasing":
                self.send(member, run.slot)

    def _new_run(self, schedule: Schedule, decision: SlotDecision, *, now: float) -> Run:
        status: RunStatus = "releasing" if decision.release else "missed"
        reason, code = decision.reason, ("missed" if not decision.release else "")
        if decision.release and schedule.after:
            chain = chain_state(self.store, schedule, decision.slot)
            if not chain.ready:
                status, reason, code = "held", chain.reason, chain.code
        return Run(slot=decision.slot, status=status, job_id=slot_job_id(schedule, decision.slot),
                   due_at=schedule.cadence().due_at(decision.slot), claimed_at=now, catch_up=decision.catch_up,
                   reason=reason, reason_code=code,
                   deadline=None if schedule.deadline is None else decision.slot + schedule.deadline)

    def look_at_held(self, now: float) -> None:
        """Release each held run whose steps before it succeeded; say why the others still wait; a run held
        past its window's end is missed."""
        keys = self.store.keys
        for member, slot in runs_due(self.store, keys.schedule_runs_held, now=now, limit=MOST_PER_PASS):
            schedule, run = find_schedule(self.store, member), get_run(self.store, member, slot)
            if schedule is None or run is None or run.status != "held":
                with translate_redis_errors():
                    self.store.client.zrem(keys.schedule_runs_held, f"{member}|{slot}")
                continue
            if schedule.paused:  # (held while paused: looked at again once it resumes)
                settle_run(self.store, member, run, expect=("held",), at=now + max(self.settings.tick, 1.0))
                continue
            closes = schedule.cadence().window_end(slot)
            if closes is not None and now >= closes:
                missed = replace(run, status="missed", reason=f"held until its window closed: {run.reason}",
                                 reason_code="missed")
                settle_run(self.store, member, missed, expect=("held",), add={MISSED: 1.0})
                continue
            chain = chain_state(self.store, schedule, slot)
            if chain.ready:
                ready = replace(run, status="releasing", due_at=now, reason="", reason_code="")
                if settle_run(self.store, member, ready, expect=("held",), at=now) == SettleReply.SETTLED:
                    self.send(member, slot)
                continue
            again = now + held_look_after(run.claimed_at, now=now, tick=self.settings.tick)
            settle_run(self.store, member, replace(run, reason=chain.reason, reason_code=chain.code),
                       expect=("held",), at=again)

    def send_lost_releases(self, now: float) -> None:
        """Send again the releases claimed `beat.release_timeout` ago whose job is still not made (and those a
        releaser turned back for their tenant's places, which it marks as due then: `release._defer`)."""
        keys = self.store.keys
        lost = runs_due(self.store, keys.schedule_runs_releasing, now=now - self.settings.release_timeout,
                        limit=MOST_PER_PASS)
        for member, slot in lost:
            touch_releasing(self.store, member, slot, now=now)
            log.info("the release of %s at slot %d is not made yet (lost, or waiting for its tenant's release "
                     "place); sending it again", member, slot)
            self.send(member, slot)

    def send_rescore_when_due(self, now: float) -> None:
        """Send the queues' re-scoring when `beat.rescore_every` has passed since this beat last sent it.
        Only the beat holding the turn sends, so one pass goes out per period (one more after a takeover)."""
        every = self.settings.rescore_every
        if self.send_rescore is None or every <= 0 or 0 <= now - self.rescore_sent_at < every:
            return
        self.rescore_sent_at = now
        self.send_rescore()

    def _due(self, now: float) -> list[str]:
        with translate_redis_errors():
            return list(self.store.client.zrangebyscore(self.store.keys.schedules_due, "-inf", now, start=0,
                                                        num=MOST_PER_PASS))

    def _sleep(self, now: float) -> float:
        """Until the next due schedule or held run, at most `beat.tick`."""
        keys = self.store.keys
        with translate_redis_errors():
            pipe = self.store.client.pipeline(transaction=False)
            pipe.zrange(keys.schedules_due, 0, 0, withscores=True)
            pipe.zrange(keys.schedule_runs_held, 0, 0, withscores=True)
            firsts = pipe.execute()
        soonest = min((found[0][1] for found in firsts if found), default=now + self.settings.tick)
        return max(SHORTEST_SLEEP, min(self.settings.tick, soonest - now))

"""The reply codes of the Lua scripts: one source of truth for both sides.

Each enum here is also a Lua table of the same name in upper case (`LeaseReply` is `LEASE`), put in
front of every script with the helpers of `lib.lua` (`broker/state/scripts.py`): a script answers
`{LEASE.STALE_TICKET}` and Python compares with `LeaseReply.STALE_TICKET`, so no number is written on
both sides. The table is the same for every call, so each script keeps one stable SHA.
"""

from __future__ import annotations

from enum import IntEnum


class LeaseReply(IntEnum):
    """The first field of `lease_batch.lua`'s and `lease_riders.lua`'s reply when it leased nothing;
    a positive count otherwise."""

    STALE_TICKET = -1
    """The ticket was replaced: the caller's drain loop stops."""
    ONLY_PAUSED = -2
    """Nothing leased, and paused items (a degraded worker's class) were all there was within reach."""
    HELD_FOR_SHARE = -3
    """Nothing leased: the tenant a batch's rows are shared by (`broker/tenants/batch_shares.py`) is present
    on the model with nothing waiting at this instant; the others' requests wait for its next ones."""
    AT_SLOT_CAP = -4
    """Nothing leased: every waiting item within reach is a chunk of a job that holds its slot cap
    (`max_slots`); one of its chunks must end first."""
    NOTHING = 0
    """Nothing leased: the queue is empty, its head is not for this call, or the batch does not fit."""


class SubmitReply(IntEnum):
    """The first field of `submit_request.lua`'s reply."""

    ACCEPTED = 1
    EXISTS = 0
    """A request with that id exists already."""
    POLICY_CHANGED = -1
    """The live policy is no longer the one the request was scored with: score again and retry."""
    QUEUE_FULL = -2
    """The model's queue is at its `max_queue_size`."""
    LEVEL_FULL = -3
    """The request's priority level is at its own `max_queue_size`."""
    TENANT_FULL = -4
    """The tenant has `max_queued` requests not answered yet."""
    TENANT_BYTES_FULL = -5
    """The request's inputs would take its tenant's requests not answered yet past `max_queued_bytes`."""


class EnqueueReply(IntEnum):
    """What `enqueue_items.lua` answers instead of the count of items it added."""

    JOB_EXISTS = -1
    """A `create` call found the job already there."""
    JOB_STOPPED = -2
    """A later call of a fill found the job stopped."""


class AckReply(IntEnum):
    """`ack_chunk.lua`'s reply."""

    SKIPPED = 0
    """A duplicate ack, or the job is no longer active: nothing recorded."""
    RECORDED = 1
    LAST_CHUNK = 2
    """Recorded, and it was the job's last chunk: the finalize item is queued."""


class ReleaseReply(IntEnum):
    """`release_ticket.lua`'s reply."""

    SET_CHANGED = -1
    """The set of queues changed since the caller read it: read it again and call again."""
    WORK_WAITING = 0
    """A queue has waiting work: keep draining."""
    RELEASED = 1


class RetryReply(IntEnum):
    """The first field of `retry_item.lua`'s reply."""

    NOT_IN_FLIGHT = -1
    """The item was reaped, finished or stopped meanwhile."""
    NOT_RETRIED = 0
    """The class has no retry left: the caller fails the item."""
    PARKED = 1
    """Parked in flight until its backoff has passed."""



class ClaimReply(IntEnum):
    """The first field of `claim_slot.lua`'s reply."""

    CLAIMED = 1
    RESCHEDULED = 2
    """A call without a slot moved the schedule's next look."""
    DUPLICATE = 0
    """The slot was decided already (by another beat, or an earlier pass): nothing written."""
    STALE = -1
    """The schedule changed since the caller read it: read it again."""
    GONE = -2
    """The schedule was deleted."""
    PAUSED = -3


class SettleReply(IntEnum):
    """The first field of `settle_run.lua`'s reply."""

    SETTLED = 1
    MOVED = 0
    """The run was in none of the statuses expected: another releaser or beat settled it first."""
    GONE = -1
    """The run is no longer kept (its schedule was deleted)."""

REPLY_ENUMS: tuple[type[IntEnum], ...] = (LeaseReply, SubmitReply, EnqueueReply, AckReply, ReleaseReply, RetryReply,
                                           ClaimReply, SettleReply)


def lua_table_name(enum: type[IntEnum]) -> str:
    """The Lua name of `enum`: its class name without `Reply`, in upper case (`LeaseReply` -> `LEASE`)."""
    return enum.__name__.removesuffix("Reply").upper()


def lua_reply_tables() -> str:
    """The Lua text that defines every reply enum as a table of named constants."""
    lines = ["-- Reply codes, from broker/state/replies.py (the Python side compares with the same enums)."]
    for enum in REPLY_ENUMS:
        fields = ", ".join(f"{member.name} = {member.value}" for member in enum)
        lines.append(f"local {lua_table_name(enum)} = {{{fields}}}")
    return "\n".join(lines) + "\n"

"""Leasing in tests: one `lease_batch` call with its options written as keywords.

The tests lease with many different options; writing each as `LeaseOptions(...)` beside the call
would hide what a test varies. `lease_items` takes the options as keywords, builds the
`LeaseOptions` the worker builds, and returns the items, as most tests read them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from broker.queueing.leases import LeasedItem, LeaseNotes, LeaseOptions, lease_batch
from broker.state.store import Store
from broker.tenants.batch_shares import BatchShares


def lease_items(store: Store, model_ref: str, *, now: float, lease_seconds: float, max_items: int, ticket: str = "",
                max_rows: int | None = None, max_tokens: int = 0, max_chunks: int | None = None,
                requests_only: bool = False, carry_chunk: bool = False, head_within_limits: bool = False,
                whole_within: tuple[int, int] | None = None, preferred_sizes: tuple[int, ...] = (),
                tenants: Mapping[str, Any] | None = None, classes: Mapping[str, Any] | None = None,
                shares: BatchShares | None = None, notes: LeaseNotes | None = None) -> list[LeasedItem]:
    """The items one lease takes; `notes`, when given, gathers what the lease told beside them."""
    options = LeaseOptions(max_items=max_items, max_rows=max_rows, max_tokens=max_tokens, max_chunks=max_chunks,
                           requests_only=requests_only, carry_chunk=carry_chunk, head_must_fit=head_within_limits,
                           batch_limit=whole_within, preferred_sizes=preferred_sizes, tenants=tenants,
                           classes=classes, shares=shares)
    result = lease_batch(store, model_ref, options, now=now, lease_seconds=lease_seconds, ticket=ticket)
    if notes is not None:
        notes.add(result)
    return result.items

"""What one API process holds for every request: the typed state its views read.

`create_app` builds one `AppState` and keeps it in the Flask app's extensions; views reach it with
`app_state()`, never through an untyped dict. The state is shared by the process's request threads:
each part is safe to use from several threads (the store holds a connection per thread).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flask import current_app

from broker.config.settings import Settings
from broker.queueing.policy import LivePolicy
from broker.state.store import Store
from broker.tenants.records import TenantTable
from sits_api.intake.registrations import Registrations
from sits_api.intake.result_inbox import ResultInbox
from sits_api.intake.task_sender import Dispatcher
from sits_api.metrics import SitsCollector
from sits_api.tenancy.known_keys import KnownKeys
from sits_api.tenancy.wait_slots import WaitSlots

EXTENSION = "sits"
"""The key of the app's extensions under which the `AppState` is kept."""


@dataclass
class AppState:
    """The settings, the Redis store and the per-process helpers every view shares."""

    settings: Settings
    store: Store
    dispatcher: Dispatcher
    """Sends the Celery drain tasks that wake workers (`sits_api.intake.task_sender`)."""
    policy: LivePolicy
    """The live scoring policy, re-read at most once a second."""
    inbox: ResultInbox
    """Where the results of this process's waiting requests arrive."""
    metrics: SitsCollector
    """The Prometheus collector of `GET /metrics`."""
    tenants: TenantTable
    """The tenants' records, kept live from Redis."""
    wait_slots: WaitSlots = field(default_factory=WaitSlots)
    """How many calls each tenant holds waiting in this process (`api.max_waits_per_tenant`)."""
    registrations: WaitSlots = field(default_factory=lambda: WaitSlots(
        "model registrations running", "models.registrations_per_tenant", "once the running one is done"))
    """How many model registrations each tenant runs in this process (`models.registrations_per_tenant`)."""
    registration_pool: Registrations = field(init=False)
    """The threads registrations run on, apart from the request threads (`sits_api.intake.registrations`)."""
    known_keys: KnownKeys = field(default_factory=KnownKeys)
    """API keys checked lately, trusted for `known_keys.KEY_CACHE_SECONDS` (`sits_api/tenancy/known_keys.py`)."""


    def __post_init__(self) -> None:
        self.registration_pool = Registrations(self.settings.models.registration_threads)

    def waiting_slot(self, identity: dict[str, Any], wait: bool) -> contextlib.AbstractContextManager[None]:
        """One of the caller's tenant's waiting calls in this process while a call waits
        (`wait_slots`); an admin key's are not counted, nor calls that do not wait."""
        if not wait or identity.get("role") == "admin":
            return contextlib.nullcontext()
        return self.wait_slots.hold(_tenant_of(identity), self.settings.api.max_waits_per_tenant)

    def registration_slot(self, identity: dict[str, Any]) -> Callable[[], None]:
        """One of the caller's tenant's model registrations in this process, until the function returned is
        called (an admin key's are not counted)."""
        if identity.get("role") == "admin":
            return lambda: None
        return self.registrations.take(_tenant_of(identity), self.settings.models.registrations_per_tenant)


def _tenant_of(identity: dict[str, Any]) -> str:
    return str(identity.get("tenant") or identity.get("name") or "")


def app_state() -> AppState:
    """The state of the app serving the current request."""
    state: AppState = current_app.extensions[EXTENSION]
    return state

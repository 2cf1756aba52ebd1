"""The API app: one Flask app with the v1 blueprints and the v2 protocol over one typed state.

Views are thin: parse the body with pydantic, call a function of `sits_api.intake` or `broker`, map
the result. Every `SitsError` becomes a JSON error with its HTTP status in one handler
(`sits_api.http.error_replies`); nothing the client does can produce a 500.
"""

from __future__ import annotations

import logging
import os

from flask import Flask
from werkzeug.exceptions import HTTPException

from broker.config.settings import Settings
from broker.errors import SitsError
from broker.models import registry
from broker.queueing import policy
from broker.state.store import Store
from broker.tenants.records import TenantTable
from sits_api import metrics
from sits_api.http import durable_writes, error_replies, request_metrics, tracing
from sits_api.http.jsonio import OrjsonProvider
from sits_api.intake import model_repository
from sits_api.intake.result_inbox import ResultInbox
from sits_api.intake.task_sender import Dispatcher
from sits_api.state import EXTENSION, AppState, app_state
from sits_api.tenancy import auth
from sits_api.v1 import admin, health, jobs, models, schedules, tuning
from sits_api.v1 import requests as online_requests
from sits_api.v2.repository import repository
from sits_api.v2.routes import v2

log = logging.getLogger(__name__)


def create_app(settings: Settings, store: Store | None = None, dispatcher: Dispatcher | None = None) -> Flask:
    """The API app over the Redis named in `settings` (or the `store` given)."""
    app = Flask("sits_api")
    tracing.instrument_app(app, os.environ)  # (first: its request hook before every other; off unless OTEL_* say)
    app.config["MAX_CONTENT_LENGTH"] = settings.api.max_body_bytes
    app.config["SITS_BODY_TIMEOUT"] = settings.api.body_timeout
    app.json = OrjsonProvider(app)
    app.json.sort_keys = False  # type: ignore[attr-defined]
    store = store or Store.of(settings.redis)
    http_counts = request_metrics.HttpCounts(store)
    request_metrics.instrument_app(app, http_counts)  # (before the other hooks: it times them, counts their refusals)
    app.extensions[EXTENSION] = AppState(
        settings=settings,
        store=store,
        dispatcher=dispatcher or Dispatcher(settings, store),
        policy=policy.LivePolicy(store, default=policy.default_ordering(settings.scheduler.policy)),
        inbox=ResultInbox(store),
        metrics=metrics.SitsCollector(store, settings, http_counts),
        tenants=TenantTable(settings.tenants),
    )
    app.before_request(_check_key)  # every blueprint: v1 and the v2 protocol
    app.after_request(durable_writes.replica_wait(settings.redis, store))  # (redis.wait_replicas)
    for blueprint in (health.blueprint, models.blueprint, jobs.blueprint, online_requests.blueprint,
                      admin.blueprint, schedules.blueprint, tuning.blueprint, v2, repository):
        app.register_blueprint(blueprint)
    app.register_error_handler(SitsError, error_replies.sits_error)
    app.register_error_handler(HTTPException, error_replies.http_error)
    app.register_error_handler(Exception, error_replies.unexpected_error)
    _own_model_names_by_tenant(store)
    model_repository.load_at_start(settings, store)  # (in a thread: the API answers while models load)
    return app


def _own_model_names_by_tenant(store: Store) -> None:
    """Model names owned by a key's name become its tenant's, once per store (`registry.own_names_by_tenant`);
    a Redis that cannot be reached now is left for the next start (admin keys still add versions)."""
    try:
        changed = registry.own_names_by_tenant(store)
    except SitsError as err:
        log.warning("model names not yet moved to their tenants (%s); the next start tries again", err.message)
        return
    if changed:
        log.info("%d model names now belong to their key's tenant", changed)


def _check_key() -> None:
    state = app_state()
    auth.check_key(state.store, state.known_keys)

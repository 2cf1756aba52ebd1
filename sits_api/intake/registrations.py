"""Model registrations run off the API's request threads.

A registration reads the whole model, checks it and runs it (ONNX Runtime's load check and the row and
sequence probes, `sits_api.intake.services.register_model`), in a child process under a memory and time
limit (`sits_api.intake.model_checks`): seconds for a large model. Waiting for it on a request thread would
hold one of the process's `api.threads` for as long, so registrations run on a small pool of their own
(`models.registration_threads` a process). The call waits `models.registration_wait` for its registration:
most end well within it and answer 201 as before; a longer one answers 202 with a registration id to poll
(`GET /v1/models/registrations/{id}`), whose record in Redis says how it ended (the version, or the error
with its code and status), an hour long. Each tenant runs at most `models.registrations_per_tenant` at once
per process (429 past it): its slot is held until its registration ends, not until its call returns.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from broker.errors import NotFound, SitsError
from broker.models.model_record import ModelRecord
from broker.state.store import Store, translate_redis_errors

log = logging.getLogger(__name__)

REGISTRATION_ID_PATTERN = re.compile(r"g[0-9a-f]{12}")
"""Every registration id `new_registration_id` makes; another is no registration's, and not looked up."""
KEEP_SECONDS = 3600
"""How long a registration's record stays once it has ended (and at most while it runs)."""


def new_registration_id() -> str:
    """A short random id, safe in keys."""
    return "g" + secrets.token_hex(6)


@dataclass(frozen=True)
class Registration:
    """One registration as its record holds it."""

    id: str
    name: str
    tenant: str
    owner: str
    status: str
    """running, registered or failed."""
    started_at: float
    finished_at: float | None = None
    ref: str | None = None
    """`name@version` once registered."""
    error: str | None = None
    code: str | None = None
    http_status: int | None = None
    """The status its call would have answered had it waited: the error's."""

    @classmethod
    def of(cls, fields: dict[str, str]) -> Registration:
        return cls(id=fields["id"], name=fields.get("name", ""), tenant=fields.get("tenant", ""),
                   owner=fields.get("owner", ""), status=fields.get("status", "running"),
                   started_at=float(fields.get("started_at") or 0),
                   finished_at=float(fields["finished_at"]) if fields.get("finished_at") else None,
                   ref=fields.get("ref") or None, error=fields.get("error") or None, code=fields.get("code") or None,
                   http_status=int(fields["http_status"]) if fields.get("http_status") else None)

    def to_json(self) -> dict[str, Any]:
        shown = {"id": self.id, "name": self.name, "status": self.status, "started_at": self.started_at,
                 "finished_at": self.finished_at, "ref": self.ref}
        if self.status == "failed":
            shown |= {"error": self.error, "code": self.code, "http_status": self.http_status}
        return shown


def registration_not_found(registration_id: str) -> NotFound:
    """The error for an unknown, expired or another tenant's registration: the same for all three."""
    return NotFound(f"no model registration with id '{registration_id}' (records are kept an hour after they end)")


def get_registration(store: Store, registration_id: str) -> Registration:
    """The registration `registration_id`; NotFound when there is none (or the id is none a registration has)."""
    if not REGISTRATION_ID_PATTERN.fullmatch(registration_id):
        raise registration_not_found(registration_id)
    with translate_redis_errors():
        fields = store.client.hgetall(store.keys.registration(registration_id))
    if not fields:
        raise registration_not_found(registration_id)
    return Registration.of(fields)


class Registrations:
    """This process's pool that runs registrations, and their records in Redis."""

    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="sits-register")

    def start(self, store: Store, *, name: str, tenant: str, owner: str, register: Callable[[], ModelRecord],
              finally_: Callable[[], None], now: float) -> tuple[str, Future[ModelRecord]]:
        """Record a registration as running and run `register` on the pool; `finally_` runs when it ends
        (the tenant's slot freed). Returns its id and its future."""
        registration_id = new_registration_id()
        key = store.keys.registration(registration_id)
        try:
            with translate_redis_errors(), store.client.pipeline(transaction=True) as pipe:
                pipe.hset(key, mapping={"id": registration_id, "name": name, "tenant": tenant, "owner": owner,
                                        "status": "running", "started_at": now})
                pipe.expire(key, KEEP_SECONDS)
                pipe.execute()
        except BaseException:
            finally_()
            raise

        def run() -> ModelRecord:
            try:
                record = register()
            except SitsError as err:
                _end(store, key, {"status": "failed", "error": err.message, "code": err.code,
                                  "http_status": err.http_status})
                raise
            except Exception as err:
                log.exception("registration %s of model %s failed", registration_id, name)
                _end(store, key, {"status": "failed", "error": f"internal error ({type(err).__name__}); see the "
                                  "API log", "code": "internal_error", "http_status": 500})
                raise
            else:
                _end(store, key, {"status": "registered", "ref": record.ref})
                return record
            finally:
                finally_()

        return registration_id, self._pool.submit(run)


def _end(store: Store, key: str, fields: dict[str, Any]) -> None:
    """Write how a registration ended (a Redis away now only loses the record: the model is registered or not)."""
    try:
        with translate_redis_errors(), store.client.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={**fields, "finished_at": time.time()})
            pipe.expire(key, KEEP_SECONDS)
            pipe.execute()
    except SitsError as err:
        log.warning("could not record how registration %s ended: %s", key, err.message)

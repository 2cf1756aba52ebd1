"""Reading what a v1 request sends: its JSON body as a schema, yes/no query flags, its priority."""

from __future__ import annotations

from typing import Any

from flask import request
from pydantic import BaseModel, ValidationError

from broker.errors import BadInput
from broker.tenants.settings import Tenant
from sits_api.http.jsonio import request_object


def parse_body(model: type[BaseModel]) -> Any:
    body = request_object("a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: "
            f"{'unknown field' if e['type'] == 'extra_forbidden' else e['msg']}"
            for e in err.errors()
        )
        raise BadInput(f"invalid {model.__name__}: {problems}") from err


def query_flag(name: str) -> bool:
    """A yes/no query parameter (`?wait=true`); BadInput for a value that is neither."""
    if not request.query_string:
        return False  # the usual case, without parsing the query into a MultiDict
    value = request.args.get(name, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    raise BadInput(f"query parameter '{name}' must be true or false, got {request.args.get(name)!r}")


def priority_of(body: Any, tenant: Tenant | None) -> int:
    """The priority a request or job runs at: its own, else its tenant's `default_priority`, else the default."""
    if "priority" in body.model_fields_set or tenant is None or tenant.default_priority is None:
        return int(body.priority)
    return tenant.default_priority

"""Flask's JSON provider, backed by orjson.

Tensors travel as JSON nested lists, so parsing request bodies and writing
answers is a large share of the API's CPU per request: orjson does both
several times faster than the standard library. Anything orjson refuses
(integers wider than 64 bits) falls back to the
standard provider, so behaviour matches Flask's except that NaN and infinity
are written as null (valid JSON) instead of bare NaN.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import orjson
from flask import Response, current_app, request
from flask.json.provider import DefaultJSONProvider
from werkzeug.sansio.response import Response as BaseResponse

from broker.errors import BadInput
from sits_api.http.content_encoding import request_body

_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY


class OrjsonProvider(DefaultJSONProvider):
    """`app.json = OrjsonProvider(app)`: compact output, keys in insertion order."""

    def dumps(self, obj: Any, **kwargs: Any) -> str:
        """Serialize `obj`; with formatting options (indent, sort) the standard provider does it."""
        if kwargs:
            return super().dumps(obj, **kwargs)
        try:
            return orjson.dumps(obj, default=self.default, option=_OPTIONS).decode()
        except (orjson.JSONEncodeError, TypeError):
            return super().dumps(obj)

    def loads(self, s: str | bytes, **kwargs: Any) -> Any:
        """Parse JSON text; what orjson rejects is parsed (or rejected) by the standard library.

        Both refuse what is not a finite JSON number: the literals NaN and Infinity (a NaN weight or
        input would reach scores and tensors), numbers beyond a double's range such as 1e400 (orjson
        refuses them; the standard parser would make them infinity, or integers no float holds), and
        nesting deeper than orjson's limit (the standard parser would recurse until Python's stack
        gives out). The ValueError becomes Flask's 400.
        """
        try:
            return orjson.loads(s)
        except orjson.JSONDecodeError:
            try:
                return super().loads(s, parse_constant=_refuse_constant, parse_float=_finite_float,
                                     parse_int=_finite_int, **kwargs)
            except RecursionError:
                raise ValueError("the JSON body is nested too deeply") from None

    def response(self, *args: Any, **kwargs: Any) -> BaseResponse:
        """A JSON response of `args` or `kwargs`, as `flask.jsonify` makes it."""
        obj = self._prepare_response_obj(args, kwargs)
        if self._app.debug:
            return super().response(*args, **kwargs)
        try:
            body = orjson.dumps(obj, default=self.default, option=_OPTIONS | orjson.OPT_APPEND_NEWLINE)
        except (orjson.JSONEncodeError, TypeError):
            return super().response(*args, **kwargs)
        return Response(body, mimetype=self.mimetype)


def _finite_float(text: str) -> float:
    """`json.loads`' hook for numbers with a fraction or exponent: refuses those no double holds."""
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text[:40]} is beyond the range of a 64-bit float; send finite numbers only")
    return value


def _finite_int(text: str) -> int:
    """`json.loads`' hook for whole numbers: refuses those beyond a double's range (orjson refuses those
    past 64 bits; wider ones are kept, but one no float holds would overflow wherever it is used)."""
    value = int(text)
    if abs(value) > sys.float_info.max:
        raise ValueError(f"{text[:40]}... is beyond the range of a 64-bit float; send finite numbers only")
    return value


def _refuse_constant(name: str) -> Any:
    """`json.loads`' hook for NaN, Infinity and -Infinity, which JSON does not have."""
    raise ValueError(f"{name} is not a JSON number; send finite numbers only")


def request_object(expected: str) -> dict[str, Any]:
    """The request's JSON body, which must be an object; BadInput says what is wrong with it.

    `expected` names what the body should be ("a JSON object of policy keys, e.g. ..."), for the
    message when it is missing, not JSON, or not an object.
    """
    if not request.is_json:
        raise BadInput(f"the request body must be {expected} (Content-Type: application/json)")
    # parsed here rather than by request.get_json, which hides the reason outside debug mode
    return parse_object(request_body(), expected)


def parse_object(text: bytes, expected: str) -> dict[str, Any]:
    """`text` parsed as a JSON object; BadInput says what is wrong with it, as for `request_object`."""
    try:
        body = current_app.json.loads(text)
    except ValueError as err:  # malformed, NaN literals, nested too deeply, not UTF-8
        raise BadInput(f"the request body is not valid JSON ({err}); it must be {expected}") from None
    if not isinstance(body, dict):
        raise BadInput(f"the request body must be {expected}, not a JSON {type(body).__name__}")
    return body

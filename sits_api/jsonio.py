"""Flask's JSON provider, backed by orjson.

Tensors travel as JSON nested lists, so parsing request bodies and writing
answers is a large share of the API's CPU per request: orjson does both
several times faster than the standard library. Anything orjson refuses
(integers wider than 64 bits, NaN literals in a body) falls back to the
standard provider, so behaviour matches Flask's except that NaN and infinity
are written as null (valid JSON) instead of bare NaN.
"""

from __future__ import annotations

from typing import Any

import orjson
from flask import Response
from flask.json.provider import DefaultJSONProvider
from werkzeug.sansio.response import Response as BaseResponse

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
        """Parse JSON text; what orjson rejects is parsed (or rejected) by the standard library."""
        try:
            return orjson.loads(s)
        except orjson.JSONDecodeError:
            return super().loads(s, **kwargs)

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

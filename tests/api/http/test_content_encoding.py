"""Compressed request bodies (Content-Encoding gzip or deflate) on every endpoint that reads a body.

A compressed body is read as its decompressed bytes, held to `api.max_body_bytes` once
decompressed (a bomb is a 413 that never expands past the limit); any other coding is a 415
naming the supported ones, and data that is not what its coding says is a 400. Refused bodies
queue nothing.
"""

from __future__ import annotations

import gzip
import json
import os
import tracemalloc
import zlib
from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient
from werkzeug.test import TestResponse

from broker.errors import BadInput, PayloadTooLarge
from broker.state.embedded import EmbeddedRedis
from broker.state.store import Store
from broker.tenants.apikeys import create_api_key
from sits_api.app import create_app
from sits_api.http.content_encoding import CHUNK_BYTES, MAX_GZIP_MEMBERS, decompress
from tests.api.api_helpers import Api, error_of, make_settings, queued_items

REQUEST = {"model": "mlp", "inputs": {"features": [[0.5] * 64]}}
COMPRESS = {"gzip": gzip.compress, "deflate": zlib.compress}


def post_encoded(api: Api, path: str, body: bytes, encoding: str, **headers: str) -> TestResponse:
    """POST `body` as JSON with `Content-Encoding: encoding`."""
    return api.client.post(path, data=body, content_type="application/json",
                           headers=api.headers | {"Content-Encoding": encoding} | headers)


def bomb(decompressed_bytes: int, coding: str = "gzip") -> bytes:
    """`decompressed_bytes` of spaces (valid JSON whitespace) compressed: about 1,000 times smaller."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS if coding == "gzip" else zlib.MAX_WBITS)
    mebibyte = b" " * 2**20
    return b"".join(compressor.compress(mebibyte) for _ in range(decompressed_bytes // 2**20)) + compressor.flush()


@pytest.fixture
def small_limit_api(redis_server: EmbeddedRedis, store: Store, tmp_path: Path, zoo_dir: Path) -> Api:
    """An API whose bodies may hold 64 KiB, with the zoo MLP registered."""
    settings = make_settings(redis_server, store, tmp_path, zoo_dir, max_body_bytes="64KiB")
    api = Api(create_app(settings, store=store).test_client(), create_api_key(store, "test", "admin"))
    assert api.post("/v1/models", json={"name": "mlp", "path": str(zoo_dir / "mlp.onnx")}).status_code == 201
    return api


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "x-gzip", "GZIP", "identity, gzip"])
def test_a_compressed_v1_request_is_read_and_queued(api: Api, mlp: dict[str, Any], encoding: str) -> None:
    compress = COMPRESS["deflate" if encoding == "deflate" else "gzip"]

    response = post_encoded(api, "/v1/requests", compress(json.dumps(REQUEST).encode()), encoding)

    assert response.status_code == 202, response.get_json()
    assert response.get_json()["model"] == "mlp"
    assert queued_items(api) == 1


def test_codings_applied_one_after_the_other_are_undone_in_reverse(api: Api, mlp: dict[str, Any]) -> None:
    body = gzip.compress(zlib.compress(json.dumps(REQUEST).encode()))  # deflate first, then gzip

    response = post_encoded(api, "/v1/requests", body, "deflate, gzip")

    assert response.status_code == 202, response.get_json()


def test_a_gzip_body_of_several_members_is_read_whole(api: Api, mlp: dict[str, Any]) -> None:
    text = json.dumps(REQUEST).encode()
    body = gzip.compress(text[:20]) + gzip.compress(text[20:])

    assert post_encoded(api, "/v1/requests", body, "gzip").status_code == 202


def test_members_of_any_size_are_joined_across_chunk_boundaries() -> None:
    texts = [os.urandom(size) for size in (0, 1, CHUNK_BYTES - 7, 3 * CHUNK_BYTES + 5, 0, 11)]
    body = b"".join(gzip.compress(text) for text in texts)

    assert decompress(body, "gzip", None) == b"".join(texts)
    with pytest.raises(PayloadTooLarge):
        decompress(body, "gzip", len(b"".join(texts)) - 1)


def test_a_gzip_body_of_more_members_than_the_cap_is_a_400_saying_so(api: Api, mlp: dict[str, Any]) -> None:
    """Clients send one member; each costs a decoder, so a body of many tiny ones is refused."""
    last = gzip.compress(json.dumps(REQUEST).encode())
    at_cap = gzip.compress(b"") * (MAX_GZIP_MEMBERS - 1) + last

    assert post_encoded(api, "/v1/requests", at_cap, "gzip").status_code == 202
    response = post_encoded(api, "/v1/requests", gzip.compress(b"") + at_cap, "gzip")

    assert response.status_code == 400
    assert f"more than {MAX_GZIP_MEMBERS} gzip members" in error_of(response)
    assert queued_items(api) == 1


def test_gzip_members_are_read_in_place_without_copying_the_rest_of_the_body() -> None:
    """Copying the rest of the body at each member's end made a body of tiny members quadratic."""
    body = gzip.compress(b"") * (MAX_GZIP_MEMBERS - 1) + b"\0" * 2**20  # then data that is not gzip

    tracemalloc.start()
    try:
        with pytest.raises(BadInput, match="not valid gzip data"):
            decompress(body, "gzip", None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert peak < 4 * CHUNK_BYTES, f"decoding held {peak} bytes for a {len(body)}-byte body"


def test_other_endpoints_read_compressed_bodies_too(api: Api, zoo_dir: Path) -> None:
    registration = json.dumps({"name": "mlp", "path": str(zoo_dir / "mlp.onnx")}).encode()
    assert post_encoded(api, "/v1/models", gzip.compress(registration), "gzip").status_code == 201
    v2 = {"inputs": [{"name": "features", "shape": [1, 64], "datatype": "FP32", "data": [0.0] * 64}],
          "parameters": {"timeout": 1000}}
    # no worker runs here: queued, then a 504 once the 1 ms timeout has passed while it waited
    response = post_encoded(api, "/v2/models/mlp/infer", zlib.compress(json.dumps(v2).encode()), "deflate")
    assert response.status_code == 504 and "while it waited in the queue" in error_of(response)


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
def test_a_compression_bomb_is_a_413_naming_the_limit_and_queues_nothing(
        small_limit_api: Api, coding: str) -> None:
    body = bomb(32 * 2**20, coding)
    assert len(body) < 64 * 2**10  # within the limit as sent: only its decompressed size is refused

    response = post_encoded(small_limit_api, "/v1/requests", body, coding)

    assert response.status_code == 413
    assert "65536-byte limit" in error_of(response) and "api.max_body_bytes" in error_of(response)
    assert "decompresses" in error_of(response)
    assert queued_items(small_limit_api) == 0


def test_a_body_that_decompresses_to_exactly_the_limit_is_read(small_limit_api: Api) -> None:
    text = json.dumps(REQUEST).encode()
    body = text + b" " * (64 * 2**10 - len(text))

    assert post_encoded(small_limit_api, "/v1/requests", gzip.compress(body), "gzip").status_code == 202
    assert post_encoded(small_limit_api, "/v1/requests", gzip.compress(body + b" "), "gzip").status_code == 413


def test_decompression_stops_at_the_limit_without_expanding_the_bomb() -> None:
    body = bomb(256 * 2**20)
    limit = 2**20

    tracemalloc.start()
    try:
        with pytest.raises(PayloadTooLarge):
            decompress(body, "gzip", limit)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert peak < limit + 4 * CHUNK_BYTES, f"decompression held {peak} bytes for a {limit}-byte limit"


@pytest.mark.parametrize("encoding", ["br", "compress", "zstd", "gzip, br"])
def test_an_unsupported_content_encoding_is_a_415_listing_the_supported_ones(
        api: Api, mlp: dict[str, Any], encoding: str) -> None:
    response = post_encoded(api, "/v1/requests", json.dumps(REQUEST).encode(), encoding)

    assert response.status_code == 415
    message = error_of(response)
    assert encoding.split(", ")[-1] in message and "gzip" in message and "deflate" in message
    assert response.get_json()["code"] == "unsupported_media_type"
    assert queued_items(api) == 0


@pytest.mark.parametrize(("body", "encoding", "message"), [
    pytest.param(json.dumps(REQUEST).encode(), "gzip", "not valid gzip data", id="plain-json-labelled-gzip"),
    pytest.param(gzip.compress(json.dumps(REQUEST).encode())[:-12], "gzip", "truncated", id="truncated-gzip"),
    pytest.param(b"\x1f\x8b\x08\x00" + b"\xff" * 40, "gzip", "not valid gzip data", id="corrupt-gzip"),
    pytest.param(gzip.compress(json.dumps(REQUEST).encode()), "deflate", "not valid deflate data",
                 id="gzip-labelled-deflate"),
    pytest.param(zlib.compress(json.dumps(REQUEST).encode()) + b"junk", "deflate", "after the end",
                 id="deflate-with-trailing-bytes"),
    pytest.param(b"", "gzip", "truncated", id="empty-gzip"),
    pytest.param(gzip.compress(b"[1, 2"), "gzip", "not valid JSON", id="gzip-of-bad-json"),
])
def test_corrupt_compressed_data_is_a_400_and_queues_nothing(
        api: Api, mlp: dict[str, Any], body: bytes, encoding: str, message: str) -> None:
    response = post_encoded(api, "/v1/requests", body, encoding)

    assert response.status_code == 400, response.get_json()
    assert message in error_of(response)
    assert queued_items(api) == 0


def test_a_compressed_body_without_a_key_is_refused_before_it_is_decompressed(client: FlaskClient) -> None:
    response = client.post("/v1/requests", data=bomb(8 * 2**20), content_type="application/json",
                           headers={"Content-Encoding": "gzip"})

    assert response.status_code == 401


def test_the_body_timeout_is_lifted_once_the_body_is_read(app: Any) -> None:
    """Left on the socket, it would also bound the answer's write: a large answer to a slow reader was
    cut off after `api.body_timeout` (sendall counts the timeout for the whole send)."""
    import socket

    from sits_api.http.content_encoding import request_body

    server, client = socket.socketpair()
    try:
        with app.test_request_context("/v1/requests", method="POST", data=b'{"a": 1}',
                                      environ_base={"gunicorn.socket": server}):
            assert request_body() == b'{"a": 1}'
            assert server.gettimeout() is None  # blocking again, as gunicorn left it
    finally:
        server.close()
        client.close()

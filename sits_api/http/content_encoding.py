"""Request bodies as the views read them: decompressed when the client sent `Content-Encoding`.

tritonclient's `request_compression_algorithm` (and any HTTP client) may send a body as `gzip` or
`deflate` (the zlib format, RFC 9110 8.4.1.2). The decompressed body is held to the same
`api.max_body_bytes` as a plain one: decompression stops one byte past the limit, so a small
compressed bomb costs no more memory than the limit before it is refused (413). Any other coding
is a 415 listing the supported ones; data that is not what its coding says, a gzip body of more
than `MAX_GZIP_MEMBERS` members, or more than `MAX_CODINGS` codings stacked, is a 400. Every view
that reads a body reads it here, so v1 and v2 treat it alike.
"""

from __future__ import annotations

import zlib

from flask import current_app, request
from werkzeug.exceptions import HTTPException, UnsupportedMediaType

from broker.errors import BadInput, BodyTimeout, PayloadTooLarge

WINDOW_BITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
"""zlib's `wbits` for each supported coding: a gzip wrapper, or the zlib one that HTTP calls deflate."""
CHUNK_BYTES = 64 * 2**10
"""The most a body is decoded by in one step (and the most compressed bytes fed in one)."""
MAX_GZIP_MEMBERS = 1000
"""The most gzip members one body may hold (a 400 past it): clients compress a body as one member, and
each member costs a decoder, so a body of many empty 20-byte ones must not keep the server busy."""
MAX_CODINGS = 2
"""The most content codings one body may stack (`gzip, gzip`): no client compresses twice on purpose,
and each layer may inflate up to the body limit again, so 50 layers behind one 16 MiB body would keep
a request thread decoding for most of a minute."""


def request_body() -> bytes:
    """The request's body with its content codings undone; an unsupported coding is refused before
    the body is read. (Flask caches the raw bytes; each call decompresses them again.)"""
    codings = [coding.strip().lower() for coding in request.headers.get("Content-Encoding", "").split(",")]
    codings = [coding for coding in codings if coding and coding != "identity"]
    unsupported = [coding for coding in codings if coding not in WINDOW_BITS]
    if unsupported:
        raise UnsupportedMediaType(f"Content-Encoding {', '.join(unsupported)} is not supported; send the body "
                                   f"uncompressed or with Content-Encoding gzip or deflate")
    if len(codings) > MAX_CODINGS:
        raise BadInput(f"Content-Encoding stacks {len(codings)} codings; at most {MAX_CODINGS} are decoded: "
                       "compress the body once")
    body, limit = _raw_body(), request.max_content_length
    for coding in reversed(codings):  # the codings were applied in the order listed (RFC 9110 8.4)
        body = decompress(body, coding, limit)
    return body


def _raw_body() -> bytes:
    """The bytes the client sent. The server decodes a chunked body while it is read, so a malformed
    one (a chunk size that is no hex number, a chunk longer than it said) fails here, with the
    server's own exception type (gunicorn's `InvalidChunkSize`, ...): that is the client's error.

    Under gunicorn each read of the body waits at most `api.body_timeout` (app config
    `SITS_BODY_TIMEOUT`): a body that stops arriving part-way is a 408, instead of holding a request
    thread for as long as the client keeps its connection open. The timeout bounds a pause, not the
    whole body (a client trickling a byte now and then is a slow client, as one stalling inside its
    headers: a buffering proxy's to absorb), and it is lifted once the body is read, so that writing
    a large answer to a slow reader is not cut short."""
    sock = request.environ.get("gunicorn.socket")
    timeout = current_app.config.get("SITS_BODY_TIMEOUT")
    if sock is not None and timeout:
        sock.settimeout(timeout)
    try:
        return request.get_data(cache=True)
    except HTTPException as err:
        if not isinstance(err.__context__, TimeoutError):  # (werkzeug's ClientDisconnected, raised on the timeout)
            raise  # 413 and the like: already the right answer
        # gunicorn then finds the body unfinished, and closes the connection
        size = (f"Content-Length {request.content_length} bytes" if request.content_length is not None
                else "its chunks")
        raise BodyTimeout(f"the request body stopped arriving: none of it came for {timeout:g} s (api.body_timeout)"
                          f"; send the whole body ({size}) without pausing") from err
    except Exception as err:
        if not _from_the_server(err):
            raise  # a fault of ours: a 500, logged
        raise BadInput(f"the request body could not be read ({type(err).__name__}: {err}); send it with "
                       f"Content-Length, or as valid HTTP/1.1 chunks") from err
    finally:
        if sock is not None and timeout:
            sock.settimeout(None)  # (blocking, as gunicorn left it)


def _from_the_server(err: Exception) -> bool:
    """Whether the WSGI server raised `err` parsing the body the client sent: gunicorn's parse errors
    (its `http` package), or the connection failing mid-body."""
    return type(err).__module__.startswith("gunicorn.") or isinstance(err, OSError)


def decompress(data: bytes, coding: str, limit: int | None) -> bytes:
    """`data` decoded from `coding` (a key of WINDOW_BITS); PayloadTooLarge past `limit` bytes
    (None: no limit), BadInput when it is not valid `coding` data.

    Decoded in pieces of at most CHUNK_BYTES, so a bomb is refused having expanded to the limit and
    no further. A gzip body may hold several members one after the other (as `cat a.gz b.gz`
    makes); they are decoded in turn under one limit, each read in place from the one body (the
    rest of the body is never copied per member, which made many tiny members quadratic), and at
    most MAX_GZIP_MEMBERS of them.
    """
    parts: list[bytes] = []
    size = 0
    body = memoryview(data)
    start = 0  # where the member being decoded begins in `body`
    members = 0
    while True:  # one gzip member, or the one deflate stream, per turn
        members += 1
        if members > MAX_GZIP_MEMBERS:
            raise BadInput(f"the request body holds more than {MAX_GZIP_MEMBERS} gzip members; compress the "
                           f"body as one gzip stream")
        decoder = zlib.decompressobj(WINDOW_BITS[coding])
        offset = start
        more_output = False
        while not decoder.eof:
            if decoder.unconsumed_tail or more_output:  # (input held back by the bound, or output pending)
                pending: bytes | memoryview = decoder.unconsumed_tail
            elif offset < len(body):  # fed in slices: a long unconsumed tail would be copied on every call
                pending = body[offset : offset + CHUNK_BYTES]
                offset += len(pending)
            else:
                raise BadInput(f"the request body is truncated {coding} data: the compressed stream does not "
                               f"end; send the whole compressed body")
            bound = CHUNK_BYTES if limit is None else min(CHUNK_BYTES, limit - size + 1)
            try:
                part = decoder.decompress(pending, bound)
            except zlib.error as err:
                raise BadInput(f"the request body is not valid {coding} data ({err}); compress it whole with "
                               f"{coding}, or send it uncompressed without Content-Encoding") from None
            size += len(part)
            if limit is not None and size > limit:
                raise PayloadTooLarge(f"the request body decompresses to more than the {limit}-byte limit "
                                      f"(api.max_body_bytes); send less per request")
            parts.append(part)
            more_output = len(part) == bound
        start = offset - len(decoder.unused_data)  # the fed bytes past this member's end begin the next
        if start == len(body):
            return parts[0] if len(parts) == 1 else b"".join(parts)
        if coding == "deflate":
            raise BadInput(f"the request body has {len(body) - start} bytes after the end of its deflate data; "
                           f"send exactly one compressed stream")

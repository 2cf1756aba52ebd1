"""mosec 0.9.8 serving the zoo models, one worker process per model, dynamic batching 32 rows / 5 ms.

    PEER_MODELS=mlp=/m/mlp.onnx,convnet=/m/convnet.onnx python mosec_server.py --address 127.0.0.1 --port 8000

Routes `/<model>`: JSON `{"inputs": [[...]]}` or raw float32 rows (any body that does not start with
`{"inputs":`; the worker sees the body, not its headers), answered in kind.

The patch. mosec's Python worker reads each IPC frame from the Rust front's Unix socket with
`Protocol.receive` (site-packages/mosec/protocol.py). The payloads go through `_recv_all`, which loops,
but the fields around them (flag, batch size, and each task's id, state and length) are read with one
bare `socket.recv(n)`, which may return fewer than n bytes. With batches of about 1 MB (32 CNN rows of
12 KiB as JSON) a field comes back short, the worker reads the rest of the frame out of step, and
every request of the batch fails (or the worker dies on a `struct.error`). `_patch_mosec_receive`
replaces `Protocol.receive`, in this process and in every worker (spawned workers import this module
again), with one that reads every field in full: it loops until the announced length is read and
fails on a closed socket. Nothing in site-packages is changed.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    JSON_PREFIX,
    MAX_BATCH_SIZE,
    MAX_WAIT_SECONDS,
    Model,
    encode,
    note,
    parse_models,
)
from mosec import Server, Worker  # noqa: E402
from mosec.errors import DecodingError  # noqa: E402
from mosec.protocol import Protocol  # noqa: E402


def _recv_exact(conn: socket.socket, length: int, *, started: bool) -> bytes:
    """Exactly `length` bytes of `conn`. A socket timeout before the first byte of a frame (`started`
    False) is raised, as the original does while it waits for work; once a frame has begun, a timeout
    only waits longer, as the rest of the frame is on its way."""
    buffer = bytearray(length)
    view = memoryview(buffer)
    got = 0
    while got < length:
        try:
            count = conn.recv_into(view[got:])
        except TimeoutError:
            if not started and got == 0:
                raise
            continue
        if count == 0:
            raise OSError(f"mosec IPC socket closed after {got} of {length} bytes")
        got += count
        started = True
    return bytes(buffer)


def _receive_in_full(self: Protocol) -> tuple[bytes, list[bytes], list[int], list[bytes]]:
    """`Protocol.receive` with every field read in full (see the module docstring)."""
    sock = self.socket
    flag = _recv_exact(sock, self.LENGTH_TASK_FLAG, started=False)
    batch_size = struct.unpack(self.FORMAT_BATCH, _recv_exact(sock, self.LENGTH_TASK_BATCH, started=True))[0]
    ids, states, payloads = [], [], []
    for _ in range(batch_size):
        ids.append(_recv_exact(sock, self.LENGTH_TASK_ID, started=True))
        states.append(struct.unpack(self.FORMAT_STATE, _recv_exact(sock, self.LENGTH_TASK_STATE, started=True))[0])
        length = struct.unpack(self.FORMAT_LENGTH, _recv_exact(sock, self.LENGTH_TASK_BODY_LEN, started=True))[0]
        payloads.append(_recv_exact(sock, length, started=True))
    return flag, ids, states, payloads


def _patch_mosec_receive() -> None:
    Protocol.receive = _receive_in_full  # type: ignore[method-assign]


UNPATCHED = os.environ.get("PEER_MOSEC_UNPATCHED") == "1"
"""Set PEER_MOSEC_UNPATCHED=1 to run mosec as shipped, to see the failure the patch removes."""
if not UNPATCHED:
    _patch_mosec_receive()  # at import: the spawned workers import this module too


class OnnxWorker(Worker):
    """One model on one SITS-configured session; a batch is one session run."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Model(os.environ["PEER_MODEL_PATH"])

    def deserialize(self, data: bytes) -> tuple[bool, object]:
        binary = not data.startswith(JSON_PREFIX)
        try:
            return binary, self.model.decode(data, binary)
        except Exception as err:
            raise DecodingError(str(err)) from err

    def forward(self, data: list[tuple[bool, object]]) -> list[tuple[bool, object]]:
        outputs = self.model.run_many([array for _, array in data])  # type: ignore[misc]
        return [(binary, output) for (binary, _), output in zip(data, outputs, strict=True)]

    def serialize(self, data: tuple[bool, object]) -> bytes:
        binary, output = data
        return encode(output, binary)  # type: ignore[arg-type]


def main() -> None:
    if UNPATCHED:
        note("mosec: UNPATCHED (PEER_MOSEC_UNPATCHED=1): Protocol.receive as shipped")
    else:
        note("mosec: Protocol.receive patched to read every IPC field in full (mosec 0.9.8 reads them with one"
             " bare recv and desyncs on ~1 MB batches); site-packages unchanged")
    models = parse_models(os.environ["PEER_MODELS"])
    server = Server()
    for name, path in models.items():
        server.append_worker(OnnxWorker, num=1, max_batch_size=MAX_BATCH_SIZE,
                             max_wait_time=round(MAX_WAIT_SECONDS * 1000), env=[{"PEER_MODEL_PATH": path}],
                             route=f"/{name}")
    server.run()


if __name__ == "__main__":
    main()

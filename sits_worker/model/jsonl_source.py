"""Reading a .jsonl input file: one JSON object per line, rows located through a byte-offset index.

Only the first row is parsed when the file is opened (the API opens every job's input), each
other row when a worker reads its chunk.
"""

from __future__ import annotations

import bisect
import json
import threading
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from broker.errors import BadInput
from sits_worker.model.source import Batch, InputSource, file_error
from sits_worker.model.tensors import InputSpec, json_array


class _JsonlSource(InputSource):
    """jsonl input: one JSON object per line, rows located through a byte-offset index."""

    def __init__(
        self, path: Path, specs: list[InputSpec], handle: BinaryIO, offsets: array[int], blank_lines: array[int]
    ) -> None:
        super().__init__(path, ".jsonl", [spec.name for spec in specs], len(offsets))
        self._specs, self._handle, self._offsets = specs, handle, offsets
        self._blank_lines = blank_lines  # for each blank line, the row that follows it (sorted)
        self._lock = threading.Lock()

    def read_rows(self, start: int, stop: int) -> list[dict[str, np.ndarray]]:
        """Parse and check rows [start, stop); each becomes {input name: array of the input's dtype}."""
        lines: list[bytes] = []
        try:
            with self._lock:  # one handle, shared by the worker's stream threads: seek and read together
                self._handle.seek(self._offsets[start])
                while len(lines) < stop - start:
                    line = self._handle.readline()
                    if not line:
                        raise BadInput(f"'{self.path.name}' changed after the job was submitted; resubmit the job")
                    if line.strip():
                        lines.append(line)
        except OSError as err:
            raise file_error(self.path, err) from err
        return [self._parse_row(line, start + offset) for offset, line in enumerate(lines)]

    def _parse_row(self, line: bytes, row: int) -> dict[str, np.ndarray]:
        # rows count from 0, as in the outputs; the line is the file's, from 1 and counting blank lines
        line_number = row + 1 + bisect.bisect_right(self._blank_lines, row)
        where = f"in row {row} of '{self.path.name}' (line {line_number})"
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
            raise BadInput(f"invalid JSON {where} ({err}); fix that line") from err
        if not isinstance(record, dict) or set(record) != set(self.input_names):
            got = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise BadInput(
                f"got keys {got} {where}; each line must be an object with exactly the inputs "
                f"{list(self.input_names)} (the model's, the same on every line: an attention mask is given "
                f"on all lines or on none)"
            )
        return {spec.name: _json_row(spec, record[spec.name], where) for spec in self._specs}

    def iter_batches(self, start: int, stop: int, max_batch: int) -> Iterator[Batch]:
        """Yield the range's rows grouped by exact shape, so batches need no padding.

        Groups come in order of their first row, rows keep their order within a group. The range
        is parsed at once: memory grows with the chunk, not with the file.
        """
        self._check_range(start, stop, max_batch)
        rows = self.read_rows(start, stop)
        groups: dict[tuple[tuple[int, ...], ...], list[int]] = {}
        for offset, sample in enumerate(rows):
            groups.setdefault(tuple(sample[name].shape for name in self.input_names), []).append(offset)
        for members in groups.values():
            for first in range(0, len(members), max_batch):
                picked = members[first : first + max_batch]
                feed = {name: np.stack([rows[i][name] for i in picked]) for name in self.input_names}
                yield np.asarray(picked, dtype=np.int64) + start, feed

    def close(self) -> None:
        """Close the file handle."""
        self._handle.close()
        super().close()


def _json_row(spec: InputSpec, value: Any, where: str) -> np.ndarray:
    """Convert one row's JSON value to the input's dtype, refusing ragged or lossy values (NaN and
    infinity stay: a file may hold them, as a .npy may)."""
    return json_array(spec, value, where, batched=False, finite=False)


def open_jsonl(path: Path, handle: BinaryIO, specs: list[InputSpec]) -> InputSource:
    """The reader of the .jsonl file `path`, opened as `handle` (`inputs.open_input`); the reader owns
    the handle and closes it."""
    try:
        handle.seek(0)
        offsets, offset = array("q"), 0  # 8 bytes per row: millions of rows cost megabytes
        blank_lines = array("q")
        for line in handle:
            if line.strip():  # blank lines are not rows
                offsets.append(offset)
            else:
                blank_lines.append(len(offsets))
            offset += len(line)
        source = _JsonlSource(path, specs, handle, offsets, blank_lines)
        # Only the first row is checked at open, so the API does not parse the whole file; each
        # row is checked when a worker reads it.
        source.read_rows(0, 1)
        return source
    except BaseException:
        handle.close()
        raise

"""A Parquet job's parts and their merge into outputs.parquet (`sits_worker/serving/table_outputs.py`)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from broker.jobs.output_layout import parts_folder, table_part_name
from sits_worker.serving.outputs import finalize_outputs
from sits_worker.serving.table_outputs import merge_table_parts, table_chunk_written, write_table_part

RANGES = [(0, 4), (4, 9), (9, 10)]


def _outputs(start: int, stop: int) -> dict[str, np.ndarray]:
    rows = np.arange(start, stop, dtype=np.float32)
    return {"score": rows * 2, "vec": np.stack([rows, -rows, rows + 0.5], axis=1).reshape(-1, 3),
            "grid": np.repeat(rows, 4).reshape(-1, 2, 2).astype(np.int64)}


def _write(out, index: int, **extra) -> None:
    start, stop = RANGES[index]
    ids = pa.array([f"id{row}" for row in range(start, stop)])
    write_table_part(out, index, _outputs(start, stop), start=start, ids=ids, id_column="key", job_id="j1", **extra)


def test_parts_merge_in_row_order_into_one_parquet_file_with_vectors_as_fixed_size_lists(tmp_path):
    for index in (2, 0, 1):  # written out of order, as chunks finish
        _write(tmp_path, index, quarantined=[(9, "bad row")] if index == 2 else (),
               quarantine_ids={9: "id9"} if index == 2 else None)
    manifest = finalize_outputs(tmp_path, RANGES, ["score", "vec", "grid"], {"job": "j1"}, job_id="j1",
                                merge=merge_table_parts)
    table = pq.read_table(tmp_path / "outputs.parquet")
    assert table.column_names == ["key", "score", "vec", "grid"]
    assert table["key"].to_pylist() == [f"id{row}" for row in range(10)]
    expected = _outputs(0, 10)
    np.testing.assert_array_equal(table["score"].to_numpy(), expected["score"])
    assert table.schema.field("vec").type == pa.list_(pa.float32(), 3)
    np.testing.assert_array_equal(np.asarray(table["vec"].combine_chunks().flatten()).reshape(10, 3), expected["vec"])
    assert manifest is not None and manifest["outputs"]["grid"]["shape"] == [10, 2, 2]
    assert manifest["outputs"]["grid"]["dtype"] == "int64" and manifest["outputs"]["vec"]["column"] == "vec"
    assert manifest["quarantined_rows"] == [9] and manifest["quarantined_ids"] == ["id9"]
    assert (tmp_path / "quarantine.jsonl").read_text() == '{"row": 9, "id": "id9", "error": "bad row"}\n'


def test_a_chunk_written_again_gives_the_same_bytes_and_counts_as_written_only_when_whole(tmp_path):
    assert not table_chunk_written(tmp_path, 1, RANGES[1], job_id="j1")
    _write(tmp_path, 1)
    part = parts_folder(tmp_path, "j1") / table_part_name(1)
    first = part.read_bytes()
    _write(tmp_path, 1)
    assert part.read_bytes() == first
    assert table_chunk_written(tmp_path, 1, RANGES[1], job_id="j1")
    assert not table_chunk_written(tmp_path, 1, (4, 8), job_id="j1")  # rows it does not hold
    part.write_bytes(first[: len(first) // 2])
    assert not table_chunk_written(tmp_path, 1, RANGES[1], job_id="j1")


def test_a_part_whose_batch_claims_rows_past_its_buffers_is_not_written_nor_merged(tmp_path):
    """A part lies in the tenant's own output folder: one replaced by a forged file of the right row count
    (its lengths patched past its buffers) is refused before a value is read, not merged from memory past
    them."""
    _write(tmp_path, 0)
    part = parts_folder(tmp_path, "j1") / table_part_name(0)
    table = pa.table({"key": pa.array(["a", "b"]), "score": np.zeros(2, np.float32)})
    with pa.ipc.new_file(part, table.schema) as writer:
        writer.write_table(table)
    data = part.read_bytes()
    part.write_bytes(data.replace(np.int64(2).tobytes(), np.int64(4).tobytes()))  # 4 rows: chunk 0's count
    assert not table_chunk_written(tmp_path, 0, RANGES[0], job_id="j1")


_CUT_WHILE_READ = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    import pyarrow.ipc as pa_ipc
    from sits_worker.serving.outputs import finalize_outputs
    from sits_worker.serving.table_outputs import merge_table_parts, table_chunk_written
    out, part, step = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    open_file = pa_ipc.open_file

    def open_then_cut(source):  # the tenant cuts the part short once its footer was read
        reader = open_file(source)
        os.truncate(part, 4096)
        return reader

    pa_ipc.open_file = open_then_cut
    try:
        if step == "written":
            print("written:", table_chunk_written(out, 0, (0, 4096), job_id="j1"))
        else:
            finalize_outputs(out, [(0, 4096)], ["score"], {}, job_id="j1", merge=merge_table_parts)
    except Exception as err:
        print(type(err).__name__, err)
""")


@pytest.mark.parametrize("step", ["written", "merged"])
def test_a_part_cut_short_while_it_is_read_is_unreadable_not_a_crash(tmp_path: Path, step: str) -> None:
    """A part lies in the tenant's folder: mapped and cut short under the mapping, the worker dies (SIGBUS, -7)
    at the first page read past the new end, with every tenant's work on it. Read, the part is unreadable:
    its chunk is not written, a merge fails naming it."""
    write_table_part(tmp_path, 0, {"score": np.ones((4096, 64), np.float32)}, start=0, ids=None, id_column="row",
                     job_id="j1")
    part = parts_folder(tmp_path, "j1") / table_part_name(0)

    done = subprocess.run([sys.executable, "-c", _CUT_WHILE_READ, str(tmp_path), str(part), step],
                          capture_output=True, text=True, timeout=3, cwd=Path(__file__).parents[3])

    assert done.returncode == 0, (done.returncode, done.stderr)
    expected = ("written: False" if step == "written" else
                f"SitsError output part '{part}' is unreadable (File too short: expected to be able to read")
    assert done.stdout.startswith(expected), done.stdout

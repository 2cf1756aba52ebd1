"""Reading tables (Parquet, Arrow IPC, CSV) in row ranges as model inputs (`sits_worker/model/table_source.py`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from broker.errors import BadInput
from sits_worker.model import arrow_reader, parquet_pages, parquet_reader, table_source
from sits_worker.model.inputs import open_input

ROWS = 1_000
ROOT = Path(__file__).resolve().parents[3]
SIGNATURE = {"inputs": [{"name": "x", "dtype": "float32", "shape": ["N", 3]}], "outputs": []}


def _table() -> pa.Table:
    rows = np.arange(ROWS)
    return pa.table({"key": pa.array([f"k{row}" for row in rows]), "a": rows.astype(np.int32),
                     "b": rows * 0.5, "text": pa.array(["t"] * ROWS), "c": -rows.astype(np.float32)})


def _expected(start: int, stop: int, order: tuple[str, ...] = ("a", "b", "c")) -> np.ndarray:
    rows = np.arange(start, stop)
    by_name = {"a": rows, "b": rows * 0.5, "c": -rows}
    return np.stack([by_name[name] for name in order], axis=1).astype(np.float32)


def _write(folder, fmt: str, table: pa.Table):
    path = folder / f"t.{fmt}"
    if fmt == "parquet":
        pq.write_table(table, path, row_group_size=300)
    elif fmt == "arrow":
        feather.write_feather(table, path, chunksize=300)
    else:
        pa_csv.write_csv(table, path)
    return path


def _read(source, start: int, stop: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    rows, values = zip(*[(rows, feed["x"]) for rows, feed in source.iter_batches(start, stop, batch)], strict=True)
    assert all(len(part) <= batch for part in rows)
    return np.concatenate(rows), np.concatenate(values)


@pytest.mark.parametrize("fmt", ["parquet", "arrow", "csv"])
def test_ranges_across_row_group_boundaries_read_exactly_their_rows_and_ids(tmp_path, fmt, monkeypatch):
    monkeypatch.setattr(table_source, "SLAB_ROWS", 128)  # slabs inside row groups, as on a large file
    monkeypatch.setattr(parquet_reader, "WHOLE_GROUP_ROWS", 200)  # and row groups streamed
    path = _write(tmp_path, fmt, _table())
    with open_input(path, SIGNATURE, id_column="key") as source:
        assert source.rows == ROWS and source.format == f".{fmt}"
        for start, stop in [(0, ROWS), (299, 301), (250, 950), (600, 601), (999, 1000), (0, 300), (250, 950)]:
            rows, values = _read(source, start, stop, 64)
            np.testing.assert_array_equal(rows, np.arange(start, stop))
            np.testing.assert_array_equal(values, _expected(start, stop))
            assert source.row_ids(start, stop).to_pylist() == [f"k{row}" for row in range(start, stop)]
        assert source.row_ids(10, 20).to_pylist() == [f"k{row}" for row in range(10, 20)]  # never read before


def test_named_columns_are_stacked_in_their_order_and_the_extension_can_be_overridden(tmp_path):
    path = tmp_path / "table.data"
    pq.write_table(_table(), path, row_group_size=300)
    with open_input(path, SIGNATURE, input_format="parquet", columns={"x": ["c", "a", "b"]}) as source:
        np.testing.assert_array_equal(_read(source, 100, 700, 50)[1], _expected(100, 700, ("c", "a", "b")))
        assert source.row_ids(0, 5) is None


def test_a_list_column_feeds_a_vector_input(tmp_path):
    values = np.arange(ROWS * 3, dtype=np.float64).reshape(ROWS, 3)
    column = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), 3)
    pq.write_table(pa.table({"id": np.arange(ROWS), "vec": column}), tmp_path / "v.parquet", row_group_size=128)
    with open_input(tmp_path / "v.parquet", SIGNATURE, id_column="id") as source:
        np.testing.assert_array_equal(_read(source, 120, 400, 32)[1], values[120:400].astype(np.float32))


def test_values_that_a_cast_would_change_and_nulls_are_refused_naming_the_column_and_row(tmp_path):
    ints = {"inputs": [{"name": "x", "dtype": "int32", "shape": ["N", 1]}], "outputs": []}
    pq.write_table(pa.table({"v": [1.0, 2.0, 2.5]}), tmp_path / "f.parquet")
    with open_input(tmp_path / "f.parquet", ints) as source, pytest.raises(BadInput, match="column 'v'.*truncated"):
        list(source.iter_batches(0, 3, 8))
    pq.write_table(pa.table({"v": pa.array([1.0, None, 3.0])}), tmp_path / "n.parquet")
    one = {"inputs": [{"name": "x", "dtype": "float32", "shape": ["N", 1]}], "outputs": []}
    with open_input(tmp_path / "n.parquet", one) as source, pytest.raises(BadInput, match="column 'v'.*null in row 1"):
        list(source.iter_batches(0, 3, 8))


@pytest.mark.parametrize(("options", "message"), [
    ({"columns": {"x": ["a", "text", "c"]}}, "column 'text' of 't.parquet' is string"),
    ({"columns": {"x": ["a", "zz", "c"]}}, r"\['zz'\] for input 'x' are not in"),
    ({"columns": {"x": ["a", "b"]}}, r"expects float32 \[N,3\], but 2 column"),
    ({"columns": {"y": ["a", "b", "c"]}}, r"the model's inputs are \['x'\]"),
    ({"id_column": "nope"}, "id_column 'nope' is not a column"),
    ({"input_format": "csv"}, "not a readable csv file"),
    ({"input_format": "xlsx"}, "input_format 'xlsx' is unknown"),
])
def test_a_table_that_does_not_fit_the_model_is_refused_at_open_naming_what_to_fix(tmp_path, options, message):
    path = _write(tmp_path, "parquet", _table().drop_columns(["text"]) if "id_column" in options else _table())
    if "columns" not in options and "input_format" not in options:
        options = options | {"columns": {"x": ["a", "b", "c"]}}
    with pytest.raises(BadInput, match=message):
        open_input(path, SIGNATURE, **options).close()


def test_every_numeric_column_but_the_id_is_the_default_and_two_inputs_need_columns(tmp_path):
    path = _write(tmp_path, "parquet", _table().drop_columns(["text"]))
    with open_input(path, SIGNATURE, id_column="key") as source:  # a, b, c; the string key is the id
        np.testing.assert_array_equal(_read(source, 0, 10, 4)[1], _expected(0, 10))
    two = {"inputs": [SIGNATURE["inputs"][0], {"name": "y", "dtype": "float32", "shape": ["N", 1]}], "outputs": []}
    with pytest.raises(BadInput, match="map columns onto each with `columns`"):
        open_input(path, two)
    with open_input(path, two, columns={"x": ["a", "b", "c"], "y": ["b"]}) as source:
        _, feed = next(source.iter_batches(5, 7, 8))
        np.testing.assert_array_equal(feed["y"], [[2.5], [3.0]])
    with pytest.raises(BadInput, match="apply only to tables"):
        np.save(tmp_path / "x.npy", np.zeros((2, 3), np.float32))
        open_input(tmp_path / "x.npy", SIGNATURE, id_column="key")


def _forged_arrow(path, rows: int = 12_345, claimed: int = 20_000) -> None:
    """An Arrow IPC file whose record batch claims `claimed` rows over buffers that hold `rows`: the int64
    length fields patched, as a hostile tenant could write it."""
    table = pa.table({"x": np.arange(rows, dtype=np.float32)})
    with pa.ipc.new_file(path, table.schema) as writer:
        writer.write_table(table)
    data = path.read_bytes()
    old, new = np.int64(rows).tobytes(), np.int64(claimed).tobytes()
    assert data.count(old) == 2  # (the batch's length and its one column's)
    path.write_bytes(data.replace(old, new))


def test_an_arrow_file_whose_batches_claim_more_rows_than_their_buffers_is_refused_at_its_first_read(tmp_path):
    one = {"inputs": [{"name": "x", "dtype": "float32", "shape": ["N", 1]}], "outputs": []}
    _forged_arrow(tmp_path / "forged.arrow")
    # (unchecked, pyarrow reads the 20,000 rows from memory past the file's buffers, or crashes the worker;
    # rows are counted from the batches' metadata, and the API reads the first row at submit)
    with open_input(tmp_path / "forged.arrow", one) as source, \
            pytest.raises(BadInput, match=r"cannot read rows \[0, 1\) of 'forged.arrow'.*too small"):
        next(source.iter_batches(0, 1, 1))


def test_a_parquet_footer_that_disagrees_with_its_row_groups_is_refused(tmp_path):
    path = tmp_path / "f.parquet"
    pq.write_table(pa.table({"x": np.arange(12_345, dtype=np.float32)}), path)
    data = path.read_bytes()
    footer_at = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    # The footer's first 12,345 (thrift: a zigzag varint) is the file's num_rows, before its row groups'.
    old, new = _thrift_i64(12_345), _thrift_i64(1_000_000)
    assert len(old) == len(new) == 3
    at = data.index(old, footer_at)
    path.write_bytes(data[:at] + new + data[at + 3:])
    one = {"inputs": [{"name": "x", "dtype": "float32", "shape": ["N", 1]}], "outputs": []}
    with pytest.raises(BadInput, match="footer of the Parquet file says 1000000 rows, but its row groups hold 12345"):
        open_input(path, one).close()


def _thrift_i64(value: int) -> bytes:
    """`value` as the thrift compact protocol writes an i64: zigzag, then a varint."""
    number, out = (value << 1) ^ (value >> 63), bytearray()
    while number > 0x7F:
        out.append((number & 0x7F) | 0x80)
        number >>= 7
    return bytes([*out, number])


def test_duplicate_column_names_are_a_bad_input_not_a_server_error(tmp_path):
    (tmp_path / "d.csv").write_text("a,a,b,c\n1,2,3,4\n5,6,7,8\n")
    with pytest.raises(BadInput, match="has 2 columns named 'a'; give each column a name of its own"):
        open_input(tmp_path / "d.csv", SIGNATURE).close()  # (every numeric column: a, a, b, c)
    with pytest.raises(BadInput, match="has 2 columns named 'a'"):
        open_input(tmp_path / "d.csv", SIGNATURE, columns={"x": ["a", "b", "c"]}).close()
    with pytest.raises(BadInput, match=r"lists \['a'\] more than once for input 'x'"):
        open_input(_write(tmp_path, "parquet", _table()), SIGNATURE, columns={"x": ["a", "a", "a"]}).close()


def test_a_list_column_with_rows_of_other_lengths_is_refused_not_cut_into_other_rows(tmp_path):
    ragged = pa.array([[1.0], [2.0, 3.0, 4.0, 5.0, 6.0]], pa.list_(pa.float32()))  # 6 values: 2 rows of 3 if cut
    pq.write_table(pa.table({"id": ["r0", "r1"], "vec": ragged}), tmp_path / "r.parquet")
    with open_input(tmp_path / "r.parquet", SIGNATURE, id_column="id") as source, \
            pytest.raises(BadInput, match=r"row 0 of column 'vec' of 'r.parquet' holds 1 values.*3 a row"):
        list(source.iter_batches(0, 2, 8))


def test_a_null_id_or_a_nested_id_column_is_refused(tmp_path):
    table = pa.table({"id": pa.array(["r0", None, "r2"]), "a": [1.0, 2.0, 3.0], "b": [1.0, 2.0, 3.0],
                      "c": [1.0, 2.0, 3.0]})
    pq.write_table(table, tmp_path / "n.parquet")
    with open_input(tmp_path / "n.parquet", SIGNATURE, id_column="id") as source, \
            pytest.raises(BadInput, match="column 'id' of 'n.parquet' has a null in row 1"):
        list(source.iter_batches(0, 3, 8))
    nested = table.set_column(0, "id", pa.array([[1], [2], [3]]))
    pq.write_table(nested, tmp_path / "l.parquet")
    with pytest.raises(BadInput, match="id_column 'id' of 'l.parquet' is list<"):
        open_input(tmp_path / "l.parquet", SIGNATURE, id_column="id").close()


def test_rows_of_wide_list_columns_are_read_a_few_at_a_time_whatever_the_row_groups(tmp_path):
    width = 3 * 224 * 224  # an image a row: 588 KiB of float32, zeros that compress to nearly nothing
    column = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(64 * width, np.float32)), width)
    path = tmp_path / "images.parquet"
    pq.write_table(pa.table({"image": column}), path, compression="zstd")  # one row group of 64 rows
    assert path.stat().st_size < 64 * width * 4 // 100
    images = {"inputs": [{"name": "image", "dtype": "float32", "shape": ["N", 3, 224, 224]}], "outputs": []}
    with open_input(path, images) as source:
        assert source.slab_rows() == table_source.SLAB_BYTES // (width * 4 + 8) == 27
        slabs = list(source._read(0, 64))  # (the slabs as read from the file, before mini-batches)
        assert [slab.num_rows for slab in slabs] == [27, 27, 10]


def test_a_parquet_row_group_holding_far_more_than_its_rows_values_is_refused_at_open(tmp_path):
    path = tmp_path / "big.parquet"
    strings = pa.array(["x" * 4096] * 1_000)  # 4 KiB ids: 64 times what an id row is counted as
    pq.write_table(pa.table({"id": strings, "a": np.ones(1_000), "b": np.ones(1_000), "c": np.ones(1_000)}), path,
                   use_dictionary=False)
    with pytest.raises(BadInput, match="row group 0 of the Parquet file holds .* of column 'id' for 1,000 rows"):
        open_input(path, SIGNATURE, id_column="id").close()
    with open_input(path, SIGNATURE) as source:  # (without it as the id, the column is never read)
        assert source.rows == 1_000


def test_a_list_of_far_more_values_than_a_row_takes_is_refused_at_open_however_well_it_compresses(tmp_path):
    many = pa.array([np.zeros(200_000, np.float32), np.zeros(3, np.float32)], pa.list_(pa.float32()))
    pq.write_table(pa.table({"vec": many}), tmp_path / "z.parquet")  # (a few KB: zeros in runs)
    with pytest.raises(BadInput, match=r"holds .* 200,003 values of column 'vec' for 2 rows.*3 values a row"):
        open_input(tmp_path / "z.parquet", SIGNATURE).close()


def test_column_names_with_dots_are_sized_as_their_own_columns(tmp_path):
    wide = {"inputs": [{"name": "x", "dtype": "float32", "shape": ["N", 64]}], "outputs": []}
    rows = 20_000
    values = np.random.default_rng(1).standard_normal((rows, 64)).astype(np.float32)
    table = pa.table({"x": np.arange(rows), "x.y": pa.FixedSizeListArray.from_arrays(pa.array(values.ravel()), 64)})
    pq.write_table(table, tmp_path / "d.parquet", use_dictionary=False)
    # (x.y's leaf path is x.y.list.element: counted under 'x', its 5 MB would pass the 8-byte ids' bound)
    with open_input(tmp_path / "d.parquet", wide, columns={"x": ["x.y"]}, id_column="x") as source:
        np.testing.assert_array_equal(_read(source, 0, 10, 4)[1], values[:10])


_TRUNCATED_READ = """
import os, sys
import numpy as np, pyarrow as pa, pyarrow.feather as feather
from sits_worker.model.inputs import open_input
path = sys.argv[1]
feather.write_feather(pa.table({"x": np.arange(200_000, dtype=np.float32)}), path, chunksize=50_000,
                      compression="uncompressed")
source = open_input(path, {"inputs": [{"name": "x", "dtype": "float32", "shape": ["N", 1]}], "outputs": []})
os.truncate(path, 4096)  # (the tenant rewrites the file while a worker has it open)
try:
    list(source.iter_batches(150_000, 150_100, 64))
except Exception as err:
    print(type(err).__name__, err)
"""


def test_an_arrow_file_cut_short_after_open_fails_the_read_and_does_not_kill_the_worker(tmp_path):
    # A mapped file's pages past its new end raise SIGBUS when touched: the process dies, no error is raised.
    done = subprocess.run([sys.executable, "-c", _TRUNCATED_READ, str(tmp_path / "cut.arrow")], cwd=ROOT,
                          capture_output=True, text=True, timeout=20)
    assert done.returncode == 0, f"the reading process died: {done.returncode} {done.stderr[-2000:]}"
    assert done.stdout.startswith("RetryableError") and "changed since it was opened" in done.stdout

    # (the retry's check of the file then fails the job: "input ... changed after the job was submitted")


def test_an_arrow_record_batch_of_more_than_a_chunk_may_read_is_refused_at_open(tmp_path, monkeypatch):
    monkeypatch.setattr(arrow_reader, "IPC_BATCH_BYTES", 100 * 16)  # 100 rows of a, b, c (int32, float64, float32)
    feather.write_feather(_table(), tmp_path / "big.arrow", chunksize=400)
    with pytest.raises(BadInput, match=r"record batch 0 of the Arrow file holds 400 rows.*at most 100 rows"):
        open_input(tmp_path / "big.arrow", SIGNATURE, columns={"x": ["a", "b", "c"]}).close()
    feather.write_feather(_table(), tmp_path / "small.arrow", chunksize=100)
    with open_input(tmp_path / "small.arrow", SIGNATURE, columns={"x": ["a", "b", "c"]}) as source:
        np.testing.assert_array_equal(_read(source, 50, 350, 64)[1], _expected(50, 350))


ONE = {"inputs": [{"name": "x", "dtype": "float32", "shape": ["N", 1]}], "outputs": []}


def _forge_page_size(path, claimed: int) -> None:
    """Make the first page header of a Parquet file (written with page checksums) claim `claimed` bytes
    uncompressed: its crc field is dropped, and its bytes widen the size's varint, so that every offset
    stays true."""
    data = path.read_bytes()
    at = pq.ParquetFile(path).metadata.row_group(0).column(0).data_page_offset
    fields, end = [], at
    for _ in range(4):  # i32 fields 1 to 4 (compact protocol): type, uncompressed size, compressed size, crc
        assert data[end] == 0x15
        start = end = end + 1
        while data[end] & 0x80:
            end += 1
        end += 1
        fields.append(data[start:end])
    assert data[end] == 0x1C  # field 5, the data page header (a struct), right after the crc
    width = len(fields[1]) + 1 + len(fields[3])
    number, wide = claimed << 1, bytearray()  # (zigzag), as a varint padded to `width` bytes
    for _ in range(width - 1):
        wide.append((number & 0x7F) | 0x80)
        number >>= 7
    assert number <= 0x7F
    header = b"\x15" + fields[0] + b"\x15" + bytes([*wide, number]) + b"\x15" + fields[2] + b"\x2C"
    assert len(header) == end + 1 - at
    path.write_bytes(data[:at] + header + data[end + 1 :])


def test_a_parquet_page_header_claiming_more_than_its_rows_take_is_refused_at_open(tmp_path):
    path = tmp_path / "page.parquet"
    pq.write_table(pa.table({"x": np.arange(1_000, dtype=np.float32)}), path, use_dictionary=False,
                   write_statistics=False, write_page_checksum=True)
    _forge_page_size(path, 2**31 - 1)
    # The footer's sizes are still true: unchecked, pyarrow allocates the 2 GiB the page's header claims to
    # decompress the page into, whatever the footer says (and a page that does decompress to that fills them).
    with pytest.raises(BadInput, match=r"row group 0 of the Parquet file holds 2,147,48\d,\d{3} bytes .* of "
                                       r"column 'x' for 1,000 rows"):
        open_input(path, ONE).close()


def test_a_damaged_parquet_page_or_footer_is_a_bad_input_not_a_read_to_retry(tmp_path):
    path = tmp_path / "damaged.parquet"
    pq.write_table(pa.table({"x": np.arange(1_000, dtype=np.float32)}), path, compression="zstd",
                   use_dictionary=False)
    column = pq.ParquetFile(path).metadata.row_group(0).column(0)
    body_end = column.data_page_offset + column.total_compressed_size
    data = path.read_bytes()
    path.write_bytes(data[: body_end - 64] + bytes(64) + data[body_end:])  # (the page's compressed bytes)
    # pyarrow's own errors are OSErrors without an errno ("Corrupt ZSTD compressed data"), not the disk's.
    with open_input(path, ONE) as source, pytest.raises(BadInput, match=r"cannot read rows \[0, 1000\)"):
        list(source.iter_batches(0, 1_000, 256))
    path.write_bytes(data[:-40] + bytes(byte ^ 0x5A for byte in data[-40:-8]) + data[-8:])  # (its footer's end)
    with pytest.raises(BadInput, match="is not a readable parquet file"):
        open_input(path, ONE).close()


def _late_csv(path, rows: int = 150_000, late: int = 120_000, a: str = "0.5", key: str = "7") -> None:
    """A CSV file of ids, integers `a` and floats `b`, whose row `late` holds `a` and `key` instead: far past
    the first block of the file (1 MiB) that pyarrow takes the columns' types from."""
    lines = [f"{row},{row % 100},{row * 0.5}" for row in range(rows)]
    lines[late] = f"{key},{a},{late * 0.5}"
    path.write_text("key,a,b\n" + "\n".join(lines) + "\n")
    assert path.stat().st_size > 2 << 20


def test_csv_columns_keep_reading_when_a_later_block_looks_otherwise(tmp_path):
    two = {"inputs": [{"name": "x", "dtype": "float32", "shape": ["N", 2]}], "outputs": []}
    _late_csv(tmp_path / "floats.csv", key="k120000")  # integers, then 0.5; integer ids, then a string
    with open_input(tmp_path / "floats.csv", two, columns={"x": ["a", "b"]}) as source:  # (the ids not read)
        assert source.rows == 150_000
        _, values = _read(source, 118_000, 122_000, 512)
        assert values[2_000].tolist() == [0.5, 60_000.0]
    with open_input(tmp_path / "floats.csv", two, columns={"x": ["a", "b"]}, id_column="key") as source, \
            pytest.raises(BadInput, match="row 120000 of column 'key' holds 'k120000', which is not int64"):
        source.row_ids(0, 150_000)  # (the ids keep the type of the first block's: a job over them fails)


def test_a_csv_value_of_another_type_fails_its_own_row_naming_it_not_its_block(tmp_path):
    two = {"inputs": [{"name": "x", "dtype": "float32", "shape": ["N", 2]}], "outputs": []}
    _late_csv(tmp_path / "text.csv", a="abc")
    with open_input(tmp_path / "text.csv", two, columns={"x": ["a", "b"]}, id_column="key") as source:
        with pytest.raises(BadInput, match=r"rows \[120000, 120001\).*row 120000 of column 'a' holds 'abc'"):
            _read(source, 120_000, 120_001, 8)
        # (its neighbours, parsed with it from one block of the file, read: a bisection quarantines it alone)
        assert _read(source, 119_999, 120_000, 8)[1].tolist() == [[99.0, 59_999.5]]
        assert _read(source, 120_001, 120_002, 8)[1].tolist() == [[1.0, 60_000.5]]


def test_a_compressed_arrow_buffer_claiming_more_memory_than_there_is_is_a_bad_input(tmp_path: Path) -> None:
    """An LZ4 buffer's length prefix forged to 2**62 made pyarrow's allocation fail with ArrowMemoryError, which
    nothing translated: a 500 at submit."""
    table = pa.table({name: np.arange(1000, dtype=np.float64) * scale for scale, name in enumerate("abc", 1)})
    feather.write_feather(table, tmp_path / "forged.arrow", compression="lz4")
    data = bytearray((tmp_path / "forged.arrow").read_bytes())
    at = data.find((8000).to_bytes(8, "little"))  # (a compressed buffer's uncompressed length: 1,000 float64)
    data[at:at + 8] = (2**62).to_bytes(8, "little")
    (tmp_path / "forged.arrow").write_bytes(bytes(data))

    with open_input(tmp_path / "forged.arrow", SIGNATURE) as source, \
            pytest.raises(BadInput, match=r"cannot read rows \[0, 1\) of 'forged.arrow'"):
        next(source.iter_batches(0, 1, 1))  # (as the API does at submit: rows are counted without reading)


def test_a_finite_value_a_float_input_cannot_hold_is_refused_naming_its_row(tmp_path: Path) -> None:
    """A safe cast turned 1e300 into float32's inf, silently: the model ran on a value the file does not hold."""
    values = np.full((300, 3), 0.5)
    values[257, 1] = 1e300
    pq.write_table(pa.table({name: values[:, index] for index, name in enumerate("abc")}), tmp_path / "big.parquet")

    with open_input(tmp_path / "big.parquet", SIGNATURE) as source, pytest.raises(
            BadInput, match=r"row 257 of column 'b' .* holds 1e\+300, beyond what float"):
        list(source.iter_batches(0, 300, 64))


def test_a_finite_value_a_float_input_cannot_hold_in_a_list_column_is_refused_naming_its_row(tmp_path: Path) -> None:
    """The row named was the value's index among the flattened lists: 772 for row 257 of 3-value rows."""
    values = np.full((300, 3), 0.5)
    values[257, 1] = 1e300
    column = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), 3)
    pq.write_table(pa.table({"vec": column}), tmp_path / "list.parquet")

    with open_input(tmp_path / "list.parquet", SIGNATURE) as source, pytest.raises(
            BadInput, match=r"row 257 of column 'vec' .* holds 1e\+300, beyond what float"):
        list(source.iter_batches(0, 300, 64))


def _thrift_varint(number: int) -> bytes:
    out = bytearray()
    while number > 0x7F:
        out.append((number & 0x7F) | 0x80)
        number >>= 7
    return bytes([*out, number])


def _thrift_i32(delta: int, value: int) -> bytes:
    """An i32 field `delta` after the last one, as thrift's compact protocol writes it."""
    return bytes([(delta << 4) | 5]) + _thrift_varint(value << 1)


def _forged_page_header(path: Path, filler) -> None:
    """A one-column Parquet file of float32 whose one page header fills its whole column chunk: a data page of
    0 bytes (type, sizes) followed by `filler(bytes left)` and the struct's end."""
    column = pq.ParquetFile(path).metadata.row_group(0).column(0)
    head = _thrift_i32(1, 0) + _thrift_i32(1, 0) + _thrift_i32(1, 0)
    header = head + filler(column.total_compressed_size - len(head) - 1) + b"\x00"
    assert len(header) == column.total_compressed_size
    data = path.read_bytes()
    at = column.data_page_offset
    path.write_bytes(data[:at] + header + data[at + len(header):])


def _bool_fields(size: int) -> bytes:
    return b"\x11" * size  # (a true bool field each byte: thrift holds its value in its type)


def _bool_list(size: int) -> bytes:
    count = size - 5  # field 4, a list (9) of bools (1), its count in 3 bytes: a byte an element
    assert len(_thrift_varint(count)) == 3
    return b"\x19\xf1" + _thrift_varint(count) + b"\x01" * count


def _long_binary(size: int) -> bytes:
    length = size - 7  # field 100 (its id in a zigzag varint of 2 bytes), binary (8), its length in 4 bytes
    assert len(_thrift_varint(length)) == 4
    return b"\x08" + _thrift_varint(200) + _thrift_varint(length) + bytes(length)


@pytest.mark.parametrize(("rows", "filler", "message"), [
    (30_000, _bool_fields, "page header holds more than 65,536 fields and elements"),
    (30_000, _bool_list, "page header holds more than 65,536 fields and elements"),
    (4_500_000, _long_binary, "page header at byte 4 is longer than 16,777,216 bytes"),
])
def test_a_parquet_page_header_of_too_many_items_or_bytes_is_refused_at_open(tmp_path, rows, filler, message):
    """Such a header parsed whole, in an API thread: one of 20 MB took 5.8 s and 1.4 GiB (a dict entry a
    field); one longer than 16 MiB, which pyarrow does not read, was accepted."""
    path = tmp_path / "header.parquet"
    pq.write_table(pa.table({"x": np.zeros(rows, np.float32)}), path, use_dictionary=False, write_statistics=False,
                   compression="none", row_group_size=rows)
    _forged_page_header(path, filler)
    with pytest.raises(BadInput, match=f"damaged page in column 'x' \\(the {message}"):
        open_input(path, ONE).close()


def test_a_page_in_the_bytes_pyarrow_reads_past_an_old_writers_column_chunk_is_checked(tmp_path):
    """For a file whose footer names parquet-mr before 1.2.9, pyarrow reads 100 bytes past a column chunk while
    its pages hold fewer values than the footer says; a page there claiming 2 GiB was never walked."""
    path = tmp_path / "old.parquet"
    pq.write_table(pa.table({"x": np.arange(1_000, dtype=np.float32)}), path, use_dictionary=False,
                   write_statistics=False, compression="snappy")
    metadata = pq.ParquetFile(path).metadata
    column, writer = metadata.row_group(0).column(0), metadata.created_by.encode()
    end = column.data_page_offset + column.total_compressed_size
    data = path.read_bytes()
    values = data.index(b"\x2c" + _thrift_i32(1, 1_000), column.data_page_offset)  # (its data page header)
    data = data[:values] + b"\x2c" + _thrift_i32(1, 999) + data[values + 4:]  # (one value left for a next page)
    page = (_thrift_i32(1, 0) + _thrift_i32(1, 2**31 - 1) + _thrift_i32(1, 16) + b"\x2c" + _thrift_i32(1, 1)
            + _thrift_i32(1, 0) + _thrift_i32(1, 3) + _thrift_i32(1, 3) + b"\x00\x00" + bytes(16))
    data = data[:end] + page + data[end:]  # (between the chunk and the footer: no offset moves)
    assert len(page) <= 100 and data.count(writer) == 1
    path.write_bytes(data.replace(writer, b"parquet-mr version 1.2.8".ljust(len(writer))))

    with pytest.raises(BadInput, match=r"holds 2,147,48\d,\d{3} bytes and 1,000 values of column 'x' for 1,000 rows"):
        open_input(path, ONE).close()


def _walked_pages(monkeypatch) -> list[int]:
    """Count the page headers read from here on."""
    walked = [0]
    read = parquet_pages._page_header

    def counted(*args):
        walked[0] += 1
        return read(*args)

    monkeypatch.setattr(parquet_pages, "_page_header", counted)
    return walked


def test_a_parquet_file_of_more_pages_than_a_submit_may_walk_is_refused_however_many_rows_it_claims(
        tmp_path, monkeypatch):
    """Each page costs the API a few microseconds at submit; the footer's rows, which bounded the pages, can
    claim any number."""
    monkeypatch.setattr(parquet_pages, "FILE_PAGES", 500)
    walked = _walked_pages(monkeypatch)
    path = tmp_path / "pages.parquet"
    pq.write_table(pa.table({"x": np.zeros(9_600, np.float32)}), path, data_page_size=1, write_batch_size=16,
                   row_group_size=2_400, use_dictionary=False, write_statistics=False)  # 150 pages a row group
    with pytest.raises(BadInput, match=r"more than 500 pages of the columns read \(row group 3, column 'x'\); "
                                       "write it with larger pages"):
        open_input(path, ONE).close()
    assert walked[0] == 500


def test_the_page_walk_stops_at_the_first_page_past_its_row_groups_bound(tmp_path, monkeypatch):
    walked = _walked_pages(monkeypatch)
    path = tmp_path / "page.parquet"
    pq.write_table(pa.table({"x": np.arange(1_000, dtype=np.float32)}), path, use_dictionary=False,
                   write_statistics=False, write_page_checksum=True, data_page_size=1, write_batch_size=16)
    _forge_page_size(path, 2**31 - 1)
    with pytest.raises(BadInput, match="row group 0 of the Parquet file holds 2,147,48"):
        open_input(path, ONE).close()
    assert walked[0] == 1  # (of 63 pages)


_ARROW_SUBMIT = """
import sys
import pyarrow as pa
from broker.errors import BadInput
from sits_worker.model import arrow_reader
from sits_worker.model.inputs import open_input
arrow_reader.IPC_BATCH_BYTES = 16 << 20
path, column, width = sys.argv[1], sys.argv[2], int(sys.argv[3])
signature = {"inputs": [{"name": "x", "dtype": "float32", "shape": ["N", width]}], "outputs": []}
try:
    with open_input(path, signature, columns={"x": [column]}) as source:
        next(source.iter_batches(0, 1, 1))  # (as the API does at submit)
    print("read")
except BadInput as err:
    print(err)
print(pa.default_memory_pool().max_memory())
"""


def _submitted_arrow(path: Path, column: str, width: int = 1) -> tuple[str, int]:
    """What the API's check of an Arrow file at submit says (open it, read its first row), batches of at most 16
    MiB, and the most memory pyarrow held meanwhile (in a process of its own: a pool's peak stays)."""
    done = subprocess.run([sys.executable, "-c", _ARROW_SUBMIT, str(path), column, str(width)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    outcome, peak = done.stdout.splitlines()
    return outcome, int(peak)


def test_arrow_rows_are_counted_and_batch_sizes_checked_without_reading_a_batch(tmp_path):
    """Rows were counted by reading the first column of every batch, checked: a wide first column (900 MiB)
    was read at submit whatever the model reads, and a batch too large was read before it was refused."""
    rows, width = 8_192, 2_000  # a first column of 64 MiB, compressed to 256 KiB (pyarrow allocates a batch's body)
    blob = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(rows * width, np.float32)), width)
    feather.write_feather(pa.table({"blob": blob, "x": np.arange(rows, dtype=np.float32)}), tmp_path / "wide.arrow",
                          chunksize=rows, compression="lz4")

    refusal, peak = _submitted_arrow(tmp_path / "wide.arrow", "blob", width)
    assert "record batch 0 of the Arrow file holds 8,192 rows" in refusal and "at most 2,095 rows" in refusal
    assert peak < 1 << 20
    assert _submitted_arrow(tmp_path / "wide.arrow", "x")[1] < 1 << 20  # (x of one batch: 32 KiB)


def test_an_arrow_buffer_claiming_far_more_than_its_rows_take_is_refused_before_it_is_read(tmp_path):
    """A batch of one row whose compressed buffer holds 16 MiB of zeros (64 KiB of LZ4): pyarrow allocates what
    the buffer's length prefix says, whatever the rows."""
    rows = 4 << 20
    feather.write_feather(pa.table({"x": np.zeros(rows, np.float32)}), tmp_path / "bomb.arrow", compression="lz4",
                          chunksize=rows)
    data = (tmp_path / "bomb.arrow").read_bytes()
    assert data.count(np.int64(rows).tobytes()) == 2  # (the batch's length and its one column's)
    (tmp_path / "bomb.arrow").write_bytes(data.replace(np.int64(rows).tobytes(), np.int64(1).tobytes()))

    refusal, peak = _submitted_arrow(tmp_path / "bomb.arrow", "x")
    assert "record batch 0 holds 16,777,216 bytes of the columns read for 1 rows" in refusal
    assert peak < 1 << 20


def test_arrow_dictionaries_claiming_more_than_a_batch_may_hold_are_refused_at_open(tmp_path):
    """pyarrow reads every dictionary of a file with the first batch a reader reads, whatever the columns: one
    compressed buffer's length prefix claiming 1 GiB was allocated at submit."""
    keys = pa.array([f"k{row:04}" for row in range(1_000)]).dictionary_encode()  # (its values: 5,000 bytes)
    feather.write_feather(pa.table({"key": keys, "x": np.arange(1_000, dtype=np.float32)}), tmp_path / "dict.arrow",
                          compression="lz4")
    assert _submitted_arrow(tmp_path / "dict.arrow", "x")[0] == "read"
    data = (tmp_path / "dict.arrow").read_bytes()
    frame = b"\x04\x22\x4d\x18"  # (an LZ4 frame's magic number, after a compressed buffer's length prefix)
    assert data.count((5_000).to_bytes(8, "little") + frame) == 1
    (tmp_path / "dict.arrow").write_bytes(data.replace((5_000).to_bytes(8, "little") + frame,
                                                       (1 << 30).to_bytes(8, "little") + frame))

    refusal, peak = _submitted_arrow(tmp_path / "dict.arrow", "x")
    assert refusal.startswith("the dictionaries of the Arrow file take 1,073,74")
    assert peak < 1 << 20


def test_a_null_inside_a_row_s_list_is_refused_naming_the_row(tmp_path: Path) -> None:
    """Only a list that was null itself was refused: a null value inside one was fed to the model as NaN."""
    rows = [[0.5, 0.5, 0.5] for _ in range(10)]
    rows[6] = [0.5, None, 0.5]
    pq.write_table(pa.table({"x": pa.array(rows, pa.list_(pa.float32(), 3))}), tmp_path / "holes.parquet")

    with open_input(tmp_path / "holes.parquet", SIGNATURE) as source, pytest.raises(
            BadInput, match="has a null in the list of row 6"):
        list(source.iter_batches(0, 10, 5))

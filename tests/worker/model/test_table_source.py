"""Reading tables (Parquet, Arrow IPC, CSV) in row ranges as model inputs (`sits_worker/model/table_source.py`)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from broker.errors import BadInput
from sits_worker.model import table_source
from sits_worker.model.inputs import open_input

ROWS = 1_000
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
    monkeypatch.setattr(table_source, "WHOLE_GROUP_ROWS", 200)  # and row groups streamed
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


def test_an_arrow_file_whose_batches_claim_more_rows_than_their_buffers_is_refused_at_open(tmp_path):
    one = {"inputs": [{"name": "x", "dtype": "float32", "shape": ["N", 1]}], "outputs": []}
    _forged_arrow(tmp_path / "forged.arrow")
    # (unchecked, pyarrow reads the 20,000 rows from memory past the file's buffers, or crashes the worker)
    with pytest.raises(BadInput, match="not a readable arrow file.*too small"):
        open_input(tmp_path / "forged.arrow", one).close()


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

"""A model version's record read back typed: named fields, its stored JSON kept whole for the API."""

from __future__ import annotations

from broker.models.model_record import ModelRecord

STORED = {
    "name": "mlp", "version": "a1b2c3", "ref": "mlp@a1b2c3", "path": "/store/mlp/a1b2c3/model.onnx",
    "source_path": "/models/mlp.onnx", "owner": "acme", "registered_at": 10.0, "profile_status": "ready",
    "signature": {"inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 4], "dynamic_axes": [0]}],
                  "outputs": [{"name": "y", "dtype": "float32", "shape": ["batch", 2], "dynamic_axes": [0]},
                              {"name": "z", "dtype": "int64", "shape": ["batch"], "dynamic_axes": [0]}]},
    "static_profile": {"flops_per_sample": 16},
    "profile": {"source": "observed", "device": "cpu", "points": [
        {"batch_size": 1, "latency_ms": 0.1, "rows_per_second": 10_000.0}]},
    "written_by_a_later_release": [1, 2],
}


def test_a_stored_record_reads_as_named_fields_and_writes_back_as_it_was() -> None:
    record = ModelRecord.of(STORED)

    assert (record.ref, record.owner, record.output_names) == ("mlp@a1b2c3", "acme", ["y", "z"])
    assert record.observed_profile and not record.token_model
    assert record.profile_points == STORED["profile"]["points"]  # type: ignore[index]
    assert record.extra == {"written_by_a_later_release": [1, 2]}
    assert record.to_json() == STORED | {"enable_fusion": False}  # (a default the API always wrote)


def test_fields_without_a_value_are_left_out_but_owner_and_a_listing_s_latest_are_shown() -> None:
    bare = ModelRecord.of({"name": "m", "version": "v1", "path": "/m.onnx", "signature": STORED["signature"]})

    shown = bare.to_json()
    assert "profile" not in shown and "fusion" not in shown and "latest" not in shown
    assert shown["owner"] is None  # a name no tenant owns says so
    assert bare.replace(latest=False).to_json()["latest"] is False


def test_a_damaged_part_reads_as_missing_rather_than_failing_every_reader() -> None:
    damaged = ModelRecord.of(STORED | {"profile": "junk", "static_profile": None, "fusion": [1]})

    assert damaged.profile is None and damaged.profile_points == [] and not damaged.observed_profile
    assert damaged.static_profile == {} and damaged.fusion is None

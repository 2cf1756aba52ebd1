"""Triton model configurations parsed and checked as Triton checks them, against Triton's own qa cases.

The cases under tests/fixtures/triton/qa are copied unchanged from Triton's `qa/L0_model_config`
(their `expected` files hold the message Triton gives, as a basic regular expression that Triton's
test greps for: only its `\\[` and `\\]` are escapes); each refusal here must say what Triton says.
tests/fixtures/triton/NOTICE.md says where they come from.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from broker.errors import BadInput
from sits_worker.model.graph import model_signature
from sits_worker.model.triton_autofill import (
    complete_config,
    online_settings,
    refuse_unhonoured,
    select_versions,
)
from sits_worker.model.triton_config import check_config, config_json, parse_config

FIXTURES = Path(__file__).parents[2] / "fixtures" / "triton"
QA = FIXTURES / "qa"
STRUCTURE_CASES = sorted(path.name for path in (QA / "noautofill_platform").iterdir()
                         if path.name not in ("control_kind_end_multiple", "batch_input_less_source0"))
GRAPH_CASES = sorted(path.name for path in QA.glob("autofill_noplatform_onnx_*"))


def _expected(folder: Path) -> str:
    return (folder / "expected").read_text().strip().replace("\\[", "[").replace("\\]", "]")


def _signature(folder: Path, version: str = "1") -> dict:
    return model_signature(onnx.load(folder / version / "model.onnx"))


@pytest.mark.parametrize("case", STRUCTURE_CASES)
def test_an_invalid_config_is_refused_with_triton_s_message(case: str) -> None:
    folder = QA / "noautofill_platform" / case
    with pytest.raises(BadInput) as refused:
        check_config(parse_config((folder / "config.pbtxt").read_text(), case))
    assert _expected(folder) in refused.value.message


@pytest.mark.parametrize("case", GRAPH_CASES)
def test_a_config_that_disagrees_with_its_graph_is_refused_with_triton_s_message(case: str) -> None:
    folder = QA / case
    name = case.removeprefix("autofill_noplatform_onnx_")
    config = parse_config((folder / "config.pbtxt").read_text().replace(f'name: "{name}"', ""), name)
    with pytest.raises(BadInput) as refused:
        complete_config(config, _signature(folder))
    assert _expected(folder) in refused.value.message


@pytest.mark.parametrize(("case", "field"), [("control_kind_end_multiple", "sequence_batching"),
                                             ("batch_input_less_source0", "batch_input")])
def test_a_field_sits_cannot_honour_is_refused_by_name(case: str, field: str) -> None:
    with pytest.raises(BadInput, match=field):
        check_config(parse_config((QA / "noautofill_platform" / case / "config.pbtxt").read_text(), case))


def test_an_unknown_field_is_refused_by_triton_s_parser_naming_it() -> None:
    with pytest.raises(BadInput, match="max_batch_sizes"):
        parse_config('name: "m"\nmax_batch_sizes: 4\n', "m")


def test_a_config_named_unlike_its_folder_is_refused() -> None:
    with pytest.raises(BadInput, match="directory name must equal model name"):
        parse_config('name: "other"', "m")


def test_an_empty_config_is_completed_from_the_graph_as_triton_completes_it() -> None:
    loaded = complete_config(parse_config(None, "empty_config"), _signature(QA / "empty_config"))

    written = config_json(loaded)
    assert written["max_batch_size"] == 4 and written["dynamic_batching"]["preferred_batch_size"] == [4]
    assert [(e["name"], e["data_type"], e["dims"]) for e in written["input"]] == [
        ("INPUT0", "TYPE_INT32", [16]), ("INPUT1", "TYPE_INT32", [16])]
    assert [(e["name"], e["data_type"], e["dims"]) for e in written["output"]] == [
        ("OUTPUT0", "TYPE_INT8", [16]), ("OUTPUT1", "TYPE_INT8", [16])]
    assert written["platform"] == "onnxruntime_onnx" and written["backend"] == "onnxruntime"
    assert written["version_policy"] == {"latest": {"num_versions": 1}}


def test_a_graph_without_a_batch_axis_is_completed_without_batching() -> None:
    loaded = complete_config(parse_config(None, "no_config_no_batch"), _signature(QA / "no_config_no_batch"))
    assert loaded.max_batch_size == 0 and not loaded.HasField("dynamic_batching")
    assert [list(entry.dims) for entry in loaded.input] == [[16], [16]]


def test_triton_s_simple_example_loads_as_written() -> None:
    folder = FIXTURES / "model_repository" / "simple"
    loaded = complete_config(parse_config((folder / "config.pbtxt").read_text(), "simple"), _signature(folder))
    refuse_unhonoured(loaded)

    written = config_json(loaded)
    assert written["max_batch_size"] == 8 and "dynamic_batching" not in written
    assert written["input"][0] == {"name": "INPUT0", "data_type": "TYPE_INT32", "dims": [16]}
    assert online_settings(loaded)["max_batch_size"] == 8 and online_settings(loaded)["max_queue_size"] == 0


def test_the_queue_policy_and_priority_levels_become_sits_s_keys() -> None:
    text = """name: "m"
max_batch_size: 8
dynamic_batching {
  max_queue_delay_microseconds: 2000
  preferred_batch_size: [ 2, 4 ]
  priority_levels: 3
  default_priority_level: 2
  default_queue_policy { max_queue_size: 5 default_timeout_microseconds: 100000 allow_timeout_override: true }
  priority_queue_policy { key: 1 value { max_queue_size: 2 timeout_action: DELAY } }
}
"""
    folder = FIXTURES / "model_repository" / "simple"
    keys = online_settings(complete_config(parse_config(text, "m"), _signature(folder)))

    assert keys["max_queue_delay"] == 0.002 and keys["preferred_batch_sizes"] == [2, 4]
    assert keys["max_queue_size"] == 0  # each level has its own, as Triton's queues are per level
    assert keys["priority_levels"][15] == {"max_queue_size": 2, "default_timeout": 0.0, "timeout_action": "delay",
                                           "allow_timeout_override": False}
    assert keys["priority_levels"][14] == keys["priority_levels"][13] == {
        "max_queue_size": 5, "default_timeout": 0.1, "timeout_action": "reject", "allow_timeout_override": True}


@pytest.mark.parametrize(("policy", "available", "chosen"), [
    ("", [1, 2, 3], [3]),
    ("version_policy { latest { num_versions: 2 } }", [1, 3, 2], [2, 3]),
    ("version_policy { all {} }", [3, 1], [1, 3]),
    ("version_policy { specific { versions: [1, 3] } }", [1, 2, 3], [1, 3]),
])
def test_the_version_policy_selects_versions(policy: str, available: list[int], chosen: list[int]) -> None:
    assert select_versions(parse_config(policy, "m"), available) == chosen


def test_a_specific_version_that_is_not_there_is_refused() -> None:
    with pytest.raises(BadInput, match="version 4 is specified for model 'm'"):
        select_versions(parse_config("version_policy { specific { versions: [4] } }", "m"), [1, 2])


@pytest.mark.parametrize(("text", "field"), [
    ('platform: "tensorrt_plan"', "platform"),
    ('backend: "python"', "backend"),
    ("dynamic_batching { priority_levels: 17 default_priority_level: 1 }", "priority_levels"),
    ("dynamic_batching { max_queue_delay_microseconds: 2000000 }", "max_queue_delay_microseconds"),
    ("model_transaction_policy { decoupled: true }", "decoupled"),
    ('instance_group { kind: KIND_MODEL }', "KIND_MODEL"),
])
def test_what_sits_cannot_honour_is_refused_naming_the_field(text: str, field: str) -> None:
    with pytest.raises(BadInput, match=field):
        check_config(parse_config("max_batch_size: 8\n" + text, "m"))

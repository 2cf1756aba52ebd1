"""POST/GET /v1/models: registering ONNX files as content-hashed versions, and every way it can be refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx
import pytest

from sits_worker.model.zoo import build_model
from tests.api.api_helpers import Api, error_of
from tests.onnx_models import token_model


def register(api: Api, name: str, path: Path | str, **extra: Any) -> Any:
    return api.post("/v1/models", json={"name": name, "path": str(path), **extra})


def save_mlp(path: Path, seed: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(build_model("mlp", seed=seed), str(path))
    return path


# --- registering ----------------------------------------------------------------------


def test_registering_a_zoo_model_answers_201_with_version_signature_and_static_profile(
        api: Api, zoo_dir: Path) -> None:
    response = register(api, "mlp", zoo_dir / "mlp.onnx")

    assert response.status_code == 201
    record = response.get_json()
    assert record["name"] == "mlp"
    assert len(record["version"]) == 12 and int(record["version"], 16) >= 0
    assert record["ref"] == f"mlp@{record['version']}"
    assert record["signature"]["inputs"] == [
        {"name": "features", "dtype": "float32", "shape": ["batch", 64], "dynamic_axes": [0]}]
    assert [output["name"] for output in record["signature"]["outputs"]] == ["logits"]
    profile = record["static_profile"]
    assert profile["flops_per_sample"] > 0
    assert profile["param_count"] == 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
    assert profile["op_histogram"] == {"Gemm": 3, "Relu": 2}
    assert record["profile_status"] == "static"
    assert Path(record["path"]).is_file()


def test_every_zoo_model_registers(api: Api, zoo_dir: Path) -> None:
    for name in ("mlp", "convnet", "transformer"):
        response = register(api, name, zoo_dir / f"{name}.onnx")
        assert response.status_code == 201, error_of(response)
    transformer = api.get("/v1/models/transformer").get_json()
    assert transformer["signature"]["inputs"][0]["dtype"] == "int64"
    assert transformer["static_profile"]["sequence_axis"] == {"input": "input_ids", "axis": 1}


def test_a_token_model_is_run_at_registration_to_see_which_outputs_carry_the_sequence(
        api: Api, zoo_dir: Path, tmp_path: Path) -> None:
    """An exporter's own name for an output's sequence dim (or none) does not hide it: the profile keeps
    the outputs whose size followed the length; a model without a declared mask is not run."""
    onnx.save(token_model(output_sequence_dim="Mullast_hidden_state_dim_1"), tmp_path / "renamed.onnx")
    renamed = register(api, "renamed", tmp_path / "renamed.onnx")
    assert renamed.status_code == 201, error_of(renamed)
    assert renamed.get_json()["static_profile"]["sequence_outputs"] == [
        ["last_hidden_state", 1], ["scores", 1], ["scores", 2]]
    assert register(api, "transformer", zoo_dir / "transformer.onnx").get_json()["static_profile"][
        "sequence_outputs"] == []  # its one output is pooled
    assert "sequence_outputs" not in register(api, "mlp", zoo_dir / "mlp.onnx").get_json()["static_profile"]


def test_reregistering_an_identical_file_keeps_the_same_version(api: Api, zoo_dir: Path, tmp_path: Path) -> None:
    first = register(api, "mlp", zoo_dir / "mlp.onnx").get_json()
    again = register(api, "mlp", zoo_dir / "mlp.onnx")
    # The same bytes in another place are the same model too.
    copy = save_mlp(tmp_path / "elsewhere" / "mlp-copy.onnx", seed=0)
    from_copy = register(api, "mlp", copy)

    assert again.status_code == 201 and from_copy.status_code == 201
    assert again.get_json()["version"] == first["version"]
    assert from_copy.get_json()["version"] == first["version"]
    assert again.get_json()["registered_at"] == first["registered_at"]
    assert len(api.get("/v1/models").get_json()["models"]) == 1


def test_a_changed_file_makes_a_new_version_and_the_old_one_stays_addressable(
        api: Api, tmp_path: Path) -> None:
    path = save_mlp(tmp_path / "models" / "mlp.onnx", seed=0)
    old = register(api, "mlp", path).get_json()
    save_mlp(path, seed=1)  # same file name, new weights
    new = register(api, "mlp", path).get_json()

    assert new["version"] != old["version"]
    latest = api.get("/v1/models/mlp")
    assert latest.status_code == 200
    assert latest.get_json()["version"] == new["version"]
    assert sorted(latest.get_json()["versions"]) == sorted([old["version"], new["version"]])
    pinned = api.get(f"/v1/models/mlp@{old['version']}")
    assert pinned.status_code == 200
    assert pinned.get_json()["version"] == old["version"]
    # The stored copy of the old version is still there although its source file was overwritten.
    assert Path(pinned.get_json()["path"]).is_file()
    assert Path(pinned.get_json()["path"]) != Path(new["path"])


def test_listing_models_shows_every_version_and_marks_the_latest(api: Api, tmp_path: Path, zoo_dir: Path) -> None:
    path = save_mlp(tmp_path / "models" / "mlp.onnx", seed=0)
    old = register(api, "mlp", path).get_json()
    new = register(api, "mlp", save_mlp(path, seed=1)).get_json()
    register(api, "conv", zoo_dir / "convnet.onnx")

    response = api.get("/v1/models")

    assert response.status_code == 200
    listed = {(m["name"], m["version"]): m["latest"] for m in response.get_json()["models"]}
    assert listed == {("mlp", old["version"]): False, ("mlp", new["version"]): True,
                      ("conv", api.get("/v1/models/conv").get_json()["version"]): True}


def test_full_profiling_is_left_pending_for_a_worker(api: Api, zoo_dir: Path) -> None:
    response = register(api, "mlp", zoo_dir / "mlp.onnx", profile_mode="full", enable_fusion=True)

    assert response.status_code == 201
    assert response.get_json()["profile_status"] == "pending"
    assert response.get_json()["profile_mode"] == "full"


def test_an_unknown_model_answers_404_listing_the_registered_ones(api: Api, mlp: dict[str, Any]) -> None:
    response = api.get("/v1/models/nope")

    assert response.status_code == 404
    message = error_of(response)
    assert "'nope'" in message and "registered models: mlp" in message and "POST /v1/models" in message


def test_an_unknown_version_answers_404_naming_it(api: Api, mlp: dict[str, Any]) -> None:
    response = api.get("/v1/models/mlp@000000000000")

    assert response.status_code == 404
    assert "mlp@000000000000" in error_of(response)


# --- refusals ---------------------------------------------------------------------------


def test_garbage_bytes_in_an_onnx_file_answer_422(api: Api, tmp_path: Path) -> None:
    path = tmp_path / "garbage.onnx"
    path.write_bytes(b"this is not a protobuf at all \x00\xff\xfe" * 10)

    response = register(api, "garbage", path)

    assert response.status_code == 422
    message = error_of(response)
    assert "garbage.onnx" in message and "re-export" in message
    assert response.get_json()["code"] == "invalid_model"


def test_an_empty_onnx_file_answers_422(api: Api, tmp_path: Path) -> None:
    path = tmp_path / "empty.onnx"
    path.write_bytes(b"")

    response = register(api, "empty", path)

    assert response.status_code == 422
    assert "empty.onnx" in error_of(response)


def test_a_missing_model_file_answers_404_naming_the_path(api: Api, tmp_path: Path) -> None:
    response = register(api, "ghost", tmp_path / "ghost.onnx")

    assert response.status_code == 404
    message = error_of(response)
    assert "ghost.onnx" in message and "does not exist" in message


def test_a_folder_instead_of_a_model_file_answers_404_saying_so(api: Api, tmp_path: Path) -> None:
    (tmp_path / "folder.onnx").mkdir()

    response = register(api, "folder", tmp_path / "folder.onnx")

    assert response.status_code == 404
    assert "is not a file" in error_of(response)


def test_a_system_file_outside_the_model_roots_answers_403_naming_the_roots(
        api: Api, tmp_path: Path, zoo_dir: Path) -> None:
    response = register(api, "hosts", "/etc/hosts")

    assert response.status_code == 403
    message = error_of(response)
    assert "/etc/hosts" in message and str(tmp_path.resolve()) in message and str(zoo_dir.resolve()) in message
    assert "paths.model_roots" in message


def test_a_valid_model_in_another_folder_answers_403(api: Api, tmp_path_factory: pytest.TempPathFactory) -> None:
    outside = save_mlp(tmp_path_factory.mktemp("not-a-root") / "mlp.onnx", seed=0)

    response = register(api, "mlp", outside)

    assert response.status_code == 403
    assert "outside this key's model roots" in error_of(response)


def test_a_symlink_escaping_the_model_roots_answers_403(
        api: Api, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    outside = save_mlp(tmp_path_factory.mktemp("not-a-root") / "mlp.onnx", seed=0)
    link = tmp_path / "link.onnx"
    link.symlink_to(outside)

    response = register(api, "mlp", link)

    assert response.status_code == 403
    assert "symbolic link" in error_of(response) and str(outside.resolve()) not in error_of(response)


def test_a_relative_path_escaping_with_dotdot_answers_403(api: Api, tmp_path: Path) -> None:
    response = register(api, "hosts", f"{tmp_path}/../../../../../../../etc/hosts")

    assert response.status_code == 403
    assert "resolves to /etc/hosts" in error_of(response) or "/etc/hosts is outside" in error_of(response)


def test_external_data_pointing_outside_the_model_folder_answers_422(
        api: Api, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    secret = tmp_path_factory.mktemp("secrets") / "weights.bin"
    secret.write_bytes(b"\0" * 1024)
    model = build_model("mlp")
    path = tmp_path / "models" / "mlp.onnx"
    path.parent.mkdir()
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="weights.bin", size_threshold=0)
    loaded = onnx.load(str(path), load_external_data=False)
    for tensor in loaded.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = f"../../{secret.parent.name}/weights.bin"
    path.write_bytes(loaded.SerializeToString())

    response = register(api, "mlp", path)

    assert response.status_code == 422
    message = error_of(response)
    assert "points outside the model folder" in message and "relative name" in message


def test_external_data_next_to_the_model_registers(api: Api, tmp_path: Path) -> None:
    path = tmp_path / "models" / "mlp.onnx"
    path.parent.mkdir()
    onnx.save_model(build_model("mlp"), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="weights.bin", size_threshold=0)

    response = register(api, "mlp", path)

    assert response.status_code == 201, error_of(response)
    stored = onnx.load(response.get_json()["path"])
    assert {tensor.name for tensor in stored.graph.initializer} >= {"fc_w_0", "fc_b_0"}


def test_external_data_next_to_the_model_registers_as_the_same_version_as_one_file(
        api: Api, tmp_path: Path, zoo_dir: Path) -> None:
    path = tmp_path / "models" / "mlp.onnx"
    path.parent.mkdir()
    onnx.save_model(build_model("mlp"), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="weights.bin", size_threshold=0)

    response = register(api, "mlp", path)

    assert response.status_code == 201, error_of(response)
    # The version hashes the graph with its data inlined, so the storage layout does not matter.
    assert response.get_json()["version"] == register(api, "mlp", zoo_dir / "mlp.onnx").get_json()["version"]


def test_an_unknown_field_answers_400_naming_it(api: Api, zoo_dir: Path) -> None:
    response = register(api, "mlp", zoo_dir / "mlp.onnx", profle_mode="full")

    assert response.status_code == 400
    message = error_of(response)
    assert "profle_mode" in message and "unknown field" in message


@pytest.mark.parametrize("name", ["", "has space", "a@b", "-leading-dash", "x" * 65, "slash/name", "../up"])
def test_a_bad_model_name_answers_400_naming_the_field(api: Api, zoo_dir: Path, name: str) -> None:
    response = register(api, name, zoo_dir / "mlp.onnx")

    assert response.status_code == 400
    assert error_of(response).startswith("invalid ModelRegistration: name:")


def test_a_missing_path_answers_400_naming_the_field(api: Api) -> None:
    response = api.post("/v1/models", json={"name": "mlp"})

    assert response.status_code == 400
    assert "path: Field required" in error_of(response)


def test_an_unknown_profile_mode_answers_400_naming_the_choices(api: Api, zoo_dir: Path) -> None:
    response = register(api, "mlp", zoo_dir / "mlp.onnx", profile_mode="thorough")

    assert response.status_code == 400
    message = error_of(response)
    assert "profile_mode" in message and "'static'" in message and "'full'" in message


@pytest.mark.parametrize("path, status", [("{root}/mlp\u0000.onnx", 400), ("~no_such_user_sits/mlp.onnx", 403)],
                         ids=["nul-byte", "unknown-home"])
def test_an_unresolvable_model_path_answers_4xx_not_500(api: Api, tmp_path: Path, path: str, status: int) -> None:
    response = register(api, "mlp", path.format(root=tmp_path))

    assert response.status_code == status, error_of(response)
    assert "model" in error_of(response)

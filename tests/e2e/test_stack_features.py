"""The rest of the offline path through a real stack: input formats, profiling on a worker,
cancel, the `sitsctl` commands, and a plain `celery -A sits_worker worker`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from broker.jobs.chunking import auto_batch_size
from broker.models.model_record import ModelRecord
from sits_api.cli.stack import Stack
from sits_worker.model.zoo import mlp_reference
from tests.e2e.stack_helpers import direct_run, register, stack_settings, start_stack, wait_job
from tests.waiting import eventually


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from sits_worker.model.zoo import build_zoo

    home = tmp_path_factory.mktemp("stack") / "home"
    settings = stack_settings(home, streams=2).with_overrides(redis={"key_prefix": "own"})  # not the default
    running = Stack(settings, worker_count=1, api_port=0).start()
    build_zoo(home / "models")
    yield running
    running.stop()


def sitsctl(stack, *args: str) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"SITS_HOME": str(stack.home)}
    env.pop("SITS_API_URL", None)
    env.pop("SITS_API_KEY", None)
    return subprocess.run([sys.executable, "-m", "sits_api.cli", *args], env=env, capture_output=True, text=True,
                          timeout=180)


def test_full_profile_and_fusion_run_on_a_worker(stack):
    result = sitsctl(stack, "model", "register", "--name", "mlp", "--path", str(stack.home / "models" / "mlp.onnx"),
                     "--profile-mode", "full", "--enable-fusion", "--json")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["profile_status"] == "ready", record
    points = record["profile"]["points"]
    assert [p["batch_size"] for p in points][:3] == [1, 2, 4] and all(p["rows_per_second"] > 0 for p in points)
    assert record["profile"]["pareto"] and record["profile"]["device"] == "cpu"
    assert os.path.exists(record["fusion"]["path"]) and record["fusion"]["op_histogram"]

    again = json.loads(sitsctl(stack, "model", "register", "--name", "mlp", "--path",
                               str(stack.home / "models" / "mlp.onnx"), "--profile-mode", "full", "--json").stdout)
    assert again["version"] == record["version"]
    assert again["profile"]["measured_at"] == record["profile"]["measured_at"], "cached for model_profile_cache_ttl"

    # A job that names no sizes takes them from that measured profile (jobs.*_size: auto).
    features = np.random.default_rng(9).standard_normal((5_000, 64)).astype(np.float32)
    np.save(stack.home / "auto.npy", features)
    client = stack.client()
    job = client.post("/v1/jobs", {"model": "mlp", "input_batch": str(stack.home / "auto.npy"),
                                   "output_dir": str(stack.home / "out-auto")})
    assert job["batch_size"] == auto_batch_size(ModelRecord.of(record)), job
    assert job["chunk_size"] % job["batch_size"] == 0, job
    assert wait_job(client, job["id"])["status"] == "succeeded"
    np.testing.assert_allclose(np.load(stack.home / "out-auto" / "logits.npy"), mlp_reference(features),
                               rtol=1e-4, atol=1e-5)


def test_npz_and_bin_inputs_give_the_reference_outputs(stack):
    client = stack.client()
    register(client, "mlp", stack.home / "models" / "mlp.onnx")
    features = np.random.default_rng(1).standard_normal((3_000, 64)).astype(np.float32)
    np.savez(stack.home / "features.npz", features=features)
    features.tofile(stack.home / "features.bin")
    for name in ("features.npz", "features.bin"):
        job = client.post("/v1/jobs", {"model": "mlp", "input_batch": str(stack.home / name),
                                       "output_dir": str(stack.home / f"out-{name}"), "chunk_size": 700})
        done = wait_job(client, job["id"])
        assert done["status"] == "succeeded" and done["input_format"] == name.split(".")[1], done
        np.testing.assert_allclose(np.load(stack.home / f"out-{name}" / "logits.npy"), mlp_reference(features),
                                   rtol=1e-4, atol=1e-5)


def test_jsonl_rows_of_different_lengths_run_unpadded(stack):
    client = stack.client()
    register(client, "transformer", stack.home / "models" / "transformer.onnx")
    rng = np.random.default_rng(2)
    rows = [rng.integers(0, 1000, size=int(rng.integers(3, 20))).astype(np.int64) for _ in range(300)]
    with open(stack.home / "tokens.jsonl", "w") as handle:
        for row in rows:
            handle.write(json.dumps({"input_ids": row.tolist()}) + "\n")
    job = client.post("/v1/jobs", {"model": "transformer", "input_batch": str(stack.home / "tokens.jsonl"),
                                   "output_dir": str(stack.home / "out-jsonl"), "chunk_size": 64})
    done = wait_job(client, job["id"])
    assert done["status"] == "succeeded", done
    outputs = np.load(stack.home / "out-jsonl" / "embedding.npy")
    for index in (0, 17, 299):
        expected = direct_run(stack.home / "models" / "transformer.onnx", rows[index][None, :], 1)
        np.testing.assert_allclose(outputs[index], expected[0], rtol=1e-4, atol=1e-5)


def test_a_bad_row_found_by_a_worker_fails_the_job_with_a_clear_error(stack):
    client = stack.client()
    register(client, "transformer", stack.home / "models" / "transformer.onnx")
    with open(stack.home / "bad.jsonl", "w") as handle:
        for index in range(100):
            ids = [1, 2, 3] if index != 70 else ["a", "b"]
            handle.write(json.dumps({"input_ids": ids}) + "\n")
    job = client.post("/v1/jobs", {"model": "transformer", "input_batch": str(stack.home / "bad.jsonl"),
                                   "output_dir": str(stack.home / "out-bad"), "chunk_size": 50})
    done = wait_job(client, job["id"])
    assert done["status"] == "failed"
    assert "input 'input_ids'" in done["error"] and "row 70" in done["error"], done["error"]
    assert client.get("/v1/status")["queues"][job["model_ref"]] == {"ready": 0, "inflight": 0}


def test_outputs_whose_rows_vary_in_length_within_a_chunk_fail_the_job_clearly(stack):
    """A per-token output over jsonl rows of different lengths cannot fill one .npy: the job fails at
    once with a message that says so (not retried until its attempts run out)."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Cast", ["ids"], ["per_token"], to=TensorProto.FLOAT)], "per_token",
                              [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "sequence"])],
                              [helper.make_tensor_value_info("per_token", TensorProto.FLOAT, ["batch", "sequence"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # what every ONNX Runtime in use loads (onnx's own default may be newer)
    onnx.save(model, stack.home / "per_token.onnx")
    client = stack.client()
    register(client, "per_token", stack.home / "per_token.onnx")
    with open(stack.home / "ragged.jsonl", "w") as handle:
        for length in (3, 3, 5, 5):
            handle.write(json.dumps({"ids": list(range(length))}) + "\n")
    job = client.post("/v1/jobs", {"model": "per_token", "input_batch": str(stack.home / "ragged.jsonl"),
                                   "output_dir": str(stack.home / "out-ragged"), "chunk_size": 4})

    done = wait_job(client, job["id"])
    assert done["status"] == "failed" and "vary in shape" in done["error"], done
    assert done["chunk_runs"] == 0 and "attempts" not in done["error"]


def test_sitsctl_job_commands_and_status(stack):
    pixels = np.random.default_rng(4).standard_normal((2_000, 3, 32, 32)).astype(np.float32)
    np.save(stack.home / "pixels.npy", pixels)
    assert sitsctl(stack, "model", "register", "--name", "convnet", "--path",
                   str(stack.home / "models" / "convnet.onnx")).returncode == 0
    submitted = sitsctl(stack, "job", "submit", "--model", "convnet", "--input-batch", str(stack.home / "pixels.npy"),
                        "--output-dir", str(stack.home / "out-cli"), "--chunk-size", "250", "--wait")
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert "succeeded" in submitted.stdout and "logits.npy" in submitted.stdout and "sha256:" in submitted.stdout

    listing = json.loads(sitsctl(stack, "job", "list", "--json").stdout)
    job_id = next(j["id"] for j in listing["jobs"] if j["output_dir"].endswith("out-cli"))
    status = json.loads(sitsctl(stack, "job", "status", job_id, "--json").stdout)
    assert status["status"] == "succeeded" and status["rows_done"] == 2_000

    overview = json.loads(sitsctl(stack, "status", "--json").stdout)
    assert overview["redis_url"].startswith("redis://:***@127.0.0.1:")
    assert overview["workers"] and overview["workers"][0]["device"] == "cpu" and overview["workers"][0]["alive"]
    memory = overview["workers"][0]["memory"]  # a CPU worker's reservations, in cpu_memory_granularity units
    assert memory["capacity_bytes"] == 16 * 2**30 and memory["granularity_bytes"] == 2 * 2**20
    assert 0.0 <= memory["fragmentation"] <= 1.0
    assert overview["jobs"].get("succeeded", 0) >= 1
    assert any(ref.startswith("convnet@") for ref in overview["queues"])

    for _ in range(2):  # online requests show in the plain status, from the v2 statistics (an admin key's)
        answer = stack.client().post("/v1/requests", {"model": "convnet", "inputs": {"pixels": pixels[:1].tolist()},
                                                      "wait": True})
        assert answer["status"] == "succeeded", answer
    plain = sitsctl(stack, "status").stdout
    served_table = plain.split("requests (model@version)")[1]  # (after the queues table's convnet row)
    served = next(line for line in served_table.splitlines() if line.strip(" │").startswith("convnet@"))
    assert served.split("│")[2].strip() == "2", plain  # succeeded

    again = sitsctl(stack, "job", "resume", job_id)
    assert again.returncode == 1 and "already succeeded" in again.stderr  # errors go to stderr


def test_cancel_takes_waiting_chunks_out_of_the_queue(stack):
    client = stack.client()
    register(client, "convnet", stack.home / "models" / "convnet.onnx")
    pixels = np.random.default_rng(6).standard_normal((20_000, 3, 32, 32)).astype(np.float32)
    np.save(stack.home / "big.npy", pixels)
    job = client.post("/v1/jobs", {"model": "convnet", "input_batch": str(stack.home / "big.npy"),
                                   "output_dir": str(stack.home / "out-cancel"), "chunk_size": 200})
    # the one worker runs up to max_concurrent_streams (2) chunks at once
    assert eventually(lambda: client.get("/v1/status")["queues"][job["model_ref"]]["inflight"] >= 2,
                      timeout=30, interval=0.02), "never saw 2 chunks in flight on a 2-stream worker"
    cancelled = client.delete(f"/v1/jobs/{job['id']}")
    assert cancelled["status"] == "cancelled"
    status = client.get("/v1/status")
    assert status["queues"][job["model_ref"]]["ready"] == 0
    later = wait_job(client, job["id"], until=lambda j: True)
    assert later["status"] == "cancelled" and later["chunks_done"] < later["chunks_total"]


def test_plain_celery_worker_serves_jobs(tmp_path, zoo_dir):
    stack = start_stack(tmp_path / "home", workers=0, model_roots=(zoo_dir,))
    try:
        stack._spawn("plain-celery", [sys.executable, "-m", "celery", "-A", "sits_worker", "worker",
                                      "--loglevel", "INFO", "--hostname", "plain@%h"])
        stack.wait_for_workers(1, timeout=60)
        client = stack.client()
        register(client, "mlp", zoo_dir / "mlp.onnx")
        features = np.random.default_rng(8).standard_normal((1_000, 64)).astype(np.float32)
        np.save(stack.home / "f.npy", features)
        job = client.post("/v1/jobs", {"model": "mlp", "input_batch": str(stack.home / "f.npy"),
                                       "output_dir": str(stack.home / "out")})
        done = wait_job(client, job["id"], timeout=60)
        assert done["status"] == "succeeded", done
        assert list(done["workers"]) and client.get("/v1/status")["workers"][0]["celery_name"].startswith("plain@")
    finally:
        stack.stop()


def _without_urls(stack, **extra: str) -> dict[str, str]:
    """The environment of a user who ran `sitsctl up` in this SITS_HOME and set nothing else."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SITS_")}
    return env | {"SITS_HOME": str(stack.home)} | extra


def test_sitsctl_output_for_scripts_and_user_keys(stack):
    """`job submit --wait --json` prints only JSON on stdout, `job list` never cuts a job id (80 columns
    in a pipe), and `status` works with a user key (the API leaves the Redis URL out for it)."""
    register(stack.client(), "mlp", stack.home / "models" / "mlp.onnx")
    np.save(stack.home / "json.npy", np.random.default_rng(12).standard_normal((500, 64)).astype(np.float32))
    env = _without_urls(stack)
    submitted = subprocess.run([sys.executable, "-m", "sits_api.cli", "job", "submit", "--model", "mlp",
                                "--input-batch", str(stack.home / "json.npy"), "--output-dir",
                                str(stack.home / "out-json"), "--wait", "--json"], env=env, capture_output=True,
                               text=True, timeout=120)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert json.loads(submitted.stdout)["status"] == "succeeded"

    listing = sitsctl(stack, "job", "list")
    ids = [job["id"] for job in json.loads(sitsctl(stack, "job", "list", "--json").stdout)["jobs"]]
    assert ids and all(job_id in listing.stdout for job_id in ids), listing.stdout

    # `key create` finds the stack's Redis in the settings of the stack running in $SITS_HOME.
    created = subprocess.run([sys.executable, "-m", "sits_api.cli", "key", "create", "--name", "status-reader"],
                             env=env, capture_output=True, text=True, timeout=60)
    assert created.returncode == 0, created.stdout + created.stderr
    status = subprocess.run([sys.executable, "-m", "sits_api.cli", "status"], env=env | {
        "SITS_API_KEY": created.stdout.strip()}, capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stdout + status.stderr
    assert "API   http://127.0.0.1" in status.stdout and "Redis" not in status.stdout


def test_ctrl_c_on_job_submit_wait_says_the_job_keeps_running(stack):
    register(stack.client(), "convnet", stack.home / "models" / "convnet.onnx")
    np.save(stack.home / "interrupted.npy",
            np.random.default_rng(13).standard_normal((8_000, 3, 32, 32)).astype(np.float32))
    # (long enough to be running when Ctrl-C comes: 3,000 rows were done in 5 s before it came, on a loaded host)
    waiting = subprocess.Popen([sys.executable, "-m", "sits_api.cli", "job", "submit", "--model", "convnet",
                                "--input-batch", str(stack.home / "interrupted.npy"), "--output-dir",
                                str(stack.home / "out-interrupted"), "--chunk-size", "100", "--wait"],
                               env=_without_urls(stack), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               # (as from a shell: a test process that ignores SIGINT a moment, as `sitsctl up`'s
                               # ordered stop does, would hand that on, and Python keeps an inherited SIG_IGN)
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    client = stack.client()
    try:
        deadline = time.monotonic() + 60
        while not (jobs := [j for j in client.get("/v1/jobs")["jobs"] if j["output_dir"].endswith("out-interrupted")]):
            assert time.monotonic() < deadline and waiting.poll() is None, "the job was never submitted"
            time.sleep(0.1)
        time.sleep(0.5)  # in its progress loop
        waiting.send_signal(signal.SIGINT)
        output, _ = waiting.communicate(timeout=60)
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.wait()
    job_id = jobs[0]["id"]
    try:
        text = " ".join(output.split())
        assert waiting.returncode == 130, text
        assert f"job {job_id} keeps running: follow it with `sitsctl job status {job_id}`" in text
        assert "Aborted" not in text
        assert client.get(f"/v1/jobs/{job_id}")["status"] in ("queued", "running", "succeeded")
    finally:
        client.delete(f"/v1/jobs/{job_id}")


def test_sitsctl_worker_joins_the_stack_of_its_sits_home(stack):
    """No SITS_REDIS_URL: the worker uses the Redis and the settings (here its key prefix) of the stack
    `sitsctl up` runs in $SITS_HOME (its effective config); with the default prefix it would never be seen."""
    worker = subprocess.Popen([sys.executable, "-m", "sits_api.cli", "worker", "--cpu", "--streams", "1",
                               "--name", "joined@%h"], env=_without_urls(stack), stdout=subprocess.DEVNULL,
                              stderr=subprocess.STDOUT)
    client = stack.client()
    try:
        deadline = time.monotonic() + 60
        while not [w for w in client.get("/v1/status")["workers"] if w["name"].startswith("joined@") and w["alive"]]:
            assert worker.poll() is None, f"the worker exited with code {worker.returncode}"
            assert time.monotonic() < deadline, "the worker never sent a heartbeat to the stack's Redis"
            time.sleep(0.2)
    finally:
        worker.terminate()  # by its PID: a warm shutdown that deregisters it
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


def test_chunks_record_what_ran_beside_them_and_teach_admission_each_pair(stack):
    """Two streams of one worker: a convnet job runs, an mlp job starts beside it. Each job's `slot_mix`
    names the other's model version with the seconds its chunks ran beside it, adding up to its slot time;
    once they ended a reaper pass calibrates each pair (`figures.contention`)."""
    client = stack.client()
    models = stack.home / "models"
    register(client, "mix_cnn", models / "convnet.onnx")
    register(client, "mix_mlp", models / "mlp.onnx")
    rng = np.random.default_rng(5)
    np.save(stack.home / "mix-cnn.npy", rng.standard_normal((1_536, 3, 32, 32)).astype(np.float32))
    np.save(stack.home / "mix-mlp.npy", rng.standard_normal((300_000, 64)).astype(np.float32))
    cnn = client.post("/v1/jobs", {"model": "mix_cnn", "input_batch": str(stack.home / "mix-cnn.npy"),
                                   "output_dir": str(stack.home / "out-mix-cnn"), "chunk_size": 512, "batch_size": 8})
    wait_job(client, cnn["id"], until=lambda job: job["status"] != "queued", timeout=60)
    mlp = client.post("/v1/jobs", {"model": "mix_mlp", "input_batch": str(stack.home / "mix-mlp.npy"),
                                   "output_dir": str(stack.home / "out-mix-mlp"), "chunk_size": 50_000,
                                   "batch_size": 64})
    for job in (cnn, mlp):
        assert wait_job(client, job["id"])["status"] == "succeeded"

    versions = {"cnn": cnn["model_version"], "mlp": mlp["model_version"]}
    for job, other in ((mlp, "cnn"), (cnn, "mlp")):
        raw = stack.store.client.hmget(stack.store.keys.job(job["id"]), "slot_mix", "busy_seconds")
        mix, busy = json.loads(raw[0]), float(raw[1])
        assert mix[versions[other]][0] > 0, mix
        assert sum(seconds for seconds, _ in mix.values()) == pytest.approx(busy, rel=0.01)
        assert sum(rows for _, rows in mix.values()) == pytest.approx(job["rows_total"], rel=1e-6)
    pair = f"{versions['mlp']}~{versions['cnn']}"
    ends = time.monotonic() + 30
    while pair not in stack.store.client.hgetall(stack.store.keys.admission_calibration):
        assert time.monotonic() < ends, "no reaper pass calibrated the pair the mlp job ran in"
        time.sleep(0.2)


def test_a_job_with_a_slot_cap_holds_one_stream_and_the_other_serves_the_job_behind_it(stack):
    """A worker of two streams: a convnet job with `max_slots: 1` never has two chunks in flight, though it
    has many waiting and the higher priority; a job submitted after it runs on the other stream meanwhile."""
    client = stack.client()
    register(client, "capped_cnn", stack.home / "models" / "convnet.onnx")
    pixels = np.random.default_rng(8).standard_normal((3_000, 3, 32, 32)).astype(np.float32)
    np.save(stack.home / "capped.npy", pixels)
    capped = client.post("/v1/jobs", {"model": "capped_cnn", "input_batch": str(stack.home / "capped.npy"),
                                      "output_dir": str(stack.home / "out-capped"), "chunk_size": 250,
                                      "priority": 9, "max_slots": 1})
    behind = client.post("/v1/jobs", {"model": "capped_cnn", "input_batch": str(stack.home / "capped.npy"),
                                      "output_dir": str(stack.home / "out-behind"), "chunk_size": 250})
    inflight_key = stack.store.keys.inflight(capped["model_ref"])
    most_capped, both_ran = 0, False
    ends = time.monotonic() + 120
    while client.get(f"/v1/jobs/{capped['id']}")["status"] in ("queued", "running"):
        assert time.monotonic() < ends, "the capped job did not finish"
        leased = stack.store.client.zrange(inflight_key, 0, -1)
        mine = sum(item.startswith(capped["id"]) for item in leased)
        most_capped = max(most_capped, mine)
        both_ran = both_ran or (mine == 1 and any(item.startswith(behind["id"]) for item in leased))
        time.sleep(0.01)

    assert capped["max_slots"] == 1 and most_capped == 1
    assert both_ran, "the job behind the capped one never ran on the stream it left"
    for job in (capped, behind):
        assert wait_job(client, job["id"])["status"] == "succeeded"


def _feature_table(rows: int, seed: int):
    """(A table of `rows` rows: a string `id`, 64 float32 feature columns and a `note` column that is no
    feature; the features as one array)."""
    import pyarrow as pa

    features = np.random.default_rng(seed).standard_normal((rows, 64)).astype(np.float32)
    columns = {"id": pa.array([f"id-{(row * 7919) % 100_000:05d}" for row in range(rows)]),
               **{f"f{col:02d}": features[:, col] for col in range(64)},
               "note": pa.array(["x"] * rows)}
    return pa.table(columns), features


def test_a_parquet_job_writes_its_ids_and_outputs_as_a_direct_run_and_lists_a_bad_row_by_id(stack):
    """A Parquet input whose row groups (500 rows) cut across the chunks (700 rows): every numeric column but
    the id goes into the MLP's one input; outputs.parquet holds the ids in row order and logits equal to a
    plain ONNX Runtime run; a row with a null feature is quarantined, listed by its id."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    client = stack.client()
    register(client, "mlp", stack.home / "models" / "mlp.onnx")
    table, features = _feature_table(3_000, 11)
    table = table.set_column(5, "f04", pa.array(features[:, 4], mask=np.arange(3_000) == 1234))
    pq.write_table(table, stack.home / "features.parquet", row_group_size=500)
    job = client.post("/v1/jobs", {"model": "mlp", "input_batch": str(stack.home / "features.parquet"),
                                   "output_dir": str(stack.home / "out-parquet"), "chunk_size": 700,
                                   "batch_size": 128, "id_column": "id", "output_format": "parquet"})
    done = wait_job(client, job["id"])
    assert done["status"] == "succeeded" and done["input_format"] == "parquet", done
    assert done["output_format"] == "parquet" and done["rows_quarantined"] == 1, done
    written = pq.read_table(stack.home / "out-parquet" / "outputs.parquet")
    assert written.column_names == ["id", "logits"]
    assert written["id"].to_pylist() == table["id"].to_pylist()
    logits = np.asarray(written["logits"].combine_chunks().flatten()).reshape(3_000, -1)
    expected = direct_run(stack.home / "models" / "mlp.onnx", features, 128)
    good = np.arange(3_000) != 1234
    np.testing.assert_allclose(logits[good], expected[good], rtol=1e-4, atol=1e-5)
    assert np.isnan(logits[1234]).all()
    manifest = done["manifest"]
    assert manifest["quarantined_rows"] == [1234] and manifest["quarantined_ids"] == [table["id"][1234].as_py()]
    assert manifest["outputs"]["logits"]["file"] == "outputs.parquet" and manifest["id_column"] == "id"
    assert not (stack.home / "out-parquet" / "logits.npy").exists()


def test_csv_and_arrow_inputs_map_named_columns_onto_the_input(stack):
    """A CSV file read into .npy outputs with its feature columns named in another order than the file's,
    and an Arrow IPC file into Parquet with its row numbers as ids: both equal a direct run."""
    import pyarrow.csv as pa_csv
    import pyarrow.feather as feather
    import pyarrow.parquet as pq

    client = stack.client()
    register(client, "mlp", stack.home / "models" / "mlp.onnx")
    table, features = _feature_table(2_000, 12)
    order = [f"f{col:02d}" for col in reversed(range(64))]
    pa_csv.write_csv(table, stack.home / "features.csv")
    csv_job = client.post("/v1/jobs", {"model": "mlp", "input_batch": str(stack.home / "features.csv"),
                                       "output_dir": str(stack.home / "out-csv"), "chunk_size": 300,
                                       "batch_size": 64, "columns": {"features": order}})
    feather.write_feather(table.drop_columns(["id"]), stack.home / "features.data", chunksize=450)
    arrow_job = client.post("/v1/jobs", {"model": "mlp", "input_batch": str(stack.home / "features.data"),
                                         "input_format": "arrow", "output_dir": str(stack.home / "out-arrow"),
                                         "chunk_size": 300, "batch_size": 64, "output_format": "parquet"})
    assert wait_job(client, csv_job["id"])["status"] == "succeeded"
    assert wait_job(client, arrow_job["id"])["status"] == "succeeded"
    model = stack.home / "models" / "mlp.onnx"
    np.testing.assert_allclose(np.load(stack.home / "out-csv" / "logits.npy"),
                               direct_run(model, np.ascontiguousarray(features[:, ::-1]), 64), rtol=1e-4, atol=1e-5)
    written = pq.read_table(stack.home / "out-arrow" / "outputs.parquet")
    assert written["row"].to_pylist() == list(range(2_000))
    np.testing.assert_allclose(np.asarray(written["logits"].combine_chunks().flatten()).reshape(2_000, -1),
                               direct_run(model, features, 64), rtol=1e-4, atol=1e-5)


def test_a_table_job_that_cannot_be_read_is_refused_at_submit_naming_what_to_fix(stack):
    import pyarrow.parquet as pq

    from sits_api.cli.client import ApiError

    client = stack.client()
    register(client, "mlp", stack.home / "models" / "mlp.onnx")
    table, _ = _feature_table(100, 13)
    pq.write_table(table, stack.home / "small.parquet")
    base = {"model": "mlp", "input_batch": str(stack.home / "small.parquet"), "output_dir": str(stack.home / "out-r")}
    cases = [({"id_column": "key"}, "id_column 'key' is not a column"),
             ({"columns": {"features": ["f00", "missing"]}}, "['missing'] for input 'features' are not in"),
             ({"columns": {"features": ["f00", "note"]}}, "column 'note' of 'small.parquet' is string"),
             ({"columns": {"pixels": ["f00"]}}, "the model's inputs are ['features']"),
             ({"input_format": "csv"}, "not a readable csv file"),
             ({"input_format": "xls"}, "input_format"),
             ({"columns": {"features": [f"f{col:02d}" for col in range(63)]}}, "expects float32 [N,64]")]
    for extra, message in cases:
        with pytest.raises(ApiError) as refused:
            client.post("/v1/jobs", base | extra)
        assert refused.value.http_status == 400 and message in str(refused.value), (extra, refused.value)


def test_a_parquet_job_cancelled_midway_resumes_running_only_its_unfinished_chunks(stack):
    """Images as one fixed-size-list column into the convnet: cancelled after a few chunks, resumed, only the
    chunks without a part run again, and outputs.parquet equals a direct run with its ids in order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    client = stack.client()
    register(client, "convnet", stack.home / "models" / "convnet.onnx")
    pixels = np.random.default_rng(14).standard_normal((1_000, 3, 32, 32)).astype(np.float32)
    images = pa.FixedSizeListArray.from_arrays(pa.array(pixels.reshape(-1)), 3 * 32 * 32)
    pq.write_table(pa.table({"key": np.arange(1_000, dtype=np.int64) * 3, "image": images}),
                   stack.home / "images.parquet", row_group_size=128)
    job = client.post("/v1/jobs", {"model": "convnet", "input_batch": str(stack.home / "images.parquet"),
                                   "output_dir": str(stack.home / "out-images"), "chunk_size": 50,
                                   "batch_size": 25, "id_column": "key", "output_format": "parquet"})
    wait_job(client, job["id"], until=lambda j: j["chunks_done"] >= 4)
    client.delete(f"/v1/jobs/{job['id']}")
    before = wait_job(client, job["id"])
    assert before["status"] == "cancelled" and 0 < before["chunks_done"] < before["chunks_total"], before
    client.post(f"/v1/jobs/{job['id']}/resume", {})
    done = wait_job(client, job["id"])
    assert done["status"] == "succeeded", done
    missing = done["chunks_total"] - before["chunks_done"]  # (a chunk leased at the cancel may run twice)
    assert missing <= done["chunk_runs"] - before["chunk_runs"] <= missing + 2, (before, done)
    written = pq.read_table(stack.home / "out-images" / "outputs.parquet")
    assert written["key"].to_pylist() == list(range(0, 3_000, 3))
    (output,) = [name for name in written.column_names if name != "key"]
    values = np.asarray(written[output].combine_chunks().flatten()).reshape(1_000, -1)
    expected = direct_run(stack.home / "models" / "convnet.onnx", pixels, 25).reshape(1_000, -1)
    np.testing.assert_allclose(values, expected, rtol=1e-4, atol=1e-5)


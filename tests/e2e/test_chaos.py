"""Chaos: workers SIGKILLed again and again, Redis killed and restarted from its AOF, an out-of-memory
storm, a model that fails 1 % of its runs and a worker cut off the network, each during one job on a
real stack (Redis, API, Celery workers). After each the job ends as its policy says, every good row
equals a direct ONNX Runtime run, no chunk is missing or counted twice, and nothing is left leased.
Short versions run by default; the soaks (`-m slow`) run longer jobs. Each test prints its figures
(`-s` shows them), the source of the reliability table in docs/benchmarks.md."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sits_api.cli.stack import Stack
from tests.e2e.stack_helpers import FAST_RECOVERY, direct_run, register, stack_settings, start_stack, wait_job

FEATURES = 64
"""The zoo mlp's input width."""


def _start(home: Path, *, workers: int = 2, **overrides: Any) -> tuple[Stack, Path]:
    """A stack of `workers` CPU workers, one stream slot each, the zoo's mlp registered; (it, the mlp)."""
    from sits_worker.model.zoo import build_zoo

    settings = stack_settings(home, streams=1).with_overrides(
        scheduler={**FAST_RECOVERY, "reap_interval": "0.2s"}, **overrides)
    stack = Stack(settings, worker_count=workers, api_port=0).start()
    mlp = build_zoo(home / "models")["mlp"]
    register(stack.client(), "mlp", mlp)
    return stack, mlp


def _submit(stack: Stack, rows: int, chunk: int, batch: int, seed: int) -> tuple[str, np.ndarray]:
    features = np.random.default_rng(seed).standard_normal((rows, FEATURES)).astype(np.float32)
    np.save(stack.home / "in.npy", features)
    job = stack.client().post("/v1/jobs", {"model": "mlp", "input_batch": str(stack.home / "in.npy"),
                                           "output_dir": str(stack.home / "out"), "chunk_size": chunk,
                                           "batch_size": batch})
    return str(job["id"]), features


def _leased(stack: Stack) -> dict[str, int]:
    """Items still in an in-flight or retrying set, by key (empty: nothing is leased)."""
    assert stack.store is not None
    client, keys = stack.store.client, stack.store.keys
    held = {}
    for pattern in (keys.inflight("*"), keys.retrying("*")):
        for key in client.scan_iter(match=pattern.replace("{", "\\{").replace("}", "\\}")):
            if count := client.zcard(key):
                held[key] = count
    return held


def _assert_exactly_once(stack: Stack, done: dict[str, Any], mlp: Path, features: np.ndarray, batch: int,
                         bad_rows: tuple[int, ...] = ()) -> None:
    """The job succeeded with every chunk counted once, every good row equal to a direct run, the bad
    rows (and only they) quarantined, and nothing left leased."""
    assert done["status"] == "succeeded", done
    assert done["rows_done"] == done["rows_total"] == len(features), done
    assert done["chunks_done"] == done["chunks_total"], done
    assert done["chunk_runs"] >= done["chunks_total"]  # re-runs are allowed, double counting is not
    assert done["manifest"]["rows"] == len(features)
    assert sorted(done["manifest"].get("quarantined_rows") or []) == sorted(bad_rows)
    assert done.get("rows_quarantined", 0) == len(bad_rows)
    outputs = np.load(stack.home / "out" / "logits.npy")
    assert outputs.shape[0] == len(features)
    good = np.setdiff1d(np.arange(len(features)), np.asarray(bad_rows, dtype=np.int64))
    expected = direct_run(mlp, features, batch)
    np.testing.assert_allclose(outputs[good], expected[good], rtol=1e-5, atol=1e-6)
    assert np.isnan(outputs[list(bad_rows)]).all()
    _assert_nothing_leased(stack)


def _assert_nothing_leased(stack: Stack) -> None:
    deadline = time.monotonic() + 5  # the last ack and the reaper's last pass may still be on their way
    while (held := _leased(stack)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not held, f"left leased: {held}"


def _progress_after(client: Any, job_id: str, rows_done: int, timeout: float = 60.0) -> float:
    """Seconds until the job has more than `rows_done` rows done (or ended)."""
    started = time.monotonic()
    wait_job(client, job_id, timeout=timeout,
             until=lambda job: job["rows_done"] > rows_done or job["status"] in ("succeeded", "failed"))
    return time.monotonic() - started


# --- kill storm ---------------------------------------------------------------------------------------


def _kill_storm(tmp_path: Path, rows: int, max_kills: int, every: float) -> None:
    stack, mlp = _start(tmp_path / "home", faults={"enabled": True, "run_latency": "0.1s"},
                        retry={"worker_lost": {"attempts": 20}})
    batch = 50
    try:
        client = stack.client()
        job_id, features = _submit(stack, rows, chunk=250, batch=batch, seed=1)
        started = time.monotonic()
        wait_job(client, job_id, until=lambda job: job["rows_done"] > 0, timeout=60)
        kills, recoveries = 0, []
        while kills < max_kills and client.get(f"/v1/jobs/{job_id}")["status"] == "running":
            time.sleep(every)
            rows_done = client.get(f"/v1/jobs/{job_id}")["rows_done"]
            victim = kills % 2
            stack.stop_child(f"worker{victim}", kill=True)  # its leased chunk comes back by lease expiry
            stack.start_worker(victim)  # the other worker carries on meanwhile
            kills += 1
            recoveries.append(_progress_after(client, job_id, rows_done))
        done = wait_job(client, job_id, timeout=300)
        elapsed = time.monotonic() - started
        lost = done["retries"].get("worker_lost", {}).get("attempts", 0)
        print(f"\nkill storm: {rows} rows, {kills} SIGKILLs, {lost} chunks lost with a worker and run again, "
              f"progress again {max(recoveries):.1f} s after a kill at worst, job {elapsed:.1f} s")
        assert kills >= 2, "the job ended before two kills; make it longer"
        _assert_exactly_once(stack, done, mlp, features, batch)
    finally:
        stack.stop()


@pytest.mark.slow  # (a killed worker is covered by default in test_worker_crash.py and a cut host in test_two_hosts.py)
def test_kill_storm_loses_and_duplicates_no_row(tmp_path):
    _kill_storm(tmp_path, rows=3_000, max_kills=2, every=0.8)


@pytest.mark.slow
def test_repeated_worker_kills_lose_and_duplicate_nothing(tmp_path, zoo_dir):
    """The soak: a 60,000-row transformer job, the two workers SIGKILLed in turn and started again."""
    rows, chunk, batch, sequence = 60_000, 500, 100, 48  # long enough to outlast two kills on a quiet machine
    stack = start_stack(tmp_path / "home", workers=2, streams=2, model_roots=(zoo_dir,))
    try:
        client = stack.client()
        register(client, "transformer", zoo_dir / "transformer.onnx")
        token_ids = np.random.default_rng(9).integers(0, 1000, size=(rows, sequence)).astype(np.int64)
        np.save(stack.home / "ids.npy", token_ids)
        job = client.post("/v1/jobs", {"model": "transformer", "input_batch": str(stack.home / "ids.npy"),
                                       "output_dir": str(stack.home / "out"), "chunk_size": chunk,
                                       "batch_size": batch})
        started = time.monotonic()
        kills, recoveries = 0, []
        while client.get(f"/v1/jobs/{job['id']}")["status"] not in ("succeeded", "failed") and kills < 6:
            time.sleep(1.5)
            rows_done = client.get(f"/v1/jobs/{job['id']}")["rows_done"]
            victim = kills % 2
            stack.stop_child(f"worker{victim}", kill=True)
            stack.start_worker(victim)
            kills += 1
            recoveries.append(_progress_after(client, job["id"], rows_done, timeout=120))
        done = wait_job(client, job["id"], timeout=300)
        elapsed = time.monotonic() - started
        lost = done["retries"].get("worker_lost", {}).get("attempts", 0)
        print(f"\nkill storm soak: {rows} rows, {kills} SIGKILLs, {lost} chunks lost with a worker and run again, "
              f"progress again {max(recoveries):.1f} s after a kill at worst, job {elapsed:.1f} s")
        assert kills >= 2, "the job ended before the workers could be killed twice; make it longer"
        assert done["status"] == "succeeded", done
        assert done["chunks_done"] == done["chunks_total"] and done["rows_done"] == rows
        assert done["manifest"]["rows"] == rows
        assert done["chunk_runs"] >= done["chunks_total"]  # re-runs are allowed, double counting is not
        expected = direct_run(zoo_dir / "transformer.onnx", token_ids, batch)
        np.testing.assert_allclose(np.load(stack.home / "out" / "embedding.npy"), expected, rtol=1e-5, atol=1e-5)
        _assert_nothing_leased(stack)
    finally:
        stack.stop()


# --- Redis killed, restarted from its AOF ---------------------------------------------------------------


def _redis_restart(tmp_path: Path, rows: int, restarts: int) -> None:
    stack, mlp = _start(tmp_path / "home", faults={"enabled": True, "run_latency": "0.02s"},
                        retry={"worker_lost": {"attempts": 20}})
    assert stack.redis is not None and stack.redis.appendonly  # the stack's Redis keeps an AOF (everysec)
    batch = 50
    try:
        client = stack.client()
        job_id, features = _submit(stack, rows, chunk=250, batch=batch, seed=2)
        started = time.monotonic()
        recoveries = []
        for restart in range(restarts):
            share = (restart + 1) / (restarts + 2)  # spread the kills over the job
            mid = wait_job(client, job_id, timeout=120,
                           until=lambda job, at=share: job["chunks_done"] >= at * job["chunks_total"])
            assert mid["status"] == "running", mid
            stack.redis.stop(kill=True)  # SIGKILL: up to a second of writes is not in the AOF
            time.sleep(1.0)
            stack.redis.start(timeout=30)  # same port, same folder: it replays the AOF
            back = time.monotonic()
            rows_done = wait_job(client, job_id, until=lambda job: True, timeout=30)["rows_done"]
            _progress_after(client, job_id, rows_done, timeout=120)
            recoveries.append(time.monotonic() - back)
        done = wait_job(client, job_id, timeout=300)
        elapsed = time.monotonic() - started
        print(f"\nredis restart: {rows} rows, {restarts} SIGKILLs of Redis, progress again "
              f"{max(recoveries):.1f} s after Redis was back at worst, job {elapsed:.1f} s, "
              f"{done['chunk_runs'] - done['chunks_total']} chunk re-runs")
        _assert_exactly_once(stack, done, mlp, features, batch)
    finally:
        stack.stop()


def test_redis_killed_and_restarted_from_its_aof_mid_job_loses_and_duplicates_no_row(tmp_path):
    _redis_restart(tmp_path, rows=3_000, restarts=1)


@pytest.mark.slow
def test_redis_restart_soak_loses_and_duplicates_no_row(tmp_path):
    _redis_restart(tmp_path, rows=30_000, restarts=3)


# --- injected out-of-memory storm -----------------------------------------------------------------------


def _oom_storm(tmp_path: Path, rows: int, share: float) -> None:
    # The breaker is off, so that this measures the out-of-memory path alone; the breaker has its own test.
    stack, mlp = _start(tmp_path / "home", workers=1, faults={"enabled": True, "seed": 3, "oom_share": share},
                        retry={"device_oom": {"attempts": 30, "backoff": "0.05s", "backoff_factor": 1}},
                        breaker={"enabled": False})
    batch = 50
    try:
        client = stack.client()
        job_id, features = _submit(stack, rows, chunk=100, batch=batch, seed=3)
        started = time.monotonic()
        done = wait_job(client, job_id, timeout=300)
        elapsed = time.monotonic() - started
        retried = done["retries"].get("device_oom", {}).get("attempts", 0)
        logs = "".join(path.read_text(errors="replace") for path in (stack.home / "logs").glob("worker*.log"))
        handled = logs.count("device out of memory running")  # each one the worker halved or offloaded
        print(f"\noom storm: {rows} rows, oom_share {share:g}, {handled} runs out of memory handled in the worker, "
              f"{retried} chunk runs retried, job {elapsed:.1f} s")
        assert handled + retried > 0, "no injected out-of-memory happened"
        _assert_exactly_once(stack, done, mlp, features, batch)
    finally:
        stack.stop()


def test_oom_storm_loses_and_duplicates_no_row(tmp_path):
    _oom_storm(tmp_path, rows=4_000, share=0.2)


@pytest.mark.slow
def test_oom_storm_soak_loses_and_duplicates_no_row(tmp_path):
    _oom_storm(tmp_path, rows=100_000, share=0.2)


# --- a model that fails 1 % of its runs ---------------------------------------------------------------


def _failing_runs(tmp_path: Path, rows: int) -> None:
    batch = 50
    runs = rows // batch
    bad_rows = tuple(int(row) for row in np.random.default_rng(4).choice(rows, size=runs // 100, replace=False))
    stack, mlp = _start(tmp_path / "home", workers=1, faults={"enabled": True, "fail_rows": list(bad_rows)},
                        jobs={"max_bad_rows": len(bad_rows)})
    try:
        client = stack.client()
        job_id, features = _submit(stack, rows, chunk=500, batch=batch, seed=4)
        started = time.monotonic()
        done = wait_job(client, job_id, timeout=300)
        elapsed = time.monotonic() - started
        print(f"\n1 % of runs fail: {rows} rows in {runs} runs, {len(bad_rows)} failing rows quarantined, "
              f"job {elapsed:.1f} s")
        _assert_exactly_once(stack, done, mlp, features, batch, bad_rows=bad_rows)
    finally:
        stack.stop()


@pytest.mark.slow  # (bad-row quarantine is covered by default in test_quarantine.py)
def test_a_model_failing_one_percent_of_runs_quarantines_only_the_failing_rows(tmp_path):
    _failing_runs(tmp_path, rows=10_000)


@pytest.mark.slow
def test_failing_runs_soak_quarantines_only_the_failing_rows(tmp_path):
    _failing_runs(tmp_path, rows=100_000)


# --- a model whose runs fail 1 % of the time, whatever their input -------------------------------------


def _flaky_model(tmp_path: Path, rows: int) -> None:
    batch = 25
    runs = rows // batch
    stack, mlp = _start(tmp_path / "home", workers=2,
                        faults={"enabled": True, "seed": 6, "fail_models": {"mlp": "transient"},
                                "fail_models_share": 0.01},
                        retry={"transient": {"attempts": 6, "backoff": "0.2s", "jitter": "0.1s"}},
                        breaker={"failure_rate": 0.05})  # (at the default 0.3 %, 1 % of runs failing opens it)
    try:
        client = stack.client()
        job_id, features = _submit(stack, rows, chunk=250, batch=batch, seed=6)
        started = time.monotonic()
        done = wait_job(client, job_id, timeout=300)
        elapsed = time.monotonic() - started
        retried = done["retries"].get("transient", {})
        print(f"\n1 % of runs fail (transient): {rows} rows in {runs} runs, {retried.get('attempts', 0)} chunk runs "
              f"failed and were retried after their backoff, job {elapsed:.1f} s")
        assert retried.get("attempts", 0) >= 1, f"no injected failure reached the job: {done['retries']}"
        assert "injected fault" in retried.get("last_error", ""), retried
        _assert_exactly_once(stack, done, mlp, features, batch)
    finally:
        stack.stop()


@pytest.mark.slow  # (transient retries are covered by default in test_retry_classes.py)
def test_a_model_failing_one_percent_of_runs_transiently_is_retried_to_every_row_exactly_once(tmp_path):
    _flaky_model(tmp_path, rows=20_000)


@pytest.mark.slow
def test_flaky_model_soak_is_retried_to_every_row_exactly_once(tmp_path):
    _flaky_model(tmp_path, rows=200_000)


# --- a worker cut off the network ---------------------------------------------------------------------


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def _netns_usable() -> str | None:
    """Why this test cannot make a network namespace here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root to make a network namespace"
    if shutil.which("ip") is None:
        return "needs the `ip` tool (iproute2)"
    probe = f"sitsprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
        _ip("netns", "del", probe)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
        return f"`ip netns add` does not work here: {getattr(err, 'stderr', b'') or err}"
    return None


@contextlib.contextmanager
def _namespace(tag: int) -> Iterator[tuple[str, str, str]]:
    """A network namespace joined to this one by a veth pair; (its name, the host's end, the host's
    address). Both are deleted afterwards (deleting the namespace deletes its end of the pair)."""
    name, host_end, inner_end = f"sitschaos{tag}", f"vsch{tag}", f"vscn{tag}"
    subnet = 200 + tag % 50
    host_ip, inner_ip = f"10.{subnet}.77.1", f"10.{subnet}.77.2"
    _ip("netns", "add", name)
    try:
        _ip("link", "add", host_end, "type", "veth", "peer", "name", inner_end)
        _ip("link", "set", inner_end, "netns", name)
        _ip("addr", "add", f"{host_ip}/30", "dev", host_end)
        _ip("link", "set", host_end, "up")
        _ip("-n", name, "addr", "add", f"{inner_ip}/30", "dev", inner_end)
        _ip("-n", name, "link", "set", inner_end, "up")
        _ip("-n", name, "link", "set", "lo", "up")
        yield name, host_end, host_ip
    finally:
        subprocess.run(["ip", "link", "del", host_end], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)


def _redis_on(address: str, data_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A redis-server of this test's own on loopback and `address` (the embedded one binds loopback only)."""
    from broker.state.embedded import die_with_parent, find_redis_server, free_port

    data_dir.mkdir(parents=True)
    port = free_port()
    process = subprocess.Popen([find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", address,
                                "--dir", str(data_dir), "--save", "", "--appendonly", "no",
                                "--protected-mode", "no", "--logfile", str(data_dir / "redis.log")],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True, preexec_fn=die_with_parent())
    import redis

    client = redis.Redis(host=address, port=port, socket_connect_timeout=0.5)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            assert process.poll() is None and time.monotonic() < deadline, "the test's redis-server did not start"
            time.sleep(0.05)
    client.close()
    return process, f"redis://{address}:{port}/0"


def _network_cut(tmp_path: Path, rows: int, cut_seconds: float) -> None:
    if (why := _netns_usable()) is not None:
        pytest.skip(f"a worker cut off the network: {why}")
    from sits_api.cli.processes import Child, stop_process
    from sits_api.cli.stack import worker_command

    tag = os.getpid() % 10_000
    with _namespace(tag) as (namespace, host_end, host_ip):
        redis_process, redis_url = _redis_on(host_ip, tmp_path / "redis")
        stack: Stack | None = None
        try:
            stack, mlp = _start(tmp_path / "home", workers=1, redis={"url": redis_url},
                                faults={"enabled": True, "run_latency": "0.05s"},
                                retry={"worker_lost": {"attempts": 20}})
            argv, extra = worker_command("cpu", 1, f"sits9-{os.getpid()}@%h", stack.settings.redis.task_queue)
            cut_off = Child.start("worker9", ["ip", "netns", "exec", namespace, *argv], stack._child_env(extra),
                                  stack.home / "logs" / "worker9.log")
            stack.children.append(cut_off)  # stack.stop() stops it by its PID (`ip netns exec` execs the worker)
            stack.wait_for_workers(2, timeout=60)
            batch = 50
            client = stack.client()
            job_id, features = _submit(stack, rows, chunk=100, batch=batch, seed=5)
            wait_job(client, job_id, timeout=60, until=lambda job: any(
                worker.startswith("sits9-") for worker in job.get("workers") or ()))
            cut_at = time.monotonic()
            _ip("link", "set", host_end, "down")  # the namespace's worker loses Redis mid-batch
            lost = wait_job(client, job_id, timeout=60, until=lambda job: job["status"] != "running" or (
                job["retries"].get("worker_lost", {}).get("attempts", 0) > 0))
            reaped_after = time.monotonic() - cut_at
            time.sleep(max(0.0, cut_seconds - reaped_after))
            _ip("link", "set", host_end, "up")
            restored_at = time.monotonic()
            stack.wait_for_workers(2, timeout=60)
            back_after = time.monotonic() - restored_at
            done = wait_job(client, job_id, timeout=300)
            print(f"\nnetwork cut: {rows} rows, a worker cut off for {restored_at - cut_at:.1f} s, its chunks "
                  f"queued again {reaped_after:.1f} s after the cut ({lost['status']}), its heartbeats back "
                  f"{back_after:.1f} s after the link, {done['chunk_runs'] - done['chunks_total']} chunk re-runs")
            _assert_exactly_once(stack, done, mlp, features, batch)
        finally:
            if stack is not None:
                stack.stop()
            stop_process(redis_process, kill=False, timeout=10)


@pytest.mark.slow  # (a host cut off mid-job is covered by default in test_two_hosts.py)
def test_a_worker_cut_off_the_network_mid_batch_loses_and_duplicates_no_row(tmp_path):
    _network_cut(tmp_path, rows=2_000, cut_seconds=4.0)


@pytest.mark.slow
def test_network_cut_soak_loses_and_duplicates_no_row(tmp_path):
    _network_cut(tmp_path, rows=30_000, cut_seconds=20.0)

"""What ran beside a job's chunks teaches admission how each pair of models slows each other down: a chunk's
ack adds its seconds beside each neighbour model to the job's `slot_mix` (once, however often it is acked),
and the job's end calibrates each pair (`admission_figures.drop_ended`) as well as the model (real Redis, a clock
passed in)."""

from __future__ import annotations

import json

import pytest

from broker.config.settings import Settings
from broker.jobs import fills as job_fills
from broker.jobs import progress as job_progress
from broker.jobs.finish_prediction import CHUNK_OVERHEAD_SECONDS, Work
from broker.models import registry
from broker.models.model_record import ModelRecord
from broker.queueing import leases, reaping, workers
from broker.sla import admission
from broker.sla import figures as admission_figures
from broker.state.store import Store
from tests.broker.broker_helpers import NOW, job_spec
from tests.leasing import lease_items

ROWS_PER_SECOND = 100.0
"""The profile of the model in these tests: 0.01 s a row, so a 50-row chunk is foreseen at 0.5 s."""
RECORD = {"name": "mlp", "version": "v1", "ref": "mlp@v1", "path": "/nowhere.onnx", "signature": {},
          "profile": {"source": "measured", "points": [{"batch_size": 2, "rows_per_second": ROWS_PER_SECOND}]}}


def run_job(store: Store, beside_each_chunk: list[tuple[float, dict[str, float]]]) -> str:
    """A 100-row job of two 50-row chunks run to success as a worker does; each chunk acked with its
    (run seconds, seconds beside each neighbour). Returns its id."""
    job_fills.create_job(store, job_spec("jmix", rows_total=100, chunk_size=50), now=NOW)
    job_progress.start_item(store, "jmix", now=NOW)
    chunks = lease_items(store, "mlp@v1", now=NOW, lease_seconds=30, max_items=2)
    for chunk, (seconds, beside) in zip(chunks, beside_each_chunk, strict=True):
        job_progress.ack_chunk(store, chunk, now=NOW + 2, worker="w1", run_seconds=seconds, beside=beside)
    [final] = lease_items(store, "mlp@v1", now=NOW + 2, lease_seconds=30, max_items=1)
    leases.finish_item(store, final, "jmix", now=NOW + 3, job_status="succeeded")
    return "jmix"


def test_acks_add_each_chunk_s_time_beside_each_neighbour_once(store: Store) -> None:
    job_fills.create_job(store, job_spec("jmix", rows_total=100, chunk_size=50), now=NOW)
    first, second = lease_items(store, "mlp@v1", now=NOW, lease_seconds=30, max_items=2)
    job_progress.ack_chunk(store, first, now=NOW + 1, worker="w1", run_seconds=1.0, beside={"v2": 0.75, "alone": 0.25})
    job_progress.ack_chunk(store, first, now=NOW + 1, worker="w1", run_seconds=1.0, beside={"v2": 0.75, "alone": 0.25})
    job_progress.ack_chunk(store, second, now=NOW + 1, worker="w1", run_seconds=0.5, beside={"v2": 0.5})

    mix = json.loads(store.client.hget(store.keys.job("jmix"), "slot_mix"))
    # seconds beside each, and the chunk's rows split as its seconds were
    assert mix == {"v2": [1.25, pytest.approx(87.5)], "alone": [0.25, pytest.approx(12.5)]}


def test_an_ended_job_calibrates_its_model_and_each_pair_it_ran_in(store: Store) -> None:
    """One chunk ran 1 s beside v2 (twice its foreseen 0.5 s), the other 0.5 s alone: the model's factor is the
    job's 1.5 s over its 1.01 s foreseen, each pair's its own part's; the plan reads them relative to the
    model's (`contention`)."""
    registry.save_model_version(store, RECORD)
    run_job(store, [(1.0, {"v2": 1.0}), (0.5, {"alone": 0.5})])

    fleet = admission_figures.LiveFleet(workers=1, streams=2, device_kind="cpu")
    assert admission_figures.drop_ended(store, ["jmix"], fleet) == 1

    foreseen_chunk = 50 / ROWS_PER_SECOND + CHUNK_OVERHEAD_SECONDS
    factors = admission_figures.calibrations(store)
    assert factors["v1"] == pytest.approx(1.5 / (2 * foreseen_chunk), abs=1e-3)
    assert factors["v1~v2"] == pytest.approx(1.0 / foreseen_chunk, abs=1e-3)
    assert factors["v1~alone"] == pytest.approx(0.5 / foreseen_chunk, abs=1e-3)
    relative = admission_figures.contention(factors)
    assert relative[("v1", "v2")] == pytest.approx(factors["v1~v2"] / factors["v1"], abs=1e-3)
    assert relative[("v1", "v2")] > 1 > relative[("v1", "alone")]


def test_a_short_spell_beside_a_neighbour_teaches_nothing(store: Store) -> None:
    registry.save_model_version(store, RECORD)
    run_job(store, [(0.6, {"v2": admission_figures.MIX_MIN_SECONDS / 2, "alone": 0.5}), (0.5, {"alone": 0.5})])

    admission_figures.drop_ended(store, ["jmix"], admission_figures.LiveFleet(workers=1, streams=2,
                                                                            device_kind="cpu"))

    factors = admission_figures.calibrations(store)
    assert "v1~alone" in factors and "v1~v2" not in factors


def test_admission_plans_a_chunk_beside_the_running_neighbour_at_the_pair_s_speed() -> None:
    """A convnet job runs on one slot of a 2-stream worker; a new mlp job of one 10 s chunk starts on the
    other slot beside it. With the pair learnt at 1.5 its predicted finish is 15 s away, not 10."""
    settings = Settings()
    running = Work("jcnn", 1.0, 30.0, chunks=1, model="vcnn")
    fleet = admission_figures.LiveFleet(workers=1, streams=2, device_kind="cpu")
    record = ModelRecord.of({**RECORD, "version": "v1"})

    def finish(contention: dict[tuple[str, str], float]) -> float:
        figures = admission_figures.Figures([running], [running], fleet, {}, contention)
        prediction = admission.predict(settings, figures, job_id="jnew", record=record, rows=1000, chunks=1,
                                       batch_size=2, deadline_at=NOW + 100, score_for=lambda deadline: 2.0,
                                       now=NOW)
        return prediction.verdict.predicted_finish - NOW - admission.JOB_LATENCY_SECONDS

    alone = 1000 / ROWS_PER_SECOND + CHUNK_OVERHEAD_SECONDS
    assert finish({}) == pytest.approx(alone)
    assert finish({("v1", "vcnn"): 1.5}) == pytest.approx(1.5 * alone)
    assert finish({("v1", "v1"): 1.5}) == pytest.approx(alone)  # a pair it does not run in


def test_a_run_whose_lease_was_lost_counts_no_slot_time_and_its_job_calibrates_nothing(store: Store) -> None:
    """A frozen worker's chunk: its lease ran out and the reaper put it back; the worker thaws and acks it
    first, with the freeze in its run time. The chunk is done, but neither its seconds nor its mix count, and
    the job, its slot time no longer whole, leaves the calibration as it was."""
    registry.save_model_version(store, RECORD)
    job_fills.create_job(store, job_spec("jmix", rows_total=100, chunk_size=50), now=NOW)
    job_progress.start_item(store, "jmix", now=NOW)
    frozen, other = lease_items(store, "mlp@v1", now=NOW, lease_seconds=3, max_items=2)
    job_progress.ack_chunk(store, other, now=NOW + 1, worker="w2", run_seconds=0.5, beside={"alone": 0.5})
    assert reaping.reap_expired_leases(store, now=NOW + 4, max_attempts=3).returned == 1
    assert job_progress.ack_chunk(store, frozen, now=NOW + 21, worker="w1", run_seconds=20.5,
                                  beside={"alone": 20.5}) == 2

    job = store.client.hgetall(store.keys.job("jmix"))
    assert float(job["busy_seconds"]) == 0.5 and job["slot_time_partial"] == "1"
    assert json.loads(job["slot_mix"]) == {"alone": [0.5, 50]}
    [final] = lease_items(store, "mlp@v1", now=NOW + 21, lease_seconds=30, max_items=1)
    leases.finish_item(store, final, "jmix", now=NOW + 22, job_status="succeeded")

    fleet = admission_figures.LiveFleet(workers=1, streams=2, device_kind="cpu")
    assert admission_figures.drop_ended(store, ["jmix"], fleet) == 1
    assert admission_figures.calibrations(store) == {}


def test_a_running_job_s_latest_chunk_start_reaches_admission_which_blocks_only_for_what_is_left(
        store: Store) -> None:
    """A job of 120 rows in chunks of 50 (0.5 s each, its last of 20 rows shorter), its first chunk begun at
    NOW, on a worker of one slot: a newcomer that goes ahead of it waits for what is left of a whole chunk,
    0.2 s at NOW + 0.3, then runs its own 0.1 s, and ends `JOB_LATENCY_SECONDS` after."""
    registry.save_model_version(store, RECORD)
    workers.record_heartbeat(store, "w1", {"streams": 1, "device": "cpu"}, now=NOW)
    job_fills.create_job(store, job_spec("jrun", rows_total=120, chunk_size=50), now=NOW)
    job_progress.start_item(store, "jrun", now=NOW, chunk=True)
    now = NOW + 0.3

    figures = admission_figures.read_figures(Settings(), store, now=now)

    [running] = figures.running
    chunk = 50 / ROWS_PER_SECOND + CHUNK_OVERHEAD_SECONDS
    assert (running.chunk_started_at, running.chunk_seconds) == (NOW, pytest.approx(chunk))
    assert admission.blocking(figures.running, running.score - 1, 1, now=now) == (pytest.approx(chunk - 0.3), 1)
    prediction = admission.predict(Settings(), figures, job_id="jnew", record=ModelRecord.of(RECORD), rows=10, chunks=1,
                                   batch_size=2, deadline_at=now + 60, score_for=lambda _: running.score - 1, now=now)
    own = 10 / ROWS_PER_SECOND + CHUNK_OVERHEAD_SECONDS
    assert prediction.verdict.predicted_finish == pytest.approx(
        now + (chunk - 0.3) + own + admission.JOB_LATENCY_SECONDS)

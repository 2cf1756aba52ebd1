"""A model version's online request statistics, in the shape of Triton's statistics extension.

`complete_requests.lua` keeps the running totals (`keys.model_stats`, and runs by size apart in
`keys.model_batch_stats`) in the same call that stores a batch's results, so a read here is one
round trip whatever the traffic, and every API process and replica reports the same figures.
Times are nanoseconds, as Triton's are:

- `success` / `fail`: requests answered, from submit to result;
- `queue`: for the requests that ran, from submit to the start of their run;
- `compute_infer`: for the requests that ran, the whole run (decoding and merging their inputs,
  ONNX Runtime, cutting the outputs back). SITS does not time those parts apart, so `compute_input`
  and `compute_output` count the same requests with 0 ns;
- `inference_count`: rows of the requests that succeeded (Triton counts every row of a batch);
  `execution_count`: runs; `batch_stats`: runs by batch size (a run shared with an offline job's
  mini-batch counts its rows too) and their time.

Only online requests count (v1 and v2 alike); an offline job's own mini-batches are the job's, and
/metrics counts their rows. No response cache exists, so `cache_hit` and `cache_miss` stay 0.
"""

from __future__ import annotations

from typing import Any

from broker.state.store import Store, translate_redis_errors

_ZERO = {"count": 0, "ns": 0}


def model_statistics(store: Store, versions: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Triton's `model_stats` entries of the given (name, version) pairs, in that order."""
    with translate_redis_errors():
        pipe = store.client.pipeline(transaction=False)
        pipe.hgetall(store.keys.model_stats)
        pipe.hgetall(store.keys.model_batch_stats)
        raw, raw_batches = pipe.execute()
    by_ref, batches_by_ref = decode_model_stats(raw), decode_model_stats(raw_batches)
    return [_entry(name, version, by_ref.get(f"{name}@{version}", {}), batches_by_ref.get(f"{name}@{version}", {}))
            for name, version in versions]


RUN_TOTALS = ("infer_count", "infer_ns", "execution_count")
"""The running totals `run_totals` reads: requests that ran, the nanoseconds of their runs, runs."""


def run_totals(store: Store, model_ref: str) -> dict[str, int]:
    """One model version's `RUN_TOTALS` (0 for those it has none of), in one round trip: what its
    queue's drain rate is estimated from (`broker.online.queue_policy.seconds_per_request`)."""
    with translate_redis_errors():
        values = store.client.hmget(store.keys.model_stats, [f"{model_ref}|{stat}" for stat in RUN_TOTALS])
    return {stat: int(value or 0) for stat, value in zip(RUN_TOTALS, values, strict=True)}


def decode_model_stats(raw: dict[str, str]) -> dict[str, dict[str, int]]:
    """The `keys.model_stats` (or `keys.model_batch_stats`) hash as model ref -> stat -> running total."""
    by_ref: dict[str, dict[str, int]] = {}
    for field, total in raw.items():
        ref, _, stat = field.partition("|")
        by_ref.setdefault(ref, {})[stat] = int(total)
    return by_ref


def _entry(name: str, version: str, totals: dict[str, int], batches: dict[str, int]) -> dict[str, Any]:
    """One version's entry from its running totals and its runs by size (`<rows>_count`, `<rows>_ns`)."""
    def stat(what: str, of: dict[str, int] = totals) -> dict[str, int]:
        return {"count": of.get(f"{what}_count", 0), "ns": of.get(f"{what}_ns", 0)}

    ran = totals.get("infer_count", 0)
    batch_sizes = sorted(int(key[:-len("_count")]) for key in batches if key.endswith("_count"))
    return {
        "name": name,
        "version": version,
        "last_inference": totals.get("last_inference", 0),
        "inference_count": totals.get("inference_count", 0),
        "execution_count": totals.get("execution_count", 0),
        "inference_stats": {
            "success": stat("success"), "fail": stat("fail"), "queue": stat("queue"),
            "compute_input": {"count": ran, "ns": 0}, "compute_infer": stat("infer"),
            "compute_output": {"count": ran, "ns": 0}, "cache_hit": dict(_ZERO), "cache_miss": dict(_ZERO),
        },
        "batch_stats": [
            {"batch_size": size, "compute_input": {"count": batches[f"{size}_count"], "ns": 0},
             "compute_infer": stat(str(size), batches),
             "compute_output": {"count": batches[f"{size}_count"], "ns": 0}}
            for size in batch_sizes
        ],
        "memory_usage": [],
    }

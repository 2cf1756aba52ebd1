"""How far one Redis goes: a simulated fleet of hundreds of workers against the real broker.

One embedded Redis (AOF on, as shipped) and the real Lua scripts; workers simulated by
`benchmarks/fleet_sim.py`: each a worker process's Redis traffic (a connection per thread, a drain thread
per stream slot, heartbeat and reaper ticks) whose runs sleep the model's profiled time instead of
running ONNX Runtime. The simulated workers are spread over client processes, each with many threads.
Per step (a number of workers) and mix:

  offline  a backlog of jobs (chunks of about `--chunk-seconds` of work, mini-batches of 256 rows)
  online   one-row requests offered open loop at `--request-rate` per worker, merged into batches
  mixed    the backlog and requests at half that rate: requests run at the chunks' looks (in place of
           a mini-batch when they outrank it, or riding along)

Reported per step: leases/s (lease calls that took something), acks/s (chunk acks and request
completions, one per batch), rows/s, pace (what the slots did over what they would do with Redis and
the client free: chunk rows by the profile, or requests offered), lease P50/P99 at the client and inside
Redis (SLOWLOG, sampled after the window), Redis's main-thread CPU over the window (cores), Redis
commands per row (`total_commands_processed`, the scripts' own commands included) and client calls per
row, the client processes' CPU (cores), and the load average. Then, per mix, the saturation point: where
Redis's main thread reached 0.9 of a core, or else where it would by the Redis CPU one worker costs at full
pace in the busiest step that kept pace; and the scripts' times inside Redis.
A mix's steps end at the first one that did not keep pace (`--all-steps` goes on): past it, more simulated
workers measure the client, not Redis, and on a small machine their threads crowd out everything else.

    python benchmarks/fleet.py --quick      # under a minute: 8 and 32 workers, every mix, 2 s windows
    python benchmarks/fleet.py              # 8 to 512 workers, 8 s windows: about 2 minutes on 2 cores
    python benchmarks/fleet.py --mixes offline --workers 8,32,128 --seconds 5 --json fleet.json
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fleet_sim import (  # noqa: E402
    ClientPlan,
    FleetClient,
    SimModel,
    Window,
    client_process,
    percentile,
)
from broker.jobs import fills as job_fills  # noqa: E402
from broker.jobs import records as jobs  # noqa: E402
from broker.queueing import tickets  # noqa: E402
from broker.queueing.scoring import estimate_latency_ms  # noqa: E402
from broker.state.embedded import EmbeddedRedis  # noqa: E402
from broker.state.keys import Keys  # noqa: E402
from broker.state.scripts import SCRIPT_NAMES, Scripts  # noqa: E402
from broker.state.store import Store  # noqa: E402

MIXES = ("offline", "online", "mixed")
JOB_BATCH_ROWS = 256
CHUNKS_PER_JOB = 32
SATURATED_CPU = 0.9
"""Redis's main thread at this share of a core counts as saturated."""
KEPT_PACE = 0.9
"""A step whose slots did at least this share of their work kept pace (neither the client nor Redis held them)."""
FAR_BEHIND = 0.5
"""The least pace of a step the saturation point is carried from (below it the client, not the work, sets
the calls)."""


@dataclass(frozen=True)
class StepConfig:
    """One step: a fleet of `workers` simulated workers of `streams` slots each, running `mix`."""

    mix: str
    workers: int
    streams: int = 4
    seconds: float = 8.0
    warmup: float = 2.0
    probe: float = 0.5
    """Seconds after the window in which Redis times every command (SLOWLOG); 0: no probe."""
    processes: int = 2
    """Client processes; 0: threads of this process (the smoke test's)."""
    models: int = 4
    fixed_ms: float = 5.0
    row_ms: float = 0.1
    chunk_seconds: float = 1.0
    request_rate: float = 20.0
    """Online requests offered a second per worker (half that in the mixed mix)."""
    max_batch: int = 32
    look_interval: float = 0.05
    """`scheduler.yield_check_interval`."""

    @property
    def slots(self) -> int:
        """Stream slots of the fleet."""
        return self.workers * self.streams

    def sim_models(self) -> tuple[SimModel, ...]:
        """The models the fleet serves, all with the same profile."""
        return tuple(SimModel(f"sim{index}", self.fixed_ms, self.row_ms) for index in range(self.models))

    def chunk_rows(self) -> int:
        """Rows of a chunk: whole mini-batches of `JOB_BATCH_ROWS` making about `chunk_seconds` of work."""
        return JOB_BATCH_ROWS * max(1, round(self.chunk_seconds / self.minibatch_seconds()))

    def minibatch_seconds(self) -> float:
        """A job mini-batch's run time by the profile."""
        return estimate_latency_ms(self.sim_models()[0].record(), rows=JOB_BATCH_ROWS, tokens=None) / 1000

    def offered_rate(self) -> float:
        """Requests a second the producers offer the whole fleet."""
        share = {"offline": 0.0, "online": 1.0, "mixed": 0.5}[self.mix]
        return self.request_rate * self.workers * share


@dataclass
class Step:
    """What one step measured."""

    config: StepConfig
    seconds: float
    calls: dict[str, int]
    events: dict[str, int]
    lease_ms: tuple[float, float]
    """Client-side P50 and P99."""
    request_ms: tuple[float, float]
    redis_cpu: float
    """Redis's main thread, cores over the window."""
    redis_cpu_all: float
    """The whole Redis process (its background threads too), cores."""
    commands: int
    """`total_commands_processed` over the window."""
    client_cpu: float
    """The client processes' CPU, cores over the window."""
    load: tuple[float, float]
    """The 1-minute load average at the window's start and end."""
    redis_us: dict[str, tuple[int, float, float, float]] = field(default_factory=dict)
    """Script, or command a client sent itself -> (calls, P50 µs, P99 µs, commands run inside) in Redis
    during the probe."""
    errors: dict[str, int] = field(default_factory=dict)
    threads_left: int = 0

    def rate(self, event: str) -> float:
        """`event` a second over the window."""
        return self.events.get(event, 0) / self.seconds

    @property
    def rows(self) -> int:
        """Job rows run (mini-batches that ended in the window: acks come a chunk at a time, too coarse for
        a window of a few chunks) and request rows answered in the window."""
        return self.events.get("job_rows_run", 0) + self.events.get("request_rows", 0)

    @property
    def acks(self) -> int:
        """Batches acknowledged: chunk acks, and request completions (one call per batch)."""
        return self.calls.get("ack_chunk", 0) + self.calls.get("complete_requests", 0)

    def pace(self) -> float:
        """What the slots did over what they would have done unhindered: job rows run against every slot
        running mini-batches back to back by the profile (offline, mixed); requests submitted and answered
        against those offered (online, mixed). The lower of the two where both apply."""
        config, paces = self.config, []
        if config.mix != "online":
            paces.append(self.rate("job_rows_run") / (config.slots * JOB_BATCH_ROWS / config.minibatch_seconds()))
        if config.mix != "offline":
            offered = config.offered_rate()
            paces.append(min(self.rate("submitted"), self.rate("requests")) / offered if offered else 1.0)
        return min(paces)


class RedisSample:
    """Redis's CPU and command counters at one instant."""

    def __init__(self, client: Any) -> None:
        cpu, stats = client.info("cpu"), client.info("stats")
        self.at = time.time()
        self.main = float(cpu.get("used_cpu_sys_main_thread", cpu["used_cpu_sys"])) + float(
            cpu.get("used_cpu_user_main_thread", cpu["used_cpu_user"]))
        self.all = float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])
        self.commands = int(stats["total_commands_processed"])


def create_backlog(store: Store, config: StepConfig) -> int:
    """Queue enough jobs for every slot to run chunks through the step; returns the chunks queued."""
    total_seconds = config.warmup + config.seconds + config.probe + 2
    needed = max(2 * config.slots, math.ceil(config.slots * total_seconds / config.chunk_seconds * 1.2))
    rows = config.chunk_rows()
    models = config.sim_models()
    job_count = math.ceil(needed / CHUNKS_PER_JOB)
    for index in range(job_count):
        model = models[index % len(models)]
        spec = jobs.JobSpec(job_id=jobs.new_job_id(), model_name=model.name, model_version="v1",
                            input_batch="/sim/in.npy", input_format="npy", input_checksum="sha256:sim",
                            output_dir=f"/sim/out{index}", output_names=["y"], rows_total=rows * CHUNKS_PER_JOB,
                            chunk_size=rows, batch_size=JOB_BATCH_ROWS, owner=f"t{index % 8}-key",
                            tenant=f"t{index % 8}")
        job_fills.create_job(store, spec, now=time.time())
    return job_count * CHUNKS_PER_JOB


def plans(config: StepConfig, url: str, prefix: str, ticket_ids: list[str]) -> list[ClientPlan]:
    """The fleet split over the client processes (one plan for in-process threads)."""
    parts = max(1, config.processes)
    models = config.sim_models()
    out = []
    for part in range(parts):
        mine = [index for index in range(config.workers) if index % parts == part]
        if not mine:
            continue
        slot_tickets = tuple(ticket_ids[index * config.streams + slot] for index in mine
                             for slot in range(config.streams))
        out.append(ClientPlan(url=url, prefix=prefix,
                              worker_names=tuple(f"sim{index}@host{index // 8}" for index in mine),
                              streams=config.streams, tickets=slot_tickets, models=models,
                              request_rate=config.offered_rate() / parts,
                              producers=(2 if config.offered_rate() > 0 else 0), total_slots=config.slots,
                              max_batch=config.max_batch, look_interval=config.look_interval))
    return out


def script_names(client: Any) -> dict[str, str]:
    """SHA -> script name, for reading SLOWLOG entries."""
    scripts = Scripts(client)
    return {getattr(scripts, name).command()[1]: name for name in SCRIPT_NAMES}


def probe_redis(client: Any, until: float, names: dict[str, str]) -> dict[str, tuple[int, float, float, float]]:
    """Let Redis time every command until `until` (SLOWLOG at 0 µs), then for each script, and each command a
    client sent itself, its calls, P50 and P99 µs (a script's own commands included) and the commands it ran
    inside; Redis's own settings are put back."""
    before = {key: client.config_get(key)[key] for key in ("slowlog-log-slower-than", "slowlog-max-len")}
    client.config_set("slowlog-max-len", 200_000)
    client.config_set("slowlog-log-slower-than", 0)
    client.slowlog_reset()
    time.sleep(max(0.0, until - time.time()))
    client.config_set("slowlog-log-slower-than", before["slowlog-log-slower-than"])
    entries = client.slowlog_get(200_000)
    client.config_set("slowlog-max-len", before["slowlog-max-len"])
    client.slowlog_reset()
    durations: dict[str, list[float]] = {}
    inner: Counter[str] = Counter()
    pending = 0  # commands a script ran: logged just before it, by Redis's script client ('?:0')
    for entry in sorted(entries, key=lambda entry: int(entry["id"])):
        words = _text(entry["command"]).split(" ")
        if _text(entry.get("client_address", "")) == "?:0":
            pending += 1
            continue
        if words[0].upper() == "EVALSHA" and len(words) > 1:
            name = names.get(words[1], "script?")
            inner[name] += pending
        else:
            name = words[0].upper()
        pending = 0
        if name not in ("SLOWLOG", "CONFIG", "INFO"):  # (this probe's own, and the window's samples)
            durations.setdefault(name, []).append(float(entry["duration"]))
    return {name: (len(values), percentile(values, 0.5), percentile(values, 0.99), inner[name] / len(values))
            for name, values in durations.items()}


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def run_step(config: StepConfig, url: str, prefix: str) -> Step:
    """Run one step against the Redis at `url` under key prefix `prefix` (its keys are left for the caller)."""
    client = redis.Redis.from_url(url, decode_responses=True)
    store = Store(client=client, keys=Keys(prefix=prefix))
    if config.mix != "online":
        create_backlog(store, config)
    ticket_ids = tickets.top_up_tickets(store, now=time.time(), target=config.slots)
    if len(ticket_ids) < config.slots:
        raise SystemExit(f"tickets already circulate under prefix {prefix}: use a fresh prefix per step")
    names = script_names(client)
    client_plans = plans(config, url, prefix, ticket_ids)
    outcomes: list[dict[str, Any]] = []
    measured: dict[str, Any]
    if config.processes == 0:
        fleet = FleetClient(client_plans[0])
        try:
            fleet.start()
            window = _window(config)
            fleet.go(window)
            meter = threading.Thread(target=fleet.measure_cpu)
            meter.start()
            measured = _measure(config, client, window, names)
            meter.join()
        finally:
            fleet.stop.set()  # (on an error too: every thread ends at its next look)
        left = fleet.join()
        outcomes.append({**fleet.result(), "threads_left": left})
    else:
        measured, outcomes = _run_processes(config, client, client_plans, names)
    client.close()
    return _combine(config, measured, outcomes)


def _window(config: StepConfig) -> Window:
    start = time.time() + 0.2
    return Window(start, start + config.warmup, start + config.warmup + config.seconds,
                  start + config.warmup + config.seconds + config.probe,
                  spread=min(config.warmup / 2, config.chunk_seconds))


def _measure(config: StepConfig, client: Any, window: Window, names: dict[str, str]) -> dict[str, Any]:
    """Redis's counters over the window, and the probe after it."""
    time.sleep(max(0.0, window.measure_from - time.time()))
    first, load_first = RedisSample(client), os.getloadavg()[0]
    time.sleep(max(0.0, window.measure_to - time.time()))
    last, load_last = RedisSample(client), os.getloadavg()[0]
    probed = probe_redis(client, window.end, names) if config.probe > 0 else {}
    wall = last.at - first.at
    return {"seconds": wall, "redis_cpu": (last.main - first.main) / wall,
            "redis_cpu_all": (last.all - first.all) / wall, "commands": last.commands - first.commands,
            "load": (load_first, load_last), "redis_us": probed}


def _run_processes(config: StepConfig, client: Any, client_plans: list[ClientPlan],
                   names: dict[str, str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The step over client processes: started, released at one window, collected, and each stopped by PID."""
    context = multiprocessing.get_context("spawn")
    ready, go, results = context.Queue(), context.Queue(), context.Queue()
    processes = [context.Process(target=client_process, args=(plan, ready, go, results), daemon=True)
                 for plan in client_plans]
    try:
        for process in processes:
            process.start()
        for _ in processes:
            said = ready.get(timeout=120)
            if said != "ready":
                raise SystemExit(f"a client process could not start its part: {said}")
        window = _window(config)
        for _ in processes:
            go.put(window)
        measured = _measure(config, client, window, names)
        outcomes = [results.get(timeout=max(5.0, window.end - time.time()) + 30) for _ in processes]
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, 9)
                process.join(timeout=5)
    return measured, outcomes


def _combine(config: StepConfig, measured: dict[str, Any], outcomes: list[dict[str, Any]]) -> Step:
    calls: Counter[str] = Counter()
    events: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    lease_ms: list[float] = []
    request_ms: list[float] = []
    for outcome in outcomes:
        calls.update(outcome["calls"])
        events.update(outcome["events"])
        errors.update(outcome["errors"])
        lease_ms += outcome["lease_ms"]
        request_ms += outcome["request_ms"]
    return Step(config=config, calls=dict(calls), events=dict(events), errors=dict(errors),
                lease_ms=(percentile(lease_ms, 0.5), percentile(lease_ms, 0.99)),
                request_ms=(percentile(request_ms, 0.5), percentile(request_ms, 0.99)),
                client_cpu=sum(outcome["cpu_seconds"] for outcome in outcomes) / measured["seconds"],
                threads_left=sum(outcome.get("threads_left", 0) for outcome in outcomes), **measured)


HEADER = ("| workers | slots | leases/s | acks/s | rows/s | pace | lease P50 ms | lease P99 ms | in Redis P50/P99 µs "
          "| request P99 ms | Redis CPU | commands/row | calls/row | client CPU | load |")
RULE = "| " + " | ".join(["---:"] * 15) + " |"


def table_row(step: Step) -> str:
    """One line of the fleet table."""
    rows = max(1, step.rows)
    in_redis = step.redis_us.get("lease_batch")
    request_p99 = step.request_ms[1]
    cells = [f"{step.config.workers}", f"{step.config.slots}", f"{step.rate('leases'):,.0f}",
             f"{step.acks / step.seconds:,.0f}", f"{step.rows / step.seconds:,.0f}", f"{step.pace():.2f}",
             f"{step.lease_ms[0]:.2f}", f"{step.lease_ms[1]:.2f}",
             f"{in_redis[1]:.0f} / {in_redis[2]:.0f}" if in_redis else "-",
             "-" if math.isnan(request_p99) else f"{request_p99:.0f}", f"{step.redis_cpu:.2f}",
             f"{step.commands / rows:.3f}", f"{sum(step.calls.values()) / rows:.3f}", f"{step.client_cpu:.2f}",
             f"{step.load[0]:.1f}–{step.load[1]:.1f}"]
    return "| " + " | ".join(cells) + " |"


@dataclass(frozen=True)
class Saturation:
    """Where one Redis runs out for one mix: measured, or carried from the busiest step the client could drive."""

    measured_at: int | None
    """The first step's workers whose Redis main thread reached `SATURATED_CPU`; None: not reached."""
    client_bound_at: int | None
    """The first step's workers that did not keep pace while Redis had CPU to spare: the client's limit."""
    steps: list[Step]
    reference: Step
    """The step the figures below come from: the most Redis CPU among those that kept pace (else among those
    at least `FAR_BEHIND` in pace): where the client fell behind, its slowness adds calls of its own (more
    slots find the work they looked at taken, and look again)."""
    cpu_per_worker: float
    """Redis main-thread cores one worker costs at full pace: the reference step's CPU over its workers and
    its pace (a slot's calls follow the work it does). Fixed costs (AOF, the reaper pass) count in it."""
    us_per_row: float
    us_per_lease: float

    @property
    def workers_at_core(self) -> float:
        """Workers at full pace that take Redis's main thread to one core."""
        return 1.0 / self.cpu_per_worker if self.cpu_per_worker > 0 else math.inf

    def describe(self, mix: str) -> str:
        """A sentence a reader can act on."""
        ref = self.reference
        full = ref.config.workers * max(ref.pace(), 1e-9) * ref.seconds  # (worker-seconds of work at full pace)
        parts = [f"{mix}: Redis's main thread reached {max(step.redis_cpu for step in self.steps):.2f} of a core",
                 f"at {ref.config.workers} workers (pace {ref.pace():.2f}) a worker at full pace cost it "
                 f"{self.cpu_per_worker * 1000:.1f} ms of CPU a second ({ref.commands / full:,.0f} commands, "
                 f"{sum(ref.calls.values()) / full:,.0f} round trips), {self.us_per_row:,.1f} µs per row and "
                 f"{self.us_per_lease:,.0f} µs per lease: one core serves about "
                 f"{self.workers_at_core:,.0f} workers ({self.workers_at_core * ref.config.streams:,.0f} slots)"]
        probed = ref.redis_us.get("lease_batch")
        if probed:
            parts.append(f"a lease took {probed[1]:,.0f} µs inside Redis at the median, {probed[2]:,.0f} µs at P99")
        if self.measured_at is not None:
            parts.append(f"it reached {SATURATED_CPU:.0%} of a core at {self.measured_at} workers")
        if self.client_bound_at is not None:
            parts.append(f"the client fell behind from {self.client_bound_at} workers")
        return "; ".join(parts) + "."


def saturation(steps: list[Step]) -> Saturation:
    """The saturation point of one mix's steps (in order of workers)."""
    measured = next((step.config.workers for step in steps if step.redis_cpu >= SATURATED_CPU), None)
    client_bound = next((step.config.workers for step in steps
                         if step.pace() < KEPT_PACE and step.redis_cpu < SATURATED_CPU), None)
    usable = ([step for step in steps if step.pace() >= KEPT_PACE]
              or [step for step in steps if step.pace() >= FAR_BEHIND] or steps[:1])
    ref = max(usable, key=lambda step: step.redis_cpu)
    per_worker = ref.redis_cpu / (ref.config.workers * max(ref.pace(), 1e-9))
    redis_seconds = ref.redis_cpu * ref.seconds * 1e6
    return Saturation(measured, client_bound, steps, ref, per_worker, redis_seconds / max(1, ref.rows),
                      redis_seconds / max(1, ref.events.get("leases", 0)))


def ping_cost(client: Any, count: int = 2000) -> float:
    """Redis main-thread µs one PING round trip costs on this machine: the floor under every call (reading
    the request, writing the reply), which a virtual machine's system calls raise."""
    first = RedisSample(client)
    for _ in range(count):
        client.ping()
    return (RedisSample(client).main - first.main) / count * 1e6


def script_table(step: Step) -> list[str]:
    """The probe's per-script (and per direct command) times of one step, busiest first."""
    lines = ["| script or command | calls in the probe | P50 µs | P99 µs | commands inside |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, (calls, p50, p99, inside) in sorted(step.redis_us.items(), key=lambda pair: -pair[1][0]):
        lines.append(f"| {name} | {calls:,} | {p50:.0f} | {p99:.0f} | {inside:.1f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 and 32 workers, 2 s windows: under a minute")
    parser.add_argument("--mixes", default=",".join(MIXES))
    parser.add_argument("--workers", default="8,32,64,128,256,512", help="steps, comma-separated")
    parser.add_argument("--streams", type=int, default=4, help="stream slots per worker (the default setting)")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured window of each step")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--processes", type=int, default=2, help="client processes the workers are spread over")
    parser.add_argument("--models", type=int, default=4)
    parser.add_argument("--fixed-ms", type=float, default=5.0, help="the profile: a run's fixed time")
    parser.add_argument("--row-ms", type=float, default=0.1, help="the profile: time per row")
    parser.add_argument("--chunk-seconds", type=float, default=1.0, help="a chunk's work (jobs.chunk_seconds)")
    parser.add_argument("--request-rate", type=float, default=20.0, help="online requests/s offered per worker")
    parser.add_argument("--look-interval", type=float, default=0.05,
                        help="how often a running chunk looks at the queues (scheduler.yield_check_interval)")
    parser.add_argument("--probe", type=float, default=0.5, help="seconds of SLOWLOG after each window (0: none)")
    parser.add_argument("--no-aof", action="store_true", help="Redis without its append-only file")
    parser.add_argument("--json", type=Path, help="also write every step's figures here")
    parser.add_argument("--all-steps", action="store_true",
                        help=f"go on past a step whose pace fell below {KEPT_PACE} (the client's limit): on a small "
                             "machine its threads then take every core, and measure only themselves")
    args = parser.parse_args()
    steps_workers = [8, 32] if args.quick else [int(value) for value in args.workers.split(",")]
    seconds, warmup = (2.0, 1.0) if args.quick else (args.seconds, args.warmup)
    results: dict[str, list[Step]] = {}
    with tempfile.TemporaryDirectory(prefix="sits-fleet-") as tmp, \
            EmbeddedRedis(Path(tmp), appendonly=not args.no_aof) as server:
        admin = redis.Redis.from_url(server.url, decode_responses=True)
        version = admin.info("server")["redis_version"]
        ping_us = ping_cost(admin)
        print(f"\nRedis {version}{' without AOF' if args.no_aof else ' with AOF (everysec)'}, {os.cpu_count()} CPUs "
              f"shared by Redis and the clients; {args.streams} slots per worker, {args.models} models "
              f"({args.fixed_ms:g} ms + {args.row_ms:g} ms a row), {args.processes} client processes, "
              f"{seconds:g} s windows, chunks look every {args.look_interval * 1000:g} ms; a PING costs Redis "
              f"{ping_us:.1f} µs of CPU here", flush=True)
        for mix in args.mixes.split(","):
            steps = results.setdefault(mix, [])
            for workers in steps_workers:
                admin.flushall()
                config = StepConfig(mix=mix, workers=workers, streams=args.streams, seconds=seconds, warmup=warmup,
                                    probe=min(args.probe, 0.3) if args.quick else args.probe,
                                    processes=args.processes, models=args.models, look_interval=args.look_interval,
                                    fixed_ms=args.fixed_ms, row_ms=args.row_ms, chunk_seconds=args.chunk_seconds,
                                    request_rate=args.request_rate)
                step = run_step(config, server.url, f"fleet{workers}")
                steps.append(step)
                print(f"  {mix} {workers} workers: {step.rate('leases'):,.0f} leases/s, Redis {step.redis_cpu:.2f} "
                      f"cores, client {step.client_cpu:.2f} cores, pace {step.pace():.2f}"
                      + (f", errors {step.errors}" if step.errors else ""), file=sys.stderr, flush=True)
                if step.redis_cpu >= SATURATED_CPU or (step.pace() < KEPT_PACE and not args.all_steps):
                    why = "Redis is saturated" if step.redis_cpu >= SATURATED_CPU else "the client could not keep pace"
                    print(f"  {mix}: no more steps, {why}", file=sys.stderr, flush=True)
                    break
            print_mix(mix, steps, args.probe)
            if args.json:
                figures = {name: [asdict(step) for step in done] for name, done in results.items()}
                args.json.write_text(json.dumps(figures, indent=1, default=str))
        admin.close()


def print_mix(mix: str, steps: list[Step], probe: float) -> None:
    """One mix's table, its saturation point, and the times inside Redis of its reference step."""
    print(f"\n### {mix}\n\n{HEADER}\n{RULE}")
    for step in steps:
        print(table_row(step))
    point = saturation(steps)
    print(f"\n{point.describe(mix)}")
    print(f"\nInside Redis at {point.reference.config.workers} workers ({probe:g} s after the window):\n")
    print("\n".join(script_table(point.reference)), flush=True)


if __name__ == "__main__":
    main()

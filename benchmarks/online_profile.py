"""Where an online request's CPU goes: every SITS process sampled with py-spy under a closed-loop load.

Starts the stack (one worker; the API's processes under `--server`; the embedded Redis), drives it with
`--clients` threads posting one-row `/v1/requests` with `"wait": true` for `--seconds`, and while the
load runs records each Python process with `py-spy record --format raw` (on-CPU samples only). Each
sample is put in the category of the deepest frame that names one (the table below), library frames
without one (numpy, threading, ...) count for the frame that called them. Redis is not Python: its
CPU comes from /proc, split by command with `INFO commandstats`. The report gives, per process and
category, CPU microseconds per request, so the hot path's cost can be read where it lies. Under
granian, whose HTTP layer runs on Rust threads that py-spy does not see, an API process's categories
share out only its Python samples; its total is still all of its CPU.

    pip install py-spy
    python benchmarks/online_profile.py                    # MLP, 32 clients, 15 s, the server's defaults
    python benchmarks/online_profile.py --model convnet --tuned --seconds 10
    python benchmarks/online_profile.py --server granian --no-spy   # the API under granian, totals only
    python benchmarks/online_profile.py --tuned --server granian --no-spy --cores 1  # everything on one core
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.online_serving import INPUTS, CpuMeter, context_switches, payloads, sits_load  # noqa: E402
from broker.config.settings import Settings  # noqa: E402
from sits_api.cli.stack import Stack  # noqa: E402
from sits_worker.model.zoo import build_zoo  # noqa: E402

CATEGORIES: list[tuple[str, str]] = [
    # (category, regular expression on a frame "function (file:line)"); the deepest matching frame wins
    ("model run (onnxruntime)", r"onnxruntime/"),
    ("redis client", r"[(/]redis/|broker[(/](?:\w+/)?store\.py"),
    ("http: gunicorn, granian", r"[(/]gunicorn/|[(/]granian/"),
    ("wsgi: flask, werkzeug", r"[(/]flask/|[(/]werkzeug/|[(/]blinker/"),
    ("celery, kombu", r"[(/]celery/|[(/]kombu/|[(/]billiard/|[(/]vine/"),
    (
        "json and body parsing",
        r"sits_api[(/](?:\w+/)?jsonio\.py|sits_api[(/](?:\w+/)?content_encoding\.py|[(/]json/|sits_api[(/](?:\w+/)?schemas\.py|"
        r"[(/]pydantic/",
    ),
    ("request validation (tensors)", r"sits_worker[(/]model[(/]tensors\.py|sits_worker[(/]model[(/]padding\.py"),
    ("auth", r"check_key|sits_api[(/]tenancy/auth\.py|broker[(/](?:\w+/)?apikeys\.py"),
    (
        "submit: score, encode, queue",
        r"sits_api[(/]intake/requests\.py|broker[(/](?:\w+/)?requests\.py \(submit|pack_array|"
        r"broker[(/](?:\w+/)?scoring\.py|broker[(/](?:\w+/)?policy\.py|broker[(/](?:\w+/)?wakeup\.py|sits_api[(/](?:\w+/)?task_sender",
    ),
    (
        "wait and answer",
        r"wait_for_request|record_from_fields|unpack_array|to_json_result|sits_api[(/]v1/|"
        r"sits_api[(/](?:\w+/)?result_inbox\.py",
    ),
    (
        "worker: lease, choose",
        r"sits_worker[(/](?:\w+/)?leasing\.py|sits_worker[(/](?:\w+/)?drain_loop\.py|broker[(/](?:\w+/)?(?:queues|leases|tickets)\.py|"
        r"broker[(/](?:\w+/)?reservation\.py|broker[(/](?:\w+/)?ledger\.py|broker[(/](?:\w+/)?batching\.py",
    ),
    (
        "worker: batch inputs and outputs",
        r"sits_worker[(/](?:\w+/)?request_runs\.py|load_inputs|complete_requests|"
        r"broker[(/](?:\w+/)?model_stats\.py",
    ),
    (
        "worker: context, profiles",
        r"sits_worker[(/](?:\w+/)?context\.py|sits_worker[(/](?:\w+/)?observed_profiles\.py|"
        r"sits_worker[(/](?:\w+/)?runtime\.py",
    ),
    ("threads, logging, other python", r"."),
]
_PATTERNS = [(name, re.compile(pattern)) for name, pattern in CATEGORIES]
_PASS_THROUGH = re.compile(
    r"[(/]numpy/|[(/]threading\.py|[(/]queue\.py|[(/]selectors\.py|[(/]socket\.py|[(/]base64\.py|[(/]typing\.py|"
    r"[(/]functools\.py|[(/]contextlib\.py|[(/]abc\.py|<frozen |[(/]re/|[(/]enum\.py|[(/]copy\.py"
)


BLOCKED_LEAVES = re.compile(
    r"^(Condition\.wait|Event\.wait|EpollSelector\.select|PollSelector\.select|_epoll\.poll|sleep) |"
    r"^_HiredisParser\.read_from_socket |^SocketUnreader\.chunk "
)
"""Leaf frames where a thread waits (a lock, a poll, a sleep, a socket read for a reply or a request).
On this kind of VM py-spy takes some blocked threads for running ones, so their samples are dropped:
the waits cost no CPU of their own, and the process's CPU comes from /proc anyway. What the kernel
does in a send is left with its caller."""


def categorize(stack: list[str]) -> str:
    """The category of one sampled stack (root first), from its deepest frame that names one."""
    for frame in reversed(stack):
        if _PASS_THROUGH.search(frame):
            continue
        for name, pattern in _PATTERNS[:-1]:
            if pattern.search(frame):
                return name
    return CATEGORIES[-1][0]


def read_raw(path: Path) -> collections.Counter[str]:
    """Samples per category of one py-spy raw file ("frame;frame;... count" lines)."""
    counts: collections.Counter[str] = collections.Counter()
    if not path.exists():
        return counts
    for line in path.read_text().splitlines():
        stack_text, _, count = line.rpartition(" ")
        if stack_text and count.isdigit():
            stack = [
                frame
                for frame in stack_text.split(";")
                if not frame.startswith("process ") and not frame.startswith("thread ")
            ]
            if stack and BLOCKED_LEAVES.search(stack[-1]):
                continue
            counts[categorize(stack)] += int(count)
    return counts


def children_of(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds so far of each thread of process `pid`, by thread id (from /proc)."""
    seconds: dict[int, float] = {}
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # (a thread that ended meanwhile)
        seconds[int(stat.parent.name)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return seconds


def redis_commandstats(stack: Stack) -> dict[str, tuple[int, float]]:
    """Calls and total microseconds per Redis command so far (`INFO commandstats`)."""
    stats = stack.store.client.info("commandstats")
    return {name.removeprefix("cmdstat_"): (int(value["calls"]), float(value["usec"])) for name, value in stats.items()}


def pin_to_cores(count: int) -> None:
    """Run this process, and every process and thread it starts from now on, on the first `count` of the
    cores it may use: the stack's processes inherit the affinity, and the worker fits its streams and
    threads to it (`sits_worker.device.worker_settings`), as it would on a machine of that many cores."""
    allowed = sorted(os.sched_getaffinity(0))
    if not 1 <= count <= len(allowed):
        sys.exit(f"--cores {count}: this process may use 1 to {len(allowed)} cores")
    os.sched_setaffinity(0, allowed[:count])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(INPUTS), default="mlp")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second per process")
    parser.add_argument(
        "--tuned",
        action="store_true",
        help="1 stream, batches of at most 32 rows with 5 ms of wait (else the defaults)",
    )
    parser.add_argument("--server", choices=("gunicorn", "granian"), default="gunicorn", help="the API's HTTP server")
    parser.add_argument("--keep", type=Path, default=None, help="copy py-spy's raw files into this folder")
    parser.add_argument("--no-spy", action="store_true", help="run the load without sampling (its own figures)")
    parser.add_argument("--intra-op", type=int, default=0,
                        help="ONNX Runtime threads of the worker's sessions (0: its default, the cores a stream has)")
    parser.add_argument("--cores", type=int, default=0,
                        help="run everything, the stack and its clients, on the first N cores this process may "
                             "use (0: all of them)")
    args = parser.parse_args()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not args.no_spy and not Path(py_spy).exists():
        sys.exit("py-spy is not installed: pip install py-spy (or measure the totals only: --no-spy)")
    if args.cores:
        pin_to_cores(args.cores)

    with tempfile.TemporaryDirectory(prefix="sits-profile-") as tmp:
        home = Path(tmp)
        zoo = build_zoo(home / "zoo")
        overrides: dict[str, Any] = (
            {
                "resources": {"max_concurrent_streams": 1},
                "online": {"batching": {"max_batch_size": 32, "max_queue_delay": 0.005}},
            }
            if args.tuned
            else {}
        )
        if args.intra_op:
            overrides["resources"] = {**overrides.get("resources", {}), "intra_op_threads": args.intra_op}
        settings = Settings().with_overrides(
            paths={"home": home, "model_roots": (home,), "input_roots": (home,), "output_roots": (home,)},
            api={"server": args.server},
            **overrides,
        )
        with Stack(settings, worker_count=1, api_port=0) as stack:
            client = stack.client()
            client.post("/v1/models", {"name": args.model, "path": str(zoo[args.model])})
            requests = payloads(args.model, 256, seed=1)
            for request in requests[:32]:  # warm-up: sessions built, connections open
                client.post("/v1/requests", {"model": args.model, "inputs": request, "wait": True})
            api_master = next(child.process.pid for child in stack.children if child.name == "api")
            worker = next(child.process.pid for child in stack.children if child.name.startswith("worker"))
            pythons = {f"api {pid}": pid for pid in children_of(api_master)} | {"worker": worker}
            redis_pid = stack.redis.process.pid if stack.redis and stack.redis.process else None
            meter = CpuMeter({**pythons, **({"redis": redis_pid} if redis_pid else {})})
            spies = (
                {}
                if args.no_spy
                else {
                    name: subprocess.Popen(
                        [
                            py_spy,
                            "record",
                            "--pid",
                            str(pid),
                            "--rate",
                            str(args.rate),
                            "--duration",
                            str(int(args.seconds)),
                            "--format",
                            "raw",
                            "--nonblocking",
                            "--output",
                            str(home / f"{pid}.txt"),
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                    for name, pid in pythons.items()
                }
            )
            time.sleep(0.5)  # py-spy attached
            before = redis_commandstats(stack)
            threads_before = thread_cpu(worker)
            watched = {**pythons, "redis": redis_pid or 0}
            switches_before = {name: context_switches(pid) for name, pid in watched.items()}

            result = sits_load(stack, args.model, requests, args.clients, args.seconds, meter)
            after = redis_commandstats(stack)
            threads_after = thread_cpu(worker)
            switches = {name: context_switches(pid) - switches_before[name] for name, pid in watched.items()}
            for spy in spies.values():
                spy.wait(timeout=args.seconds + 60)
            if args.keep:
                args.keep.mkdir(parents=True, exist_ok=True)
                for name, pid in pythons.items():
                    if (home / f"{pid}.txt").exists():
                        shutil.copy(home / f"{pid}.txt", args.keep / f"{name.replace(' ', '-')}.txt")
            done = max(1, result["done"])
            print(
                f"{args.model}, {args.clients} clients, {'tuned' if args.tuned else 'defaults'}, {args.server}, "
                f"{len(os.sched_getaffinity(0))} cores: "
                f"{result['rps']:,.0f} req/s, P50 {result['p50']:.1f} ms, P99 {result['p99']:.1f} ms, "
                f"{result['errors']} errors, mean batch {result['mean_batch']:.1f}"
            )
            cpu = result["cpu"]
            print(f"\nCPU per request: {sum(cpu.values()) / done * 1e6:,.0f} us in all")
            print("| process | category | us per request | share of the process |")
            print("| --- | --- | ---: | ---: |")
            for name, pid in pythons.items():
                counts = read_raw(home / f"{pid}.txt")
                samples = sum(counts.values()) or 1
                process_us = cpu.get(name, 0.0) / done * 1e6
                print(f"| {name} | (all) | {process_us:,.0f} | 100 % |")
                for category, count in counts.most_common():
                    print(f"| | {category} | {process_us * count / samples:,.0f} | {100 * count / samples:.0f} % |")
            busiest = sorted(((seconds - threads_before.get(tid, 0.0), tid) for tid, seconds in threads_after.items()),
                             reverse=True)[:4]
            print("\nWorker threads, the busiest (us per request; the main thread's id is the process's): "
                  + ", ".join(f"{tid}{' (main)' if tid == worker else ''} {seconds / done * 1e6:,.0f}"
                              for seconds, tid in busiest))
            print("Context switches per request (all threads of each process): "
                  + ", ".join(f"{name} {count / done:.1f}" for name, count in switches.items() if count))
            if redis_pid:
                redis_us = cpu.get("redis", 0.0) / done * 1e6
                print(f"| redis | (all) | {redis_us:,.0f} | 100 % |")
                spent = {
                    name: (calls - before.get(name, (0, 0.0))[0], usec - before.get(name, (0, 0.0))[1])
                    for name, (calls, usec) in after.items()
                }
                total_usec = sum(usec for _, usec in spent.values()) or 1.0
                for name, (calls, usec) in sorted(spent.items(), key=lambda item: -item[1][1])[:8]:
                    print(
                        f"| | {name} ({calls / done:.2f} calls per request) | {usec / done:,.0f} "
                        f"| {100 * usec / total_usec:.0f} % of command time |"
                    )


if __name__ == "__main__":
    main()

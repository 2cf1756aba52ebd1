"""`sitsctl`: start the stack, build the zoo, register models, submit and steer jobs, run workers.

Each command is thin: parse options, call the REST API (or the stack
launcher), print the result. `--json` prints what the API answered. The
`job` commands are in `job_commands.py`, the `schedule` ones in `schedule_commands.py`, the `sla`
ones in `sla_commands.py`, `usage` in `usage_commands.py`, the printing helpers in `output.py`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.table import Table

from broker.config.loading import load_settings
from broker.config.settings import Settings
from broker.errors import ConnectionLost, SitsError
from broker.memory.settings import MAX_CONCURRENT_STREAMS
from sits_api.cli.client import ApiClient, ApiError, recorded, segment, stack_runs
from sits_api.cli.job_commands import job
from sits_api.cli.output import console, print_error, print_json, print_table
from sits_api.cli.params import non_empty
from sits_api.cli.repository_commands import repository
from sits_api.cli.schedule_commands import schedule
from sits_api.cli.sla_commands import sla
from sits_api.cli.tune_commands import tune
from sits_api.cli.usage_commands import usage

if TYPE_CHECKING:
    from broker.state.store import Store
    from sits_api.cli.stack import Stack

MAX_WORKERS = 64
"""The most workers `sitsctl up` starts (one machine's worth; more would only compete for its cores)."""
STREAMS = click.IntRange(1, MAX_CONCURRENT_STREAMS)


class _SitsGroup(click.Group):
    """Prints SITS errors and failed file operations as one clear line and exits 1, instead of a traceback.

    Only errors about the outside world are caught: `SitsError` (the API client's `ApiError`, Redis
    unreachable, bad config) and `OSError` (a path that cannot be read or written). Anything else is a
    bug in sitsctl and keeps its traceback.
    """

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except SitsError as err:
            print_error(err.message)
        except OSError as err:
            if err.errno == errno.EPIPE:
                raise  # `sitsctl job list | head`: click's own handler exits quietly
            print_error(f"{err.filename}: {err.strerror}" if err.filename is not None else str(err))
        sys.exit(1)


@click.group(cls=_SitsGroup)
def cli() -> None:
    """SITS: a Scalable Inference Task Scheduler."""


def _client() -> ApiClient:
    return ApiClient.from_environment()


def _stack_settings(config_path: Path | None) -> tuple[Settings, Path | None]:
    """The settings of a command that talks to Redis itself (`worker`, `key create`): the config given
    (or SITS_CONFIG) with SITS_* variables; with neither a config nor a Redis URL, those of the stack
    `sitsctl up` runs in this SITS_HOME (its effective config, and its path), so that a worker joins it
    with the same Redis, key prefix and limits."""
    settings = load_settings(config_path)
    if config_path or os.environ.get("SITS_CONFIG") or settings.redis.url:
        return settings, None
    effective = settings.paths.home / "run" / "sits-config.yaml"  # left when the stack stops: used only while it runs
    if effective.is_file() and stack_runs(settings.paths.home):
        return load_settings(effective), effective
    return settings, None


def _stack_redis(settings: Settings, *, recorded_by_up: bool = False) -> tuple[str, Store]:
    """The Redis URL to use and a `Store` on it, checked to answer: SITS_REDIS_URL (or redis.url), else
    the Redis the `sitsctl up` of this SITS_HOME runs (it records it in `$SITS_HOME/redis-url`)."""
    from broker.state.embedded import masked_url
    from broker.state.store import Store

    if settings.redis.url and not recorded_by_up:  # named: a worker's Celery waits for it to come up (compose)
        return settings.redis.url, Store.of(settings.redis)
    source = settings.paths.home / ("run/sits-config.yaml" if recorded_by_up else "redis-url")
    url = settings.redis.url or recorded(settings.paths.home, "redis-url") or ""
    if not url:
        left = (" (its redis-url is left from a stack that no longer runs)"
                if (settings.paths.home / "redis-url").exists() else "")
        raise SitsError(f"no Redis to use: start a stack with `sitsctl up` (it records its Redis in {source}"
                        f"{left}), or set SITS_REDIS_URL (or redis.url in the config) to the Redis the API uses")
    store = Store.of(settings.redis.model_copy(update={"url": url}))  # ConfigError for a bad URL
    try:  # a recorded URL may be left from a stack that has stopped
        store.ping()
    except ConnectionLost as err:
        raise ConnectionLost(f"{err.message} (the Redis at {masked_url(url)}, recorded in {source}); "
                             "is `sitsctl up` running?") from err
    return url, store


# --- stack --------------------------------------------------------------------------


@cli.command()
@click.option("--workers", "worker_count", type=click.IntRange(0, MAX_WORKERS), default=2, show_default=True,
              help="worker processes to start (0: Redis and the API only)")
@click.option("--streams", type=STREAMS, default=None,
              help="concurrent batches per worker (default from config)")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None)
@click.option("--port", type=click.IntRange(0, 65535), default=None,
              help="API port (default api.port; 0 picks a free one)")
@click.option("--listen", metavar="ADDR", default=None,
              help="the address the embedded Redis listens on, one the fleet's other hosts reach, so that "
              "`sitsctl worker --redis URL` joins from there (default redis.bind: 127.0.0.1)")
@click.option("--no-beat", is_flag=True, help="start no beat (and no releaser): schedules are not released")
@click.option("--model-repository", "model_repositories", multiple=True,
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="a Triton model repository to serve as it is, besides repository.paths (docs/models.md); repeatable")
def up(worker_count: int, streams: int | None, config_path: Path | None, port: int | None,
       listen: str | None, no_beat: bool, model_repositories: tuple[Path, ...]) -> None:
    """Start embedded Redis, the API, workers and the beat in the foreground; Ctrl-C stops them all.

    The beat releases the schedules (docs/schedules.md) through a releaser process started with it.

    A worker or the API that exits on its own is started again (at most 5 times a minute each);
    the embedded Redis exiting stops everything. SIGTERM, SIGHUP (the terminal closed) and the death
    of this process stop everything too. With --listen, `$SITS_HOME/redis-url` names that address:
    the URL (password included) a worker on another host joins with.
    """
    from broker.state.embedded import masked_url
    from sits_api.cli.stack import Stack

    settings = load_settings(config_path)
    if listen is not None:
        if settings.redis.url:
            raise click.UsageError("--listen is the embedded Redis's address, and redis.url (or SITS_REDIS_URL) "
                                   "names another Redis: set its address there, or drop one of them")
        settings = settings.with_overrides(redis={"bind": listen})
    if model_repositories:
        settings = settings.with_overrides(repository={"paths": [*settings.repository.paths, *model_repositories]})
    stack = Stack(settings, worker_count=worker_count, streams=streams, api_port=port, beat=not no_beat)
    # `kill %1` of a backgrounded `up`, or its terminal closing, stops it as Ctrl-C does (unless started
    # under nohup, which ignores SIGHUP so that the stack outlives the terminal).
    stopping = [signal.SIGTERM] + ([signal.SIGHUP] if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN else [])
    previous = {sig: signal.signal(sig, _raise_keyboard_interrupt) for sig in stopping}
    previous[signal.SIGINT] = signal.getsignal(signal.SIGINT)
    try:
        with console.status("starting Redis, the API and workers ..."):
            stack.start()
        grpc = stack.settings.api.grpc_address()
        console.print(f"SITS is up: API {stack.api_url}{f'  gRPC {grpc}' if grpc else ''}  "
                      f"Redis {masked_url(stack.settings.redis.url)}  "
                      f"{worker_count} workers  (key in {stack.home / 'api-key'}, logs in {stack.home / 'logs'})",
                      markup=False)
        console.print("Ctrl-C stops everything.")
        _supervise(stack)
    finally:
        for sig in previous:  # a second Ctrl-C (or SIGTERM) must not cut the ordered stop short: Redis last
            signal.signal(sig, signal.SIG_IGN)
        try:
            stack.stop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _supervise(stack: Stack) -> None:
    """Restart the stack's children as they exit, until Ctrl-C (or SIGTERM, SIGHUP); exit 1 when the stack
    cannot go on (its Redis exited, a child kept dying)."""
    try:
        while True:
            for note in stack.supervise(time.monotonic()):
                console.print(note, markup=False, soft_wrap=True)
            time.sleep(1.0)
    except KeyboardInterrupt:
        with contextlib.suppress(OSError):  # (a terminal that hung up cannot be written to)
            console.print("stopping ...")
    except SitsError as err:
        with contextlib.suppress(OSError):
            print_error(err.message)
            console.print("stopping everything ...")
        sys.exit(1)


def _raise_keyboard_interrupt(*_: object) -> None:
    raise KeyboardInterrupt


@cli.command()
@click.option("--rows", default=12_288, show_default=True, help="rows in the demo job (at least 10,000)")
@click.option("--workers", "worker_count", type=click.IntRange(1, MAX_WORKERS), default=2, show_default=True,
              help="worker processes (at least one: the demo's models are profiled and run by workers)")
def demo(rows: int, worker_count: int) -> None:
    """The main job: start the stack, build and register the zoo, run an offline job, print a summary."""
    from sits_api.cli.demo import run_demo

    sys.exit(run_demo(console, rows=rows, worker_count=worker_count))


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="print the API's JSON")
def status(as_json: bool) -> None:
    """API and Redis URLs, workers, queue depths, jobs by status, the circuit breakers not closed and, to
    an admin key, the online requests served per model version (GET /v2/models/stats; not in --json, which
    is GET /v1/status)."""
    client = _client()
    data = client.get("/v1/status")
    if not isinstance(data, dict) or not {"api_url", "workers", "queues", "jobs", "policy"} <= data.keys():
        raise SitsError(f"the server at {client.url} did not answer as a SITS API; check SITS_API_URL")
    if as_json:
        print_json(data)
        return
    console.print(f"API   {data['api_url']}", markup=False)
    if data.get("grpc_address"):
        console.print(f"gRPC  {data['grpc_address']}", markup=False)
    if "redis_url" in data:  # the API shows it to admin keys only, its password masked (as is done here again)
        from broker.state.embedded import masked_url

        console.print(f"Redis {masked_url(data['redis_url'])}", markup=False)
    console.print(f"policy {data['policy']}", markup=False)
    table = Table("worker", "device", "streams", "pid", "last heartbeat", "alive", "degrade")
    for worker in data["workers"]:
        table.add_row(worker["name"], worker["device"], str(worker["streams"]), str(worker["pid"]),
                      f"{worker['heartbeat_age_seconds']}s ago", "yes" if worker["alive"] else "no",
                      _degrade_text(worker.get("degrade")))
    print_table(table)
    queues = Table("queue (model@version)", "ready", "in flight")
    for ref, depth in data["queues"].items():
        queues.add_row(ref, str(depth["ready"]), str(depth["inflight"]))
    print_table(queues)
    console.print("jobs: " + (", ".join(f"{k} {v}" for k, v in sorted(data["jobs"].items())) or "none"))
    _print_breakers(data.get("breakers") or [])  # (an API of a release before breakers has none)
    served = _request_statistics(client)
    if served is not None and served.row_count:
        print_table(served)
    elif served is not None:
        console.print("online requests: none served yet")


def _degrade_text(degrade: Any) -> str:
    """A worker's degrade step as the status table shows it: its name, and the jitter when degraded."""
    if not isinstance(degrade, dict):
        return "-"  # (a worker of a release before degrade steps)
    if not degrade.get("step"):
        return "normal"
    return f"{degrade['name']} (jitter {100 * degrade.get('jitter', 0):.0f}%)"


def _print_breakers(breakers: list[dict[str, Any]]) -> None:
    """The circuit breakers that are not closed, one row each; a line when all are."""
    tripped = [entry for entry in breakers if entry["state"] != "closed"]
    if not tripped:
        console.print(f"circuit breakers: {len(breakers)} closed" if breakers else "circuit breakers: none yet")
        return
    table = Table("breaker (model@version)", "worker", "state", "until", "runs", "failed", "last error")
    for entry in tripped:
        until = f"{max(0.0, entry['retry_at'] - time.time()):.0f}s" if entry.get("retry_at") else "-"
        table.add_row(entry["model"], entry["worker"], entry["state"].replace("_", "-"), until, str(entry["runs"]),
                      str(entry["failures"]), entry.get("last_error") or "-")
    print_table(table)


def _request_statistics(client: ApiClient) -> Table | None:
    """Online requests served per model version, from the v2 statistics (`broker.monitoring.model_stats`); None for a
    key that may not read them (they count every tenant's requests: admin and metrics keys only), and for
    an API that has none (a release before them), whose other figures `status` still shows."""
    try:
        answer = client.get("/v2/models/stats")
    except ApiError:
        return None
    entries = answer.get("model_stats") if isinstance(answer, dict) else None
    if not isinstance(entries, list):  # (an older API's metadata of a model named 'stats')
        return None
    table = Table("requests (model@version)", "succeeded", "failed", "mean ms", "mean queue ms", "runs",
                  "rows per run")
    for entry in entries:
        stats = entry["inference_stats"]
        ok, failed, queue = stats["success"], stats["fail"], stats["queue"]
        if not ok["count"] and not failed["count"]:
            continue  # a version no request reached
        answered = ok["count"] + failed["count"]
        runs = entry["execution_count"]
        rows_run = sum(batch["batch_size"] * batch["compute_infer"]["count"] for batch in entry["batch_stats"])
        table.add_row(f"{entry['name']}@{entry['version']}", f"{ok['count']:,}", f"{failed['count']:,}",
                      f"{(ok['ns'] + failed['ns']) / answered / 1e6:.1f}",
                      f"{queue['ns'] / queue['count'] / 1e6:.1f}" if queue["count"] else "-",
                      f"{runs:,}", f"{rows_run / runs:.1f}" if runs else "-")
    return table


@cli.command()
@click.option("--gpu", type=click.IntRange(min=0), default=None,
              help="pin to GPU N: CUDA's device N (the CUDA provider's device_id), the N-th GPU "
              "CUDA_VISIBLE_DEVICES lists when set; refused where ONNX Runtime cannot use that GPU")
@click.option("--cpu", "use_cpu", is_flag=True, help="run on the CPU provider")
@click.option("--streams", type=STREAMS, default=None,
              help="batches in flight at once (default from config)")
@click.option("--name", default=None, help="Celery worker name (default sits-<device>-<pid>@host)")
@click.option("--loglevel", default="INFO", show_default=True)
@click.option("--redis", "redis_url", metavar="URL", default=None,
              help="the fleet's Redis, password included: on another host, the URL in the stack's "
              "$SITS_HOME/redis-url (default SITS_REDIS_URL, redis.url, else the stack of this SITS_HOME)")
def worker(gpu: int | None, use_cpu: bool, streams: int | None, name: str | None, loglevel: str,
           redis_url: str | None) -> None:
    """Run a Celery worker pinned to one device (replaces this process).

    Its Redis: --redis, else SITS_REDIS_URL (or redis.url), else the one `sitsctl up` runs in this
    SITS_HOME, whose settings (key prefix, limits) it then takes too, unless SITS_CONFIG names others.
    Without --gpu or --cpu it takes the first GPU ONNX Runtime can use, else the CPU. A worker on
    another host must see the inputs, outputs and model store at the same paths as the API.
    """
    from sits_api.cli.stack import worker_command

    if gpu is not None and use_cpu:
        raise click.UsageError("choose one of --gpu N and --cpu")
    device = "cpu" if use_cpu else (f"gpu:{gpu}" if gpu is not None else "auto")
    if gpu is not None:  # refused here, before Celery prints its banner (the worker checks again at start)
        from sits_api.cli.devices import gpu_problem

        if problem := gpu_problem(f"gpu:{gpu}"):
            raise SitsError(f"cannot pin this worker to gpu:{gpu}: {problem}; start it with --cpu "
                            "or on a machine with that GPU")
    settings, stack_config = _stack_settings(None)
    if redis_url is not None:  # named: this worker joins that Redis, whatever stack runs in this SITS_HOME
        if not redis_url.strip():
            raise click.UsageError("--redis must name a Redis URL (the stack's $SITS_HOME/redis-url)")
        settings, stack_config = load_settings(None).with_overrides(redis={"url": redis_url}), None
    redis_url, _ = _stack_redis(settings, recorded_by_up=stack_config is not None)
    streams = streams or settings.resources.max_concurrent_streams
    argv, extra = worker_command(device, streams, name or f"sits-{device.replace(':', '')}-{os.getpid()}@%h",
                                 settings.redis.task_queue, loglevel)
    joined = {"SITS_CONFIG": str(stack_config)} if stack_config else {}  # the stack's prefix and limits too
    os.execvpe(argv[0], argv, os.environ | extra | joined | {"SITS_REDIS_URL": redis_url})


@cli.group()
def key() -> None:
    """API keys (talks to Redis directly: SITS_REDIS_URL or redis.url, else the one `sitsctl up` runs)."""


@key.command("create")
@click.option("--name", required=True, callback=non_empty,
              help="who the key is for (a user key sees only what keys of this name submit)")
@click.option("--role", type=click.Choice(["admin", "tenant-admin", "user", "viewer", "metrics"]), default="user",
              show_default=True,
              help="user: submits and sees its own work; tenant-admin: its tenant's work; viewer: reads its "
                   "tenant's work; admin: everything; metrics: only GET /metrics and the v2 statistics")
@click.option("--tenant", default="", help="the tenant it belongs to and is billed to (docs/tenants.md); "
                                            "default: the key's name")
@click.option("--group", default="", help="the user group its requests count in for A/B routes (docs/routing.md)")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None)
def key_create(name: str, role: str, tenant: str, group: str, config_path: Path | None) -> None:
    """Create an API key and print it once (only its digest is stored)."""
    import redis

    from broker.state.embedded import masked_url
    from broker.tenants.apikeys import create_api_key

    settings, stack_config = _stack_settings(config_path)
    redis_url, store = _stack_redis(settings, recorded_by_up=stack_config is not None)
    try:
        click.echo(create_api_key(store, name, role, group, tenant))
    except ValueError as err:  # a name the key cannot have: say so as a usage error, not a traceback
        raise click.UsageError(str(err)) from err
    except redis.RedisError as err:  # connection failures arrive as ConnectionLost; this is what else Redis says
        raise SitsError(f"Redis at {masked_url(redis_url)} refused to store the key: {err}") from err


# --- zoo and models -----------------------------------------------------------------


@cli.group()
def zoo() -> None:
    """The built-in ONNX models."""


@zoo.command("build")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--with-resnet50", is_flag=True, help="also the ResNet-50-shaped graph (about 100 MB, for GPUs)")
def zoo_build(directory: Path, with_resnet50: bool) -> None:
    """Write the zoo models (fixed seeds, byte-identical every time) into DIRECTORY."""
    from sits_worker.model.zoo import build_zoo

    for name, path in build_zoo(directory, include_large=with_resnet50).items():
        console.print(f"{name:12s} {path}  ({path.stat().st_size:,} bytes)")


@cli.group()
def model() -> None:
    """Register and inspect models."""


def _registered(client: ApiClient, registration_id: str, timeout: float = 3600.0) -> dict[str, Any]:
    """The model record of a registration that answered 202, once it ended; its error if it failed."""
    with console.status(f"the API is checking the model (registration {registration_id}) ..."):
        deadline = time.monotonic() + timeout
        while True:
            registration = client.get(f"/v1/models/registrations/{registration_id}")
            if registration["status"] == "registered":
                return dict(registration["model"])
            if registration["status"] == "failed":
                raise ApiError(f"{registration['http_status']}: {registration['error']}",
                               int(registration["http_status"] or 500))
            if time.monotonic() > deadline:
                raise ApiError(f"registration {registration_id} is still running after {timeout:.0f} s", 504)
            time.sleep(0.5)


@model.command("register")
@click.option("--name", required=True)
@click.option("--path", "model_path", required=True, type=click.Path(path_type=Path))
@click.option("--profile-mode", type=click.Choice(["static", "full"]), default="static", show_default=True)
@click.option("--enable-fusion", is_flag=True, help="save ONNX Runtime's fully optimised graph and its op counts")
@click.option("--no-wait", is_flag=True, help="return before a worker finished profiling")
@click.option("--json", "as_json", is_flag=True)
def model_register(name: str, model_path: Path, profile_mode: str, enable_fusion: bool, no_wait: bool,
                   as_json: bool) -> None:
    """Register an ONNX file; its version is its content hash.

    A new name becomes your key's tenant's: only its keys and admin keys add versions to it.
    """
    client = _client()
    record = client.post("/v1/models", {"name": name, "path": str(model_path.resolve()),
                                        "profile_mode": profile_mode, "enable_fusion": enable_fusion})
    if "registration" in record:  # a long registration (a large model): it goes on off the request threads
        record = _registered(client, record["registration"])
    ref = record["ref"]
    if record["profile_status"] == "pending" and not no_wait:
        with console.status(f"a worker is profiling {ref} ..."):
            deadline = time.monotonic() + 600
            while record["profile_status"] == "pending" and time.monotonic() < deadline:
                time.sleep(0.5)
                record = client.get(f"/v1/models/{ref}")
    if as_json:
        print_json(record)
        return
    profile = record["static_profile"]
    console.print(f"registered [bold]{ref}[/bold]: {profile['param_count']:,} parameters, "
                  f"{profile['flops_per_sample']:,} FLOPs/sample, profile {record['profile_status']}")
    for point in (record.get("profile") or {}).get("pareto", []):
        console.print(f"  batch {point['batch_size']:4d}: {point['latency_ms']:8.2f} ms  "
                      f"{point['rows_per_second']:10,.0f} rows/s")
    if record.get("fusion"):
        fusion = record["fusion"]
        console.print(f"  fused graph: {fusion['original_node_count']} -> {fusion['node_count']} nodes "
                      f"({fusion['path']})")
    if record.get("profile_error"):
        console.print(f"[red]profiling failed:[/red] {record['profile_error']}")


@model.command("list")
def model_list() -> None:
    """Every registered model version."""
    table = Table("name", "version", "latest", "owner", "profile", "inputs")
    for record in _client().get("/v1/models")["models"]:
        inputs = ", ".join(f"{i['name']} {i['dtype']}{i['shape']}" for i in record["signature"]["inputs"])
        table.add_row(record["name"], record["version"], "yes" if record["latest"] else "",
                      record.get("owner") or "-", record["profile_status"], inputs)
    print_table(table)


@model.command("show")
@click.argument("ref")
def model_show(ref: str) -> None:
    """One model (`name` or `name@version`) as JSON."""
    print_json(_client().get(f"/v1/models/{segment(ref)}"))


model.add_command(tune)
cli.add_command(job)
cli.add_command(schedule)
cli.add_command(sla)
cli.add_command(usage)
cli.add_command(repository)

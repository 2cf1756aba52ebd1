"""`sitsctl`: start the stack, build the zoo, register models, submit and steer jobs, run workers.

Each command is thin: parse options, call the REST API (or the stack
launcher), print the result. `--json` prints what the API answered.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from broker.config import load_settings
from broker.errors import SitsError
from sits_api.cli.client import ApiClient
from sits_api.cli.params import SHAPE, non_empty
from sits_api.cli.progress import wait_for_job

console = Console()


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


def print_error(message: str) -> None:
    """One red `error:` line; the message is printed as text (API messages may hold `[...]`)."""
    console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True)


@click.group(cls=_SitsGroup)
def cli() -> None:
    """SITS: a Scalable Inference Task Scheduler."""


def _client() -> ApiClient:
    return ApiClient.from_environment()


def _segment(text: str) -> str:
    """`text` as one URL path segment, so a typed id with spaces or slashes gets the API's "not found"."""
    return quote(text, safe="@")


def _print_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2))


# --- stack --------------------------------------------------------------------------


@cli.command()
@click.option("--workers", "worker_count", default=2, show_default=True, help="worker processes to start")
@click.option("--streams", type=int, default=None, help="concurrent batches per worker (default from config)")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None)
@click.option("--port", type=int, default=None, help="API port (default api.port; 0 picks a free one)")
def up(worker_count: int, streams: int | None, config_path: Path | None, port: int | None) -> None:
    """Start embedded Redis, the API, beat and workers in the foreground; Ctrl-C stops them all."""
    from sits_api.cli.stack import Stack

    settings = load_settings(config_path)
    stack = Stack(settings, worker_count=worker_count, streams=streams, api_port=port)
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)  # `kill %1` of a backgrounded `up` stops it cleanly
    with console.status("starting Redis, API, beat and workers ..."):
        stack.start()
    console.print(f"SITS is up: API {stack.api_url}  Redis {stack.settings.redis.url}  "
                  f"{worker_count} workers  (key in {stack.home / 'api-key'}, logs in {stack.home / 'logs'})")
    console.print("Ctrl-C stops everything.")
    try:
        while True:
            stack.check_children()
            time.sleep(1.0)
    except KeyboardInterrupt:
        console.print("stopping ...")
    finally:
        stack.stop()


def _raise_keyboard_interrupt(*_: object) -> None:
    raise KeyboardInterrupt


@cli.command()
@click.option("--rows", default=12_288, show_default=True, help="rows in the demo job (at least 10,000)")
@click.option("--workers", "worker_count", default=2, show_default=True)
def demo(rows: int, worker_count: int) -> None:
    """The main job: start the stack, build and register the zoo, run an offline job, print a summary."""
    from sits_api.cli.demo import run_demo

    sys.exit(run_demo(console, rows=rows, worker_count=worker_count))


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="print the API's JSON")
def status(as_json: bool) -> None:
    """API and Redis URLs, workers, queue depths and jobs by status."""
    data = _client().get("/v1/status")
    if as_json:
        _print_json(data)
        return
    console.print(f"API   {data['api_url']}\nRedis {data['redis_url']}\npolicy {data['policy']}")
    table = Table("worker", "device", "streams", "pid", "last heartbeat", "alive")
    for worker in data["workers"]:
        table.add_row(worker["name"], worker["device"], str(worker["streams"]), str(worker["pid"]),
                      f"{worker['heartbeat_age_seconds']}s ago", "yes" if worker["alive"] else "no")
    console.print(table)
    queues = Table("queue (model@version)", "ready", "in flight")
    for ref, depth in data["queues"].items():
        queues.add_row(ref, str(depth["ready"]), str(depth["inflight"]))
    console.print(queues)
    console.print("jobs: " + (", ".join(f"{k} {v}" for k, v in sorted(data["jobs"].items())) or "none"))


@cli.command()
@click.option("--gpu", type=int, default=None, help="pin to GPU N (CUDA provider device_id N)")
@click.option("--cpu", "use_cpu", is_flag=True, help="run on the CPU provider")
@click.option("--streams", type=int, default=None, help="batches in flight at once (default from config)")
@click.option("--name", default=None, help="Celery worker name (default sits-<device>-<pid>@host)")
@click.option("--loglevel", default="INFO", show_default=True)
def worker(gpu: int | None, use_cpu: bool, streams: int | None, name: str | None, loglevel: str) -> None:
    """Run a Celery worker pinned to one device (replaces this process)."""
    from sits_api.cli.stack import worker_command

    if gpu is not None and use_cpu:
        raise click.UsageError("choose one of --gpu N and --cpu")
    device = "cpu" if use_cpu else (f"gpu:{gpu}" if gpu is not None else "auto")
    streams = streams or load_settings().resources.max_concurrent_streams
    argv, extra = worker_command(device, streams, name or f"sits-{device.replace(':', '')}-{os.getpid()}@%h",
                                 loglevel)
    os.execvpe(argv[0], argv, os.environ | extra)


@cli.group()
def key() -> None:
    """API keys (talks to Redis directly: needs SITS_REDIS_URL or redis.url)."""


@key.command("create")
@click.option("--name", required=True, callback=non_empty,
              help="who the key is for (its tenant: a user key sees only what keys of this name submit)")
@click.option("--role", type=click.Choice(["admin", "user"]), default="user", show_default=True)
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None)
def key_create(name: str, role: str, config_path: Path | None) -> None:
    """Create an API key and print it once (only its digest is stored)."""
    import redis

    from broker.apikeys import create_api_key
    from broker.store import Store

    settings = load_settings(config_path)
    if not settings.redis.url:
        raise click.UsageError("set SITS_REDIS_URL (or redis.url in the config) to the Redis the API uses")
    store = Store.connect(settings.redis.url, settings.redis.key_prefix)  # ConfigError for a bad URL
    try:
        click.echo(create_api_key(store, name, role))
    except ValueError as err:  # a name the key cannot have: say so as a usage error, not a traceback
        raise click.UsageError(str(err)) from err
    except redis.RedisError as err:  # connection failures arrive as ConnectionLost; this is what else Redis says
        raise SitsError(f"Redis at {settings.redis.url} refused to store the key: {err}") from err


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
    ref = record["ref"]
    if record["profile_status"] == "pending" and not no_wait:
        with console.status(f"a worker is profiling {ref} ..."):
            deadline = time.monotonic() + 600
            while record["profile_status"] == "pending" and time.monotonic() < deadline:
                time.sleep(0.5)
                record = client.get(f"/v1/models/{ref}")
    if as_json:
        _print_json(record)
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
    console.print(table)


@model.command("show")
@click.argument("ref")
def model_show(ref: str) -> None:
    """One model (`name` or `name@version`) as JSON."""
    _print_json(_client().get(f"/v1/models/{_segment(ref)}"))


# --- jobs ---------------------------------------------------------------------------


@cli.group()
def job() -> None:
    """Submit and steer offline jobs."""


@job.command("submit")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="sits-config.yaml for job defaults (chunk and batch size)")
@click.option("--model", "model_ref", required=True, help="name or name@version")
@click.option("--input-batch", required=True, type=click.Path(path_type=Path))
@click.option("--output-dir", required=True, type=click.Path(path_type=Path))
@click.option("--priority", default=0, show_default=True, type=click.IntRange(0, 15))
@click.option("--chunk-size", type=click.IntRange(min=1), default=None,
              help="rows per queue item (default: the config's jobs.chunk_size, else the server's)")
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="rows per ONNX Runtime run (default: the config's jobs.batch_size, else the server's)")
@click.option("--shape", type=SHAPE, default=None, help="per-sample shape of a raw .bin input, e.g. 3,32,32")
@click.option("--dtype", default=None, help="dtype of a raw .bin input, e.g. float32")
@click.option("--wait", is_flag=True, help="show a progress bar until the job ends, then a summary")
@click.option("--json", "as_json", is_flag=True)
def job_submit(config_path: Path | None, model_ref: str, input_batch: Path, output_dir: Path, priority: int,
               chunk_size: int | None, batch_size: int | None, shape: list[int] | None, dtype: str | None, wait: bool,
               as_json: bool) -> None:
    """Submit an offline job over an input file (.npy, .npz, .bin, .jsonl)."""
    settings = load_settings(config_path) if config_path else None
    body: dict[str, Any] = {
        "model": model_ref,
        "input_batch": str(input_batch.resolve()),
        "output_dir": str(output_dir.resolve()),
        "priority": priority,
        "chunk_size": chunk_size or (settings.jobs.chunk_size if settings else None),
        "batch_size": batch_size or (settings.jobs.batch_size if settings else None),
    }
    if shape:
        body["input_shape"] = shape
    if dtype:
        body["input_dtype"] = dtype
    client = _client()
    submitted = client.post("/v1/jobs", body)
    if not wait:
        _print_json(submitted) if as_json else console.print(f"job {submitted['id']} {submitted['status']}")
        return
    final = wait_for_job(console, client, submitted["id"])
    _print_json(final) if as_json else None
    sys.exit(0 if final["status"] == "succeeded" else 1)


@job.command("status")
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True)
def job_status(job_id: str, as_json: bool) -> None:
    """One job's status, progress, throughput and ETA."""
    data = _client().get(f"/v1/jobs/{_segment(job_id)}")
    if as_json:
        _print_json(data)
        return
    eta = f", ETA {data['eta_seconds']}s" if data.get("eta_seconds") is not None else ""
    console.print(f"{data['id']} [bold]{data['status']}[/bold] {data['model']}@{data['model_version']}: "
                  f"rows {data['rows_done']:,}/{data['rows_total']:,}, chunks {data['chunks_done']}/"
                  f"{data['chunks_total']}, {data['rows_per_second']:,.0f} rows/s{eta}")
    if data.get("error"):
        print_error(data["error"])


@job.command("list")
@click.option("--status", "status_filter", default=None)
@click.option("--owner", default=None, help="only the jobs submitted with keys of this name (needs an admin key)")
@click.option("--json", "as_json", is_flag=True)
def job_list(status_filter: str | None, owner: str | None, as_json: bool) -> None:
    """Newest jobs first (a user key sees only its own)."""
    query = {name: value for name, value in (("status", status_filter), ("owner", owner)) if value is not None}
    path = "/v1/jobs" + (f"?{urlencode(query)}" if query else "")
    data = _client().get(path)
    if as_json:
        _print_json(data)
        return
    table = Table("id", "model", "status", "owner", "rows", "chunks", "rows/s", "output")
    for item in data["jobs"]:
        table.add_row(item["id"], item["model"], item["status"], item.get("owner") or "-",
                      f"{item['rows_done']:,}/{item['rows_total']:,}",
                      f"{item['chunks_done']}/{item['chunks_total']}", f"{item['rows_per_second']:,.0f}",
                      item["output_dir"])
    console.print(table)


@job.command("cancel")
@click.argument("job_id")
def job_cancel(job_id: str) -> None:
    """Cancel a job (its waiting chunks leave the queue)."""
    data = _client().delete(f"/v1/jobs/{_segment(job_id)}")
    console.print(f"job {job_id} {data['status']}")


@job.command("resume")
@click.argument("job_id")
@click.option("--wait", is_flag=True)
def job_resume(job_id: str, wait: bool) -> None:
    """Re-queue only the chunks of a job that are not done."""
    client = _client()
    data = client.post(f"/v1/jobs/{_segment(job_id)}/resume")
    console.print(f"job {job_id} {data['status']}: {data['chunks_done']}/{data['chunks_total']} chunks already done")
    if wait:
        final = wait_for_job(console, client, job_id)
        sys.exit(0 if final["status"] == "succeeded" else 1)

"""`sitsctl job ...`: submit offline jobs, follow them, list, cancel and resume them."""

from __future__ import annotations

import sys
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import click
from rich.console import Console
from rich.table import Column, Table

from broker.config.loading import load_settings
from sits_api.cli.client import ApiClient, segment
from sits_api.cli.output import console, print_error, print_json, print_table
from sits_api.cli.params import DEADLINE, JOB_ID_ARGUMENT, SHAPE
from sits_api.cli.progress import wait_for_job


def _follow(job_id: str, client: ApiClient, *, to: Console = console, summary: bool = True) -> dict[str, Any]:
    """Show the job's progress until it ends; Ctrl-C stops only the waiting, and says so."""
    try:
        return wait_for_job(to, client, job_id, summary=summary)
    except KeyboardInterrupt:
        to.print(f"stopped waiting; job {job_id} keeps running: follow it with `sitsctl job status {job_id}` "
                 f"(or stop it with `sitsctl job cancel {job_id}`)", markup=False)
        sys.exit(130)


def _column_map(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, list[str]] | None:
    """`--columns INPUT=COL,COL` options as the API's `columns` (input -> its columns, in order)."""
    mapped: dict[str, list[str]] = {}
    for value in values:
        name, sep, listed = value.partition("=")
        columns = [column.strip() for column in listed.split(",") if column.strip()]
        if not sep or not name.strip() or not columns or name.strip() in mapped:
            raise click.BadParameter(f"'{value}' is not INPUT=COL,COL,... (each input once)", ctx, param)
        mapped[name.strip()] = columns
    return mapped or None


@click.group()
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
@click.option("--input-format", type=click.Choice(["npy", "npz", "bin", "jsonl", "parquet", "arrow", "csv"]),
              default=None, help="the input's format, when its extension does not say it")
@click.option("--columns", "columns", multiple=True, callback=_column_map, metavar="INPUT=COL,COL,...",
              help="a table's columns read into a model input, in order (repeat for each input; default: every "
                   "numeric column but the id column, into the model's one input)")
@click.option("--id-column", default=None, help="a table's column carried to the outputs (and the quarantine listing)")
@click.option("--output-format", type=click.Choice(["npy", "parquet"]), default=None,
              help="npy (default): <output>.npy per output; parquet: outputs.parquet, the id column and one "
                   "column per output")
@click.option("--deadline", type=DEADLINE, default=None,
              help="when the job must be done: a duration from now (10m, 90s, 1h) or an RFC 3339 time; a job "
                   "predicted to miss it is refused, with the earliest deadline that would be accepted")
@click.option("--wait", is_flag=True, help="show a progress bar until the job ends, then a summary")
@click.option("--json", "as_json", is_flag=True, help="print the API's JSON (with --wait: the final job; the "
              "progress bar goes to stderr)")
def job_submit(config_path: Path | None, model_ref: str, input_batch: Path, output_dir: Path, priority: int,
               chunk_size: int | None, batch_size: int | None, shape: list[int] | None, dtype: str | None,
               input_format: str | None, columns: dict[str, list[str]] | None, id_column: str | None,
               output_format: str | None, deadline: dict[str, Any] | None, wait: bool, as_json: bool) -> None:
    """Submit an offline job over an input file (.npy, .npz, .bin, .jsonl, or a table: .parquet, .arrow,
    .feather, .ipc, .csv)."""
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
    tables = {"input_format": input_format, "columns": columns, "id_column": id_column, "output_format": output_format}
    body.update({name: value for name, value in tables.items() if value})
    body.update(deadline or {})
    client = ApiClient.from_environment()
    submitted = client.post("/v1/jobs", body)
    if not wait:
        print_json(submitted) if as_json else console.print(f"job {submitted['id']} {submitted['status']}"
                                                            f"{deadline_note(submitted)}", markup=False)
        return
    if not as_json and submitted.get("deadline") is not None:
        console.print(f"job {submitted['id']} accepted{deadline_note(submitted)}", markup=False)
    if as_json:  # stdout holds only the JSON
        final = _follow(submitted["id"], client, to=Console(stderr=True), summary=False)
        print_json(final)
    else:
        final = _follow(submitted["id"], client)
    sys.exit(0 if final["status"] == "succeeded" else 1)


@job.command("status")
@click.argument("job_id", type=JOB_ID_ARGUMENT)
@click.option("--json", "as_json", is_flag=True)
def job_status(job_id: str, as_json: bool) -> None:
    """One job's status, progress, throughput and ETA."""
    data = ApiClient.from_environment().get(f"/v1/jobs/{segment(job_id)}")
    if as_json:
        print_json(data)
        return
    eta = f", ETA {data['eta_seconds']}s" if data.get("eta_seconds") is not None else ""
    console.print(f"{data['id']} [bold]{data['status']}[/bold] {data['model']}@{data['model_version']}: "
                  f"rows {data['rows_done']:,}/{data['rows_total']:,}, chunks {data['chunks_done']}/"
                  f"{data['chunks_total']}, {data['rows_per_second']:,.0f} rows/s{eta}")
    if data.get("deadline") is not None:
        console.print(deadline_note(data).lstrip(", "), markup=False)
    if data.get("error"):
        print_error(data["error"])


def deadline_note(job: dict[str, Any]) -> str:
    """', due 10:42:00, predicted 10:40:12 (risk 0.02)' for a job with a deadline ('' without one);
    local times, with the date when it is not today's."""
    if job.get("deadline") is None:
        return ""
    parts = [f"due {_local(job['deadline'])}"]
    if job.get("predicted_finish") is not None and job.get("deadline_met") is None:
        parts.append(f"predicted {_local(job['predicted_finish'])}")
    if job.get("sla_risk") is not None and job.get("deadline_met") is None:
        parts.append(f"risk {job['sla_risk']:.2f}")
    if job.get("at_risk"):
        parts.append("accepted at risk: predicted to miss it")
    if job.get("deadline_met") is not None:
        parts.append("deadline met" if job["deadline_met"] else "deadline missed")
    return ", " + ", ".join(parts)


def _local(unix: float) -> str:
    moment = datetime.fromtimestamp(unix).astimezone()
    same_day = moment.date() == datetime.now().astimezone().date()
    return moment.strftime("%H:%M:%S" if same_day else "%Y-%m-%d %H:%M:%S")


@job.command("list")
@click.option("--status", "status_filter", default=None)
@click.option("--owner", default=None, help="only the jobs submitted with keys of this name (an admin or "
                                            "tenant-admin key's choice)")
@click.option("--tenant", default=None, help="only the jobs of this tenant (an admin key's choice)")
@click.option("--json", "as_json", is_flag=True)
def job_list(status_filter: str | None, owner: str | None, tenant: str | None, as_json: bool) -> None:
    """Newest jobs first (a user key sees only its own)."""
    query = {name: value for name, value in (("status", status_filter), ("owner", owner), ("tenant", tenant))
             if value is not None}
    path = "/v1/jobs" + (f"?{urlencode(query)}" if query else "")
    data = ApiClient.from_environment().get(path)
    if as_json:
        print_json(data)
        return
    ids = [item["id"] for item in data["jobs"]]
    table = Table(Column("id", no_wrap=True, min_width=max(map(len, ids), default=2)), "model", "status", "owner",
                  "rows", "chunks", "rows/s", Column("output", overflow="fold"))
    for item in data["jobs"]:
        table.add_row(item["id"], item["model"], item["status"], item.get("owner") or "-",
                      f"{item['rows_done']:,}/{item['rows_total']:,}",
                      f"{item['chunks_done']}/{item['chunks_total']}", f"{item['rows_per_second']:,.0f}",
                      item["output_dir"])
    print_table(table)


@job.command("cancel")
@click.argument("job_id", type=JOB_ID_ARGUMENT)
def job_cancel(job_id: str) -> None:
    """Cancel a job (its waiting chunks leave the queue)."""
    data = ApiClient.from_environment().delete(f"/v1/jobs/{segment(job_id)}")
    console.print(f"job {job_id} {data['status']}")


@job.command("resume")
@click.argument("job_id", type=JOB_ID_ARGUMENT)
@click.option("--wait", is_flag=True)
def job_resume(job_id: str, wait: bool) -> None:
    """Re-queue only the chunks of a job that are not done."""
    client = ApiClient.from_environment()
    data = client.post(f"/v1/jobs/{segment(job_id)}/resume")
    console.print(f"job {job_id} {data['status']}: {data['chunks_done']}/{data['chunks_total']} chunks already done")
    if wait:
        final = _follow(job_id, client)
        sys.exit(0 if final["status"] == "succeeded" else 1)

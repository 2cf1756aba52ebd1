"""A live progress bar for a job, and the summary printed when it ends."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sits_api.cli.client import ApiClient, segment
from sits_api.cli.output import print_table

FINAL = ("succeeded", "failed", "cancelled")


def wait_for_job(console: Console, client: ApiClient, job_id: str, *, poll_seconds: float = 0.25,
                 summary: bool = True) -> dict[str, Any]:
    """Poll the job, showing rows done, rows/s and ETA, until it ends; then print a summary."""
    job = client.get(f"/v1/jobs/{segment(job_id)}")
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("rows  {task.fields[rate]:>10} rows/s  ETA {task.fields[eta]}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(f"{job_id} {job['model']}", total=job["rows_total"], rate="-", eta="-")
        while True:
            eta = f"{job['eta_seconds']:.0f}s" if job.get("eta_seconds") is not None else "-"
            progress.update(task, completed=job["rows_done"], rate=f"{job['rows_per_second']:,.0f}", eta=eta)
            if job["status"] in FINAL:
                break
            time.sleep(poll_seconds)
            job = client.get(f"/v1/jobs/{segment(job_id)}")
    if summary:
        print_summary(console, job)
    return job


def print_summary(console: Console, job: dict[str, Any]) -> None:
    """Rows/s, chunks, workers used, output files and checksums of a finished job."""
    colour = "green" if job["status"] == "succeeded" else "red"
    console.print(f"job {job['id']} [{colour}]{job['status']}[/{colour}] in {job['elapsed_seconds']:.2f}s: "
                  f"{job['rows_done']:,} rows, {job['rows_per_second']:,.0f} rows/s, "
                  f"{job['chunks_done']} chunks ({job['chunk_runs']} chunk runs)")
    if job.get("error"):
        console.print(f"[red]error:[/red] {escape(job['error'])}", soft_wrap=True)
    if job.get("workers"):
        console.print("workers used: " + ", ".join(f"{name} ({count} chunks)"
                                                   for name, count in sorted(job["workers"].items())))
    manifest = job.get("manifest") or {}
    if manifest:
        table = Table("output file", "shape", "dtype", "checksum", title=f"outputs in {job['output_dir']}")
        for output in manifest["outputs"].values():
            table.add_row(output["file"], str(output["shape"]), output["dtype"], output["checksum"])
        print_table(table, on=console)  # checksums whole in a pipe or a log

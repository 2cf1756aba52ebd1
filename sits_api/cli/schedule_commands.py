"""`sitsctl schedule ...`: make schedules, list and show them with their runs, pause, resume, delete, run now."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import click
from rich.table import Column, Table

from sits_api.cli.client import ApiClient, segment
from sits_api.cli.output import console, print_json, print_table


def _path(path: Path) -> str:
    """An absolute path with its templates ({date}, {time}, {slot}) kept as written."""
    return os.path.abspath(path)


def _query(tenant: str | None) -> str:
    return f"?tenant={quote(tenant)}" if tenant else ""


@click.group()
def schedule() -> None:
    """Release a job at each slot of a cron expression or a period (docs/schedules.md)."""


@schedule.command("create")
@click.option("--name", required=True, help="the schedule's name within this key's tenant")
@click.option("--cron", default=None, help="five fields in --timezone's wall time, e.g. '30 17 * * 1-5'")
@click.option("--every", default=None, help="a period from 1s to 1d, e.g. 10s or 5m (instead of --cron)")
@click.option("--timezone", default=None, help="IANA time zone of --cron, --window and {date}/{time} (default UTC)")
@click.option("--model", "model_ref", required=True, help="name or name@version")
@click.option("--input-batch", required=True, type=click.Path(path_type=Path),
              help="the input file; may hold {date}, {time} and {slot}")
@click.option("--output-dir", required=True, type=click.Path(path_type=Path),
              help="each run's folder; hold {slot} (or {date}, {time}) so that each run has its own")
@click.option("--priority", default=None, type=click.IntRange(0, 15))
@click.option("--chunk-size", type=click.IntRange(min=1), default=None)
@click.option("--batch-size", type=click.IntRange(min=1), default=None)
@click.option("--window", default=None, help="HH:MM-HH:MM local: slots inside it only, late or held releases "
              "until it ends")
@click.option("--deadline", default=None, help="each run's job must be done this long after its slot, e.g. 2h")
@click.option("--catch-up", type=click.Choice(["once", "skip"]), default=None,
              help="a slot missed while no beat ran: released once on return (default), or not at all")
@click.option("--after", multiple=True, help="a schedule whose run of the same slot must succeed first (repeatable)")
@click.option("--paused", is_flag=True, help="make it paused")
@click.option("--json", "as_json", is_flag=True)
def schedule_create(name: str, cron: str | None, every: str | None, timezone: str | None, model_ref: str,
                    input_batch: Path, output_dir: Path, priority: int | None, chunk_size: int | None,
                    batch_size: int | None, window: str | None, deadline: str | None, catch_up: str | None,
                    after: tuple[str, ...], paused: bool, as_json: bool) -> None:
    """Make a schedule: its job is released at each slot."""
    if (cron is None) == (every is None):
        raise click.UsageError("give either --cron or --every")
    job: dict[str, Any] = {"model": model_ref, "input_batch": _path(input_batch), "output_dir": _path(output_dir)}
    for field, value in (("priority", priority), ("chunk_size", chunk_size), ("batch_size", batch_size)):
        if value is not None:
            job[field] = value
    body: dict[str, Any] = {"name": name, "job": job}
    for field, text in (("cron", cron), ("every", every), ("timezone", timezone), ("window", window),
                        ("deadline", deadline), ("catch_up", catch_up)):
        if text is not None:
            body[field] = text
    if after:
        body["after"] = list(after)
    if paused:
        body["paused"] = True
    made = ApiClient.from_environment().post("/v1/schedules", body)
    if as_json:
        print_json(made)
        return
    console.print(f"schedule {made['name']} made; next slot {made['next_slot'] or '-'}", markup=False)


@schedule.command("list")
@click.option("--tenant", default=None, help="an admin key: this tenant's (default the key's own)")
@click.option("--json", "as_json", is_flag=True)
def schedule_list(tenant: str | None, as_json: bool) -> None:
    """The schedules this key may read."""
    data = ApiClient.from_environment().get("/v1/schedules" + _query(tenant))
    if as_json:
        print_json(data)
        return
    table = Table(Column("name", no_wrap=True), "tenant", "when", "timezone", "after", "next slot", "paused")
    for item in data["schedules"]:
        when = item["cron"] or f"every {item['every']}s"
        table.add_row(item["name"], item["tenant"], when, item["timezone"], ", ".join(item["after"]) or "-",
                      item["next_slot"] or "-", "yes" if item["paused"] else "")
    print_table(table)


@schedule.command("show")
@click.argument("name")
@click.option("--tenant", default=None, help="an admin key: the tenant whose schedule it is")
@click.option("--json", "as_json", is_flag=True)
def schedule_show(name: str, tenant: str | None, as_json: bool) -> None:
    """One schedule and its recent runs: slot, job, status, predicted and actual finish."""
    data = ApiClient.from_environment().get(f"/v1/schedules/{segment(name)}{_query(tenant)}")
    if as_json:
        print_json(data)
        return
    when = data["cron"] or f"every {data['every']}s"
    console.print(f"{data['name']} ({data['tenant']}, {data['owner']}): {when} {data['timezone']}, next slot "
                  f"{data['next_slot'] or '-'}{' (paused)' if data['paused'] else ''}", markup=False)
    table = Table(Column("slot", no_wrap=True), "status", "job", "late s", "predicted", "finished",
                  Column("reason", overflow="fold"))
    for run in data["runs"]:
        table.add_row(run["slot"], run["status"] + (f" ({run['job_status']})" if run["job_status"] else ""),
                      run["job_id"] or "-", "-" if run["lateness_s"] is None else f"{run['lateness_s']:.2f}",
                      _clock(run["predicted_finish"]), _clock(run["finished_at"]), run["reason"] or "")
    print_table(table)


def _clock(unix: float | None) -> str:
    from datetime import datetime

    return "-" if unix is None else datetime.fromtimestamp(unix).astimezone().strftime("%Y-%m-%d %H:%M:%S")


def _steer(verb: str, name: str, tenant: str | None) -> dict[str, Any]:
    return dict(ApiClient.from_environment().post(f"/v1/schedules/{segment(name)}/{verb}{_query(tenant)}"))


@schedule.command("pause")
@click.argument("name")
@click.option("--tenant", default=None)
def schedule_pause(name: str, tenant: str | None) -> None:
    """Release no slot until it resumes."""
    _steer("pause", name, tenant)
    console.print(f"schedule {name} paused", markup=False)


@schedule.command("resume")
@click.argument("name")
@click.option("--tenant", default=None)
def schedule_resume(name: str, tenant: str | None) -> None:
    """Release its slots again from the next one."""
    data = _steer("resume", name, tenant)
    console.print(f"schedule {name} resumed; next slot {data['next_slot'] or '-'}", markup=False)


@schedule.command("delete")
@click.argument("name")
@click.option("--tenant", default=None)
def schedule_delete(name: str, tenant: str | None) -> None:
    """Delete a schedule and its runs (the jobs it released stay)."""
    ApiClient.from_environment().delete(f"/v1/schedules/{segment(name)}{_query(tenant)}")
    console.print(f"schedule {name} deleted", markup=False)


@schedule.command("run-now")
@click.argument("name")
@click.option("--tenant", default=None)
@click.option("--json", "as_json", is_flag=True)
def schedule_run_now(name: str, tenant: str | None, as_json: bool) -> None:
    """Release one run now, outside its slots; exits 1 when its release was refused."""
    run = _steer("run", name, tenant)
    if as_json:
        print_json(run)
    elif run["status"] == "released":
        console.print(f"schedule {name}: job {run['job_id']} released", markup=False)
    else:
        console.print(f"schedule {name}: {run['status']}: {run['reason']}", markup=False)
    if run["status"] != "released":
        raise SystemExit(1)


@schedule.command("plan")
@click.option("--window", default=None, help="HH:MM-HH:MM: plan the runs whose slots fall in it (default: the "
              "next 24 hours)")
@click.option("--day", default=None, help="YYYY-MM-DD of the window (default: its next opening)")
@click.option("--timezone", default="UTC", show_default=True, help="IANA time zone of --window and --day")
@click.option("--slots", type=click.IntRange(min=1), default=None,
              help="the fleet's stream slots to plan for (default: the live workers')")
@click.option("--tenant", default=None, help="an admin key: this tenant's schedules only (default: every tenant's)")
@click.option("--apply", "apply_plan", is_flag=True, help="store each offset and cap on its schedule")
@click.option("--json", "as_json", is_flag=True)
def schedule_plan(window: str | None, day: str | None, timezone: str, slots: int | None, tenant: str | None,
                  apply_plan: bool, as_json: bool) -> None:
    """Stagger a window's runs: a release offset and a slot cap per schedule that lower the fleet's peak
    while every run finishes before its deadline. Prints the peak before and after and each run's
    predicted finish; --apply stores the offsets and caps."""
    ask: dict[str, Any] = {"timezone": timezone}
    for field, value in (("window", window), ("day", day), ("slots", slots)):
        if value is not None:
            ask[field] = value
    client = ApiClient.from_environment()
    if apply_plan:
        data = client.post("/v1/schedules/plan" + _query(tenant), ask)
    else:
        data = client.get("/v1/schedules/plan?" + urlencode({**ask, **({"tenant": tenant} if tenant else {})}))
    if as_json:
        print_json(data)
        return
    _print_plan(data)


def _print_plan(data: dict[str, Any]) -> None:
    span = f"{data['window'] or 'the next 24 h'} ({data['from']} to {data['until']}), {data['slots']} slots"
    for left in data["left_out"]:
        console.print(f"left out: {left['tenant']}/{left['schedule']}: {left['reason']}", markup=False)
    before = data["before"]
    if not data["runs"]:
        console.print(f"{span}: nothing planned. {data.get('reason', '')}", markup=False)
        return
    after = data["after"]
    console.print(f"{span}: peak {before['peak_slots']} -> {after['peak_slots']} slots "
                  f"({data['peak_drop']}x lower), {before['peak_rows_per_second']:g} -> "
                  f"{after['peak_rows_per_second']:g} rows/s; late runs {before['late_runs']} -> "
                  f"{after['late_runs']}", markup=False)
    table = Table(Column("schedule", no_wrap=True), "slot", "offset s", "max slots", "finish", "predicted",
                  "deadline", "on time")
    for run in data["runs"]:
        table.add_row(f"{run['tenant']}/{run['schedule']}", run["slot"], f"{run['offset_s']:g}",
                      str(run["max_slots"] or "-"), run["finish"] or "-", run["predicted_finish"] or "-",
                      run["deadline"], "yes" if run["on_time"] and run["admitted"] else "NO")
    print_table(table)
    analysis = data["response_time_analysis"]
    console.print(f"response-time analysis: {analysis['verdict']}", markup=False)
    if data["applied"]:
        console.print(f"applied to: {', '.join(data['applied'])}", markup=False)

"""`sitsctl sla ...`: service-level checks, for now `sla check FILE` for a periodic task set."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click
import yaml
from rich.markup import escape
from rich.table import Table

from broker.errors import BadInput
from sits_api.cli.client import ApiClient
from sits_api.cli.output import console, print_json, print_table

NOT_FEASIBLE_EXIT = 3
"""Exit status of `sla check` when a task may miss its deadline (1 is an error, 2 a usage error)."""


@click.group()
def sla() -> None:
    """Service-level checks: is a periodic task set schedulable?"""


@sla.command("check")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--policy", type=click.Choice(["rate-monotonic", "deadline-monotonic"]), default=None,
              help="priorities to analyse under, instead of the file's")
@click.option("--workers", type=click.IntRange(1, 1024), default=None, help="workers, instead of the file's")
@click.option("--json", "as_json", is_flag=True, help="print the API's JSON")
def sla_check(file: Path, policy: str | None, workers: int | None, as_json: bool) -> None:
    """Whether the periodic task set in FILE (YAML or JSON) meets its deadlines, and why, per task.

    FILE holds `policy`, `workers` and `tasks`, each task `name`, `period_ms`, and `wcet_ms` or
    `model` and `rows` (see docs/sla.md). Exits 0 when every task meets its deadline, 3 when one may
    miss it, 1 on an error.
    """
    body = read_task_set(file)
    body.update({name: value for name, value in (("policy", policy), ("workers", workers)) if value is not None})
    answer = ApiClient.from_environment().post("/v1/sla/analysis", body)
    if as_json:
        print_json(answer)
    else:
        print_answer(answer)
    sys.exit(0 if answer["feasible"] else NOT_FEASIBLE_EXIT)


def read_task_set(file: Path) -> dict[str, Any]:
    """The task set in `file`: a mapping, or a bare list taken as its tasks; BadInput when it is neither."""
    text = file.read_text(encoding="utf-8")
    try:
        data = json.loads(text) if file.suffix.lower() == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as err:
        kind = "JSON" if file.suffix.lower() == ".json" else "YAML"
        raise BadInput(f"{file} is not valid {kind}: {err}") from err
    if isinstance(data, list):
        return {"tasks": data}
    if not isinstance(data, dict):
        raise BadInput(f"{file} holds no task set: write a mapping with `tasks` (a list of tasks), and "
                       "optionally `policy` and `workers`")
    return data


def print_answer(answer: dict[str, Any]) -> None:
    """The verdict, the utilisation against the bound, a table of the tasks, and why each meets or not."""
    colour = "green" if answer["feasible"] else "red"
    console.print(f"[bold {colour}]{escape(answer['verdict'])}[/bold {colour}]")
    bound = answer["bound"]
    workers = answer["workers"]
    console.print(f"{answer['policy']} on {workers} worker{'s' if workers != 1 else ''}: "
                  f"U = {answer['utilisation']:.3f}, Liu-Layland bound {bound['value']:.3f}: "
                  f"{bound['verdict']} ({bound['reason']})", markup=False, soft_wrap=True)
    table = Table("priority", "task", "C ms", "T ms", "D ms", "B ms", "R ms", "meets")
    for task in answer["tasks"]:
        response = "-" if task["response_ms"] is None else f"{task['response_ms']:g}"
        table.add_row(str(task["priority"]), escape(task["name"]), f"{task['wcet_ms']:g}", f"{task['period_ms']:g}",
                      f"{task['deadline_ms']:g}", f"{task['blocking_ms']:g}", response,
                      "[green]yes[/green]" if task["meets"] else "[red]no[/red]")
    print_table(table)
    for task in answer["tasks"]:
        console.print(f"{task['name']}: {task['reason']}", markup=False, soft_wrap=True)
        if task["wcet_source"] != "given":
            console.print(f"  C: {task['wcet_source']}", markup=False, soft_wrap=True)
        if task["blocking_source"] != "given" and task["blocking_ms"]:
            console.print(f"  B: {task['blocking_source']}", markup=False, soft_wrap=True)
    for note in answer.get("notes", []):
        console.print(f"note: {note}", markup=False, soft_wrap=True, style="yellow" if "warning" in note else None)

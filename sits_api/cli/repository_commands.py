"""`sitsctl repository`: the Triton model repository's index, and loading and unloading its models."""

from __future__ import annotations

import click
from rich.markup import escape
from rich.table import Table

from sits_api.cli.client import ApiClient, segment
from sits_api.cli.output import console, print_json, print_table


@click.group("repository")
def repository() -> None:
    """The models of the Triton model repositories (repository.paths; docs/models.md)."""


@repository.command("index")
@click.option("--ready", is_flag=True, help="only the READY models")
@click.option("--json", "as_json", is_flag=True, help="print the API's JSON")
def index(ready: bool, as_json: bool) -> None:
    """Every model of the repository: its versions, state and, when UNAVAILABLE, why."""
    entries = ApiClient.from_environment().post("/v2/repository/index", {"ready": ready})
    if as_json:
        print_json(entries)
        return
    table = Table("name", "version", "state", "reason")
    for entry in entries:
        table.add_row(escape(entry["name"]), entry.get("version", "-"), entry["state"], escape(entry.get("reason", "")))
    print_table(table)


@repository.command("load")
@click.argument("name")
def load(name: str) -> None:
    """Load a model of the repository from its folder again (its config and versions as they are now)."""
    ApiClient.from_environment().post(f"/v2/repository/models/{segment(name)}/load", {})
    console.print(f"loaded {name}", markup=False)


@repository.command("unload")
@click.argument("name")
def unload(name: str) -> None:
    """Unload a model of the repository: its versions are not served until it is loaded again."""
    ApiClient.from_environment().post(f"/v2/repository/models/{segment(name)}/unload", {})
    console.print(f"unloaded {name}", markup=False)

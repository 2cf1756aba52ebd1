"""How `sitsctl` prints: one console, error lines, JSON, and tables that never cut a cell in a pipe."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

console = Console()
errors = Console(stderr=True)
"""Errors go to stderr: `--json` output piped into a program never holds an error line."""


def print_error(message: str) -> None:
    """One red `error:` line on stderr; the message is printed as text (API messages may hold `[...]`)."""
    errors.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True)


def print_json(data: Any) -> None:
    """`data` as indented JSON on stdout, nothing else."""
    click.echo(json.dumps(data, indent=2))


def print_table(table: Table, on: Console = console) -> None:
    """A table at the terminal's width; into a pipe or a file at its own width, so no cell is cut."""
    if on.is_terminal:
        on.print(table)
    else:
        Console(file=on.file, width=100_000).print(table)

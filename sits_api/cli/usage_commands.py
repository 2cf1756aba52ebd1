"""`sitsctl usage`: chargeback per tenant, from `GET /v1/usage`, as a table, JSON or CSV."""

from __future__ import annotations

import csv
import sys
import urllib.parse
from typing import Any

import click
from rich.markup import escape
from rich.table import Table

from sits_api.cli.client import ApiClient
from sits_api.cli.output import console, print_json, print_table

COLUMNS = ("device_seconds", "rows", "requests", "failed", "jobs", "queue_seconds", "cost")


@click.command("usage")
@click.option("--tenant", default=None, help="one tenant (an admin key; any other key sees only its own)")
@click.option("--from", "first", default=None, metavar="YYYY-MM-DD", help="first UTC day (default: --to)")
@click.option("--to", "last", default=None, metavar="YYYY-MM-DD", help="last UTC day (default: today)")
@click.option("--by", type=click.Choice(["tenant", "model", "key", "day", "device"]), default="tenant",
              show_default=True, help="one row per tenant, or per tenant and model version, key, day or device kind")
@click.option("--json", "as_json", is_flag=True, help="print the API's JSON")
@click.option("--csv", "as_csv", is_flag=True, help="print CSV, one row per line, for a spreadsheet")
def usage(tenant: str | None, first: str | None, last: str | None, by: str, as_json: bool, as_csv: bool) -> None:
    """Device-seconds, rows, requests, jobs, queue time and cost of each tenant's work (docs/tenants.md)."""
    query = {name: value for name, value in (("tenant", tenant), ("from", first), ("to", last), ("by", by))
             if value}
    answer = ApiClient.from_environment().get("/v1/usage?" + urllib.parse.urlencode(query))
    if as_json:
        print_json(answer)
    elif as_csv:
        write_csv(answer)
    else:
        print_usage(answer)


def _keys(answer: dict[str, Any]) -> list[str]:
    return ["tenant", *([answer["by"]] if answer["by"] != "tenant" else [])]


def write_csv(answer: dict[str, Any]) -> None:
    """The rows as CSV on stdout, a header first."""
    writer = csv.writer(sys.stdout)
    keys = _keys(answer)
    writer.writerow([*keys, *COLUMNS])
    for row in answer["usage"]:
        writer.writerow([*(row[key] for key in keys), *(row[column] for column in COLUMNS)])


def print_usage(answer: dict[str, Any]) -> None:
    """A table of the rows, with the period and the prices above it; `--by model` splits each A/B arm's
    requests, errors and mean queue wait."""
    prices = ", ".join(f"{kind} {price:g}" for kind, price in sorted(answer["price_per_device_hour"].items()))
    console.print(f"usage {answer['from']} to {answer['to']} (UTC), {answer['currency']} per device-hour: "
                  f"{prices or 'no prices set (fair_share.price_per_device_hour)'}", markup=False, soft_wrap=True)
    keys = _keys(answer)
    table = Table(*keys, "device s", "rows", "requests", "failed", "jobs", "mean wait ms", f"cost {answer['currency']}")
    for row in answer["usage"]:
        wait = f"{row['queue_seconds'] / row['requests'] * 1000:.1f}" if row["requests"] else "-"
        table.add_row(*(escape(str(row[key])) for key in keys), f"{row['device_seconds']:.3f}", f"{row['rows']:,}",
                      f"{row['requests']:,}", f"{row['failed']:,}", f"{row['jobs']:,}", wait, f"{row['cost']:.4f}")
    print_table(table)

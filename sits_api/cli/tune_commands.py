"""`sitsctl model tune`: sweep a model's batching, print the front and the pick, chart it, apply it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from broker.setting_types import parse_duration
from sits_api.cli.client import ApiClient, ApiError, segment
from sits_api.cli.output import console, print_json, print_table

_POLL_SECONDS = 1.0
_NO_RELEASER_SECONDS = 60.0
"""How long the sweep may stay unstarted before the command says no releaser took it."""


def _milliseconds(ctx: click.Context, param: click.Parameter, value: str) -> float:
    try:
        return parse_duration(value if any(c.isalpha() for c in value) else f"{value}ms") * 1000
    except ValueError as err:
        raise click.BadParameter(str(err)) from err


def _numbers(kind: type) -> Any:
    def parse(ctx: click.Context, param: click.Parameter, value: str | None) -> list[Any] | None:
        if value is None:
            return None
        try:
            return [kind(part) for part in value.split(",") if part.strip()]
        except ValueError as err:
            raise click.BadParameter(f"{value!r} is not a comma-separated list of numbers") from err
    return parse


@click.command("tune")
@click.argument("ref")
@click.option("--p99", "p99_ms", default="120ms", show_default=True, callback=_milliseconds,
              help="the P99 bound the pick must meet (e.g. 120ms, 0.5s)")
@click.option("--apply", "apply_", is_flag=True, help="store the pick as the model's batching (source: tuned)")
@click.option("--method", type=click.Choice(["quick", "brute"]), default="quick", show_default=True,
              help="quick: a coordinate climb from the smallest setting; brute: every setting")
@click.option("--concurrency", "concurrencies", callback=_numbers(int), default=None,
              help="closed-loop clients per point, e.g. 1,8,32 (the default)")
@click.option("--batch-sizes", callback=_numbers(int), default=None, help="ceilings to try, e.g. 1,8,32")
@click.option("--delays-ms", callback=_numbers(float), default=None, help="max_queue_delay values, e.g. 0,2,10")
@click.option("--streams", callback=_numbers(int), default=None, help="streams per worker to try, e.g. 1,2")
@click.option("--cell-seconds", type=click.FloatRange(0.2, 60), default=None, help="seconds each point counts")
@click.option("--device-kind", type=click.Choice(["cpu", "gpu"]), default=None, help="tune on this kind only")
@click.option("--refresh", is_flag=True, help="measure again even when a cached sweep could answer")
@click.option("--chart", "chart_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="write the front as a PNG chart (needs matplotlib)")
@click.option("--json", "as_json", is_flag=True)
def tune(ref: str, p99_ms: float, apply_: bool, method: str, concurrencies: list[int] | None,
         batch_sizes: list[int] | None, delays_ms: list[float] | None, streams: list[int] | None,
         cell_seconds: float | None, device_kind: str | None, refresh: bool, chart_path: Path | None,
         as_json: bool) -> None:
    """Sweep REF's batching under closed-loop load and pick the highest throughput within the P99 bound.

    The sweep runs on a releaser (started with the beat) through the API's intake, on each kind of device
    the live workers have; your key's tenant is billed for its requests.
    """
    ask: dict[str, Any] = {"p99_ms": p99_ms, "method": method, "apply": apply_, "refresh": refresh}
    for name, value in (("concurrencies", concurrencies), ("batch_sizes", batch_sizes), ("delays_ms", delays_ms),
                        ("streams", streams), ("cell_seconds", cell_seconds), ("device_kind", device_kind)):
        if value is not None:
            ask[name] = value
    client = ApiClient.from_environment()
    started = client.post(f"/v1/models/{segment(ref)}/tune", ask)
    tunings = _wait(client, started)
    if as_json:
        print_json({"model_ref": started["model_ref"], "tunings": tunings})
    else:
        for tuning in tunings:
            _print(tuning)
    if chart_path is not None:
        chart(tunings, chart_path)
        console.print(f"chart: {chart_path}")
    if any(t["status"] != "done" for t in tunings):
        raise click.exceptions.Exit(1)


def _wait(client: ApiClient, started: dict[str, Any]) -> list[dict[str, Any]]:
    """The ask's records once every kind's is done or failed."""
    kinds, ask_id = set(started["device_kinds"]), started["ask_id"]
    began = time.monotonic()
    deadline = began + float(started["planned_seconds"]) * 1.5 + _NO_RELEASER_SECONDS
    with console.status(f"tuning {started['model_ref']} on {', '.join(sorted(kinds))} ...") as status:
        while True:
            found = [t for t in client.get(started["poll"])["tunings"] if t.get("ask_id") == ask_id]
            if {t["device_kind"] for t in found if t["status"] in ("done", "failed")} >= kinds:
                return sorted(found, key=lambda t: t["device_kind"])
            if all(t["status"] == "queued" for t in found) and time.monotonic() - began > _NO_RELEASER_SECONDS:
                raise ApiError("no releaser took the sweep: start the stack with its beat (sitsctl up without "
                               "--no-beat)", 504)
            if time.monotonic() > deadline:
                raise ApiError(f"the sweep is still running after {time.monotonic() - began:.0f} s", 504)
            points = sum(len(t["points"]) for t in found)
            status.update(f"tuning {started['model_ref']}: {points} points measured ...")
            time.sleep(_POLL_SECONDS)


def _print(tuning: dict[str, Any]) -> None:
    kind, bound = tuning["device_kind"], tuning["p99_bound_ms"]
    console.print(f"[bold]{tuning['model_ref']}[/bold] on {kind}: {tuning['method']} sweep, "
                  f"{len(tuning['points'])} points, P99 bound {bound:g} ms, {tuning['status']}")
    if tuning["error"]:
        console.print(f"[red]{tuning['error']}[/red]")
    table = Table("batch", "delay ms", "streams", "clients", "req/s", "P50 ms", "P99 ms", "", title="front")
    chosen = tuning["chosen"]
    for point in tuning["front"]:
        setting = point["setting"]
        mark = "chosen" if point == chosen else ("over bound" if point["p99_ms"] > bound else "")
        table.add_row(str(setting["max_batch_size"]), f"{setting['max_queue_delay_ms']:g}", str(setting["streams"]),
                      str(point["concurrency"]), f"{point['throughput']:,.1f}", f"{point['p50_ms']:.1f}",
                      f"{point['p99_ms']:.1f}", mark)
    print_table(table)
    if chosen is None:
        console.print(f"no point met the P99 bound of {bound:g} ms")
        return
    verified = tuning["verified"]
    if verified:
        held = "held" if verified["p99_ms"] <= bound else "[red]did not hold[/red]"
        console.print(f"verified at {verified['concurrency']} clients: {verified['throughput']:,.1f} req/s, "
                      f"P99 {verified['p99_ms']:.1f} ms ({held})")
    console.print("applied: workers now batch by it (source: tuned)" if tuning["applied"]
                  else "not applied (--apply stores it)")


def chart(tunings: list[dict[str, Any]], path: Path) -> None:
    """A PNG of each kind's points (P99 against throughput), its front, the bound and the pick."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise click.ClickException("--chart needs matplotlib: pip install 'sits[charts]' (or matplotlib)") from err
    figure, axes = plt.subplots(1, len(tunings), figsize=(6 * len(tunings), 4.5), squeeze=False)
    for axis, tuning in zip(axes[0], tunings, strict=True):
        points = [p for p in tuning["points"] if p["answered"]]
        axis.scatter([p["throughput"] for p in points], [p["p99_ms"] for p in points], s=12, alpha=0.5,
                     label="points")
        front = tuning["front"]
        axis.plot([p["throughput"] for p in front], [p["p99_ms"] for p in front], "-o", ms=4, label="front")
        axis.axhline(tuning["p99_bound_ms"], color="grey", ls="--", label=f"P99 bound {tuning['p99_bound_ms']:g} ms")
        if tuning["chosen"]:
            axis.plot([tuning["chosen"]["throughput"]], [tuning["chosen"]["p99_ms"]], "*", ms=16, label="chosen")
        axis.set(xlabel="requests/s", ylabel="P99 ms", yscale="log",
                 title=f"{tuning['model_ref'].partition('@')[0]} on {tuning['device_kind']}")
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)

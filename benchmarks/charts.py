"""PNG charts of an online benchmark run: `python benchmarks/online_serving.py --json r.json` then
`python benchmarks/charts.py r.json docs/img` (needs matplotlib: `pip install -e '.[bench]'`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def bars(ax, labels: list[str], series: dict[str, list[float]], ylabel: str, title: str) -> None:
    width = 0.8 / max(len(series), 1)
    for index, (name, values) in enumerate(series.items()):
        ax.bar([i + index * width for i in range(len(labels))], values, width, label=name)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(labels))], labels)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend()


def main() -> None:
    results = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    if results.get("load"):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        rows = results["load"]
        series = {"naive Celery task per request": [r["naive"]["rps"] for r in rows]}
        if all("naive_rest" in r for r in rows):
            series["naive, behind a REST endpoint"] = [r["naive_rest"]["rps"] for r in rows]
        series["SITS (REST, merged batches)"] = [r["sits"]["rps"] for r in rows]
        floors = results.get("floors") or {}
        if all(row["model"] in floors for row in rows):
            series["REST floor (parse and answer only)"] = [floors[row["model"]]["rps"] for row in rows]
        bars(ax, [row["model"] for row in rows], series, "requests/s",
             "Closed loop, 16 clients, one-row requests (2 vCPUs)")
        fig.tight_layout()
        fig.savefig(out / "online-throughput.png", dpi=110)
    if results.get("priority"):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        cases = sorted({(p["model"], p["batch"]) for p in results["priority"]})
        labels = [f"{model} (batch {batch})" for model, batch in cases]
        series = {}
        for ordering in ("fifo", "dynamic"):
            series[f"vip P99, {ordering}"] = [min(p["vip_p99"] for p in results["priority"] if (p["model"], p["batch"])
                                                  == case and p["ordering"] == ordering) for case in cases]
        bars(ax, labels, series, "ms", "Mixed vip/free load: vip P99 under FIFO vs dynamic priority")
        fig.tight_layout()
        fig.savefig(out / "priority-vip-p99.png", dpi=110)
    if results.get("scenarios"):
        fig, ax = plt.subplots(figsize=(7, 3.8))
        labels, series = [], {"FIFO": [], "dynamic": []}
        for scenario in results["scenarios"]:
            runs = {run["ordering"]: run for run in scenario["runs"]}
            top = next(iter(runs["fifo"]["classes"]))  # the first class listed is the most urgent one
            labels.append(f"{scenario['title'].split(':')[0]}\n({top})")
            series["FIFO"].append(runs["fifo"]["classes"][top]["p99"])
            series["dynamic"].append(runs["dynamic"]["classes"][top]["p99"])
        bars(ax, labels, series, "P99 ms", "Load scenarios: P99 of the most urgent class")
        ax.tick_params(axis="x", labelsize=7)
        fig.tight_layout()
        fig.savefig(out / "scenarios-p99.png", dpi=110)


if __name__ == "__main__":
    main()

"""The speculation tables of docs/simulation.md: StaleFlow against the issue's goals, with and without drafts.

Each argument is a ``results.json`` of ``staleflow simulate --speculation MODE --out DIR`` (one
workload, one seed, one mode, one or more ``eta``; StaleFlow and the bound-keeping baselines it is
compared with). For each workload (in the order the arguments first name it), ``eta`` and mode: StaleFlow's trained tokens/s (whole run and
steady state: the first ``eta + 2`` steps left out), its share of the upper bound and of the
latency-aware bound (both computed without drafts), the fastest baseline whose p99 staleness is
within ``eta``, and StaleFlow's ratio over it. A cell is the median over seeds with the range in
brackets; a ratio or share is the median of the per-seed figures. With ``siblings``, StaleFlow drafts
from the group's other responses and every baseline from the request's own tokens (``request``).
The goal column (StaleFlow with sibling drafts) reads the issue's targets on the steady state: a share of the
upper bound of at least 0.75 / 0.90 / 0.95 at ``eta`` 1 / 2 / 3 and 1.15x the best bound-keeping
baseline, both.

    python scripts/speculation_table.py runs/*/results.json
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

#: The issue's targets with sibling drafts: StaleFlow's share of the upper bound by eta, and its ratio over the best.
SHARE_GOAL = {1: 0.75, 2: 0.90, 3: 0.95}
RATIO_GOAL = 1.15
WHOLE, STEADY = "tokens_per_s", "steady_tokens_per_s"


def spread(values: list[float], fmt: str) -> str:
    """Median, and the range over seeds when there are several: ``1.02 [0.98, 1.05]``."""
    median = format(statistics.median(values), fmt)
    return median if len(values) == 1 else f"{median} [{format(min(values), fmt)}, {format(max(values), fmt)}]"


def best_keeping(systems: dict[str, Any], eta: int, key: str) -> tuple[str, float]:
    """The fastest system other than StaleFlow whose p99 staleness is within ``eta``."""
    speed, name = max((f[key], name) for name, f in systems.items() if name != "staleflow" and f["staleness_p99"] <= eta)
    return name, speed


def rows(paths: list[str]) -> list[str]:
    runs: dict[tuple[str, str, int], dict[int, dict[str, Any]]] = defaultdict(dict)  # (workload, mode, eta) -> seed -> figures
    steps: dict[str, set[int]] = defaultdict(set)
    for path in paths:
        report = json.loads(Path(path).read_text())
        steps[report["workload"]].add(report["steps"])
        for eta, entry in report["by_eta"].items():
            runs[report["workload"], report.get("speculation", "off"), int(eta)][report["seed"]] = {
                "systems": entry["systems"], "bound": report["upper_bound_tokens_per_s"],
                "latency": entry.get("staleflow_of_latency_bound", {}).get(STEADY)}
    lines = ["| setting | steps | eta | speculation | seeds | StaleFlow tokens/s, whole / steady | of upper bound, whole / steady "
             "| of latency-aware bound (steady) | best bound-keeping (steady) | over best, whole / steady | goal (steady) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    order = list(steps)  # workloads in the order of the arguments
    for (workload, mode, eta), seeds in sorted(runs.items(), key=lambda item: (order.index(item[0][0]), item[0][2], item[0][1])):
        figures = list(seeds.values())
        flow = [f["systems"]["staleflow"] for f in figures]
        share = {key: [s[key] / f["bound"] for s, f in zip(flow, figures)] for key in (WHOLE, STEADY)}
        over = {key: [s[key] / best_keeping(f["systems"], eta, key)[1] for s, f in zip(flow, figures)] for key in (WHOLE, STEADY)}
        names = sorted({best_keeping(f["systems"], eta, STEADY)[0] for f in figures})
        latency = [f["latency"] for f in figures if f["latency"] is not None]
        met = statistics.median(share[STEADY]) >= SHARE_GOAL.get(eta, 1.0) and statistics.median(over[STEADY]) >= RATIO_GOAL
        lines.append(
            f"| {workload} | {'/'.join(map(str, sorted(steps[workload])))} | {eta} | {mode} | {', '.join(map(str, sorted(seeds)))} "
            f"| {spread([s[WHOLE] for s in flow], ',.0f')} / {spread([s[STEADY] for s in flow], ',.0f')} "
            f"| {spread(share[WHOLE], '.2f')} / {spread(share[STEADY], '.2f')} | {spread(latency, '.2f') if latency else '-'} "
            f"| {', '.join(names)} | {spread(over[WHOLE], '.2f')}x / {spread(over[STEADY], '.2f')}x "
            f"| {('met' if met else 'not met') if mode == 'siblings' else '-'} |")
    return lines


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(rows(paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

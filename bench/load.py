"""Coordinator and protocol under load: decision time per tick and memory, up to 1,024 instances and
100,000 in-flight requests.

For each size (instances x in-flight requests) the setup of ``staleflow bench coordinator`` is used
as is (:func:`staleflow.bench.coordinator.measure`: simulated instances, a staleness protocol with
``eta = 3`` holding the requests, the StaleFlow coordinator routing them, a virtual clock):

* **time**: the coordinator's decision per tick (``plan`` on a full tick, steady state, and after
  1% of the requests were interrupted back to the queue), median and p95 over ``--ticks`` ticks,
  against the goal of :data:`GOAL_MS` per tick (wall time), with the same figures in the process's
  CPU time beside them and the count of full garbage collections that fell inside the timed ticks;
* **memory**: the peak of Python allocations (``tracemalloc``) while the same setup is built and
  ticked once, in a separate run (tracing slows allocation, so the timed run is untraced). Memory
  is linear if the bytes per in-flight request stay flat across sizes; the least-squares line
  through (requests, bytes) and each size's deviation from it are reported.

Reproduce: ``staleflow bench load [--scales 128x12500 256x25000 512x50000 1024x100000] [--ticks 10] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tracemalloc
from typing import Any

DEFAULT_SCALES = ("128x12500", "256x25000", "512x50000", "1024x100000")
GOAL_MS = 20.0
#: Largest deviation of a size's peak memory from the fitted line still called linear.
LINEAR_TOLERANCE = 0.15


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scales", nargs="+", default=list(DEFAULT_SCALES), metavar="INSTANCESxREQUESTS",
                        help=f"sizes to measure (default: {' '.join(DEFAULT_SCALES)})")
    parser.add_argument("--ticks", type=int, default=10, help="ticks timed per size (default: 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-memory", action="store_true", help="skip the (slower) traced memory runs")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON only")


def peak_memory(instances: int, requests: int, seed: int) -> int:
    """Peak bytes allocated by Python while the setup is built and ticked once (tracemalloc)."""
    from staleflow.bench.coordinator import measure

    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        measure(instances, requests, 1, seed)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def linear_fit(points: list[tuple[int, int]]) -> dict[str, Any]:
    """Least-squares line ``bytes = base + per_request * requests`` and each point's relative deviation."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else 0.0
    base = mean_y - slope * mean_x
    deviations = [abs(y - (base + slope * x)) / y for x, y in points]
    return {
        "bytes_per_request": slope,
        "base_bytes": base,
        "max_deviation": max(deviations),
        "linear": max(deviations) <= LINEAR_TOLERANCE,
    }


def run(args: argparse.Namespace) -> int:
    from staleflow.bench.coordinator import measure, parse_scale

    try:
        scales = [parse_scale(s) for s in args.scales]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.ticks < 1:
        print("error: --ticks must be >= 1", file=sys.stderr)
        return 2
    rows = []
    for instances, requests in scales:
        timing = measure(instances, requests, args.ticks, args.seed)
        row = {
            "instances": instances,
            "in_flight_requests": timing["in_flight_requests"],
            "plan_ms": timing["plan"],
            "plan_rerouted_1pct_ms": timing["plan_rerouted_1pct"],
            "observe_ms": timing["observe"],
            "cpu_ms": timing["cpu"],
            "full_gc_in_timed_ticks": timing["full_gc"],
            "within_goal": max(timing["plan"]["p95_ms"], timing["plan_rerouted_1pct"]["p95_ms"]) < GOAL_MS,
        }
        if not args.no_memory:
            row["peak_bytes"] = peak_memory(instances, requests, args.seed)
            row["bytes_per_request"] = row["peak_bytes"] / row["in_flight_requests"]
        rows.append(row)
        if not args.json:
            print(_row_text(row), flush=True)
    fit = linear_fit([(r["in_flight_requests"], r["peak_bytes"]) for r in rows]) if not args.no_memory and len(rows) > 1 else None
    command = f"staleflow bench load --scales {' '.join(args.scales)} --ticks {args.ticks}" + (" --no-memory" if args.no_memory else "")
    ok = all(r["within_goal"] for r in rows) and (fit is None or fit["linear"])
    if args.json:
        print(json.dumps({"goal_ms": GOAL_MS, "results": rows, "memory_fit": fit, "ok": ok, "reproduce": command}, indent=2))
        return 0 if ok else 1
    if fit is not None:
        verdict = "linear" if fit["linear"] else "NOT linear"
        print(f"memory: {fit['bytes_per_request']:,.0f} bytes per in-flight request + {fit['base_bytes'] / 2**20:,.1f} MiB; "
              f"largest deviation from the line {fit['max_deviation']:.1%} ({verdict}, tolerance {LINEAR_TOLERANCE:.0%})")
    print(f"goal: decision p95 under {GOAL_MS:.0f} ms per tick: {'met' if all(r['within_goal'] for r in rows) else 'MISSED'}")
    print(f"Reproduce: {command}")
    return 0 if ok else 1


def _row_text(row: dict[str, Any]) -> str:
    cpu = row["cpu_ms"]
    memory = (f", peak memory {row['peak_bytes'] / 2**20:,.1f} MiB ({row['bytes_per_request']:,.0f} B per request)"
              if "peak_bytes" in row else "")
    return (
        f"{row['instances']:>5} instances, {row['in_flight_requests']:>7,} in flight: "
        f"plan {row['plan_ms']['median_ms']:.2f} ms (p95 {row['plan_ms']['p95_ms']:.2f}), "
        f"with 1% re-routed {row['plan_rerouted_1pct_ms']['median_ms']:.2f} ms "
        f"(p95 {row['plan_rerouted_1pct_ms']['p95_ms']:.2f}), snapshots {row['observe_ms']['median_ms']:.2f} ms"
        f"{memory}\n{'':>27}in CPU time: plan {cpu['plan']['median_ms']:.2f} ms (p95 {cpu['plan']['p95_ms']:.2f}), "
        f"with 1% re-routed {cpu['plan_rerouted_1pct']['median_ms']:.2f} ms (p95 {cpu['plan_rerouted_1pct']['p95_ms']:.2f}); "
        f"full collections in the timed plans: {row['full_gc_in_timed_ticks']['plan']} and "
        f"{row['full_gc_in_timed_ticks']['plan_rerouted_1pct']}"
    )

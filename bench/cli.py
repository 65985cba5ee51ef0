"""``staleflow bench NAME``: dispatch to one benchmark module (each has add_arguments/run)."""

from __future__ import annotations

import argparse
import importlib

#: benchmark -> module implementing it
BENCHMARKS: dict[str, str] = {
    "protocol": "staleflow.bench.protocol",
    "coordinator": "staleflow.bench.coordinator",
    "chaos": "staleflow.bench.chaos",
    "load": "staleflow.bench.load",
    "convergence": "staleflow.bench.convergence",
    "time-to-quality": "staleflow.bench.time_to_quality",
    "weight-sync": "staleflow.bench.weight_sync",
    "mutation": "staleflow.bench.mutation",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    benches = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        sub = benches.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        sub.set_defaults(_bench_module=module_name)
        module.add_arguments(sub)


def run(args: argparse.Namespace) -> int:
    return int(importlib.import_module(args._bench_module).run(args))

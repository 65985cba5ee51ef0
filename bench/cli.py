"""``staleflow bench NAME``: dispatch to one benchmark module (each has add_arguments/run)."""

from __future__ import annotations

import argparse
from types import ModuleType

from staleflow.bench import (
    chaos,
    convergence,
    coordinator,
    draft_acceptance,
    draft_index,
    load,
    mutation,
    protocol,
    response_lengths,
    time_to_quality,
    trace_cost,
    weight_check,
    weight_sync,
)

#: benchmark -> module implementing it
BENCHMARKS: dict[str, ModuleType] = {
    "protocol": protocol,
    "trace-cost": trace_cost,
    "coordinator": coordinator,
    "chaos": chaos,
    "load": load,
    "convergence": convergence,
    "time-to-quality": time_to_quality,
    "weight-sync": weight_sync,
    "weight-check": weight_check,
    "mutation": mutation,
    "draft-acceptance": draft_acceptance,
    "draft-index": draft_index,
    "response-lengths": response_lengths,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    benches = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, module in BENCHMARKS.items():
        sub = benches.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        sub.set_defaults(_bench_module=module)
        module.add_arguments(sub)


def run(args: argparse.Namespace) -> int:
    return int(args._bench_module.run(args))

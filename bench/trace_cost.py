"""What tracing the protocol costs per admitted group: the time (traced over untraced) and the writes.

One steady-state call sequence (reserve until refused, finish in random order, a few aborts,
consume as soon as possible; :func:`recorded_ops`) is replayed on a fresh manager:

* timed: untraced, traced to a JSONL file (refused reserves counted, the default) and traced with
  every refusal, alternately ``repeats`` times each, the fastest of each counting, in this process's
  CPU time (what tracing costs, without the time other processes take the core away on a shared
  machine); the file is written and closed inside the timed loop. Goal: a traced group costs at
  most :data:`GOAL_TRACE_RATIO` untraced ones. ``--runs N`` repeats the whole measurement and
  prints the median and range of each figure (a run's ratio moves by a third on a busy machine).
* counted (:func:`trace_footprint`, the same on every machine): the writer's stream calls and the
  characters written per admitted group; ``tests/test_trace_cost.py`` holds them to a budget and
  checks that the manager built no event object on the way (the writer's fast path).

Reproduce: ``staleflow bench trace-cost [--runs 7] [--batches 200] [--seed 0] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from staleflow.protocol import LockedStalenessManager, ProtocolEvent, StalenessManager
from staleflow.protocol.trace import JsonlTraceWriter

#: a traced group (refused reserves counted, not traced) costs at most this many untraced ones
GOAL_TRACE_RATIO = 3.0
#: the (eta, batch size) settings measured
SETTINGS = ((1, 64), (3, 512))
_MODES = ("untraced", "traced", "traced_refusals")

Call = tuple[str, tuple[object, ...]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", type=int, default=1, help="whole measurements; median and range printed (default 1)")
    parser.add_argument("--batches", type=int, default=200, help="batches consumed by the replayed sequence (default 200)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON only")


def _direct(op: str, fn: Callable[[], object]) -> object:
    return fn()


def drive_steady_state(
    manager: StalenessManager | LockedStalenessManager, eta: int, batch_size: int, batches: int, seed: int,
    call: Callable[[str, Callable[[], object]], object] = _direct,
) -> None:
    """A steady state like a real run, until ``batches`` consumes: instances at versions
    ``version - eta .. version`` keep reserving until refused at their version, a batch of the running
    groups finishes (2% aborted) and every full batch is consumed. Each protocol call is made through
    ``call(op, fn)`` (the timed bench times it there)."""
    rng = random.Random(seed)
    running: list[int] = []
    next_id = 0
    while manager.version < batches:
        while True:
            version = rng.randint(max(0, manager.version - eta), manager.version)
            if not call("reserve", lambda: manager.reserve(next_id, version)):
                break
            running.append(next_id)
            next_id += 1
        rng.shuffle(running)
        finishing, running = running[:batch_size], running[batch_size:]
        for group_id in finishing:
            if rng.random() < 0.02:
                call("abort", lambda: manager.abort(group_id))
            else:
                call("occupy", lambda: manager.occupy(group_id))
        while manager.can_consume():
            call("consume", manager.consume)
        if not finishing and not manager.can_consume():
            break
        running = [g for g in running if g in manager]


def recorded_ops(eta: int, batch_size: int, batches: int, seed: int) -> list[Call]:
    """The calls of one steady-state run (reserve, occupy, abort, consume), recorded for replay."""
    ops: list[Call] = []
    manager = StalenessManager(eta=eta, batch_size=batch_size)

    def record(e: ProtocolEvent) -> None:
        if e.op == "reserve":
            ops.append(("reserve", (e.group_id, e.version)))
        elif e.op in ("occupy", "abort"):
            ops.append((e.op, (e.group_id,)))
        else:
            ops.append(("consume", ()))

    manager.add_event_hook(record)
    drive_steady_state(manager, eta, batch_size, batches, seed)
    return ops


def _admitted(ops: list[Call]) -> int:
    return sum(1 for op, _ in ops if op in ("occupy", "abort"))  # every admitted group ends so


def trace_cost(batches: int, seed: int, repeats: int = 5) -> dict[str, dict[str, float]]:
    """ns per admitted group of :func:`recorded_ops` replayed untraced, traced and traced with every
    refusal, alternately ``repeats`` times each; the fastest run of each counts (CPU time)."""
    rows = {}
    for eta, batch_size in SETTINGS:
        ops = recorded_ops(eta, batch_size, batches, seed)
        groups = _admitted(ops)
        best = dict.fromkeys(_MODES, float("inf"))
        with tempfile.TemporaryDirectory() as folder:
            for _ in range(repeats):
                for mode in best:
                    manager = StalenessManager(eta, batch_size)
                    calls = [(getattr(manager, op), args) for op, args in ops]
                    start = time.process_time_ns()
                    writer = None if mode == "untraced" else JsonlTraceWriter.attach(
                        manager, Path(folder) / "trace.jsonl", refusals=mode == "traced_refusals")
                    for fn, args in calls:
                        fn(*args)
                    if writer is not None:
                        writer.close()
                    best[mode] = min(best[mode], (time.process_time_ns() - start) / groups)
        rows[f"eta={eta},B={batch_size}"] = {
            "groups": float(groups),
            "refused_reserves": float(sum(1 for op, _ in ops if op == "reserve") - groups),
            **{f"{mode}_ns_per_group": ns for mode, ns in best.items()},
            "traced_ratio": best["traced"] / best["untraced"],
            "traced_refusals_ratio": best["traced_refusals"] / best["untraced"],
        }
    return rows


class CountingStream:
    """A text stream that keeps only counts: ``write`` calls, characters written, ``flush`` calls."""

    def __init__(self) -> None:
        self.writes = 0
        self.chars = 0
        self.flushes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        self.chars += len(text)
        return len(text)

    def flush(self) -> None:
        self.flushes += 1


def trace_footprint(manager: StalenessManager, ops: list[Call]) -> dict[str, float]:
    """Replay ``ops`` on ``manager`` (a fresh one) traced, refusals counted, into a
    :class:`CountingStream`: the stream calls and characters of the events (the header left out),
    in all and per admitted group."""
    stream = CountingStream()
    writer = JsonlTraceWriter.attach(manager, stream)  # type: ignore[arg-type]  # a write/flush stream is all it uses
    header = (stream.writes, stream.chars, stream.flushes)
    for op, args in ops:
        getattr(manager, op)(*args)
    writer.close()
    groups = _admitted(ops)
    writes, chars, flushes = (stream.writes - header[0], stream.chars - header[1], stream.flushes - header[2])
    return {
        "groups": float(groups),
        "events": float(len(ops) - writer.refusals_skipped),
        "consumes": float(sum(1 for op, _ in ops if op == "consume")),
        "writes": float(writes),
        "flushes": float(flushes),
        "bytes": float(chars),  # ASCII only (integer group ids): one byte per character
        "writes_per_group": writes / groups,
        "bytes_per_group": chars / groups,
    }


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run(args: argparse.Namespace) -> int:
    if args.runs < 1 or args.batches < 1:
        print(f"error: --runs and --batches must be at least 1, got {args.runs} and {args.batches}", file=sys.stderr)
        return 2
    runs = [trace_cost(args.batches, args.seed) for _ in range(args.runs)]
    command = f"staleflow bench trace-cost --runs {args.runs} --batches {args.batches} --seed {args.seed}"
    result: dict = {"runs": args.runs, "command": command, "settings": {}}
    for eta, batch_size in SETTINGS:
        key = f"eta={eta},B={batch_size}"
        timed = {figure: _spread([run[key][figure] for run in runs])
                 for figure in (*(f"{mode}_ns_per_group" for mode in _MODES), "traced_ratio", "traced_refusals_ratio")}
        footprint = trace_footprint(StalenessManager(eta, batch_size), recorded_ops(eta, batch_size, args.batches, args.seed))
        result["settings"][key] = {**timed, "footprint": footprint}
    worst = max(row["traced_ratio"]["median"] for row in result["settings"].values())
    result["goal"] = {"traced_ratio": GOAL_TRACE_RATIO, "worst_median": worst, "met": worst <= GOAL_TRACE_RATIO}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_report(result)
    return 0


def _us(spread: dict[str, float]) -> str:
    return f"{spread['median'] / 1e3:.2f} us [{spread['min'] / 1e3:.2f} to {spread['max'] / 1e3:.2f}]"


def _ratio(spread: dict[str, float]) -> str:
    return f"{spread['median']:.2f}x [{spread['min']:.2f}x to {spread['max']:.2f}x]"


def print_report(result: dict) -> None:
    """The figures of :func:`run` as text: per setting the timed figures (median [min to max] over
    the runs) and the counted footprint, then the goal's verdict and the command."""
    print(f"Trace cost per admitted group, CPU time, best of 5 replays per run, {result['runs']} run(s): median [min to max]")
    for key, row in result["settings"].items():
        foot = row["footprint"]
        print(f"  {key}: untraced {_us(row['untraced_ns_per_group'])}, traced {_us(row['traced_ns_per_group'])}, "
              f"ratio {_ratio(row['traced_ratio'])}; with every refusal {_us(row['traced_refusals_ns_per_group'])}, "
              f"ratio {_ratio(row['traced_refusals_ratio'])}")
        print(f"  {key}: {foot['groups']:,.0f} groups, {foot['events']:,.0f} events traced in {foot['writes']:,.0f} writes "
              f"and {foot['flushes']:,.0f} flushes, {foot['bytes']:,.0f} bytes: {foot['writes_per_group']:.4f} writes "
              f"and {foot['bytes_per_group']:.1f} bytes per group")
    goal = result["goal"]
    print(f"worst median traced/untraced ratio {goal['worst_median']:.2f}x "
          f"(goal <= {goal['traced_ratio']}x: {'met' if goal['met'] else 'NOT met'})")
    print(f"Reproduce: {result['command']}")

"""Operations per second of the staleness protocol in a steady state like a real run.

Two measurements:

* steady state: for eta in {1, 3} and batch_size in {64, 512}, instances sit at versions
  ``version - eta .. version``; groups are reserved at a random one of those versions until the
  protocol refuses, finished in random order (occupy), a few are aborted (failed instances), and
  batches are consumed as soon as possible. Every call is timed; the timer's own cost is subtracted.
* scaling: the cost of reserve/occupy/abort at 1,000, 10,000 and 100,000 active groups (batch size
  chosen so that the protocol holds that many), to show the cost does not grow with the group count.
* lock cost: the steady state again through :class:`LockedStalenessManager` (one uncontended
  re-entrant lock per call), next to the plain manager: the per-operation price of thread safety.
* trace cost: the same recorded calls untraced, traced to a JSONL file (refused reserves counted,
  the default) and traced with every refusal; the cost per admitted group and the traced/untraced
  ratio (goal: a traced group costs at most 3x an untraced one; :mod:`staleflow.bench.trace_cost`).

Reproduce: ``staleflow bench protocol [--json]``; the trace cost alone, over several runs:
``staleflow bench trace-cost --runs 7``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict
from collections.abc import Callable

from staleflow.bench.trace_cost import GOAL_TRACE_RATIO, drive_steady_state, recorded_ops, trace_cost
from staleflow.protocol import LockedStalenessManager, StalenessManager

OPS = ("reserve", "occupy", "abort", "consume")
GOAL_OPS_PER_S = 200_000
GOAL_SCALING_RATIO = 1.5
CONSUME_SIZES = (500, 2_000, 8_000, 32_000)
#: consume must stay linear in B: ns per group taken at the largest B over the smallest.
GOAL_CONSUME_RATIO = 2.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the figures as JSON only")
    parser.add_argument("--batches", type=int, default=200, help="batches consumed per steady-state run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--consume-sizes",
        type=lambda text: tuple(int(v) for v in text.split(",")),
        default=CONSUME_SIZES,
        metavar="B,B,...",
        help="batch sizes of the consume table (default %(default)s)",
    )


def _timer_overhead_ns() -> float:
    clock = time.perf_counter_ns
    samples = []
    for _ in range(20_000):
        start = clock()
        samples.append(clock() - start)
    samples.sort()
    return float(samples[len(samples) // 2])


class _Timings:
    """Per-operation total time (ns) and count, with the timer's cost removed."""

    def __init__(self, overhead_ns: float) -> None:
        self.overhead_ns = overhead_ns
        self.total_ns: dict[str, float] = defaultdict(float)
        self.count: dict[str, int] = defaultdict(int)

    def call(self, op: str, fn: Callable[[], object]) -> object:
        start = time.perf_counter_ns()
        result = fn()
        self.total_ns[op] += max(0.0, time.perf_counter_ns() - start - self.overhead_ns)
        self.count[op] += 1
        return result

    def ops_per_s(self, op: str) -> float:
        return self.count[op] / (self.total_ns[op] / 1e9) if self.total_ns[op] else float("inf")


def steady_state(
    eta: int, batch_size: int, batches: int, seed: int, overhead_ns: float, locked: bool = False
) -> dict[str, float]:
    """Run ``batches`` consumes of a refill/finish/consume cycle and time every protocol call
    (through :class:`LockedStalenessManager` when ``locked``)."""
    manager: StalenessManager | LockedStalenessManager = (
        LockedStalenessManager.create(eta, batch_size) if locked else StalenessManager(eta=eta, batch_size=batch_size)
    )
    timings = _Timings(overhead_ns)
    drive_steady_state(manager, eta, batch_size, batches, seed, call=timings.call)
    total_ns = sum(timings.total_ns.values())
    row = {f"{op}_ops_per_s": timings.ops_per_s(op) for op in OPS}
    row["all_ops_per_s"] = sum(timings.count.values()) / (total_ns / 1e9)
    row["consumed_batches"] = float(manager.version)
    return row


def scaling(active: int, eta: int, rounds: int, seed: int, overhead_ns: float) -> dict[str, float]:
    """Per-operation cost (ns) of reserve/occupy/abort with ``active`` groups in the protocol
    (:func:`drive_fixed_size`)."""
    timings = _Timings(overhead_ns)
    drive_fixed_size(active, eta, rounds, seed, call=timings.call)
    return {op: timings.total_ns[op] / timings.count[op] for op in ("reserve", "occupy", "abort")}


def drive_fixed_size(active: int, eta: int, rounds: int, seed: int, call: Callable[[str, Callable[[], object]], object],
                     manager_class: type[StalenessManager] = StalenessManager) -> None:
    """Fill the protocol (a ``manager_class``) to ``active`` groups, half of them finished (not
    through ``call``); then each of ``rounds`` aborts a random finished group, reserves a new one in
    its place and finishes a random running one, each call through ``call(op, fn)``: the size stays
    constant and dict resizing during the fill is not counted."""
    rng = random.Random(seed)
    manager = manager_class(eta=eta, batch_size=active // (eta + 1))
    for group_id in range(active):
        manager.reserve(group_id, 0)
    running, done = list(range(0, active, 2)), list(range(1, active, 2))
    for group_id in done:
        manager.occupy(group_id)

    def take_random(ids: list[int]) -> int:
        index = rng.randrange(len(ids))
        ids[index], ids[-1] = ids[-1], ids[index]
        return ids.pop()

    for new_id in range(active, active + rounds):
        gone = take_random(done)
        call("abort", lambda: manager.abort(gone))
        call("reserve", lambda: manager.reserve(new_id, 0))
        running.append(new_id)
        finished = take_random(running)
        call("occupy", lambda: manager.occupy(finished))
        done.append(finished)


def lock_cost(batches: int, seed: int, overhead_ns: float, repeats: int = 5) -> dict[str, dict[str, float]]:
    """ns per operation of one recorded steady-state call sequence replayed on the plain manager and
    on :class:`LockedStalenessManager`, alternately ``repeats`` times each; the fastest run of each
    counts (the least disturbed by other processes). ``overhead_ns`` is unused: whole loops are timed."""
    rows = {}
    for eta, batch_size in ((1, 64), (3, 512)):
        ops = recorded_ops(eta, batch_size, batches, seed)
        best = {False: float("inf"), True: float("inf")}
        for _ in range(repeats):
            for locked in (False, True):
                manager: StalenessManager | LockedStalenessManager = (
                    LockedStalenessManager.create(eta, batch_size) if locked else StalenessManager(eta, batch_size)
                )
                calls = [(getattr(manager, op), args) for op, args in ops]
                start = time.perf_counter_ns()
                for fn, args in calls:
                    fn(*args)
                best[locked] = min(best[locked], (time.perf_counter_ns() - start) / len(calls))
        rows[f"eta={eta},B={batch_size}"] = {
            "operations": float(len(ops)),
            "plain_ns_per_op": best[False],
            "locked_ns_per_op": best[True],
            "lock_ns_per_op": best[True] - best[False],
            "lock_overhead_pct": 100.0 * (best[True] - best[False]) / best[False],
        }
    return rows


def _print_trace_table(rows: dict[str, dict[str, float]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Trace cost per admitted group: untraced vs JsonlTraceWriter (ns, 1 thread, best of 5)")
    for column in ("setting", "untraced", "traced", "ratio", "traced + refusals", "ratio"):
        table.add_column(column, justify="left" if column == "setting" else "right")
    for setting, row in rows.items():
        table.add_row(setting, f"{row['untraced_ns_per_group']:,.0f}", f"{row['traced_ns_per_group']:,.0f}",
                      f"{row['traced_ratio']:.2f}x", f"{row['traced_refusals_ns_per_group']:,.0f}",
                      f"{row['traced_refusals_ratio']:.2f}x")
    worst = max(row["traced_ratio"] for row in rows.values())
    Console().print(table)
    Console().print(f"worst traced/untraced ratio {worst:.2f}x (goal <= {GOAL_TRACE_RATIO}x: "
                    f"{'met' if worst <= GOAL_TRACE_RATIO else 'NOT met'})")


def _print_lock_table(rows: dict[str, dict[str, float]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Lock cost: one steady-state call sequence, plain vs LockedStalenessManager (ns per op, 1 thread, best of 5)")
    for column in ("setting", "plain", "locked", "lock", "overhead"):
        table.add_column(column, justify="left" if column == "setting" else "right")
    for setting, row in rows.items():
        table.add_row(setting, f"{row['plain_ns_per_op']:,.0f}", f"{row['locked_ns_per_op']:,.0f}",
                      f"{row['lock_ns_per_op']:,.0f}", f"{row['lock_overhead_pct']:.0f}%")
    Console().print(table)


def consume_cost(batch_size: int, rounds: int, overhead_ns: float) -> dict[str, float]:
    """Cost of one ``consume`` taking ``batch_size`` groups (eta 1, so the protocol holds 2 B).

    Each round (untimed) reserves at the trainer's version until refused and finishes every running
    group, then times one consume: it takes B of the 2 B finished groups, leaving the other half
    for the next round (so both a partial and a whole bucket are taken). Reported: the best round
    (least disturbed by other load) in ms, and that time per group taken in ns.
    """
    manager = StalenessManager(eta=1, batch_size=batch_size)
    next_id = 0
    best = float("inf")
    for _ in range(rounds):
        while manager.reserve(next_id, manager.version):
            manager.occupy(next_id)
            next_id += 1
        timings = _Timings(overhead_ns)
        timings.call("consume", manager.consume)
        best = min(best, timings.total_ns["consume"])
    return {"consume_ms": best / 1e6, "ns_per_group": best / batch_size}


def run(args: argparse.Namespace) -> int:
    overhead_ns = _timer_overhead_ns()
    steady = {
        f"eta={eta},B={b}": steady_state(eta, b, args.batches, args.seed, overhead_ns)
        for eta in (1, 3)
        for b in (64, 512)
    }
    sizes = (1_000, 10_000, 100_000)
    per_op_ns = {str(n): scaling(n, 3, 20_000, args.seed, overhead_ns) for n in sizes}
    worst_ratio = max(
        max(per_op_ns[str(n)][op] for n in sizes) / min(per_op_ns[str(n)][op] for n in sizes)
        for op in ("reserve", "occupy", "abort")
    )
    slowest = min(row["all_ops_per_s"] for row in steady.values())
    consume_by_b = {str(b): consume_cost(b, 7, overhead_ns) for b in args.consume_sizes}
    per_group = [row["ns_per_group"] for row in consume_by_b.values()]
    consume_ratio = per_group[-1] / per_group[0]
    result = {
        "steady_state": steady,
        "per_op_ns_by_active_groups": per_op_ns,
        "slowest_all_ops_per_s": slowest,
        "worst_scaling_ratio": worst_ratio,
        "consume_by_batch_size": consume_by_b,
        "consume_ns_per_group_ratio": consume_ratio,
        "goals": {
            "ops_per_s": {"goal": GOAL_OPS_PER_S, "met": slowest >= GOAL_OPS_PER_S},
            "scaling_ratio": {"goal": GOAL_SCALING_RATIO, "met": worst_ratio <= GOAL_SCALING_RATIO},
            "consume_linear": {"goal": GOAL_CONSUME_RATIO, "met": consume_ratio <= GOAL_CONSUME_RATIO},
        },
        "timer_overhead_ns": overhead_ns,
        "command": "staleflow bench protocol",
    }
    lock_rows = lock_cost(args.batches, args.seed, overhead_ns)
    result["lock_cost"] = lock_rows
    trace_rows = trace_cost(args.batches, args.seed)
    worst_trace = max(row["traced_ratio"] for row in trace_rows.values())
    result["trace_cost"] = trace_rows
    result["goals"]["trace_ratio"] = {"goal": GOAL_TRACE_RATIO, "met": worst_trace <= GOAL_TRACE_RATIO}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    _print_tables(result)
    _print_lock_table(lock_rows)
    _print_trace_table(trace_rows)
    return 0


def _print_tables(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="Protocol steady state (operations per second)")
    table.add_column("setting")
    for op in (*OPS, "all"):
        table.add_column(op, justify="right")
    for setting, row in result["steady_state"].items():
        table.add_row(setting, *(f"{row[f'{op}_ops_per_s']:,.0f}" for op in (*OPS, "all")))
    console.print(table)
    scale = Table(title="Per-operation cost by active groups (ns, eta=3)")
    scale.add_column("active groups", justify="right")
    for op in ("reserve", "occupy", "abort"):
        scale.add_column(op, justify="right")
    for size, row in result["per_op_ns_by_active_groups"].items():
        scale.add_row(f"{int(size):,}", *(f"{row[op]:,.0f}" for op in ("reserve", "occupy", "abort")))
    console.print(scale)
    linear = Table(title="consume by batch size (eta=1, best of 7)")
    for column in ("B", "consume (ms)", "per group taken (ns)"):
        linear.add_column(column, justify="right")
    for size, row in result["consume_by_batch_size"].items():
        linear.add_row(f"{int(size):,}", f"{row['consume_ms']:,.3f}", f"{row['ns_per_group']:,.0f}")
    console.print(linear)
    goals = result["goals"]
    console.print(
        f"slowest steady state: {result['slowest_all_ops_per_s']:,.0f} ops/s "
        f"(goal >= {GOAL_OPS_PER_S:,}: {'met' if goals['ops_per_s']['met'] else 'NOT met'}); "
        f"worst cost ratio 1k -> 100k groups: {result['worst_scaling_ratio']:.2f}x "
        f"(goal <= {GOAL_SCALING_RATIO}x: {'met' if goals['scaling_ratio']['met'] else 'NOT met'}); "
        f"consume per group, largest B over smallest: {result['consume_ns_per_group_ratio']:.2f}x "
        f"(goal <= {GOAL_CONSUME_RATIO}x: {'met' if goals['consume_linear']['met'] else 'NOT met'})"
    )
    console.print(f"reproduce: {result['command']}")

"""``staleflow simulate``: StaleFlow and the baselines side by side on a simulated cluster (the work:
:mod:`staleflow.app.simulation`).

Exit codes: 0 done; 1 a run stalled or broke a guarantee (staleness above ``eta``, a lost or
duplicated trajectory); 2 bad arguments or workload file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from staleflow.app import simulation, simulation_plots
from staleflow.app.simulation import ABLATIONS, BASELINE_ABLATIONS, BEST, BEST_PAPER, DEFAULT_SYSTEMS, UPPER_BOUND
from staleflow.runtime.settings.workload import WorkloadError, load_workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", required=True, help="workload YAML file, or the name of a shipped one (e.g. small-ci)")
    parser.add_argument(
        "--systems",
        nargs="+",
        default=list(DEFAULT_SYSTEMS),
        metavar="SYSTEM",
        help=f"systems to run (default: {' '.join(DEFAULT_SYSTEMS)}); 'ablation' adds {' '.join(ABLATIONS)}; "
        f"'all' runs every system (the baseline ablations {' '.join(BASELINE_ABLATIONS)} included); '{UPPER_BOUND}' is always reported",
    )
    parser.add_argument("--eta", nargs="+", type=int, default=[3], help="staleness bound(s) (default: 3)")
    parser.add_argument("--steps", type=int, default=20, help="training steps per run (default: 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts' response lengths (default: 0)")
    parser.add_argument("--estimation-error", type=float, default=0.1,
                        help="relative error of the cost model the coordinator plans with (default: 0.1, as the paper measured)")
    parser.add_argument("--cost-refit-s", type=float, default=None, metavar="S",
                        help="refit the planner's cost model to the engines' decode steps every S simulated seconds, as "
                        "staleflow train does (default: plan with it as it is)")
    parser.add_argument("--group-redundancy", type=int, default=0, metavar="N_EXTRA",
                        help="StaleFlow samples N_EXTRA more responses per group, keeps the first (default: 0)")
    parser.add_argument("--batch-redundancy", type=int, default=0, metavar="X",
                        help="StaleFlow admits X groups beyond the batches, drops the surplus (default: 0)")
    parser.add_argument("--speculation", choices=simulation.SPECULATION, default="off",
                        help="engines speculate at every batch size, timed by the cost model: 'request' drafts from each "
                        "request's own tokens for every system; 'siblings' also from the group's other responses for "
                        "StaleFlow (default: off; the acceptance rates are fitted to replayed samples of a math model, not of a reasoning "
                        "model: docs/simulation.md)")
    parser.add_argument("--draft-positions", choices=simulation.DRAFT_POSITIONS, default="off",
                        help="with --speculation: 'uniform' accepts drafts at the rate measured where each request is in its "
                        "response, every request drafting the same k; 'per-request': each its own k (default: off, one rate)")
    parser.add_argument("--rollout-gpus", type=int, default=None, metavar="N",
                        help="give N of the workload's GPUs to rollout and the rest to the trainer (default: the workload's split)")
    parser.add_argument("--tick", type=float, default=None, help="coordinator tick in seconds (default: the workload's)")
    parser.add_argument("--quantum", type=float, default=None, help="engine event grid in seconds (default: the workload's)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON on stdout (nothing else)")
    parser.add_argument("--out", type=Path, default=None, help="write results.json and PNG plots into this folder")
    parser.add_argument(
        "--trace-dir", type=Path, default=None,
        help="write each run's protocol trace as DIR/<system>-eta<eta>.jsonl (check with staleflow verify --trace)",
    )


def run(args: argparse.Namespace) -> int:
    err = Console(stderr=True)
    try:
        workload = load_workload(args.workload)
        if args.rollout_gpus is not None:
            workload = workload.with_rollout_gpus(args.rollout_gpus)
        systems = simulation.expand_systems(args.systems)
    except (WorkloadError, ValueError) as exc:
        err.print(f"[red]error:[/red] {exc}", markup=True, highlight=False)
        return 2
    problems = _problems(args)
    if problems:
        err.print("error: " + "; ".join(problems), highlight=False)
        return 2
    comparison = simulation.Comparison(
        systems=systems, etas=list(args.eta), steps=args.steps, seed=args.seed, tick_s=args.tick, event_quantum_s=args.quantum,
        estimation_error=args.estimation_error, cost_refit_s=args.cost_refit_s, group_redundancy=args.group_redundancy,
        batch_redundancy=args.batch_redundancy,
        trace_dir=args.trace_dir, speculation=args.speculation, draft_positions=args.draft_positions,
    )
    with Progress(console=err, transient=True, disable=not err.is_terminal) as progress:
        report, exit_code = simulation.compare_systems(workload, comparison, progress, lambda line: err.print(line, highlight=False))
    if args.out is not None:  # first: a long grid's results survive a failure to print or plot
        simulation.write_results(report, args.out)
    if args.json:
        sys.stdout.write(json.dumps(simulation.json_payload(report, comparison), indent=2) + "\n")
    else:
        out = Console()
        if not out.is_terminal:
            out = Console(width=200)  # a file or pipe: keep each row on one line
        print_tables(report, out)
    if args.out is not None:
        written = simulation_plots.write_plots(report, args.out) if any(r["systems"] for r in report["by_eta"].values()) else []
        err.print(f"wrote {args.out / 'results.json'} and {len(written)} plots into {args.out}", highlight=False)
    return exit_code


def _problems(args: argparse.Namespace) -> list[str]:
    """What is wrong with the numeric arguments (empty: nothing)."""
    problems = [f"--steps must be >= 1, got {args.steps}"] if args.steps < 1 else []
    problems += [f"--eta must be >= 0, got {e}" for e in args.eta if e < 0]
    problems += [f"--{k} must be > 0" for k, v in (("tick", args.tick),) if v is not None and v <= 0]
    problems += ["--quantum must be >= 0"] if args.quantum is not None and args.quantum < 0 else []
    problems += [] if args.cost_refit_s is None or args.cost_refit_s > 0 else [f"--cost-refit-s must be > 0, got {args.cost_refit_s}"]
    problems += [] if 0 <= args.estimation_error < 0.5 else [f"--estimation-error must be in [0, 0.5), got {args.estimation_error}"]
    problems += [f"--{k.replace('_', '-')} must be >= 0" for k in ("group_redundancy", "batch_redundancy") if getattr(args, k) < 0]
    problems += ["--draft-positions needs --speculation"] if args.draft_positions != "off" and args.speculation == "off" else []
    return problems


def histogram_text(histogram: dict[str, int]) -> str:
    total = sum(histogram.values()) or 1
    return " ".join(f"{s}:{100 * n / total:.0f}%" for s, n in sorted(histogram.items(), key=lambda kv: int(kv[0])))


def print_tables(report: dict[str, Any], console: Any) -> None:
    bound = report["upper_bound_tokens_per_s"]
    for eta_key, run in report["by_eta"].items():
        table = Table(title=f"{report['workload']} ({report['gpus']} GPUs), eta={eta_key}, {report['steps']} steps, seed {report['seed']}")
        for column in ("system", "tokens/s", "steady tokens/s", "of bound", "step time (s)", "steady step (s)", "utilisation",
                       "trainer busy",
                       "staleness p99/max", "past eta", "staleness (groups)", "dropped", "wasted tokens", "lost/dup", "wall (s)"):
            table.add_column(column, justify="left" if column in ("system", "staleness (groups)") else "right",
                             no_wrap=column == "system")
        for name, f in run["systems"].items():
            label = name if f["admission_eta"] == f["eta"] else f"{name} (admits at eta {f['admission_eta']})"
            table.add_row(
                label, f"{f['tokens_per_s']:,.0f}", _figure(f["steady_tokens_per_s"], ",.0f"), f"{f['tokens_per_s'] / bound:.0%}",
                f"{f['step_time_s']:.1f}", _figure(f["steady_step_time_s"], ".1f"),
                f"{f['utilisation']:.0%}", f"{f['trainer_busy']:.0%}", f"{f['staleness_p99']}/{f['max_staleness']}",
                f"{f['past_eta_share']:.1%}", histogram_text(f["staleness_histogram"]),
                str(f["dropped"] + f["proactive_aborted"]), f"{f['wasted_tokens']:,}", f"{f['lost']}/{f['duplicated']}",
                f"{f['wall_s']:.1f}",
            )
        table.add_row(UPPER_BOUND, f"{bound:,.0f}", "", "100%", *[""] * 11)
        latency = run["latency_bound"]["tokens_per_s"]
        table.add_row("latency-bound", f"{latency:,.0f}", "", f"{latency / bound:.0%}", *[""] * 11)
        console.print(table)
        skip = next(iter(run["systems"].values()))["steady_skip_steps"] if run["systems"] else 0
        for line in comparison_lines(run, int(eta_key), skip):
            console.print(line, highlight=False)


def _figure(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def comparison_lines(run: dict[str, Any], eta: int, skip: int) -> list[str]:
    """StaleFlow's ratio on both comparison bases, whole run and steady state (the first ``skip``
    steps left out): over each system the paper ran (with the share of its groups trained past
    ``eta`` and its largest lag), and over the best baseline that keeps the bound."""
    whole, steady = run["staleflow_ratio"], run["staleflow_ratio_steady"]
    if not whole:
        return []

    def pair(name: str) -> str:
        later = f", steady {steady[name]:.2f}x" if name in steady else ""
        return f"{whole[name]:.2f}x{later}"

    systems = run["systems"]
    paper = [f"{name} {pair(name)} ({systems[name]['past_eta_share']:.1%} past eta, max lag {systems[name]['max_staleness']})"
             for name in simulation.PAPER_SYSTEMS if name in whole]
    lines = []
    if paper:
        lines.append(f"StaleFlow over the systems the paper ran (steady: without the first {skip} steps): " + "; ".join(paper)
                     + (f"; best of them {pair(BEST_PAPER)}" if BEST_PAPER in whole else ""))
    if BEST in whole:
        lines.append(f"StaleFlow over the best bound-keeping baseline (p99 staleness within eta {eta}): {pair(BEST)}")
    rest = [f"{name} {pair(name)}" for name in whole
            if name not in (*simulation.PAPER_SYSTEMS, BEST, BEST_PAPER, UPPER_BOUND)]
    if rest:
        lines.append("StaleFlow over the others: " + "; ".join(rest))
    if UPPER_BOUND in whole:
        later = f" (steady {steady[UPPER_BOUND]:.0%})" if UPPER_BOUND in steady else ""
        lines.append(f"StaleFlow of the upper bound: {whole[UPPER_BOUND]:.0%}{later}")
    share = run.get("staleflow_of_latency_bound", {})
    if "tokens_per_s" in share:
        later = f" (steady {share['steady_tokens_per_s']:.0%})" if "steady_tokens_per_s" in share else ""
        lines.append(f"StaleFlow of the latency-aware bound (each batch's longest response decoded alone within the "
                     f"eta + 1 step window): {share['tokens_per_s']:.0%}{later}")
    return lines

"""``staleflow simulate``: StaleFlow and the baselines side by side on a simulated cluster.

Every system runs the same runtime (protocol, trajectory and parameter servers, coordinator, run
loop) against simulated rollout instances and a simulated trainer in virtual time, on the same
prompts and response lengths (same seed). The table reports throughput (trained response tokens per
second), time per step, instance utilisation, staleness and drops, and StaleFlow's ratio to each
baseline and to the workload's upper bound (:mod:`staleflow.cli.upper_bound`).

Exit codes: 0 done; 1 a run stalled or broke a guarantee (staleness above ``eta``, a lost or
duplicated trajectory); 2 bad arguments or workload file.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from staleflow.runtime.workload import Workload

BASELINES = ("sync", "one-step-off", "inflight-cap", "start-version-gc")
ABLATIONS = ("staleflow-no-routing", "staleflow-no-sync", "staleflow-no-migration", "staleflow-fresh")
DEFAULT_SYSTEMS = ("staleflow", *BASELINES)
UPPER_BOUND = "upper-bound"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", required=True, help="workload YAML file, or the name of a shipped one (e.g. small-ci)")
    parser.add_argument(
        "--systems",
        nargs="+",
        default=list(DEFAULT_SYSTEMS),
        metavar="SYSTEM",
        help=f"systems to run (default: {' '.join(DEFAULT_SYSTEMS)}); 'ablation' adds {' '.join(ABLATIONS)}; "
        f"'all' runs every system; '{UPPER_BOUND}' is always reported",
    )
    parser.add_argument("--eta", nargs="+", type=int, default=[3], help="staleness bound(s) (default: 3)")
    parser.add_argument("--steps", type=int, default=20, help="training steps per run (default: 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts' response lengths (default: 0)")
    parser.add_argument("--tick", type=float, default=None, help="coordinator tick in seconds (default: the workload's)")
    parser.add_argument("--quantum", type=float, default=None, help="engine event grid in seconds (default: the workload's)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON on stdout (nothing else)")
    parser.add_argument("--out", type=Path, default=None, help="write results.json and PNG plots into this folder")
    parser.add_argument(
        "--trace-dir", type=Path, default=None,
        help="write each run's protocol trace as DIR/<system>-eta<eta>.jsonl (check with staleflow verify --trace)",
    )


def _systems(requested: list[str]) -> list[str]:
    from staleflow.runtime.policies import POLICIES

    names: list[str] = []
    for name in requested:
        expanded = {"all": list(POLICIES), "ablation": ["staleflow", *ABLATIONS]}.get(name, [name])
        for item in expanded:
            if item == UPPER_BOUND:
                continue
            if item not in POLICIES:
                known = ", ".join([*POLICIES, UPPER_BOUND, "ablation", "all"])
                raise ValueError(f"unknown system {item!r}; known: {known}")
            if item not in names:
                names.append(item)
    return names


def simulate_system(
    workload: Workload,
    system: str,
    eta: int,
    steps: int,
    seed: int,
    tick_s: float | None = None,
    event_quantum_s: float | None = None,
    on_step: Any = None,
    trace_path: Path | None = None,
) -> dict[str, Any]:
    """Run one system for ``steps`` training steps; returns its figures (the JSON entry).

    With ``trace_path`` the run's protocol trace is written there (JSONL, for ``verify --trace``).
    """
    from staleflow.adapters.sim.engine import SimEngine
    from staleflow.adapters.sim.trainer import SimTrainer
    from staleflow.runtime.assembly import RunSpec, assemble_run
    from staleflow.runtime.clock import VirtualClock
    from staleflow.runtime.loop import RunParts

    spec = RunSpec.from_workload(workload, system, eta, tick_s=tick_s)
    policy = spec.policy
    clock = VirtualClock()
    quantum = workload.simulation.event_quantum_s if event_quantum_s is None else event_quantum_s
    parts = RunParts(
        engines=[
            SimEngine.from_workload(workload, f"i{i}", clock, event_quantum_s=quantum)
            for i in range(workload.cluster.rollout_instances)
        ],
        trainer=SimTrainer.from_workload(workload, clock),
        prompts=workload.prompt_groups(seed, n_extra=policy.group_redundancy),
        cost_model=workload.build_cost_model(),
        clock=clock,
    )
    loop = assemble_run(spec, parts, trace_path=trace_path)
    started = time.perf_counter()
    try:
        metrics = loop.run(steps, on_step=on_step)
    finally:
        loop.close()
    wall = time.perf_counter() - started
    return {
        "tokens_per_s": metrics.tokens_per_s,
        "step_time_s": metrics.step_time_s,
        "utilisation": metrics.utilisation,
        "max_staleness": metrics.max_staleness,
        "staleness_histogram": {str(k): v for k, v in metrics.staleness_histogram.items()},
        "dropped": metrics.dropped,
        "eta": policy.protocol_eta(eta),
        "generated_tokens_per_s": metrics.tokens_generated / metrics.elapsed_s,
        "trainer_busy": sum(m["step_time_s"] for m in metrics.train_metrics) / metrics.elapsed_s,
        "steps": metrics.steps,
        "step_times_s": metrics.step_times_s,
        "staleness_per_buffer": {
            str(b): {str(s): n for s, n in counts.items()} for b, counts in metrics.staleness_per_buffer.items()
        },
        "gc_aborted": metrics.gc_aborted,
        "lost": metrics.lost,
        "duplicated": metrics.duplicated,
        "virtual_s": metrics.elapsed_s,
        "wall_s": wall,
        "coordinator_decision_s": metrics.coordinator.get("decision_seconds", 0.0),
    }


def _violations(results: dict[str, dict[str, Any]]) -> list[str]:
    problems = []
    for name, figures in results.items():
        if figures["max_staleness"] > figures["eta"]:
            problems.append(f"{name}: staleness {figures['max_staleness']} above its bound {figures['eta']}")
        if figures["lost"] or figures["duplicated"]:
            problems.append(f"{name}: {figures['lost']} lost and {figures['duplicated']} duplicated trajectories")
    return problems


def _ratios(systems: dict[str, dict[str, Any]], bound: float) -> dict[str, float]:
    """StaleFlow's throughput over each other system's, and over the upper bound."""
    if "staleflow" not in systems:
        return {}
    ours = systems["staleflow"]["tokens_per_s"]
    ratios = {name: ours / f["tokens_per_s"] for name, f in systems.items() if name != "staleflow" and f["tokens_per_s"] > 0}
    ratios[UPPER_BOUND] = ours / bound if bound > 0 else 0.0
    return ratios


def _histogram_text(histogram: dict[str, int]) -> str:
    total = sum(histogram.values()) or 1
    return " ".join(f"{s}:{100 * n / total:.0f}%" for s, n in sorted(histogram.items(), key=lambda kv: int(kv[0])))


def _print_tables(report: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    bound = report["upper_bound_tokens_per_s"]
    for eta_key, run in report["by_eta"].items():
        table = Table(title=f"{report['workload']} ({report['gpus']} GPUs), eta={eta_key}, {report['steps']} steps, seed {report['seed']}")
        for column in ("system", "tokens/s", "of bound", "step time (s)", "utilisation", "trainer busy",
                       "max staleness", "staleness (groups)", "dropped", "lost/dup", "wall (s)"):
            table.add_column(column, justify="left" if column in ("system", "staleness (groups)") else "right")
        for name, f in run["systems"].items():
            table.add_row(
                name, f"{f['tokens_per_s']:,.0f}", f"{f['tokens_per_s'] / bound:.0%}", f"{f['step_time_s']:.1f}",
                f"{f['utilisation']:.0%}", f"{f['trainer_busy']:.0%}", str(f["max_staleness"]),
                _histogram_text(f["staleness_histogram"]),
                str(f["dropped"]), f"{f['lost']}/{f['duplicated']}", f"{f['wall_s']:.1f}",
            )
        table.add_row(UPPER_BOUND, f"{bound:,.0f}", "100%", "", "", "", "", "", "", "", "")
        console.print(table)
        if run["staleflow_ratio"]:
            ratios = ", ".join(f"{name} {ratio:.2f}x" for name, ratio in run["staleflow_ratio"].items())
            console.print(f"StaleFlow / other: {ratios}")


def _plot(report: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    bound = report["upper_bound_tokens_per_s"]
    etas = list(report["by_eta"])
    names = list(next(iter(report["by_eta"].values()))["systems"])
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(names) * len(etas)), 4))
    width = 0.8 / max(1, len(etas))
    for j, eta in enumerate(etas):
        values = [report["by_eta"][eta]["systems"][n]["tokens_per_s"] for n in names]
        ax.bar([i + j * width for i in range(len(names))], values, width, label=f"eta={eta}")
    ax.axhline(bound, color="black", linestyle="--", label="upper bound")
    ax.set_xticks([i + width * (len(etas) - 1) / 2 for i in range(len(names))], names, rotation=20, ha="right")
    ax.set_ylabel("trained tokens / s")
    ax.set_title(f"{report['workload']}: throughput")
    ax.legend()
    fig.tight_layout()
    path = out / "throughput.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)

    for eta in etas:
        systems = report["by_eta"][eta]["systems"]
        cols = min(4, len(systems))
        rows = -(-len(systems) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False, sharey=True)
        for ax in axes.flat[len(systems):]:
            ax.axis("off")
        for ax, (name, figures) in zip(axes.flat, systems.items()):
            per_buffer = figures["staleness_per_buffer"]
            buffers = sorted(per_buffer, key=int)
            levels = sorted({int(s) for counts in per_buffer.values() for s in counts})
            bottom = [0] * len(buffers)
            for level in levels:
                counts = [per_buffer[b].get(str(level), 0) for b in buffers]
                ax.bar([int(b) for b in buffers], counts, bottom=bottom, label=f"staleness {level}")
                bottom = [x + y for x, y in zip(bottom, counts)]
            ax.set_title(name)
            ax.set_xlabel("buffer (training step)")
        for row in axes:
            row[0].set_ylabel("groups")
        axes.flat[0].legend(fontsize="small")
        fig.suptitle(f"staleness per buffer, eta={eta}")
        fig.tight_layout()
        path = out / f"staleness_eta{eta}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

        fig, ax = plt.subplots(figsize=(7, 3.5))
        for name, figures in systems.items():
            ax.plot(range(1, len(figures["step_times_s"]) + 1), figures["step_times_s"], label=name)
        ax.set_xlabel("training step")
        ax.set_ylabel("step time (s)")
        ax.set_title(f"time per step, eta={eta}")
        ax.legend(fontsize="small")
        fig.tight_layout()
        path = out / f"step_times_eta{eta}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from staleflow.cli.upper_bound import upper_bound
    from staleflow.runtime.loop import RunStalledError
    from staleflow.runtime.workload import WorkloadError, load_workload

    err = Console(stderr=True)
    try:
        workload = load_workload(args.workload)
        systems = _systems(args.systems)
    except (WorkloadError, ValueError) as exc:
        err.print(f"[red]error:[/red] {exc}", markup=True, highlight=False)
        return 2
    problems = [f"--steps must be >= 1, got {args.steps}"] if args.steps < 1 else []
    problems += [f"--eta must be >= 0, got {e}" for e in args.eta if e < 0]
    problems += [f"--{k} must be > 0" for k, v in (("tick", args.tick),) if v is not None and v <= 0]
    problems += ["--quantum must be >= 0"] if args.quantum is not None and args.quantum < 0 else []
    if problems:
        err.print("error: " + "; ".join(problems), highlight=False)
        return 2

    bound = upper_bound(workload, seed=args.seed)
    report: dict[str, Any] = {
        "workload": workload.name,
        "gpus": workload.gpus,
        "steps": args.steps,
        "seed": args.seed,
        "upper_bound_tokens_per_s": bound.tokens_per_s,
        "upper_bound": bound.to_dict(),
        "by_eta": {},
    }
    exit_code = 0
    if args.trace_dir is not None:
        args.trace_dir.mkdir(parents=True, exist_ok=True)
    with Progress(console=err, transient=True, disable=not err.is_terminal) as progress:
        for eta in args.eta:
            results: dict[str, dict[str, Any]] = {}
            for name in systems:
                task = progress.add_task(f"eta={eta} {name}", total=args.steps)
                try:
                    results[name] = simulate_system(
                        workload, name, eta, args.steps, args.seed, args.tick, args.quantum,
                        on_step=lambda task=task: progress.advance(task),
                        trace_path=None if args.trace_dir is None else args.trace_dir / f"{name}-eta{eta}.jsonl",
                    )
                except RunStalledError as exc:
                    err.print(f"error: eta={eta} {name}: {exc}", highlight=False)
                    exit_code = 1
                progress.remove_task(task)
            for problem in _violations(results):
                err.print(f"error: eta={eta} {problem}", highlight=False)
                exit_code = 1
            report["by_eta"][str(eta)] = {"systems": results, "staleflow_ratio": _ratios(results, bound.tokens_per_s)}

    if args.json:
        if len(args.eta) == 1:
            only = report["by_eta"][str(args.eta[0])]
            payload = {"systems": only["systems"], "upper_bound_tokens_per_s": bound.tokens_per_s,
                       "staleflow_ratio": only["staleflow_ratio"], "eta": args.eta[0], "workload": workload.name,
                       "steps": args.steps, "seed": args.seed}
        else:
            payload = report
        sys.stdout.write(json.dumps(payload, indent=2) + "\n")
    else:
        out = Console()
        if not out.is_terminal:
            out = Console(width=170)  # a file or pipe: keep each row on one line
        _print_tables(report, out)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
        written = _plot(report, args.out) if any(r["systems"] for r in report["by_eta"].values()) else []
        err.print(f"wrote {args.out / 'results.json'} and {len(written)} plots into {args.out}", highlight=False)
    return exit_code

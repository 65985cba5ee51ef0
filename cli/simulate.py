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
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from staleflow.runtime.settings.workload import Workload

#: The paper's baselines as the real systems run (runtime/settings/policies.py says which peer code each follows).
BASELINES = ("verl-sync", "one-step-off", "verl-async", "areal", "areal-filter", "areal-tight", "roll-flash")
ABLATIONS = (
    "staleflow-no-routing", "staleflow-no-sync", "staleflow-no-migration", "staleflow-no-proactive-abort", "staleflow-fresh",
)
DEFAULT_SYSTEMS = ("staleflow", *BASELINES)
UPPER_BOUND = "upper-bound"
BEST = "best-bound-keeping"
#: AReaL run with the largest admission bound below ``eta`` whose p99 staleness is within ``eta``.
TIGHT = "areal-tight"


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
    parser.add_argument("--estimation-error", type=float, default=0.1,
                        help="relative error of the cost model the coordinator plans with (default: 0.1, as the paper measured)")
    parser.add_argument("--group-redundancy", type=int, default=0, metavar="N_EXTRA",
                        help="StaleFlow samples N_EXTRA more responses per group, keeps the first (default: 0)")
    parser.add_argument("--batch-redundancy", type=int, default=0, metavar="X",
                        help="StaleFlow admits X groups beyond the batches, drops the surplus (default: 0)")
    parser.add_argument("--tick", type=float, default=None, help="coordinator tick in seconds (default: the workload's)")
    parser.add_argument("--quantum", type=float, default=None, help="engine event grid in seconds (default: the workload's)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON on stdout (nothing else)")
    parser.add_argument("--out", type=Path, default=None, help="write results.json and PNG plots into this folder")
    parser.add_argument(
        "--trace-dir", type=Path, default=None,
        help="write each run's protocol trace as DIR/<system>-eta<eta>.jsonl (check with staleflow verify --trace)",
    )


def _systems(requested: list[str]) -> list[str]:
    from staleflow.runtime.settings.policies import ALIASES, POLICIES

    names: list[str] = []
    for name in requested:
        expanded = {"all": [*POLICIES, TIGHT], "ablation": ["staleflow", *ABLATIONS]}.get(name, [name])
        for item in expanded:
            if item == UPPER_BOUND:
                continue
            item = ALIASES.get(item, item)
            if item not in POLICIES and item != TIGHT:
                known = ", ".join([*POLICIES, TIGHT, *ALIASES, UPPER_BOUND, "ablation", "all"])
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
    estimation_error: float = 0.0,
    admission_eta: int | None = None,
    **knobs: Any,
) -> dict[str, Any]:
    """Run one system for ``steps`` training steps; returns its figures (the JSON entry).

    With ``trace_path`` the run's protocol trace is written there (JSONL, for ``verify --trace``).
    ``estimation_error``: the coordinator plans with the cost model off by this much (the engines
    run the exact one). ``admission_eta``: a system that does not keep the bound admits with this
    bound instead of ``eta`` (its staleness is still measured against ``eta``). ``knobs`` override
    the policy's.
    """
    from staleflow.adapters.sim.engine import SimEngine
    from staleflow.adapters.sim.network import Broadcast, ParameterServerLink, WeightTransfer
    from staleflow.adapters.sim.trainer import SimTrainer
    from staleflow.runtime.run.assembly import assemble_run
    from staleflow.runtime.run.clock import VirtualClock
    from staleflow.runtime.run.loop import RunParts
    from staleflow.runtime.run.run_spec import RunSpec

    spec = RunSpec.from_workload(workload, system, eta, tick_s=tick_s, **knobs)
    policy = spec.policy
    if admission_eta is not None:
        spec = replace(spec, eta=admission_eta)
    clock = VirtualClock()
    quantum = workload.simulation.event_quantum_s if event_quantum_s is None else event_quantum_s
    cluster = workload.cluster
    instances = cluster.rollout_instances
    scale, after_step = 1.0, 0.0
    link: WeightTransfer | None = None
    if policy.colocated:  # every GPU rolls out, then every GPU trains
        instances = workload.gpus // cluster.gpus_per_instance
        scale = cluster.trainer_gpus / workload.gpus if cluster.trainer_gpus else 1.0
    elif policy.weight_transfer == "broadcast":
        link = Broadcast(workload.network)
        after_step = link.seconds
    elif policy.weight_transfer == "ps_pull":
        link = ParameterServerLink(workload.network)
    parts = RunParts(
        engines=[
            SimEngine.from_workload(workload, f"i{i}", clock, event_quantum_s=quantum, weight_link=link)
            for i in range(instances)
        ],
        trainer=SimTrainer.from_workload(workload, clock, scale=scale, after_step_s=after_step),
        prompts=workload.prompt_groups(seed, n_extra=policy.group_redundancy),
        cost_model=workload.build_cost_model().with_error(estimation_error, seed),
        clock=clock,
    )
    loop = assemble_run(spec, parts, trace_path=trace_path)
    started = time.perf_counter()
    try:
        metrics = loop.run(steps, on_step=on_step)
    finally:
        loop.close()
    wall = time.perf_counter() - started
    trained_groups = sum(metrics.staleness_histogram.values())
    return measured_against({
        "tokens_per_s": metrics.tokens_per_s,
        "step_time_s": metrics.step_time_s,
        "utilisation": metrics.utilisation,
        "max_staleness": metrics.max_staleness,
        "staleness_p99": metrics.staleness_p99,
        "keeps_bound": policy.keeps_bound,
        "staleness_histogram": {str(k): v for k, v in metrics.staleness_histogram.items()},
        "dropped": metrics.dropped,
        "wasted_tokens": metrics.wasted_tokens,
        "proactive_aborted": metrics.proactive_aborted,
        "mean_trained_length": metrics.tokens_trained / max(1, trained_groups * workload.batch.group_size),
        "admission_eta": policy.protocol_eta(spec.eta),
        "instances": instances,
        "generated_tokens_per_s": metrics.tokens_generated / metrics.elapsed_s,
        "trainer_busy": sum(m["step_time_s"] for m in metrics.train_metrics) / metrics.elapsed_s,
        "steps": metrics.steps,
        "step_times_s": metrics.step_times_s,
        "staleness_per_buffer": {
            str(b): {str(s): n for s, n in counts.items()} for b, counts in metrics.staleness_per_buffer.items()
        },
        "lost": metrics.lost,
        "duplicated": metrics.duplicated,
        "virtual_s": metrics.elapsed_s,
        "wall_s": wall,
        "coordinator_decision_s": metrics.coordinator.get("decision_seconds", 0.0),
        "reused_run": False,
    }, policy.protocol_eta(eta))


def measured_against(figures: dict[str, Any], eta: int) -> dict[str, Any]:
    """``figures`` of a run with the bound it is measured against set to ``eta``: ``eta`` and the
    share of trained groups past it (the run itself depends only on its ``admission_eta``)."""
    histogram = {int(s): n for s, n in figures["staleness_histogram"].items()}
    past = sum(n for s, n in histogram.items() if s > eta) / max(1, sum(histogram.values()))
    return {**figures, "eta": eta, "past_eta_share": past}


def _violations(results: dict[str, dict[str, Any]]) -> list[str]:
    """Broken guarantees: a system that keeps the bound trained a group past it (a baseline that
    does not keep it is measured, not failed), or a trajectory was lost or duplicated."""
    problems = []
    for name, figures in results.items():
        if figures["keeps_bound"] and figures["max_staleness"] > figures["eta"]:
            problems.append(f"{name}: staleness {figures['max_staleness']} above its bound {figures['eta']}")
        if figures["lost"] or figures["duplicated"]:
            problems.append(f"{name}: {figures['lost']} lost and {figures['duplicated']} duplicated trajectories")
    return problems


def knobs_for(system: str, args: argparse.Namespace) -> dict[str, int]:
    """The redundancy the command line asks for, for StaleFlow's policies only."""
    if not system.startswith("staleflow"):
        return {}
    return {"group_redundancy": args.group_redundancy, "batch_redundancy": args.batch_redundancy}


def keeps_eta(figures: dict[str, Any], eta: int) -> bool:
    """A baseline that keeps the bound ``eta`` asked for: at most 1% of its groups past it (p99)."""
    return bool(figures["staleness_p99"] <= eta)


def _ratios(systems: dict[str, dict[str, Any]], bound: float, eta: int) -> dict[str, float]:
    """StaleFlow's throughput over each other system's, over the best baseline whose p99 staleness
    is within ``eta`` (``best-bound-keeping``), and over the upper bound."""
    if "staleflow" not in systems:
        return {}
    ours = systems["staleflow"]["tokens_per_s"]
    others = {name: f for name, f in systems.items() if not name.startswith("staleflow") and f["tokens_per_s"] > 0}
    ratios = {name: ours / f["tokens_per_s"] for name, f in systems.items() if name != "staleflow" and f["tokens_per_s"] > 0}
    keeping = [f["tokens_per_s"] for f in others.values() if keeps_eta(f, eta)]
    if keeping:
        ratios[BEST] = ours / max(keeping)
    ratios[UPPER_BOUND] = ours / bound if bound > 0 else 0.0
    return ratios


def _tight(workload: Workload, eta: int, run_one: Any) -> dict[str, Any]:
    """AReaL with a smaller admission bound: the largest ``eta' < eta`` whose run keeps its p99
    staleness within ``eta`` (down to 0; the last tried is reported if none does)."""
    figures: dict[str, Any] = {}
    for admission in range(eta - 1, -1, -1):
        figures = run_one("areal", admission_eta=admission)
        if keeps_eta(figures, eta):
            break
    return figures


def _histogram_text(histogram: dict[str, int]) -> str:
    total = sum(histogram.values()) or 1
    return " ".join(f"{s}:{100 * n / total:.0f}%" for s, n in sorted(histogram.items(), key=lambda kv: int(kv[0])))


def _print_tables(report: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    bound = report["upper_bound_tokens_per_s"]
    for eta_key, run in report["by_eta"].items():
        table = Table(title=f"{report['workload']} ({report['gpus']} GPUs), eta={eta_key}, {report['steps']} steps, seed {report['seed']}")
        for column in ("system", "tokens/s", "of bound", "step time (s)", "utilisation", "trainer busy",
                       "staleness p99/max", "past eta", "staleness (groups)", "dropped", "wasted tokens", "lost/dup", "wall (s)"):
            table.add_column(column, justify="left" if column in ("system", "staleness (groups)") else "right")
        for name, f in run["systems"].items():
            label = name if f["admission_eta"] == f["eta"] else f"{name} (admits at eta {f['admission_eta']})"
            table.add_row(
                label, f"{f['tokens_per_s']:,.0f}", f"{f['tokens_per_s'] / bound:.0%}", f"{f['step_time_s']:.1f}",
                f"{f['utilisation']:.0%}", f"{f['trainer_busy']:.0%}", f"{f['staleness_p99']}/{f['max_staleness']}",
                f"{f['past_eta_share']:.1%}", _histogram_text(f["staleness_histogram"]),
                str(f["dropped"] + f["proactive_aborted"]), f"{f['wasted_tokens']:,}", f"{f['lost']}/{f['duplicated']}",
                f"{f['wall_s']:.1f}",
            )
        table.add_row(UPPER_BOUND, f"{bound:,.0f}", "100%", *[""] * 10)
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
    from staleflow.runtime.run.loop import RunStalledError
    from staleflow.runtime.settings.policies import make_policy
    from staleflow.runtime.settings.workload import WorkloadError, load_workload

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
    problems += [] if 0 <= args.estimation_error < 0.5 else [f"--estimation-error must be in [0, 0.5), got {args.estimation_error}"]
    problems += [f"--{k.replace('_', '-')} must be >= 0" for k in ("group_redundancy", "batch_redundancy") if getattr(args, k) < 0]
    if problems:
        err.print("error: " + "; ".join(problems), highlight=False)
        return 2

    bound = upper_bound(workload, seed=args.seed)
    report: dict[str, Any] = {
        "workload": workload.name,
        "gpus": workload.gpus,
        "steps": args.steps,
        "seed": args.seed,
        "estimation_error": args.estimation_error,
        "upper_bound_tokens_per_s": bound.tokens_per_s,
        "upper_bound": bound.to_dict(),
        "by_eta": {},
    }
    exit_code = 0
    if args.trace_dir is not None:
        args.trace_dir.mkdir(parents=True, exist_ok=True)
    # A run depends on its system and the bound it admits with, not on the bound it is measured
    # against: verl-sync (0) and one-step-off (1) run once for every eta, and areal-tight at eta
    # reuses areal's run at the smaller bound. Same seed, same run: only the measurement differs.
    runs: dict[tuple[str, int], tuple[dict[str, Any], Path | None]] = {}
    with Progress(console=err, transient=True, disable=not err.is_terminal) as progress:
        for eta in args.eta:
            results: dict[str, dict[str, Any]] = {}
            for name in systems:
                task = progress.add_task(f"eta={eta} {name}", total=args.steps)

                def run_one(system: str, task: Any = task, eta: int = eta, **extra: Any) -> dict[str, Any]:
                    policy = make_policy(system)
                    key = (system, policy.protocol_eta(extra.get("admission_eta", eta)))
                    trace = None if args.trace_dir is None or not policy.keeps_bound else args.trace_dir / f"{system}-eta{eta}.jsonl"
                    if key in runs:
                        figures, earlier_trace = runs[key]
                        if trace is not None and earlier_trace is not None:
                            shutil.copyfile(earlier_trace, trace)
                        return {**measured_against(figures, policy.protocol_eta(eta)), "reused_run": True}
                    progress.reset(task)
                    figures = simulate_system(
                        workload, system, eta, args.steps, args.seed, args.tick, args.quantum,
                        on_step=lambda: progress.advance(task), trace_path=trace,
                        estimation_error=args.estimation_error, **knobs_for(system, args), **extra,
                    )
                    runs[key] = (figures, trace)
                    return figures

                try:
                    results[name] = _tight(workload, eta, run_one) if name == TIGHT else run_one(name)
                except RunStalledError as exc:
                    err.print(f"error: eta={eta} {name}: {exc}", highlight=False)
                    exit_code = 1
                progress.remove_task(task)
            for problem in _violations(results):
                err.print(f"error: eta={eta} {problem}", highlight=False)
                exit_code = 1
            report["by_eta"][str(eta)] = {"systems": results, "staleflow_ratio": _ratios(results, bound.tokens_per_s, eta)}

    if args.out is not None:  # first: a long grid's results survive a failure to print or plot
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    if args.json:
        if len(args.eta) == 1:
            only = report["by_eta"][str(args.eta[0])]
            payload = {"systems": only["systems"], "upper_bound_tokens_per_s": bound.tokens_per_s,
                       "staleflow_ratio": only["staleflow_ratio"], "eta": args.eta[0], "workload": workload.name,
                       "steps": args.steps, "seed": args.seed, "estimation_error": args.estimation_error}
        else:
            payload = report
        sys.stdout.write(json.dumps(payload, indent=2) + "\n")
    else:
        out = Console()
        if not out.is_terminal:
            out = Console(width=170)  # a file or pipe: keep each row on one line
        _print_tables(report, out)
    if args.out is not None:
        written = _plot(report, args.out) if any(r["systems"] for r in report["by_eta"].values()) else []
        err.print(f"wrote {args.out / 'results.json'} and {len(written)} plots into {args.out}", highlight=False)
    return exit_code

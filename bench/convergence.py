"""Convergence study: the built-in training job for several staleness bounds eta and seeds.

For every (eta, seed) pair it runs, one after the other, as a subprocess::

    staleflow train protocol.eta=E seed=S train.steps=N --run-dir DIR/eta{E}-seed{S}

(seeds in the outer loop, so an interrupted study has every eta at the same number of seeds).
A run directory that already holds a finished run (``summary.json``) of N steps is kept, so a
study continues where it stopped; a started but unfinished one is deleted and run again. Then it
reads each run's ``metrics.jsonl`` and writes into DIR:

* ``convergence.png``: train reward (trailing mean of ``--smooth`` steps) against training step
  and against run-loop time, per eta: the mean over seeds with the min-max band;
* ``convergence.md`` / ``convergence.json``: per eta, the greedy eval reward at the start and the
  end and its gain (end - start of each seed, which removes the seeds' different warm-ups), the
  train reward over the last ``--smooth`` steps, the (smoothed) train reward at the run-loop time
  the shortest run of the study reached, and the trained tokens/s, each as mean +- sample
  standard deviation over seeds; per run, the largest group staleness (must be <= eta).

Reproduce: ``staleflow bench convergence [--etas 0 1 2 4 8] [--seeds 0 1 2] [--steps 70] [--out runs/convergence] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_ETAS = (0, 1, 2, 4, 8)
DEFAULT_SEEDS = (0, 1, 2)
DEFAULT_STEPS = 70
DEFAULT_SMOOTH = 10
PLOT_FILE = "convergence.png"
TABLE_FILE = "convergence.md"
FIGURES_FILE = "convergence.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--etas", type=int, nargs="+", default=list(DEFAULT_ETAS), help="staleness bounds (default: 0 1 2 4 8)")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(DEFAULT_SEEDS), help="seeds per eta (default: 0 1 2)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"training steps per run (default: {DEFAULT_STEPS})")
    parser.add_argument("--out", type=Path, default=Path("runs/convergence"), help="study folder (default: runs/convergence)")
    parser.add_argument(
        "--smooth", type=int, default=DEFAULT_SMOOTH, help=f"steps in the reward's trailing mean (default: {DEFAULT_SMOOTH})"
    )
    parser.add_argument("--no-train", action="store_true", help="only aggregate the runs already finished in --out")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON only")


# ----------------------------------------------------------------------------------- one run
@dataclass(frozen=True)
class RunResult:
    """What the study needs from one finished run's ``metrics.jsonl``."""

    eta: int
    seed: int
    steps: list[int]
    rewards: list[float]  # train reward (batch mean) per step
    elapsed_s: list[float]  # run-loop time at the end of each step
    eval_start: float
    eval_end: float
    tokens_per_s: float  # trained tokens per second of run loop, at the last step
    max_staleness: int  # largest group staleness over every buffer


def run_dir_name(eta: int, seed: int) -> str:
    return f"eta{eta}-seed{seed}"


def load_run(run_dir: Path, eta: int, seed: int) -> RunResult:
    """Read one run's ``metrics.jsonl``; a run without steps or evaluations is an error."""
    from staleflow.app.metrics import read_metrics

    records = read_metrics(run_dir)
    steps = [r for r in records if r.get("kind") == "step"]
    evals = [r for r in records if r.get("kind") == "eval"]
    if not steps:
        raise ValueError(f"{run_dir}: metrics.jsonl has no training steps")
    if len(evals) < 2:
        raise ValueError(f"{run_dir}: metrics.jsonl needs a start and an end evaluation (found {len(evals)})")
    missing = [r["step"] for r in steps if r.get("reward_mean") is None]
    if missing:
        raise ValueError(f"{run_dir}: steps {missing[:5]} have no reward_mean")
    staleness = [int(level) for r in steps for level in (r.get("group_staleness") or {})]
    return RunResult(
        eta=eta,
        seed=seed,
        steps=[int(r["step"]) for r in steps],
        rewards=[float(r["reward_mean"]) for r in steps],
        elapsed_s=[float(r["elapsed_s"]) for r in steps],
        eval_start=float(evals[0]["eval_reward"]),
        eval_end=float(evals[-1]["eval_reward"]),
        tokens_per_s=float(steps[-1]["tokens_per_s"]),
        max_staleness=max(staleness, default=0),
    )


def finished_steps(run_dir: Path) -> int | None:
    """Steps of the finished run in ``run_dir`` (None if it has not finished)."""
    summary = run_dir / "summary.json"
    if not summary.is_file():
        return None
    return int(json.loads(summary.read_text(encoding="utf-8"))["steps"])


def train_command(eta: int, seed: int, steps: int, run_dir: Path) -> list[str]:
    return ["staleflow", "train", f"protocol.eta={eta}", f"seed={seed}", f"train.steps={steps}", "--run-dir", str(run_dir)]


def train_one(eta: int, seed: int, steps: int, out: Path, quiet: bool) -> bool:
    """Run (or keep) one training run; True if a finished run of ``steps`` steps is there after."""
    name = run_dir_name(eta, seed)
    return run_train(train_command(eta, seed, steps, out / name), out / name, steps, out / "logs" / f"{name}.log", quiet)


def run_train(command: list[str], run_dir: Path, steps: int, log: Path, quiet: bool) -> bool:
    """Run ``command`` (``staleflow train ... --run-dir run_dir``) unless ``run_dir`` already holds a
    finished run of ``steps`` steps; its output goes to ``log``. A started but unfinished run is
    deleted first (train refuses a non-empty folder); a finished run of other steps is an error.
    True if a finished run of ``steps`` steps is there after."""
    done = finished_steps(run_dir)
    if done == steps:
        return True
    if done is not None:
        raise ValueError(f"{run_dir} holds a finished run of {done} steps, not {steps}; move it away or use another --out")
    if run_dir.exists():
        shutil.rmtree(run_dir)
    log.parent.mkdir(parents=True, exist_ok=True)
    # the same interpreter's CLI, so the study runs without the console script on PATH
    argv = [sys.executable, "-m", "staleflow", *command[1:]]
    if not quiet:
        print(f"[{time.strftime('%H:%M:%S')}] {' '.join(command)}  (log {log})", flush=True)
    started = time.perf_counter()
    with open(log, "w", encoding="utf-8") as handle:
        code = subprocess.run(argv, stdout=handle, stderr=subprocess.STDOUT, check=False).returncode
    if not quiet:
        print(f"    exit {code} after {time.perf_counter() - started:.0f} s", flush=True)
    return finished_steps(run_dir) == steps


# -------------------------------------------------------------------------------- aggregation
def trailing_mean(values: Sequence[float], window: int) -> list[float]:
    """Mean of the last ``window`` values at each point (fewer at the start)."""
    from staleflow.app.report import moving_mean

    return moving_mean(list(values), window)


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def aggregate(runs: Sequence[RunResult], smooth: int) -> dict[int, dict[str, Any]]:
    """Per eta: the figures of the table and the curves of the plot (mean, min, max over seeds).

    The step curves need every seed to have the same steps. The time curves are each seed's
    smoothed reward interpolated on 100 points of run-loop time, from the latest first step to
    the earliest last step of the eta's seeds. ``reward_at_common_s`` compares the etas per second
    of run: the smoothed reward at the end of the shortest run of the whole study
    (``common_s``), mean and spread over seeds.
    """
    import numpy as np

    by_eta: dict[int, list[RunResult]] = {}
    for run in runs:
        by_eta.setdefault(run.eta, []).append(run)
    common_s = min(run.elapsed_s[-1] for run in runs)
    figures: dict[int, dict[str, Any]] = {}
    for eta, group in sorted(by_eta.items()):
        group = sorted(group, key=lambda r: r.seed)
        if any(r.steps != group[0].steps for r in group):
            raise ValueError(f"eta {eta}: the seeds' runs have different steps; run them with the same --steps")
        smoothed = np.array([trailing_mean(r.rewards, smooth) for r in group])
        grid = np.linspace(max(r.elapsed_s[0] for r in group), min(r.elapsed_s[-1] for r in group), 100)
        on_grid = np.array([np.interp(grid, r.elapsed_s, s) for r, s in zip(group, smoothed)])
        eval_start, eval_start_std = mean_std([r.eval_start for r in group])
        eval_end, eval_end_std = mean_std([r.eval_end for r in group])
        gain, gain_std = mean_std([r.eval_end - r.eval_start for r in group])
        last, last_std = mean_std([statistics.fmean(r.rewards[-smooth:]) for r in group])
        tps, tps_std = mean_std([r.tokens_per_s for r in group])
        at_common, at_common_std = mean_std([float(np.interp(common_s, r.elapsed_s, s)) for r, s in zip(group, smoothed)])
        figures[eta] = {
            "seeds": [r.seed for r in group],
            "eval_start": eval_start,
            "eval_start_std": eval_start_std,
            "eval_end": eval_end,
            "eval_end_std": eval_end_std,
            "eval_gain": gain,
            "eval_gain_std": gain_std,
            "reward_last": last,
            "reward_last_std": last_std,
            "common_s": common_s,
            "reward_at_common_s": at_common,
            "reward_at_common_s_std": at_common_std,
            "tokens_per_s": tps,
            "tokens_per_s_std": tps_std,
            "run_loop_s": statistics.fmean(r.elapsed_s[-1] for r in group),
            "max_staleness": {r.seed: r.max_staleness for r in group},
            "bound_ok": all(r.max_staleness <= eta for r in group),
            "curve_step": {
                "step": group[0].steps,
                "mean": smoothed.mean(0).tolist(),
                "min": smoothed.min(0).tolist(),
                "max": smoothed.max(0).tolist(),
            },
            "curve_time": {
                "t": grid.tolist(),
                "mean": on_grid.mean(0).tolist(),
                "min": on_grid.min(0).tolist(),
                "max": on_grid.max(0).tolist(),
            },
        }
    return figures


def plot(figures: dict[int, dict[str, Any]], path: Path, smooth: int, steps: int) -> None:
    from staleflow.app.report import pyplot

    plt = pyplot()
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for i, (eta, f) in enumerate(sorted(figures.items())):
        label = f"eta {eta} ({len(f['seeds'])} seeds)"
        for ax, curve, x in ((by_step, f["curve_step"], "step"), (by_time, f["curve_time"], "t")):
            ax.plot(curve[x], curve["mean"], color=f"C{i}", label=label)
            ax.fill_between(curve[x], curve["min"], curve["max"], color=f"C{i}", alpha=0.15)
    by_step.set_xlabel("training step")
    by_time.set_xlabel("run-loop time (s)")
    by_step.set_ylabel(f"train reward (trailing mean of {smooth} steps)")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
    by_step.legend(loc="upper left")
    fig.suptitle(f"Built-in job, {steps} steps: mean over seeds, band = min..max")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(figures: dict[int, dict[str, Any]], smooth: int) -> str:
    common_s = next(iter(figures.values()))["common_s"]
    lines = [
        f"| eta | seeds | greedy eval start -> end | eval gain (end - start, per seed) | train reward, last {smooth} steps "
        f"| train reward at {common_s:.0f} s of run loop | trained tokens/s | run loop (mean) | max staleness per seed (<= eta) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for eta, f in sorted(figures.items()):
        staleness = ", ".join(str(f["max_staleness"][s]) for s in f["seeds"])
        lines.append(
            f"| {eta} | {' '.join(map(str, f['seeds']))} | {f['eval_start']:.3f} ± {f['eval_start_std']:.3f} -> "
            f"{f['eval_end']:.3f} ± {f['eval_end_std']:.3f} | {f['eval_gain']:+.3f} ± {f['eval_gain_std']:.3f} | "
            f"{f['reward_last']:.3f} ± {f['reward_last_std']:.3f} | "
            f"{f['reward_at_common_s']:.3f} ± {f['reward_at_common_s_std']:.3f} | "
            f"{f['tokens_per_s']:.0f} ± {f['tokens_per_s_std']:.0f} | {f['run_loop_s']:.0f} s | "
            f"{staleness} ({'ok' if f['bound_ok'] else 'VIOLATED'}) |"
        )
    return "\n".join(lines)


def reproduce_command(args: argparse.Namespace) -> str:
    return (
        f"staleflow bench convergence --etas {' '.join(map(str, args.etas))} --seeds {' '.join(map(str, args.seeds))} "
        f"--steps {args.steps} --out {args.out}"
    )


# ------------------------------------------------------------------------------------ command
def run(args: argparse.Namespace) -> int:
    problems = [f"--{name} must be >= 1 (got {value})" for name, value in (("steps", args.steps), ("smooth", args.smooth)) if value < 1]
    problems += [f"--etas: eta must be >= 0 (got {e})" for e in args.etas if e < 0]
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    failed: list[str] = []
    runs: list[RunResult] = []
    try:
        for seed in args.seeds:
            for eta in args.etas:
                run_dir = args.out / run_dir_name(eta, seed)
                finished = finished_steps(run_dir) == args.steps if args.no_train else train_one(eta, seed, args.steps, args.out, args.json)
                if finished:
                    runs.append(load_run(run_dir, eta, seed))
                elif not args.no_train:
                    failed.append(run_dir_name(eta, seed))
        if not runs:
            raise ValueError(f"no finished run of {args.steps} steps in {args.out}")
        figures = aggregate(runs, args.smooth)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    plot(figures, args.out / PLOT_FILE, args.smooth, args.steps)
    text = table(figures, args.smooth)
    command = reproduce_command(args)
    (args.out / TABLE_FILE).write_text(f"{text}\n\n![convergence]({PLOT_FILE})\n\nReproduce: `{command}`\n", encoding="utf-8")
    compact = {eta: {k: v for k, v in f.items() if not k.startswith("curve_")} for eta, f in figures.items()}
    (args.out / FIGURES_FILE).write_text(
        json.dumps({"steps": args.steps, "smooth": args.smooth, "failed": failed, "etas": figures}, indent=1), encoding="utf-8"
    )
    if args.json:
        print(json.dumps({"steps": args.steps, "failed": failed, "etas": compact}, indent=1))
    else:
        print(text)
        if failed:
            print(f"runs that did not finish (see {args.out / 'logs'}): {', '.join(failed)}")
        print(f"plot: {args.out / PLOT_FILE}; figures: {args.out / FIGURES_FILE}")
        print(f"reproduce: {command}")
    bound_ok = all(f["bound_ok"] for f in figures.values())
    return 0 if bound_ok and not failed else 1

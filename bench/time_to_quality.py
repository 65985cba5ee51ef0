"""Time to quality: run-loop seconds until the held-out eval reward first reaches each threshold, per system.

For every seed, and for every cell (system, eta) in an order rotated by one per seed (so no system
always runs first or last on a busy machine), it runs, back to back, as a subprocess::

    staleflow train [--config YAML] system=S protocol.eta=E seed=N train.steps=STEPS
        task.eval_every=K task.eval_timing=deferred checkpoint.every=0 [KEY=VALUE ...] --run-dir DIR/S-etaE-seedN

``sync`` and ``one-step-off`` have their own bound (0 and 1) and run once per seed whatever
``--etas`` says. Evaluation is **deferred** (``task.eval_timing=deferred``): at each K-th step the
trainer's weights are saved (milliseconds), and every saved version is evaluated after the run loop,
so the run loop's wall time holds no evaluation for any system; checkpoints are off for the same
reason (a checkpoint interrupts every running request). The time of an evaluation is the run-loop
time (``elapsed_s``, from the loop's start: warm-up and engine start-up excluded) at the end of its
step; a run recorded with inline evaluations has the evaluation seconds before that step
subtracted. The load average before and after each run is kept in ``DIR/runs.jsonl``, with the
command and its wall time. A finished run of STEPS steps is kept, so a study continues where it stopped.

It writes into DIR: ``time-to-quality.json`` (every run's figures and each cell's), ``.md`` (the
table) and ``.png`` (eval reward against run-loop time, one line per run). Per cell: for each
threshold (with ``--gains``: a gain over each run's evaluation at step 0, since seeds start from
different warm-ups), the median, min and max over seeds of the time to reach it (a seed that never reaches
it counts as infinite, so the median is "not reached" once half the seeds miss it) and the speed-up
against ``sync`` (sync's median over the cell's, and paired: the median over seeds of sync's time
over the cell's for the same seed); trained tokens/s; the staleness histogram of all
trained groups and its mean; the fitted learning rate (least-squares slope of eval reward on
run-loop time, per 100 s, median and spread, against sync's and paired by seed; and per 100 training
steps), which uses every evaluation where a threshold's first crossing rests on one noisy one;
where the time goes: run-loop seconds per step, training seconds per step, the trainer's busy
fraction (training seconds over run-loop seconds), the rollout instances' utilisation and their
weight-reload seconds per step (summed over instances). Exit 1 if a run's staleness exceeds its bound.

Reproduce: ``staleflow bench time-to-quality [--config YAML] [--systems sync one-step-off staleflow staleflow-fresh]
[--etas 2] [--seeds 0 1 2] [--steps 70] [--eval-every 10] [--thresholds 0.18 0.22 0.26] [--gains] [--out runs/ttq] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DEFAULT_SYSTEMS = ("sync", "one-step-off", "staleflow", "staleflow-fresh")
DEFAULT_THRESHOLDS = (0.18, 0.22, 0.26)
FILE = "time-to-quality"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="job file (default: the built-in job)")
    parser.add_argument("--systems", nargs="+", default=list(DEFAULT_SYSTEMS), help="systems (default: %(default)s)")
    parser.add_argument("--etas", type=int, nargs="+", default=[2], help="bounds of the systems without their own (default: 2)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (default: 0 1 2)")
    parser.add_argument("--steps", type=int, default=70, help="training steps per run (default: 70)")
    parser.add_argument("--eval-every", type=int, default=10, help="steps between evaluations (default: 10)")
    parser.add_argument(
        "--thresholds", type=float, nargs="+", default=list(DEFAULT_THRESHOLDS), help="eval reward thresholds (default: %(default)s)"
    )
    parser.add_argument(
        "--gains",
        action="store_true",
        help="thresholds are gains over each run's evaluation at step 0 (seeds start from different warm-ups)",
    )
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides for every run")
    parser.add_argument("--out", type=Path, default=Path("runs/ttq"), help="study folder (default: runs/ttq)")
    parser.add_argument("--no-train", action="store_true", help="only aggregate the runs already finished in --out")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON only")


# ----------------------------------------------------------------------------------- one run
@dataclass(frozen=True)
class RunFigures:
    """What the study reads from one finished run's ``metrics.jsonl``."""

    system: str
    eta: int
    seed: int
    eval_t: list[float]  # run-loop seconds at each evaluation (0 for the one before the loop)
    eval_reward: list[float]
    loop_s: float  # run-loop seconds at the last step, without inline evaluations
    tokens_per_s: float
    staleness: dict[int, int]  # trained groups per staleness, over every step
    train_s: float  # the trainer's busy seconds
    utilisation: float  # the rollout instances' mean busy fraction
    weight_sync_s: float  # the instances' weight reloads, summed over instances
    steps: int
    eval_steps: list[int]  # the training step of each evaluation

    @property
    def gain_per_100s(self) -> float:
        """The least-squares slope of eval reward on run-loop time, per 100 s: a learning rate that
        uses every evaluation, where the first crossing of a threshold rests on one noisy one."""
        return 100 * statistics.linear_regression(self.eval_t, self.eval_reward).slope

    @property
    def gain_per_100_steps(self) -> float:
        """The same slope against training steps (what a step teaches, whatever its duration)."""
        return 100 * statistics.linear_regression(self.eval_steps, self.eval_reward).slope

    @property
    def mean_staleness(self) -> float:
        groups = sum(self.staleness.values())
        return sum(s * n for s, n in self.staleness.items()) / groups if groups else 0.0

    def time_to(self, threshold: float, gain: bool = False) -> float:
        """Run-loop seconds at the first evaluation with reward >= ``threshold`` (inf: never); with
        ``gain``, reward >= the run's first evaluation + ``threshold``."""
        target = threshold + (self.eval_reward[0] if gain else 0.0)
        return next((t for t, r in zip(self.eval_t, self.eval_reward) if r >= target - 1e-12), math.inf)


def read_run(records: Sequence[dict[str, Any]], system: str, eta: int, seed: int) -> RunFigures:
    """The figures of one run from its metrics records (in file order)."""
    inline_eval_s = 0.0
    loop_t: dict[int, float] = {0: 0.0}  # step -> run-loop seconds without inline evaluations before it
    steps: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    for record in records:
        if record.get("kind") == "step":
            steps.append(record)
            loop_t[int(record["step"])] = float(record["elapsed_s"]) - inline_eval_s
        elif record.get("kind") == "eval":
            evals.append(record)
            if not record.get("eval_deferred") and int(record["step"]) > 0:
                inline_eval_s += float(record.get("eval_s", 0.0))
    if not steps:
        raise ValueError(f"{system} eta {eta} seed {seed}: no training steps")
    if len(evals) < 2:
        raise ValueError(f"{system} eta {eta} seed {seed}: needs at least 2 evaluations (found {len(evals)})")
    missing = sorted({int(e["step"]) for e in evals} - set(loop_t))
    if missing:
        raise ValueError(f"{system} eta {eta} seed {seed}: evaluations at steps {missing} without a step record")
    evals.sort(key=lambda e: int(e["step"]))
    staleness: Counter[int] = Counter()
    for record in steps:
        staleness.update({int(s): int(n) for s, n in (record.get("group_staleness") or {}).items()})
    last = steps[-1]
    loop_s = loop_t[int(last["step"])]
    return RunFigures(
        system=system,
        eta=eta,
        seed=seed,
        eval_t=[loop_t[int(e["step"])] for e in evals],
        eval_reward=[float(e["eval_reward"]) for e in evals],
        loop_s=loop_s,
        tokens_per_s=float(last["tokens_trained"]) / loop_s if "tokens_trained" in last else float(last["tokens_per_s"]),
        staleness=dict(sorted(staleness.items())),
        train_s=sum(float(r.get("train_s", 0.0)) for r in steps),
        utilisation=float(last.get("utilisation", 0.0)),
        weight_sync_s=float(last.get("sync_seconds", 0.0)),
        steps=len(steps),
        eval_steps=[int(e["step"]) for e in evals],
    )


def cells(systems: Sequence[str], etas: Sequence[int]) -> list[tuple[str, int]]:
    """The study's (system, eta) cells: a system with its own bound once, at that bound."""
    from staleflow.runtime.settings.policies import make_policy

    out: list[tuple[str, int]] = []
    for system in systems:
        policy = make_policy(system)
        for eta in [policy.fixed_eta] if policy.fixed_eta is not None else etas:
            if (system, eta) not in out:
                out.append((system, eta))
    return out


def run_name(system: str, eta: int, seed: int) -> str:
    return f"{system}-eta{eta}-seed{seed}"


def train_command(args: argparse.Namespace, system: str, eta: int, seed: int) -> list[str]:
    config = ["--config", str(args.config)] if args.config else []
    return [
        "staleflow", "train", *config, f"system={system}", f"protocol.eta={eta}", f"seed={seed}", f"train.steps={args.steps}",
        f"task.eval_every={args.eval_every}", "task.eval_timing=deferred", "checkpoint.every=0", "metrics.report=false",
        "metrics.progress=false", "metrics.tensorboard=false", *args.set, "--run-dir", str(args.out / run_name(system, eta, seed)),
    ]  # fmt: skip


def study_order(cell_list: Sequence[tuple[str, int]], seeds: Sequence[int]) -> list[tuple[str, int, int]]:
    """Seeds in the outer loop; the cells' order rotated by one per seed."""
    order = []
    for i, seed in enumerate(seeds):
        k = i % len(cell_list)
        order += [(system, eta, seed) for system, eta in [*cell_list[k:], *cell_list[:k]]]
    return order


def _train(args: argparse.Namespace, system: str, eta: int, seed: int) -> bool:
    from staleflow.bench.convergence import finished_steps, run_train

    name = run_name(system, eta, seed)
    run_dir = args.out / name
    if finished_steps(run_dir) == args.steps:
        return True
    command = train_command(args, system, eta, seed)
    load_before, started = os.getloadavg(), time.time()
    ok = run_train(command, run_dir, args.steps, args.out / "logs" / f"{name}.log", args.json)
    entry = {
        "run": name, "command": " ".join(command), "finished": ok, "started_utc": time.strftime("%H:%M:%S", time.gmtime(started)),
        "wall_s": round(time.time() - started, 1), "load_before": list(load_before), "load_after": list(os.getloadavg()),
    }  # fmt: skip
    with open(args.out / "runs.jsonl", "a", encoding="utf-8") as handle:
        handle.write(json.dumps(entry) + "\n")
    return ok


# -------------------------------------------------------------------------------- aggregation
def summarise_cell(runs: Sequence[RunFigures], thresholds: Sequence[float], gain: bool = False) -> dict[str, Any]:
    """Median, min and max over seeds of each threshold's time, and the cell's throughput and staleness."""
    staleness: Counter[int] = Counter()
    for run in runs:
        staleness.update(run.staleness)
    groups = sum(staleness.values())
    times = {}
    for threshold in thresholds:
        seeds = [run.time_to(threshold, gain) for run in runs]
        times[str(threshold)] = {
            "median": statistics.median(seeds),
            "min": min(seeds),
            "max": max(seeds),
            "reached": sum(1 for t in seeds if math.isfinite(t)),
            "per_seed": seeds,
        }
    rates = [run.gain_per_100s for run in runs]
    return {
        "seeds": [run.seed for run in runs],
        "time_to": times,
        "gain_per_100s": {"median": statistics.median(rates), "min": min(rates), "max": max(rates), "per_seed": rates},
        "gain_per_100_steps": statistics.median(run.gain_per_100_steps for run in runs),
        "tokens_per_s": statistics.median(run.tokens_per_s for run in runs),
        "tokens_per_s_range": [min(r.tokens_per_s for r in runs), max(r.tokens_per_s for r in runs)],
        "eval_start": statistics.median(run.eval_reward[0] for run in runs),
        "eval_final": statistics.median(run.eval_reward[-1] for run in runs),
        "loop_s": statistics.median(run.loop_s for run in runs),
        "staleness": dict(sorted(staleness.items())),
        "mean_staleness": sum(s * n for s, n in staleness.items()) / groups if groups else 0.0,
        "max_staleness": max(staleness, default=0),
        "trainer_busy": statistics.median(run.train_s / run.loop_s for run in runs),
        "rollout_utilisation": statistics.median(run.utilisation for run in runs),
        "step_s": statistics.median(run.loop_s / run.steps for run in runs),
        "train_s_per_step": statistics.median(run.train_s / run.steps for run in runs),
        "weight_sync_s_per_step": statistics.median(run.weight_sync_s / run.steps for run in runs),
    }


def speedups(figures: dict[str, dict[str, Any]], thresholds: Sequence[float], baseline: str = "sync-eta0") -> None:
    """Adds ``speedup`` per threshold: the baseline's median time over the cell's (None if either is not reached)."""
    base = figures.get(baseline)
    for cell in figures.values():
        cell["speedup"], cell["speedup_paired"] = {}, {}
        for threshold in map(str, thresholds):
            mine = cell["time_to"][threshold]["median"]
            theirs = base["time_to"][threshold]["median"] if base else math.inf
            usable = 0 < mine < math.inf and math.isfinite(theirs)  # 0: reached before the first step, nothing to compare
            cell["speedup"][threshold] = theirs / mine if usable else None
            cell["speedup_paired"][threshold] = _paired(cell, base, threshold) if base else None
        cell["rate_vs_sync"], cell["rate_vs_sync_paired"] = None, None
        if base and base["gain_per_100s"]["median"] > 0:
            cell["rate_vs_sync"] = cell["gain_per_100s"]["median"] / base["gain_per_100s"]["median"]
            theirs = dict(zip(base["seeds"], base["gain_per_100s"]["per_seed"]))
            ratios = [mine / theirs[s] for s, mine in zip(cell["seeds"], cell["gain_per_100s"]["per_seed"]) if theirs.get(s, 0) > 0]
            cell["rate_vs_sync_paired"] = statistics.median(ratios) if ratios else None


def _paired(cell: dict[str, Any], base: dict[str, Any], threshold: str) -> float | None:
    """Median over the seeds both cells ran of the baseline's time over the cell's (None if a seed
    misses the threshold in either, or they share no seed): the seeds' different starts cancel."""
    mine = dict(zip(cell["seeds"], cell["time_to"][threshold]["per_seed"]))
    theirs = dict(zip(base["seeds"], base["time_to"][threshold]["per_seed"]))
    ratios = [theirs[s] / mine[s] for s in mine if s in theirs and 0 < mine[s] < math.inf and math.isfinite(theirs[s])]
    shared = [s for s in mine if s in theirs]
    return statistics.median(ratios) if shared and len(ratios) == len(shared) else None


def json_safe(value: Any) -> Any:
    """``value`` with every infinite float (a threshold not reached) as None, for strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _seconds(value: float) -> str:
    return f"{value:.0f} s" if math.isfinite(value) else "not reached"


def table(figures: dict[str, dict[str, Any]], thresholds: Sequence[float], gain: bool = False) -> str:
    heads = " | ".join(f"to {'+' if gain else ''}{t:g}: median (min-max) [speed-up vs sync; paired by seed]" for t in thresholds)
    lines = [
        f"| system (eta) | seeds | {heads} | eval gain per 100 s, fitted: median (min-max) [vs sync; paired] "
        "| per 100 steps | trained tokens/s | eval start -> end | staleness histogram (mean) | s per step (training) "
        "| trainer busy | rollout busy | weight reloads s per step |",
        "|---|---|" + "---|" * len(thresholds) + "---|---|---|---|---|---|---|---|---|",
    ]
    for name, f in figures.items():
        cols = []
        for t in map(str, thresholds):
            c, speedup, seeds = f["time_to"][t], f["speedup"][t], len(f["seeds"])
            if c["reached"] == 0:
                cols.append(f"not reached (0/{seeds})")
                continue
            reached = "" if c["reached"] == seeds else f", {c['reached']}/{seeds} reached"
            paired = f["speedup_paired"][t]
            cols.append(
                f"{_seconds(c['median'])} ({_seconds(c['min'])}-{_seconds(c['max'])}{reached})"
                + (f" [{speedup:.2f}x" if speedup is not None else " [-")
                + (f"; paired {paired:.2f}x]" if paired is not None else "]")
            )
        histogram = ", ".join(f"{s}: {n}" for s, n in f["staleness"].items())
        rate, vs, paired = f["gain_per_100s"], f["rate_vs_sync"], f["rate_vs_sync_paired"]
        versus = f" [{vs:.2f}x; paired {paired:.2f}x]" if vs is not None and paired is not None else ""
        lines.append(
            f"| {name} | {len(f['seeds'])} | {' | '.join(cols)} | {rate['median']:+.3f} ({rate['min']:+.3f} to {rate['max']:+.3f}){versus} "
            f"| {f['gain_per_100_steps']:+.3f} | {f['tokens_per_s']:.0f} "
            f"({f['tokens_per_s_range'][0]:.0f}-{f['tokens_per_s_range'][1]:.0f}) | {f['eval_start']:.3f} -> {f['eval_final']:.3f} | "
            f"{{{histogram}}} ({f['mean_staleness']:.2f}) | {f['step_s']:.2f} ({f['train_s_per_step']:.2f}) | "
            f"{f['trainer_busy']:.0%} | {f['rollout_utilisation']:.0%} | {f['weight_sync_s_per_step']:.2f} |"
        )
    return "\n".join(lines)


def plot(runs: Sequence[RunFigures], names: Sequence[str], thresholds: Sequence[float], path: Path, title: str, gain: bool) -> None:
    from staleflow.app.report import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 5))
    for i, name in enumerate(names):
        mine = [r for r in runs if f"{r.system}-eta{r.eta}" == name]
        for k, run in enumerate(mine):
            rewards = [r - run.eval_reward[0] for r in run.eval_reward] if gain else run.eval_reward
            ax.plot(run.eval_t, rewards, marker="o", ms=3, color=f"C{i}", alpha=0.8, label=name if k == 0 else None)
    for threshold in thresholds:
        ax.axhline(threshold, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("run-loop time (s; start-up and evaluation excluded)")
    ax.set_ylabel("held-out eval reward" + (" gain over step 0" if gain else ""))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def reproduce_command(args: argparse.Namespace) -> str:
    config = f" --config {args.config}" if args.config else ""
    extra = f" --set {' '.join(args.set)}" if args.set else ""
    return (
        f"staleflow bench time-to-quality{config} --systems {' '.join(args.systems)} --etas {' '.join(map(str, args.etas))} "
        f"--seeds {' '.join(map(str, args.seeds))} --steps {args.steps} --eval-every {args.eval_every} "
        f"--thresholds {' '.join(f'{t:g}' for t in args.thresholds)}{' --gains' if args.gains else ''}{extra} --out {args.out}"
    )


# ------------------------------------------------------------------------------------ command
def _problems(args: argparse.Namespace) -> list[str]:
    from staleflow.runtime.settings.policies import training_systems

    known = training_systems()  # each cell is a `staleflow train` run
    problems = [f"--{n} must be >= 1 (got {v})" for n, v in (("steps", args.steps), ("eval-every", args.eval_every)) if v < 1]
    problems += [f"--etas: eta must be >= 0 (got {e})" for e in args.etas if e < 0]
    problems += [f"--systems: {s!r} is not a system a training job runs (known: {', '.join(known)})"
                 for s in args.systems if s not in known]
    problems += [f"--set: {item!r} is not KEY=VALUE" for item in args.set if "=" not in item]
    if args.config is not None and not args.config.is_file():
        problems.append(f"--config: {args.config} is not a file")
    return problems


def run(args: argparse.Namespace) -> int:
    from staleflow.app.metrics import read_metrics

    problems = _problems(args)
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    from staleflow.bench.convergence import finished_steps

    cell_list = cells(args.systems, args.etas)
    failed: list[str] = []
    runs: list[RunFigures] = []
    try:
        for system, eta, seed in study_order(cell_list, args.seeds):
            run_dir = args.out / run_name(system, eta, seed)
            if finished_steps(run_dir) == args.steps if args.no_train else _train(args, system, eta, seed):
                runs.append(read_run(read_metrics(run_dir), system, eta, seed))
            elif not args.no_train:
                failed.append(run_name(system, eta, seed))
        if not runs:
            raise ValueError(f"no finished run of {args.steps} steps in {args.out}")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    names = [f"{s}-eta{e}" for s, e in cell_list if any(r.system == s and r.eta == e for r in runs)]
    figures = {
        n: summarise_cell(sorted((r for r in runs if f"{r.system}-eta{r.eta}" == n), key=lambda r: r.seed), args.thresholds, args.gains)
        for n in names
    }
    speedups(figures, args.thresholds)
    job = args.config.name if args.config else "built-in job"
    plot(runs, names, args.thresholds, args.out / f"{FILE}.png", f"{job}, {args.steps} steps: held-out eval per run", args.gains)
    command = reproduce_command(args)
    text = table(figures, args.thresholds, args.gains)
    (args.out / f"{FILE}.md").write_text(f"{text}\n\n![time to quality]({FILE}.png)\n\nReproduce: `{command}`\n", encoding="utf-8")
    payload = json_safe({"job": job, "steps": args.steps, "eval_every": args.eval_every, "thresholds": args.thresholds,
               "gains": args.gains, "failed": failed, "command": command, "cells": figures, "runs": [asdict(r) for r in runs]})  # fmt: skip
    (args.out / f"{FILE}.json").write_text(json.dumps(payload, indent=1), encoding="utf-8")
    if args.json:
        print(json.dumps({k: v for k, v in payload.items() if k != "runs"}, indent=1))
    else:
        print(text)
        if failed:
            print(f"runs that did not finish (see {args.out / 'logs'}): {', '.join(failed)}")
        print(f"plot: {args.out / f'{FILE}.png'}; figures: {args.out / f'{FILE}.json'}\nreproduce: {command}")
    return 0 if all(r.staleness and max(r.staleness) <= r.eta for r in runs) else 1

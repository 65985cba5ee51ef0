"""The final report of a training run: ``report.md`` with PNG plots, from the run directory's files.

Plots: ``reward.png`` (train reward per step with a moving mean and the evaluations, against training
steps and against run time), ``throughput.png`` (trained tokens/s, cumulative and per step),
``staleness.png`` (per buffer, how many groups were 0, 1, ... versions stale: stacked bars),
``instances.png`` (how many versions each rollout instance is behind the newest, and its requests,
over time).

``write_report(run_dir)`` reads ``summary.json``, ``metrics.jsonl`` and ``instances.jsonl``.
Several runs on the same axes: :mod:`staleflow.app.report_compare`; ``staleflow report``
(``cli/report.py``) calls one or the other.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from staleflow.app.metrics import INSTANCES_FILE, read_metrics
from staleflow.app.summary import cost_fit_line


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> None:
    """Write a report figure as a PNG and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def moving_mean(values: Sequence[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def step_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("kind") == "step"]


def eval_points(records: list[dict[str, Any]]) -> list[tuple[int, float, float]]:
    """``(step, run seconds, eval reward)`` of each evaluation: the seconds are the run time at which
    the step that made the evaluated weights ended (0 before the first step); an evaluation of a step
    with no step record (a resumed run's first) is left out."""
    seconds = {0: 0.0, **{r["step"]: r["elapsed_s"] for r in step_records(records)}}
    return [(r["step"], seconds[r["step"]], r["eval_reward"]) for r in records if r.get("kind") == "eval" and r["step"] in seconds]


def eval_label(records: list[dict[str, Any]]) -> str:
    evals = [r for r in records if r.get("kind") == "eval"]
    return "eval (pass@1 / mean reward)" if evals and "eval_pass@1" in evals[0] else "greedy eval (fixed set)"


def plot_reward(records: list[dict[str, Any]], path: Path) -> None:
    """Train reward (each batch and the mean of 20 steps) and the evaluations, against training steps
    (left) and against run time (right)."""
    plt = pyplot()
    steps = step_records(records)
    evals = eval_points(records)
    y = [r.get("reward_mean") or 0.0 for r in steps]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, x, eval_x, xlabel in (
        (axes[0], [r["step"] for r in steps], [e[0] for e in evals], "training step"),
        (axes[1], [r["elapsed_s"] for r in steps], [e[1] for e in evals], "run time (s)"),
    ):
        ax.plot(x, y, alpha=0.3, color="C0", label="batch reward")
        ax.plot(x, moving_mean(y, 20), color="C0", label="mean of 20 steps")
        if evals:
            ax.plot(eval_x, [e[2] for e in evals], "o--", color="C3", label=eval_label(records))
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("reward")
    axes[0].set_ylim(0, 1)
    axes[0].legend()
    save_figure(fig, path)


def plot_throughput(records: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    steps = step_records(records)
    fig, ax = plt.subplots(figsize=(7, 4))
    x = [r["elapsed_s"] for r in steps]
    ax.plot(x, [r["tokens_per_s"] for r in steps], label="trained tokens/s (cumulative)")
    per_step = [r["tokens"] / r["step_time_s"] if r.get("step_time_s") else 0.0 for r in steps]
    ax.plot(x, moving_mean(per_step, 10), alpha=0.6, label="per step (mean of 10)")
    ax.set_xlabel("run time (s)")
    ax.set_ylabel("tokens/s")
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, path)


def plot_staleness(records: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    steps = [r for r in step_records(records) if r.get("group_staleness")]
    fig, ax = plt.subplots(figsize=(7, 4))
    levels = sorted({int(s) for r in steps for s in r["group_staleness"]})
    bottom = [0] * len(steps)
    x = [r["buffer"] for r in steps]
    for level in levels:
        heights = [r["group_staleness"].get(str(level), 0) for r in steps]
        ax.bar(x, heights, bottom=bottom, width=1.0, label=f"{level} stale")
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xlabel("buffer (training step)")
    ax.set_ylabel("groups")
    ax.set_title("staleness of the groups in each buffer")
    if levels:
        ax.legend()
    save_figure(fig, path)


def read_timeline(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    file = run_dir / INSTANCES_FILE
    timeline: dict[str, list[dict[str, Any]]] = defaultdict(list)
    if file.is_file():
        for line in file.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                timeline[row["instance"]].append(row)
    return dict(timeline)


def version_lags(timeline: dict[str, list[dict[str, Any]]]) -> dict[str, tuple[list[float], list[int]]]:
    """Per instance, ``(times, lags)`` at every sample of every instance: how many versions it is behind
    the newest instance then, its own version carried forward from its last sample (an instance that
    has no sample yet is not drawn). An instance still on the old version while another has synced
    shows its lag even though its own samples are taken only around its own syncs."""
    rows = sorted((r for rs in timeline.values() for r in rs), key=lambda r: r["t"])
    current: dict[str, int] = {}
    lags: dict[str, tuple[list[float], list[int]]] = {iid: ([], []) for iid in timeline}
    for row in rows:
        current[row["instance"]] = row["version"]
        newest = max(current.values())
        for iid, version in current.items():
            lags[iid][0].append(row["t"])
            lags[iid][1].append(newest - version)
    return lags


def plot_instances(timeline: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """Top: how many versions each instance is behind the newest instance (0 = newest; see
    :func:`version_lags`). Bottom: the requests on each instance."""
    plt = pyplot()
    lags = version_lags(timeline)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    for i, (iid, rs) in enumerate(sorted(timeline.items())):
        top.step(*lags[iid], where="post", label=iid, color=f"C{i}", alpha=0.8)
        bottom.plot([r["t"] for r in rs], [r["running"] + r["waiting"] for r in rs], color=f"C{i}", alpha=0.8, label=iid)
    top.set_ylabel("versions behind newest")
    top.grid(alpha=0.3)
    top.legend(loc="upper left")
    bottom.set_ylabel("requests on instance")
    bottom.set_xlabel("time since the command started (s)")
    bottom.grid(alpha=0.3)
    save_figure(fig, path)


def write_report(run_dir: Path) -> Path:
    """Write ``report.md`` and its plots into ``run_dir``; returns the report's path."""
    run_dir = Path(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    records = read_metrics(run_dir)
    plot_reward(records, run_dir / "reward.png")
    plot_throughput(records, run_dir / "throughput.png")
    plot_staleness(records, run_dir / "staleness.png")
    plot_instances(read_timeline(run_dir), run_dir / "instances.png")

    def fmt(value: Any, digits: int = 3) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    inst = summary["instances"]
    times = summary["time_breakdown_s"]
    label = summary.get("eval_label") or {"reward": "greedy eval reward (fixed set)", "exact": "greedy exact answers"}
    lines = [
        f"# Training run: {summary['system']} (eta {summary['eta']})",
        "",
        "| | |",
        "|---|---|",
        f"| steps | {summary['steps']} |",
        f"| wall time (all) / run loop | {summary['wall_s']:.0f} s / {summary['elapsed_s']:.0f} s |",
        f"| warm-up / engine start-up | {summary['warmup_s']:.1f} s / {summary['engine_start_s']:.1f} s |",
        f"| train reward, first {summary['reward_window']} -> last {summary['reward_window']} steps "
        f"| {fmt(summary['reward_first'])} -> {fmt(summary['reward_last'])} |",
        f"| {label['reward']} | {fmt(summary['eval_first'])} -> {fmt(summary['eval_last'])} |",
        f"| {label['exact']} | {fmt(summary['eval_exact_first'])} -> {fmt(summary['eval_exact_last'])} |",
        f"| trained tokens/s | {summary['tokens_per_s']:.0f} |",
        f"| generated / trained tokens | {summary['tokens_generated']} / {summary['tokens_trained']} |",
        f"| mean step time | {summary['step_time_s']:.3f} s |",
        f"| staleness histogram (groups) | {summary['staleness_histogram']} |",
        f"| max staleness <= eta | {summary['max_staleness']} <= {summary['eta']}: {summary['bound_ok']} |",
        f"| dropped / reward failures / re-queued | {summary['dropped']} / {summary['reward_failures']} / {summary['proactive_aborted']} |",
        f"| audit (lost, duplicated) | {summary['lost']}, {summary['duplicated']}: {'ok' if summary['audit_ok'] else 'FAILED'} |",
        f"| instance busy fraction | {', '.join(f'{k} {v:.2f}' for k, v in summary['instance_busy_fraction'].items())} |",
        f"| max version spread between instances | {inst['max_version_spread']:.0f} |",
        f"| requests interrupted / resumed / resumed on another instance "
        f"| {inst['interrupted_requests']:.0f} / {inst['resumed_requests']:.0f} / {inst['resumed_elsewhere']:.0f} |",
        f"| weight syncs (time) | {inst['weight_syncs']:.0f} ({inst['sync_seconds']:.1f} s) |",
        f"| time: train / reward / weight sync / rollout busy (mean) "
        f"| {times['train']:.1f} / {times['reward']:.1f} / {times['weight_sync']:.1f} / {times['rollout_busy_mean']:.1f} s |",
        f"| cost model (fitted online to the engines' decode steps) | {cost_fit_line(summary.get('cost_fit') or {})} |",
        f"| protocol trace | `{Path(summary['trace']).name}` (`staleflow verify --trace {summary['trace']}`) |",
        "",
        "## Reward",
        "",
        "![reward](reward.png)",
        "",
        *_eval_table(summary, label, {e[0]: e[1] for e in eval_points(records)}),
        "## Throughput",
        "",
        "![throughput](throughput.png)",
        "",
        "## Staleness per buffer",
        "",
        "![staleness](staleness.png)",
        "",
        "## Rollout instances",
        "",
        "![instances](instances.png)",
        "",
    ]
    path = run_dir / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def _eval_table(summary: dict[str, Any], label: dict[str, str], seconds: dict[int, float]) -> list[str]:
    """The evaluations, each at its training step and run time (``seconds``: step -> run seconds)."""
    evals = summary.get("evals") or []
    if not evals:
        return []

    def at(step: int) -> str:
        return f"{seconds[step]:.0f}" if step in seconds else "-"

    rows = [f"| {e['step']} | {at(e['step'])} | {e['reward']:.3f} | {e['exact']:.3f} |" for e in evals]
    return ["## Evaluation", "", f"| step | run s | {label['reward']} | {label['exact']} |", "|---|---|---|---|", *rows, ""]

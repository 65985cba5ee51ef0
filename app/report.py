"""The final report of a training run: ``report.md`` with PNG plots, from the run directory's files.

Plots: ``reward.png`` (train reward per step with a moving mean, greedy eval points),
``throughput.png`` (trained tokens/s, cumulative and per step), ``staleness.png`` (per buffer, how
many groups were 0, 1, ... versions stale: stacked bars), ``instances.png`` (how many versions each rollout
instance is behind the newest, and its requests, over time).

``write_report(run_dir)`` reads ``summary.json``, ``metrics.jsonl`` and ``instances.jsonl``.
``compare_runs`` writes one Markdown table and reward/throughput plots for several runs (e.g.
``staleflow`` against ``sync``); ``staleflow report`` (``cli/report.py``) calls one or the other.
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


def _save(fig: Any, path: Path) -> None:
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


def _steps(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("kind") == "step"]


def plot_reward(records: list[dict[str, Any]], path: Path, label: str = "") -> None:
    plt = pyplot()
    steps = _steps(records)
    fig, ax = plt.subplots(figsize=(7, 4))
    x = [r["step"] for r in steps]
    y = [r.get("reward_mean") or 0.0 for r in steps]
    ax.plot(x, y, alpha=0.3, color="C0", label=f"{label} batch reward".strip())
    ax.plot(x, moving_mean(y, 20), color="C0", label=f"{label} mean of 20 steps".strip())
    evals = [r for r in records if r.get("kind") == "eval"]
    if evals:
        name = "eval (pass@1 / mean reward)" if "eval_pass@1" in evals[0] else "greedy eval (fixed set)"
        ax.plot([r["step"] for r in evals], [r["eval_reward"] for r in evals], "o--", color="C3", label=name)
    ax.set_xlabel("training step")
    ax.set_ylabel("reward")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path)


def plot_throughput(records: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    steps = _steps(records)
    fig, ax = plt.subplots(figsize=(7, 4))
    x = [r["elapsed_s"] for r in steps]
    ax.plot(x, [r["tokens_per_s"] for r in steps], label="trained tokens/s (cumulative)")
    per_step = [r["tokens"] / r["step_time_s"] if r.get("step_time_s") else 0.0 for r in steps]
    ax.plot(x, moving_mean(per_step, 10), alpha=0.6, label="per step (mean of 10)")
    ax.set_xlabel("run time (s)")
    ax.set_ylabel("tokens/s")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path)


def plot_staleness(records: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    steps = [r for r in _steps(records) if r.get("group_staleness")]
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
    _save(fig, path)


def read_timeline(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    file = run_dir / INSTANCES_FILE
    timeline: dict[str, list[dict[str, Any]]] = defaultdict(list)
    if file.is_file():
        for line in file.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                timeline[row["instance"]].append(row)
    return dict(timeline)


def plot_instances(timeline: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """Top: how many versions each instance is behind the newest instance version seen so far
    (0 = newest; several instances at different versions show as different lines). Bottom: the
    requests on each instance."""
    plt = pyplot()
    rows = sorted((r for rs in timeline.values() for r in rs), key=lambda r: r["t"])
    newest, lag = 0, {}
    for r in rows:
        newest = max(newest, r["version"])
        lag[id(r)] = newest - r["version"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    for i, (iid, rs) in enumerate(sorted(timeline.items())):
        t = [r["t"] for r in rs]
        top.step(t, [lag[id(r)] for r in rs], where="post", label=iid, color=f"C{i}", alpha=0.8)
        bottom.plot(t, [r["running"] + r["waiting"] for r in rs], color=f"C{i}", alpha=0.8, label=iid)
    top.set_ylabel("versions behind newest")
    top.grid(alpha=0.3)
    top.legend(loc="upper left")
    bottom.set_ylabel("requests on instance")
    bottom.set_xlabel("time since the command started (s)")
    bottom.grid(alpha=0.3)
    _save(fig, path)


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
        *_eval_table(summary, label),
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


def _eval_table(summary: dict[str, Any], label: dict[str, str]) -> list[str]:
    evals = summary.get("evals") or []
    if not evals:
        return []
    rows = [f"| {e['step']} | {e['reward']:.3f} | {e['exact']:.3f} |" for e in evals]
    return ["## Evaluation", "", f"| step | {label['reward']} | {label['exact']} |", "|---|---|---|", *rows, ""]


def compare_runs(run_dirs: Sequence[Path], out_dir: Path) -> Path:
    """A side-by-side Markdown table and reward/throughput plots of several runs."""
    plt = pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = [json.loads((Path(d) / "summary.json").read_text(encoding="utf-8")) for d in run_dirs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (run_dir, summary) in enumerate(zip(run_dirs, summaries)):
        steps = _steps(read_metrics(Path(run_dir)))
        label = f"{summary['system']} (eta {summary['eta']})"
        left.plot(
            [r["elapsed_s"] for r in steps], moving_mean([r.get("reward_mean") or 0.0 for r in steps], 20), color=f"C{i}", label=label
        )
        right.plot([r["elapsed_s"] for r in steps], [r["tokens_per_s"] for r in steps], color=f"C{i}", label=label)
    left.set_xlabel("run time (s)")
    left.set_ylabel("train reward (mean of 20 steps)")
    right.set_xlabel("run time (s)")
    right.set_ylabel("trained tokens/s (cumulative)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    _save(fig, out_dir / "compare.png")
    base = summaries[0]["tokens_per_s"]
    lines = [
        "| system | eta | steps | run s | tokens/s | vs first | reward first -> last | eval first -> last | max staleness |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        lines.append(
            f"| {s['system']} | {s['eta']} | {s['steps']} | {s['elapsed_s']:.0f} | {s['tokens_per_s']:.0f} | "
            f"{s['tokens_per_s'] / base:.2f}x | {s['reward_first']:.3f} -> {s['reward_last']:.3f} | "
            f"{(s['eval_first'] or 0):.3f} -> {(s['eval_last'] or 0):.3f} | {s['max_staleness']} |"
        )
    lines += ["", "![compare](compare.png)", ""]
    path = out_dir / "compare.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path

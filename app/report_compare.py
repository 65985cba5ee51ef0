"""Several training runs on the same axes (``staleflow report RUN --compare OTHER_RUN``): whether an
asynchronous run learns as much per step as a synchronous one, and more per second.

``compare_runs(run_dirs, out_dir)`` writes ``compare.md`` (one row per run) and ``compare.png``: train
reward (mean of 20 steps) and evaluation reward against training steps and against run time, trained
tokens/s against run time, and the mean staleness of the groups trained at each step.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from staleflow.app.metrics import read_metrics
from staleflow.app.report import eval_label, eval_points, moving_mean, pyplot, save_figure, step_records


def mean_staleness(histogram: Mapping[str, int]) -> float:
    """The mean staleness of a step's groups from its histogram (staleness -> groups); 0 for none."""
    groups = sum(histogram.values())
    return sum(int(level) * n for level, n in histogram.items()) / groups if groups else 0.0


def run_label(summary: Mapping[str, Any]) -> str:
    return f"{summary['system']} (eta {summary['eta']})"


def compare_runs(run_dirs: Sequence[Path], out_dir: Path) -> Path:
    """Write ``compare.md`` and ``compare.png`` for ``run_dirs`` into ``out_dir``; returns the Markdown's path."""
    plt = pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = [json.loads((Path(d) / "summary.json").read_text(encoding="utf-8")) for d in run_dirs]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    (reward_step, reward_time, speed), (eval_step, eval_time, stale) = axes
    eval_name = "eval reward"
    for i, (run_dir, summary) in enumerate(zip(run_dirs, summaries)):
        records = read_metrics(Path(run_dir))
        steps, evals = step_records(records), eval_points(records)
        style = {"color": f"C{i}", "label": run_label(summary)}
        reward = moving_mean([r.get("reward_mean") or 0.0 for r in steps], 20)
        reward_step.plot([r["step"] for r in steps], reward, **style)
        reward_time.plot([r["elapsed_s"] for r in steps], reward, **style)
        speed.plot([r["elapsed_s"] for r in steps], [r["tokens_per_s"] for r in steps], **style)
        eval_step.plot([e[0] for e in evals], [e[2] for e in evals], "o-", **style)
        eval_time.plot([e[1] for e in evals], [e[2] for e in evals], "o-", **style)
        stale.plot([r["step"] for r in steps], moving_mean([mean_staleness(r.get("group_staleness") or {}) for r in steps], 10), **style)
        eval_name = eval_label(records) if evals else eval_name
    for ax, xlabel, ylabel in (
        (reward_step, "training step", "train reward (mean of 20 steps)"),
        (reward_time, "run time (s)", "train reward (mean of 20 steps)"),
        (speed, "run time (s)", "trained tokens/s (cumulative)"),
        (eval_step, "training step", eval_name),
        (eval_time, "run time (s)", eval_name),
        (stale, "training step", "mean staleness of a step's groups (mean of 10)"),
    ):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    save_figure(fig, out_dir / "compare.png")
    path = out_dir / "compare.md"
    path.write_text("\n".join([*_table(summaries), "", "![compare](compare.png)", ""]), encoding="utf-8")
    return path


def _table(summaries: Sequence[Mapping[str, Any]]) -> list[str]:
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
    return lines

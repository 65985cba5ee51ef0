"""The run report's plots are drawn from the run's data: the instances panel shows an instance that
lags behind another, the evaluations are drawn against run time as well as steps, and a comparison
puts two runs on the same axes. Figures are caught as the report closes them and read back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The figures the report closes after saving them, in order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures: list[Any] = []
    monkeypatch.setattr(plt, "close", figures.append)
    return figures


def _sample(t: float, instance: str, version: int) -> dict[str, Any]:
    return {"t": t, "instance": instance, "version": version, "running": 3, "waiting": 0}


def test_the_instances_panel_draws_an_instance_still_on_the_old_version(tmp_path: Path, drawn: list[Any]) -> None:
    from staleflow.app.report import plot_instances

    # Each instance is sampled only around its own syncs (as instances.jsonl records them): rollout-1
    # stays on version 0 from t=1 to t=2 while rollout-0 serves version 1.
    timeline = {
        "rollout-0": [_sample(0.0, "rollout-0", 0), _sample(1.0, "rollout-0", 1), _sample(3.0, "rollout-0", 2)],
        "rollout-1": [_sample(0.5, "rollout-1", 0), _sample(2.0, "rollout-1", 1), _sample(3.5, "rollout-1", 2)],
    }
    plot_instances(timeline, tmp_path / "instances.png")
    assert (tmp_path / "instances.png").stat().st_size > 0
    lines = {line.get_label(): line for line in drawn[0].axes[0].lines}
    lagging = lines["rollout-1"]
    assert max(lagging.get_ydata()) == 1
    assert list(zip(lagging.get_xdata(), lagging.get_ydata())) == [(0.5, 0), (1.0, 1), (2.0, 0), (3.0, 1), (3.5, 0)]
    assert list(lines["rollout-0"].get_ydata()) == [0, 0, 0, 0, 0, 0]  # from its first sample at t=0


def _write_run(run_dir: Path, system: str, step_seconds: float, staleness: int) -> Path:
    """A finished run's ``summary.json`` and ``metrics.jsonl``: 4 steps of ``step_seconds``, evaluated at 0, 2 and 4."""
    run_dir.mkdir(parents=True)
    records: list[dict[str, Any]] = [{"kind": "eval", "step": 0, "eval_reward": 0.1, "eval_exact": 0.0}]
    for step in range(1, 5):
        records.append({
            "kind": "step", "step": step, "buffer": step - 1, "elapsed_s": step * step_seconds, "reward_mean": 0.1 * step,
            "tokens_per_s": 100.0 / step_seconds, "tokens": 100, "step_time_s": step_seconds,
            "group_staleness": {str(staleness): 4},
        })
        if step % 2 == 0:
            records.append({"kind": "eval", "step": step, "eval_reward": 0.1 + 0.1 * step, "eval_exact": 0.0})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = {
        "system": system, "eta": 2, "steps": 4, "elapsed_s": 4 * step_seconds, "tokens_per_s": 100.0 / step_seconds,
        "reward_first": 0.1, "reward_last": 0.4, "eval_first": 0.1, "eval_last": 0.5, "max_staleness": staleness,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def test_the_reward_plot_draws_the_evaluations_against_steps_and_run_time(tmp_path: Path, drawn: list[Any]) -> None:
    from staleflow.app.metrics import read_metrics
    from staleflow.app.report import plot_reward

    run = _write_run(tmp_path / "run", "staleflow", step_seconds=5.0, staleness=1)
    plot_reward(read_metrics(run), tmp_path / "reward.png")
    by_steps, by_seconds = drawn[0].axes
    evals = [(ax.lines[-1].get_xdata().tolist(), ax.lines[-1].get_ydata().tolist()) for ax in (by_steps, by_seconds)]
    assert evals[0] == ([0, 2, 4], pytest.approx([0.1, 0.3, 0.5]))
    assert evals[1] == ([0.0, 10.0, 20.0], pytest.approx([0.1, 0.3, 0.5]))  # the run time at which each step ended
    assert by_seconds.get_xlabel() == "run time (s)"


def test_report_compare_puts_two_runs_on_the_same_axes(tmp_path: Path, drawn: list[Any], capsys: pytest.CaptureFixture[str]) -> None:
    from staleflow.__main__ import main

    fast = _write_run(tmp_path / "fast", "staleflow", step_seconds=5.0, staleness=1)
    slow = _write_run(tmp_path / "slow", "sync", step_seconds=10.0, staleness=0)
    assert main(["report", str(fast), "--compare", str(slow), "--out", str(tmp_path / "compare")]) == 0
    assert "| sync | 2 | 4 | 40 | 10 | 0.50x |" in capsys.readouterr().out
    assert (tmp_path / "compare" / "compare.png").stat().st_size > 0
    panels = {ax.get_ylabel() + " / " + ax.get_xlabel(): ax for ax in drawn[0].axes}
    assert len(panels) == 6
    for ax in panels.values():
        assert [line.get_label() for line in ax.lines] == ["staleflow (eta 2)", "sync (eta 2)"]

    def line(panel: str, run: int) -> list[float]:
        return panels[panel].lines[run].get_xdata().tolist()

    assert line("greedy eval (fixed set) / run time (s)", 0) == [0.0, 10.0, 20.0]
    assert line("greedy eval (fixed set) / run time (s)", 1) == [0.0, 20.0, 40.0]
    assert line("greedy eval (fixed set) / training step", 1) == [0, 2, 4]
    assert panels["trained tokens/s (cumulative) / run time (s)"].lines[1].get_ydata().tolist() == [10.0] * 4
    staleness = "mean staleness of a step's groups (mean of 10) / training step"
    assert [panels[staleness].lines[i].get_ydata().tolist() for i in (0, 1)] == [[1.0] * 4, [0.0] * 4]

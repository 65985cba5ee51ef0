"""What a training job records: one metrics record per step, the run's summary and its text."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from staleflow.app.metrics import read_metrics

if TYPE_CHECKING:
    from staleflow.runtime.settings.config import JobConfig


def step_record(metrics: Any, ledger: Any, reward_seconds: float, trained_before: int) -> dict[str, Any]:
    train = dict(metrics.train_metrics[-1]) if metrics.train_metrics else {}
    buffer = max(metrics.staleness_per_buffer) if metrics.staleness_per_buffer else None
    record = {
        **train,
        "elapsed_s": metrics.elapsed_s,
        "step_time_s": metrics.step_times_s[-1] if metrics.step_times_s else 0.0,
        "tokens_per_s": (metrics.tokens_trained - trained_before) / metrics.elapsed_s,
        "tokens_trained": metrics.tokens_trained,
        "tokens_generated": metrics.tokens_generated,
        "buffer": buffer,
        "group_staleness": {} if buffer is None else {str(s): n for s, n in metrics.staleness_per_buffer[buffer].items()},
        "dropped": metrics.dropped,
        "reward_failures": metrics.reward_failures,
        "utilisation": metrics.utilisation,
        "reward_s_total": reward_seconds,
        **{k: v for k, v in ledger.summary().items()},
        **cost_fit_scalars(metrics.cost_fit),
    }
    return record


def cost_fit_scalars(fit: dict[str, Any]) -> dict[str, Any]:
    """The online cost fit's figures as flat metrics (TensorBoard takes numbers only): its error, the
    prior's, its age, steps, points and refits, and the coefficients as ``cost_<name>``."""
    coefficients = {f"cost_{name}": value for name, value in fit.get("cost_model", {}).items()}
    return {**{k: v for k, v in fit.items() if k not in ("cost_model", "cost_prior")}, **coefficients}


def cost_fit_line(fit: dict[str, Any]) -> str:
    """One line on the cost model the coordinator planned with at the end of the run."""
    if not fit:
        return "-"
    error, prior = fit["cost_fit_error"], fit["cost_prior_error"]
    errors = "no decode step measured" if error is None else f"mean relative error {error:.1%} (prior {prior:.1%})"
    return (f"{errors}; {fit['cost_fit_refits']} refits on {fit['cost_fit_steps']} decode steps ({fit['cost_fit_points']} points), "
            f"last {fit['cost_fit_age_s']:.0f} s before the end; prior: {fit['cost_prior']}")


@dataclass(frozen=True)
class RunOutcome:
    """What a finished run's summary is made of besides its config: the run loop's figures and final
    audit, the engines' ledger, where its files are, and how long each part took (seconds)."""

    eta: int
    metrics: Any
    audit: Any
    ledger: Any
    run_dir: Path
    trace_path: Path
    wall_s: float
    warmup_s: float
    engine_start_s: float
    reward_s: float
    trained_before: int = 0  # tokens trained before a resume: throughput covers this run only


def summarise(config: JobConfig, outcome: RunOutcome) -> dict[str, Any]:
    """``summary.json``'s content (``metrics.jsonl`` is read for the reward and eval figures)."""
    metrics, audit, ledger, eta = outcome.metrics, outcome.audit, outcome.ledger, outcome.eta
    records = read_metrics(outcome.run_dir)
    steps = [r for r in records if r.get("kind") == "step"]
    evals = [r for r in records if r.get("kind") == "eval"]
    rewards = [r["reward_mean"] for r in steps if r.get("reward_mean") is not None]
    window = min(20, max(1, len(rewards) // 3)) if rewards else 0
    train_s = sum(r.get("train_s", 0.0) for r in steps)
    data = metrics.to_dict()
    data.pop("train_metrics", None)
    data.pop("step_times_s", None)
    return {
        "system": config.system,
        "eta": eta,
        "steps": metrics.steps,
        "wall_s": outcome.wall_s,
        "warmup_s": outcome.warmup_s,
        "engine_start_s": outcome.engine_start_s,
        "reward_first": sum(rewards[:window]) / window if window else None,
        "reward_last": sum(rewards[-window:]) / window if window else None,
        "reward_window": window,
        "eval_first": evals[0]["eval_reward"] if evals else None,
        "eval_last": evals[-1]["eval_reward"] if evals else None,
        "eval_exact_first": evals[0]["eval_exact"] if evals else None,
        "eval_exact_last": evals[-1]["eval_exact"] if evals else None,
        "eval_label": eval_label(config),
        "evals": [{"step": r["step"], "reward": r["eval_reward"], "exact": r["eval_exact"]} for r in evals],
        "bound_ok": metrics.max_staleness <= eta,
        "time_breakdown_s": {
            "run": metrics.elapsed_s,
            "train": train_s,
            "reward": outcome.reward_s,
            "weight_sync": ledger.summary()["sync_seconds"],
            "rollout_busy_mean": metrics.utilisation * metrics.elapsed_s,
        },
        "instances": ledger.summary(),
        "trace": str(outcome.trace_path),
        **{k: v for k, v in data.items() if k not in ("system", "steps")},
        # the audit after the final quiesce (the loop's own is taken while instances still run)
        "tokens_per_s": (metrics.tokens_trained - outcome.trained_before) / metrics.elapsed_s,  # this run (after a resume)
        "audit_ok": audit.ok,
        "lost": len(audit.lost),
        "duplicated": len(audit.duplicated),
        "orphaned": len(audit.orphaned),
        "audit_problems": list(audit.problems[:10]),
        "trajectory_server": {"groups": audit.groups, "requests": audit.requests},
    }


def eval_label(config: JobConfig) -> dict[str, str]:
    """How the run evaluates: the built-in job on the trainer (greedy), files through a rollout engine."""
    task = config.task
    if task.eval_file is None and task.prompt_file is None:
        return {"reward": "greedy eval reward (fixed set)", "exact": "greedy exact answers"}
    source = f"held-out {Path(task.eval_file).name}" if task.eval_file else "training rows, not held out"
    return {"reward": f"eval reward ({source}; {task.eval_sampling}, rollout engine)", "exact": f"eval pass@1 ({task.eval_sampling})"}


def summary_text(summary: dict[str, Any], run_dir: Path) -> str:
    def fmt(value: Any) -> str:
        return "-" if value is None else f"{value:.3f}"

    inst = summary["instances"]
    label = summary.get("eval_label") or {"reward": "greedy eval reward", "exact": "exact"}
    lines = [
        (
            f"system {summary['system']} (eta {summary['eta']}): {summary['steps']} steps in {summary['wall_s']:.0f} s "
            f"(run loop {summary['elapsed_s']:.0f} s)"
        ),
        (
            f"  train reward, first {summary['reward_window']} -> last {summary['reward_window']} steps: "
            f"{fmt(summary['reward_first'])} -> {fmt(summary['reward_last'])}"
        ),
        (
            f"  {label['reward']}: {fmt(summary['eval_first'])} -> {fmt(summary['eval_last'])} "
            f"({label['exact']} {fmt(summary['eval_exact_first'])} -> {fmt(summary['eval_exact_last'])})"
        ),
        (
            f"  trained tokens/s: {summary['tokens_per_s']:.0f}; staleness histogram {summary['staleness_histogram']} "
            f"(max {summary['max_staleness']} <= eta {summary['eta']}: {summary['bound_ok']})"
        ),
        (
            f"  instances: max version spread {inst['max_version_spread']:.0f}, interrupted {inst['interrupted_requests']:.0f}, "
            f"resumed elsewhere {inst['resumed_elsewhere']:.0f}, weight syncs {inst['weight_syncs']:.0f}"
        ),
        f"  cost model: {cost_fit_line(summary.get('cost_fit') or {})}",
        f"  audit: lost {summary['lost']}, duplicated {summary['duplicated']}, orphaned {summary['orphaned']}, ok {summary['audit_ok']}",
        f"  files: {run_dir}/ (report.md, metrics.jsonl, {Path(summary['trace']).name}, checkpoints/, logs/)",
    ]
    return "\n".join(lines)

"""How evenly a simulated run spreads its work over the rollout instances, step by step (the
paper's Fig. 4: instances of one system finish very different numbers of trajectories and tokens
in a step, and the ones that run dry idle).

:class:`SkewRecorder` takes, at the end of every training step, each instance's cumulative decode
tokens, finished trajectories and busy seconds (time holding requests, the run's utilisation
measure), and keeps the per-step differences. :meth:`SkewRecorder.figures` gives, per step, the
min / median / max and coefficient of variation (population standard deviation over mean) of the
tokens generated and of the trajectories finished per instance, and the mean instance utilisation
in that step; and the means of those over the steps.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any, Protocol


class InstanceProgress(Protocol):
    instance_id: str

    def progress(self) -> tuple[int, int]:
        """Decode tokens generated and trajectories finished so far."""
        ...


def spread(values: Sequence[float]) -> dict[str, float]:
    """``min``, ``median``, ``max`` and ``cv`` (population standard deviation / mean; 0 when the mean is 0)."""
    mean = statistics.fmean(values)
    cv = statistics.pstdev(values) / mean if mean > 0 else 0.0
    return {"min": float(min(values)), "median": float(statistics.median(values)), "max": float(max(values)), "cv": cv}


class SkewRecorder:
    """Per-step, per-instance work of a run (module docstring).

    Args:
        engines: the instances, in a fixed order.
        now: the run's clock.
        busy_seconds: cumulative seconds each instance (by id) held requests, up to a time
            (:meth:`~staleflow.runtime.run.run_stats.RunStats.busy_seconds`).
    """

    def __init__(
        self, engines: Sequence[InstanceProgress], now: Callable[[], float], busy_seconds: Callable[[float], dict[str, float]]
    ) -> None:
        self._engines = list(engines)
        self._now = now
        self._busy_seconds = busy_seconds
        self._last = self._sample(now())
        self.steps: list[dict[str, Any]] = []

    def _sample(self, at: float) -> tuple[float, list[int], list[int], list[float]]:
        progress = [engine.progress() for engine in self._engines]
        busy = self._busy_seconds(at)
        return at, [p[0] for p in progress], [p[1] for p in progress], [busy.get(e.instance_id, 0.0) for e in self._engines]

    def step_finished(self) -> None:
        """Record the step that just ended (call once per finished training step)."""
        current = self._sample(self._now())
        (t0, tokens0, done0, busy0), (t1, tokens1, done1, busy1) = self._last, current
        self._last = current
        span = t1 - t0
        utilisation = [min(1.0, (b1 - b0) / span) if span > 0 else 0.0 for b0, b1 in zip(busy0, busy1)]
        self.steps.append({
            "tokens": spread([b - a for a, b in zip(tokens0, tokens1)]),
            "trajectories": spread([b - a for a, b in zip(done0, done1)]),
            "utilisation": statistics.fmean(utilisation),
        })

    def figures(self) -> dict[str, Any]:
        """``per_step`` (one entry per step, see :meth:`step_finished`) and the means over the steps
        of the two coefficients of variation and of the utilisation."""
        steps = self.steps
        return {
            "per_step": steps,
            "mean_tokens_cv": _mean([s["tokens"]["cv"] for s in steps]),
            "mean_trajectories_cv": _mean([s["trajectories"]["cv"] for s in steps]),
            "mean_utilisation": _mean([s["utilisation"] for s in steps]),
        }


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0

"""The cost model fitted online to the engines' own decode steps, and what routing derives from it.

Every rollout engine records its pure decode steps (``n`` running requests, ``K`` KV tokens, the
step's seconds: :class:`DecodeStepLog`; vLLM's scheduler state on a real engine, the cost model's
steps on a simulated one). :class:`OnlineCostModel` starts from a prior (derived from the model's
shape and the device, :mod:`staleflow.runtime.settings.cost_prior`, or a ``staleflow profile`` file of
the same device) and, every ``refit_s`` seconds of the run's clock, refits
:func:`~staleflow.runtime.coordination.cost_model.fit_cost_model` to the steps seen so far:

* steps are pooled per ``(n, K)`` bin (``n`` exact, ``K`` in quarter octaves) into one point at the
  bin's mean ``K`` with the lower quartile of its latencies (a step slowed by another process can
  only be slower: the profiler's rule, ``app/profile.py``);
* an engines' pooled point :data:`OUTLIER_RATIO` times off the first fit, either way, is set aside
  and the fit made again without it (the prior's points below stay): bins are by exact ``n``, so one step that was no decode step (a pause
  the meter could not tell from one) is a bin's point on its own, and a least-squares fit bends its
  knee towards it;
* batch sizes beyond those the engines have run (the powers of two up to ``max_n`` above 1.5 times
  the largest observed ``n``) keep the prior's latency, at the observed KV per request: a run that
  only ever holds 40 requests does not tell the fit where compute binds, so the prior still does
  (between observed sizes the model's form interpolates).

:meth:`OnlineCostModel.figures` reports the fit: its mean relative error on the pooled points (and
the prior's, on the same points), its age (seconds since the last refit), steps and points.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from staleflow.runtime.coordination.cost_model import COEFFICIENTS, CostModel, ProfileRecord, fit_cost_model

#: latencies kept per bin (the lower quartile of the latest ones is the bin's point)
BIN_STEPS = 32
#: bins kept (the least recently seen one goes first)
MAX_BINS = 512
#: a pooled point more than this many times slower or faster than the first fit is set aside
OUTLIER_RATIO = 3.0


class DecodeStepLog:
    """A bounded, thread-safe record of pure decode steps, drained by the run loop (an engine
    thread records, the loop's thread drains)."""

    def __init__(self, maxlen: int = 100_000) -> None:
        self._steps: deque[ProfileRecord] = deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def record(self, n: int, kv_tokens: int, latency: float) -> None:
        with self._lock:
            self._steps.append(ProfileRecord(n=n, kv_tokens=kv_tokens, latency=latency))

    def drain(self) -> list[ProfileRecord]:
        """The steps recorded since the last call."""
        with self._lock:
            steps = list(self._steps)
            self._steps.clear()
        return steps


class OnlineCostModel:
    """The cost model the coordinator plans with: ``prior`` until the first refit, then the fit to
    the engines' steps (module docstring). ``online`` False: the prior throughout (steps are still
    taken, so :meth:`figures` tells how well it matches the engines). ``source`` names the prior."""

    def __init__(self, prior: CostModel, source: str, *, online: bool = True, refit_s: float = 10.0, max_n: int = 256) -> None:
        if refit_s <= 0 or max_n < 1:
            raise ValueError(f"need refit_s > 0 and max_n >= 1, got {refit_s}, {max_n}")
        self.prior = self.model = prior
        self.source = source
        self.online = online
        self.refit_s = refit_s
        self.max_n = max_n
        self._bins: OrderedDict[tuple[int, int], tuple[deque[float], float, int]] = OrderedDict()
        self._points: dict[tuple[int, int], ProfileRecord] = {}  # each bin's point, made again when the bin changes
        self._steps = 0
        self._new = 0
        self._refits = 0
        self._fitted_at: float | None = None
        self._started: float | None = None
        #: the errors of the model in use and of the prior on the pooled points (None: to measure)
        self._errors: tuple[float | None, float | None] | None = (None, None)

    def due(self, now: float) -> bool:
        """Whether it is time to take the engines' steps and refit (every ``refit_s`` from the first call)."""
        if self._started is None:
            self._started = now
        return now - (self._fitted_at if self._fitted_at is not None else self._started) >= self.refit_s

    def observe(self, steps: Iterable[ProfileRecord]) -> None:
        """Pool measured decode steps into their bins."""
        for step in steps:
            if step.n < 1 or not step.latency > 0:
                continue
            key = (step.n, round(4 * math.log2(1 + step.kv_tokens)))
            latencies, kv_sum, count = self._bins.pop(key, (deque(maxlen=BIN_STEPS), 0.0, 0))
            latencies.append(step.latency)
            self._bins[key] = (latencies, kv_sum + step.kv_tokens, count + 1)
            self._points.pop(key, None)
            if len(self._bins) > MAX_BINS:
                self._points.pop(self._bins.popitem(last=False)[0], None)
            self._steps += 1
            self._new += 1

    def points(self) -> list[ProfileRecord]:
        """One point per bin: its mean ``K`` and the lower quartile of its latest latencies (only the
        bins that took steps since the last call are computed again)."""
        for key, (latencies, kv_sum, count) in self._bins.items():
            if key not in self._points:
                self._points[key] = ProfileRecord(n=key[0], kv_tokens=round(kv_sum / count), latency=quantile(sorted(latencies), 0.25))
        return [self._points[key] for key in self._bins]

    @classmethod
    def of(cls, model: CostModel | OnlineCostModel) -> OnlineCostModel:
        """``model`` if it is one, else a fixed model (``online`` False) that still measures its error."""
        return model if isinstance(model, OnlineCostModel) else cls(model, "given", online=False)

    def refit(self, now: float, steps: Iterable[ProfileRecord] = ()) -> bool:
        """Pool ``steps`` and refit to every step pooled so far, if there are new ones; True if
        :attr:`model` changed. The errors are measured either way (``online`` False: no refit)."""
        self.observe(steps)
        self._fitted_at = now
        points = self.points()
        if not self._new or not points:
            return False
        self._new = 0
        changed = False
        if self.online and len(points) >= 2:
            self.model = fit_without_outliers(points, self._prior_points(points))
            self._refits += 1
            changed = True
        self._errors = None  # measured when :meth:`figures` asks (refits are many, reports few)
        return changed

    def _prior_points(self, points: list[ProfileRecord]) -> list[ProfileRecord]:
        """The prior's latency at the batch sizes beyond those run (module docstring)."""
        largest = max(p.n for p in points)
        per_request = sum(p.kv_tokens for p in points) / sum(p.n for p in points)
        sizes = {2**i for i in range(int(math.log2(self.max_n)) + 1)} | {self.max_n}
        return [
            ProfileRecord(n=n, kv_tokens=round(n * per_request), latency=self.prior.step_latency(n, n * per_request))
            for n in sorted(sizes)
            if n > 1.5 * largest
        ]

    def figures(self, now: float) -> dict[str, Any]:
        """The fit as metrics: ``cost_fit_error`` (mean relative error of the model in use on the
        pooled points; None before any), ``cost_prior_error`` (the prior's on the same points),
        ``cost_fit_age_s``, ``cost_fit_steps``, ``cost_fit_points``, ``cost_fit_refits``, the
        coefficients (``cost_model``) and the prior's source."""
        since = self._fitted_at if self._fitted_at is not None else self._started
        if self._errors is None:
            points = self.points()
            self._errors = (relative_error(self.model, points), relative_error(self.prior, points))
        return {
            "cost_fit_error": self._errors[0],
            "cost_prior_error": self._errors[1],
            "cost_fit_age_s": None if since is None else now - since,
            "cost_fit_steps": self._steps,
            "cost_fit_points": len(self._bins),
            "cost_fit_refits": self._refits,
            "cost_model": self.model.to_dict(),
            "cost_prior": self.source,
        }


def fit_without_outliers(points: Sequence[ProfileRecord], prior: Sequence[ProfileRecord] = ()) -> CostModel:
    """The cost model fitted to ``points`` and the ``prior``'s, fitted again without the ``points``
    :data:`OUTLIER_RATIO` times off the first fit (when enough are left to fit; the prior's are kept:
    they stand where the engines have not run)."""
    model, _ = fit_cost_model([*points, *prior])
    kept = [p for p in points if p.latency / OUTLIER_RATIO <= model.step_latency(p.n, p.kv_tokens) <= p.latency * OUTLIER_RATIO]
    if len(kept) == len(points) or len(kept) + len(prior) < len(COEFFICIENTS):
        return model
    return fit_cost_model([*kept, *prior])[0]


def quantile(ordered: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default) of an ascending sequence."""
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def relative_error(model: CostModel, points: Iterable[ProfileRecord]) -> float:
    """Mean relative error of ``model``'s step latency on ``points``."""
    errors = [abs(model.step_latency(p.n, p.kv_tokens) - p.latency) / p.latency for p in points]
    return sum(errors) / len(errors)


def gain_threshold(model: CostModel, mu: float, tokens: int, cap: np.ndarray, max_running: int) -> np.ndarray:
    """The throughput router's threshold per instance (KV capacity ``cap``) for requests of ``tokens``:
    ``mu`` times the throughput of an empty instance running the request alone, but never more than
    the gain of the request that fills the instance through its memory-bound regime.

    That fill point is the fewest of ``max_running`` requests, what the KV cache holds of such
    requests, and the fitted model's knee ``n* = (thr - o_b) / o_k`` (where compute binds). Up to
    it, the fitted model is flat but for attention: a GPU that reads its weights once a step gains
    about ``T(1)`` per request, so an empty instance fills to what its KV cache and ``max_num_seqs``
    allow however small the attention term makes the gain look against ``mu``. Beyond the knee the
    gain falls steeply and ``mu`` decides, as in the paper.
    """
    knee = (model.thr - model.o_b) / model.o_k if model.o_k > 0 else math.inf
    caps, which = np.unique(cap, return_inverse=True)
    fills = [max(1, min(int(c // max(tokens, 1)), max_running, int(min(knee, max_running)))) for c in caps]
    gains = np.array([model.throughput(n, n * tokens) - model.throughput(n - 1, (n - 1) * tokens) for n in fills])
    result: np.ndarray = np.minimum(mu / model.step_latency(1, tokens), gains[which])
    return result

"""Fitting the workloads' length model (:class:`~staleflow.runtime.settings.workload.LognormalLengths`)
to stated figures and to recorded samples.

The model: a response's log length is ``mu + u + e``, ``u ~ N(0, prompt_sigma^2)`` drawn once per
prompt and shared by its group, ``e ~ N(0, sigma^2 - prompt_sigma^2)`` its own; the length is clipped
to ``[min, max]`` and ``mean`` is the clipped mean (``mu`` follows from it). Two figures describe its
tail: the **clip ratio**, the share of responses cut at ``max``, and the **within-group correlation**
``ICC = prompt_sigma^2 / sigma^2`` (log scale, before clipping).

* :func:`fit_to_targets`: the model with a stated mean, clip ratio at a cap and ICC (``sigma`` by
  ``brentq``, ``prompt_sigma = sqrt(ICC) sigma``).
* :func:`fit_to_clipped_means`: the model whose mean lengths under two caps or more are stated
  figures (``mu`` and ``sigma``), e.g. a report's mean lengths under several token budgets.
* :func:`icc_anova`: the one-way random-effects ICC(1) of recorded log lengths grouped by prompt, with
  its F-distribution confidence interval. It takes clipped lengths at face value, so responses cut
  at a cap pull it away from the model's ICC.
* :func:`fit_to_samples`: maximum-likelihood ``mu``, ``sigma`` and ``prompt_sigma`` of recorded lengths
  grouped by prompt, a response at the cap counted as right-censored there (it would have run on):
  the model's own parameters, ICC included, with a bootstrap interval over prompts if asked.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np
from scipy import optimize, special, stats
from staleflow.runtime.settings.workload import LognormalLengths, clipped_lognormal_mean

#: ``sigma`` range searched by :func:`fit_to_targets` (``LognormalLengths`` allows up to 4)
SIGMA_RANGE = (0.05, 4.0)
#: Gauss-Hermite nodes integrating a group's shared difficulty out of its likelihood
QUADRATURE_NODES = 40


def lognormal_lengths(mean: float, sigma: float, cap: int, prompt_sigma: float = 0.0, min_tokens: int = 16) -> LognormalLengths:
    """The workloads' ``response_tokens`` model with these parameters."""
    return LognormalLengths(distribution="lognormal", mean=mean, sigma=sigma, max=cap, min=min_tokens, prompt_sigma=prompt_sigma)


def fit_to_targets(mean: float, clip_ratio: float, cap: int, icc: float, min_tokens: int = 16) -> LognormalLengths:
    """The length model whose clipped mean is ``mean``, whose share of responses at ``cap`` is
    ``clip_ratio`` and whose ICC is ``icc``; ValueError if no ``sigma`` in :data:`SIGMA_RANGE` gives
    that clip ratio at that mean (the message says which clip ratios it can give)."""
    if not 0 <= icc < 1:
        raise ValueError(f"the ICC must be in [0, 1), got {icc}")
    low, high = SIGMA_RANGE

    def excess(sigma: float) -> float:
        return lognormal_lengths(mean, sigma, cap, min_tokens=min_tokens).truncated_share() - clip_ratio

    reach = (excess(low) + clip_ratio, excess(high) + clip_ratio)
    if not reach[0] < clip_ratio < reach[1]:
        raise ValueError(f"mean {mean} under cap {cap}: a log-normal with sigma {low}..{high} cuts "
                         f"{reach[0]:.4f}..{reach[1]:.4f} of responses at the cap, not {clip_ratio}")
    sigma = float(optimize.brentq(excess, low, high, xtol=1e-12))
    return lognormal_lengths(mean, sigma, cap, math.sqrt(icc) * sigma, min_tokens)


def fit_to_clipped_means(means: Mapping[int, float], cap: int, icc: float = 0.0, min_tokens: int = 16) -> LognormalLengths:
    """The length model under ``cap`` whose clipped means under the caps of ``means`` (cap -> mean
    length of the responses cut there, two caps or more) are those figures: ``mu`` and ``sigma`` by
    least squares on the relative errors (exact with two caps), ``prompt_sigma`` from ``icc``. A
    report of mean lengths under several token budgets fixes the tail beyond them this way."""
    if len(means) < 2:
        raise ValueError(f"need the mean under two caps or more, got {len(means)}")
    if not 0 <= icc < 1:
        raise ValueError(f"the ICC must be in [0, 1), got {icc}")

    def errors(theta: np.ndarray) -> list[float]:
        return [clipped_lognormal_mean(theta[0], math.exp(theta[1]), min_tokens, c) / m - 1 for c, m in means.items()]

    result = optimize.least_squares(errors, [math.log(min(means.values())), 0.0], xtol=1e-14, ftol=1e-14)
    mu, sigma = float(result.x[0]), math.exp(result.x[1])
    return lognormal_lengths(clipped_lognormal_mean(mu, sigma, min_tokens, cap), sigma, cap, math.sqrt(icc) * sigma, min_tokens)


@dataclass(frozen=True)
class IccEstimate:
    """An ICC with its confidence interval, over ``groups`` prompts and ``responses`` responses."""

    icc: float
    low: float
    high: float
    groups: int
    responses: int
    confidence: float


def _log_groups(groups: Sequence[Sequence[float]]) -> list[np.ndarray]:
    logs = [np.log(np.asarray(g, dtype=float)) for g in groups if len(g)]
    if len(logs) < 2 or sum(len(g) for g in logs) <= len(logs):
        raise ValueError("need two groups or more, and a group with two responses or more")
    return logs


def icc_anova(groups: Sequence[Sequence[float]], confidence: float = 0.95) -> IccEstimate:
    """One-way random-effects ICC(1) of the log lengths: ``(MSB - MSW) / (MSB + (n0 - 1) MSW)`` with
    ``n0 = (N - sum n_i^2 / N) / (k - 1)`` the effective group size (``n`` when groups are equal), and
    the interval from ``F = MSB / MSW``'s F distribution (exact for equal groups; McGraw & Wong 1996, case 1)."""
    logs = _log_groups(groups)
    sizes = np.array([len(g) for g in logs], dtype=float)
    k, total = len(logs), sizes.sum()
    grand = np.concatenate(logs).mean()
    between = sum(len(g) * (g.mean() - grand) ** 2 for g in logs) / (k - 1)
    within = sum(((g - g.mean()) ** 2).sum() for g in logs) / (total - k)
    n0 = (total - (sizes**2).sum() / total) / (k - 1)
    f = between / within
    q = 1 - (1 - confidence) / 2

    def icc(ratio: float) -> float:
        return float((ratio - 1) / (ratio + n0 - 1))

    low = icc(f / stats.f.ppf(q, k - 1, total - k))
    high = icc(f * stats.f.ppf(q, total - k, k - 1))
    return IccEstimate(icc(f), low, high, k, int(total), confidence)


@dataclass(frozen=True)
class SampleFit:
    """Maximum-likelihood parameters of the length model on recorded groups (log scale).
    ``icc_low``/``icc_high``: a bootstrap interval over prompts (NaN when not asked for)."""

    mu: float
    sigma: float
    prompt_sigma: float
    groups: int
    responses: int
    censored: int
    icc_low: float = math.nan
    icc_high: float = math.nan

    @property
    def icc(self) -> float:
        return self.prompt_sigma**2 / self.sigma**2

    def lengths(self, cap: int, min_tokens: int = 16) -> LognormalLengths:
        """The workload length model with these parameters clipped at ``cap`` (its ``mean`` is the
        clipped mean at ``mu``), e.g. to read its clip ratio under another cap."""
        mean = clipped_lognormal_mean(self.mu, self.sigma, min_tokens, cap)
        return lognormal_lengths(mean, self.sigma, cap, self.prompt_sigma, min_tokens)


@cache
def _quadrature() -> tuple[np.ndarray, np.ndarray]:
    """Nodes and log weights of ``E[f(Z)]``, ``Z ~ N(0, 1)``, by :data:`QUADRATURE_NODES`-point Gauss-Hermite."""
    nodes, weights = np.polynomial.hermite_e.hermegauss(QUADRATURE_NODES)
    return nodes, np.log(weights / math.sqrt(2 * math.pi))


def _negative_log_likelihood(theta: np.ndarray, logs: np.ndarray, observed: np.ndarray, censored: np.ndarray, cut: float) -> float:
    """``-log L`` of ``(mu, log prompt_sigma, log own sigma)``; ``logs`` is groups x slots, a slot
    either observed, censored at ``cut`` or empty; the shared difficulty is integrated out by
    Gauss-Hermite quadrature."""
    mu, tau, omega = theta[0], math.exp(theta[1]), math.exp(theta[2])
    nodes, log_weights = _quadrature()
    centre = mu + tau * nodes[None, None, :]
    own = np.where(observed[..., None], -0.5 * ((logs[..., None] - centre) / omega) ** 2 - math.log(omega * math.sqrt(2 * math.pi)), 0.0)
    cut_off = np.where(censored[..., None], special.log_ndtr((centre - cut) / omega), 0.0) if censored.any() else 0.0
    per_node = (own + cut_off).sum(axis=1) + log_weights[None, :]
    return float(-special.logsumexp(per_node, axis=1).sum())


def _fit(groups: Sequence[np.ndarray], cap: float | None, start: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """``(mu, log prompt_sigma, log own sigma)`` at the likelihood's maximum, and the number of
    censored responses; ``start``: where the search begins (else from the ANOVA's split)."""
    width = max(len(g) for g in groups)
    logs = np.zeros((len(groups), width))
    filled = np.zeros_like(logs, dtype=bool)
    for row, g in enumerate(groups):
        logs[row, : len(g)], filled[row, : len(g)] = g, True
    cut = math.log(cap) if cap else math.inf
    censored = filled & (logs >= cut)
    observed = filled & ~censored
    if start is None:
        pooled = np.concatenate(groups)
        share = min(max(icc_anova([np.exp(g) for g in groups]).icc, 0.05), 0.95)
        spread = float(pooled.std()) or 1.0
        start = np.array([float(pooled.mean()), math.log(spread * math.sqrt(share)), math.log(spread * math.sqrt(1 - share))])
    result = optimize.minimize(_negative_log_likelihood, start, args=(logs, observed, censored, cut), method="L-BFGS-B")
    return result.x, int(censored.sum())


def fit_to_samples(groups: Sequence[Sequence[float]], cap: float | None = None, bootstrap: int = 0, confidence: float = 0.95,
                   seed: int = 0) -> SampleFit:
    """Maximum-likelihood length model of recorded lengths grouped by prompt; ``cap``: the generation
    cap, a response at or above it counted as cut there (None: every length as observed).
    ``bootstrap`` > 0: that many refits on prompts drawn with replacement give the ICC's
    percentile interval at ``confidence``. Lengths under the model's ``min`` are taken as observed."""
    logs = _log_groups(groups)
    theta, censored = _fit(logs, cap)
    mu, tau, omega = float(theta[0]), math.exp(theta[1]), math.exp(theta[2])
    low = high = math.nan
    if bootstrap:
        rng = np.random.default_rng(seed)
        draws = []
        for _ in range(bootstrap):
            again, _ = _fit([logs[i] for i in rng.integers(0, len(logs), len(logs))], cap, theta)
            draws.append(1 / (1 + math.exp(2 * (again[2] - again[1]))))
        low, high = (float(x) for x in np.quantile(draws, [(1 - confidence) / 2, 1 - (1 - confidence) / 2]))
    return SampleFit(mu, math.hypot(tau, omega), tau, len(logs), sum(len(g) for g in logs), censored, low, high)

"""Speculative decoding as a simulated engine sees it, in two models.

:class:`DraftVerification` (every batch size, from the cost model): each request drafts ``k``
tokens without a draft model (vLLM's n-gram or suffix proposer: from the request's own tokens, or
also from the other responses of its prompt) and one forward pass verifies them all. Under the
workload's cost model ``L(n, K) = a_b + a_k K + max(thr, o_b + o_k n)`` that pass reads the KV cache
once and runs the matmuls over ``n (k + 1)`` tokens,

    L_verify(n, K, k) = a_b + a_k K + max(thr, o_b + o_k n (k + 1)),

and emits ``tau(k)`` tokens per request on average (the accepted drafts and one token of the
model's own), so a token costs ``L_verify(n, K, k) / tau(k)`` and the speed-up over a plain step is
``tau(k) L(n, K) / L_verify(n, K, k)``. At long contexts the KV term dominates a step and a few
drafts are nearly free even at full batch; at a large batch over short contexts they are not, and
``k = 0`` (no drafts) wins. ``tau`` is an input: :func:`geometric_tau` turns a per-token acceptance
rate into it (each draft accepted with the same probability given the ones before it).
With ``by_position`` the rate depends on how far into its response a request is (measured:
:data:`ACCEPTANCE_BY_POSITION`) and the drafts of a run of steps are chosen for the running
requests' positions, one ``k`` for all or each request its own (:meth:`DraftVerification.at_positions`).

:class:`SpeculativeDecoding` (the older, assumed form): a decode step of an instance running at most
``max_batch`` requests takes ``1 / speedup`` of its time.

A speculative step drafts a few tokens per request (vLLM's n-gram or suffix proposer: no draft
model) and the target model verifies them in one forward pass; at a small batch the step is
memory-bound, so the verification costs about what a plain step does and each accepted draft token
is a step saved. At a large batch the extra verified tokens cost compute and the gain turns into a
loss, which is why vLLM's dynamic speculative decoding (``num_speculative_tokens_per_batch_size``,
whose documentation names the RL rollout's long tail as its use) drafts only below a batch size:
``max_batch`` here. The training job turns the same schedule on with ``rollout.speculation``.

The speed-up is an input, never measured here: a GPU has not run it. The default of the simulated
variant (``staleflow-spec``, 1.5x at 8 requests or fewer) is below what DAS measured for a
suffix-tree drafter on math and code RL rollouts (arXiv 2511.13841: rollout time cut by up to 50%,
2x over a whole rollout), since vLLM's n-gram proposer only matches the request's own context.
Its figures are reported apart from the headline (docs/simulation.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import least_squares
from staleflow.runtime.coordination.cost_model import CostModel


def geometric_tau(acceptance: float, max_drafts: int) -> tuple[float, ...]:
    """``tau(k)`` for ``k = 1..max_drafts`` when each draft token is accepted with probability
    ``acceptance`` once the ones before it were: ``(1 - a^(k+1)) / (1 - a)`` tokens per verification."""
    if not 0 <= acceptance < 1:
        raise ValueError(f"draft acceptance must be in [0, 1), got {acceptance}")
    if max_drafts < 1:
        raise ValueError(f"max_drafts must be >= 1, got {max_drafts}")
    return tuple((1 - acceptance ** (k + 1)) / (1 - acceptance) for k in range(1, max_drafts + 1))


def fit_acceptance(tau: Sequence[float]) -> tuple[float, float]:
    """The per-token acceptance ``a`` whose :func:`geometric_tau` comes nearest a measured ``tau``
    (``tau[k - 1]`` for ``k = 1..len(tau)``) in least squares over every ``k``, and the
    root-mean-square residual left (tokens per verification step): how far the geometric model
    is from the measurement."""
    if not tau:
        raise ValueError("fitting an acceptance needs tau(k) for at least one k")

    def residuals(a: Sequence[float]) -> list[float]:
        return [model - measured for measured, model in zip(tau, geometric_tau(float(a[0]), len(tau)))]

    start = min(max(tau[0] - 1, 0.0), 0.99)  # the rate that fits tau(1) alone
    fit = least_squares(residuals, [start], bounds=(0.0, 0.9999), xtol=1e-15, ftol=1e-15, gtol=1e-15)
    return float(fit.x[0]), math.sqrt(sum(r * r for r in fit.fun) / len(tau))


#: ``tau(k)``, ``k = 1..8``, measured by replaying recorded samples (``staleflow bench
#: draft-acceptance``, ``app/draft_replay.py``): Qwen2.5-Math-1.5B with Qwen's chain-of-thought prompt,
#: 70 prompts (AIME 2025, AMC 2023) x 8 samples at temperature 0.6, 3,072-token cap, 1,439 tokens per
#: response on average, tokenized with Qwen2.5's own BPE; from the public evaluation outputs of
#: github.com/XinghanLi66/rl-sft at c981ccd1 (``one-shot-em/results/1.5B-eval-promptoriginal/``).
#: ``request``: drafts from the response's own prefix; ``siblings``: also from the tokens its
#: siblings have generated by then (the replay's ``causal`` source). A base math model's
#: 1,000-token answers, not a reasoning model's 10,000-token ones: docs/simulation.md.
MEASURED_TAU = {
    "request": (1.6049, 1.9655, 2.1956, 2.3551, 2.4720, 2.5549, 2.6242, 2.6761),
    "siblings": (1.6649, 2.0865, 2.3667, 2.5644, 2.7122, 2.8199, 2.9094, 2.9769),
}

#: Per-draft-token acceptance rates ``staleflow simulate --speculation`` gives the engines: drafts
#: from the request's own tokens (vLLM's n-gram and suffix proposers, open to every system) and
#: from the other responses of its prompt too (grouped speculative decoding: Seer, arXiv 2511.14617;
#: DAS, arXiv 2511.13841): the geometric fits (:func:`fit_acceptance`) of :data:`MEASURED_TAU`, 0.623
#: and 0.667, each 0.04 and 0.03 tokens per step from the measurement (root mean square over ``k``).
DRAFT_ACCEPTANCE = {mode: round(fit_acceptance(tau)[0], 3) for mode, tau in MEASURED_TAU.items()}


#: ``tau(k)``, ``k = 1..8``, of the replayed steps of :data:`MEASURED_TAU`'s samples by where in its
#: response a step starts: ``(first position, tau)`` (``staleflow bench draft-acceptance --samples
#: FILE --sources request causal``, its ``by_position``; each group's longest response, most of them
#: at the 3,072-token cap, so the last bucket, 2,048 tokens on, is where the capped responses and
#: their loops are). The rate rises along a response: little to repeat in its first 256 tokens.
MEASURED_TAU_BY_POSITION = {
    "request": ((0, (1.2895, 1.4072, 1.4666, 1.5018, 1.5253, 1.5400, 1.5524, 1.5623)),
                (256, (1.5388, 1.8345, 2.0117, 2.1293, 2.2120, 2.2713, 2.3151, 2.3497)),
                (1024, (1.6844, 2.1236, 2.4248, 2.6432, 2.8061, 2.9251, 3.0295, 3.1049)),
                (2048, (1.7262, 2.2287, 2.5793, 2.8394, 3.0457, 3.1943, 3.3267, 3.4287))),
    "siblings": ((0, (1.4713, 1.7110, 1.8461, 1.9325, 1.9879, 2.0312, 2.0605, 2.0832)),
                 (256, (1.6305, 2.0134, 2.2590, 2.4265, 2.5492, 2.6382, 2.7066, 2.7621)),
                 (1024, (1.7036, 2.1629, 2.4817, 2.7123, 2.8873, 3.0173, 3.1289, 3.2099)),
                 (2048, (1.7320, 2.2404, 2.5964, 2.8595, 3.0681, 3.2174, 3.3524, 3.4537))),
}

#: The per-token acceptance by position (the geometric fits of :data:`MEASURED_TAU_BY_POSITION`):
#: ``simulate --draft-positions`` drafts at these rates instead of :data:`DRAFT_ACCEPTANCE`'s one
#: rate, a request at the rate of the bucket its generated length is in (past 3,072 tokens the
#: measurement has nothing: the last bucket's rate, an extrapolation).
ACCEPTANCE_BY_POSITION = {mode: tuple((start, round(fit_acceptance(tau)[0], 3)) for start, tau in buckets)
                          for mode, buckets in MEASURED_TAU_BY_POSITION.items()}


@dataclass(frozen=True)
class DraftVerification:
    """The decode timing of an engine that speculates at every batch size (module docstring).

    Engine steps stay one token per running request; a token-step costs ``L_verify / tau(k)``
    with the ``k`` that costs least, chosen where a run of steps of a fixed running set starts
    (the engine times such a run in closed form: the KV term then grows linearly, as without drafts).

    Args:
        cost: the engine's decode cost model without drafts.
        tau: ``tau[k - 1]`` the mean tokens a request emits per verification step with ``k`` drafts
            (``1 <= tau(k) <= k + 1``).
        by_position: ``((first position, acceptance), ...)``, positions rising from 0: the geometric
            acceptance of a request that has generated that many tokens or more; empty: ``tau`` for
            every request. With it the engine times each run of steps with :meth:`at_positions`.
        budgets: with ``by_position``, each request drafts its own number of tokens
            (:meth:`at_positions`); without, every request of a step drafts the same ``k``.
    """

    cost: CostModel
    tau: tuple[float, ...]
    by_position: tuple[tuple[int, float], ...] = ()
    budgets: bool = False
    #: ``per_token[k]``: the cost model of a token-step with ``k`` drafts (``per_token[0]``: ``cost``)
    per_token: tuple[CostModel, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.tau:
            raise ValueError("draft verification needs tau(k) for at least one k")
        for k, tau in enumerate(self.tau, start=1):
            if not 1.0 <= tau <= k + 1:
                raise ValueError(f"tau({k}) must be in [1, {k + 1}] tokens per verification, got {tau}")
        starts = [start for start, _ in self.by_position]
        if self.by_position and (starts[0] != 0 or starts != sorted(set(starts)) or not all(0 <= a < 1 for _, a in self.by_position)):
            raise ValueError(f"by_position must rise from position 0 with acceptances in [0, 1), got {self.by_position}")
        object.__setattr__(self, "per_token", tuple(self._per_token(k, tau) for k, tau in enumerate((1.0,) + self.tau)))

    def _per_token(self, drafts: float, tau: float) -> CostModel:
        """The cost model of a token-step when a request drafts ``drafts`` tokens and emits ``tau`` (means over the batch)."""
        c = self.cost
        if drafts == 0 and tau == 1.0:
            return c
        return CostModel(thr=c.thr / tau, o_b=c.o_b / tau, o_k=c.o_k * (drafts + 1) / tau, a_b=c.a_b / tau, a_k=c.a_k / tau)

    def verify_latency(self, n_running: float, kv_tokens: float, drafts: int) -> float:
        """``L_verify(n, K, k)``: seconds of one verification step of ``drafts`` tokens per request."""
        c = self.cost
        return c.a_b + c.a_k * kv_tokens + max(c.thr, c.o_b + c.o_k * n_running * (drafts + 1))

    def drafts(self, n_running: int, kv_tokens: int) -> int:
        """The number of drafts per request that makes a token cheapest at this batch and KV (0: none)."""
        latencies = [model.step_latency(n_running, kv_tokens) for model in self.per_token]
        return latencies.index(min(latencies))

    def step_latency(self, n_running: float, kv_tokens: float) -> float:
        """Seconds per token-step: ``min_k L_verify(n, K, k) / tau(k)`` (``L(n, K)`` at ``k = 0``)."""
        return min(model.step_latency(n_running, kv_tokens) for model in self.per_token)

    def decode_seconds(self, steps: int, n_running: int, kv_tokens: int) -> float:
        """:meth:`CostModel.decode_seconds` at the cheapest number of drafts."""
        return self.per_token[self.drafts(n_running, kv_tokens)].decode_seconds(steps, n_running, kv_tokens)

    def steps_within(self, budget_s: float, n_running: int, kv_tokens: int, limit: int) -> int:
        """:meth:`CostModel.steps_within` at the cheapest number of drafts."""
        return self.per_token[self.drafts(n_running, kv_tokens)].steps_within(budget_s, n_running, kv_tokens, limit)

    def at_positions(self, positions: Sequence[int], kv_tokens: int) -> CostModel:
        """The cost model of the token-steps of running requests that have generated ``positions``
        tokens each, their drafts chosen to make a token cheapest (timed at the run's start).

        A request at acceptance ``a`` that drafts ``k`` emits ``geometric_tau(a)(k)`` tokens a step; a
        verification of ``D`` drafts in all costs ``L_verify`` over ``n + D`` tokens. Without
        ``budgets`` every request drafts the same ``k`` (0 to ``len(tau)``). With them the ``D``
        drafts go where they are likeliest accepted: the ``k``-th draft of a request adds ``a^k`` to
        its tokens, so the greedy order of those marginals makes the most tokens of every ``D``
        (``tau`` is concave in ``k``); the cost per token is a ratio of two functions linear in
        ``D`` between the points where the marginal or ``L_verify``'s slope changes, so its least is
        at one of them. At one acceptance and no floor ``thr`` this is the uniform ``k`` (the
        marginals tie); at the floor a part of the requests may draft one more.
        """
        n, c = len(positions), self.cost
        if not n or not self.by_position:
            raise ValueError("at_positions needs running requests and an acceptance by position")
        rates = [a for _, a in self.by_position]
        bucket = np.searchsorted([start for start, _ in self.by_position], positions, side="right") - 1
        counts = np.bincount(bucket, minlength=len(rates)).tolist()
        top = len(self.tau)

        def cost(drafts: float, tokens: float) -> float:  # seconds per token-step of the n requests
            return n * (c.a_b + c.a_k * kv_tokens + max(c.thr, c.o_b + c.o_k * (n + drafts))) / tokens

        taus = [(1.0,) + geometric_tau(a, top) for a in rates]
        points = [(k * n, sum(m * t[k] for m, t in zip(counts, taus))) for k in range(top + 1)]
        if self.budgets:
            marginals = sorted(((a ** k, b) for b, a in enumerate(rates) if counts[b] for k in range(1, top + 1)), reverse=True)
            points, floor = [(0, float(n))], (c.thr - c.o_b) / c.o_k - n if c.o_k else math.inf
            for value, b in marginals:
                drafts, tokens = points[-1]
                if drafts < floor < drafts + counts[b]:
                    points += [(d, tokens + value * (d - drafts)) for d in (math.floor(floor), math.ceil(floor)) if d > drafts]
                points.append((drafts + counts[b], tokens + value * counts[b]))
        drafts, tokens = min(points, key=lambda point: cost(*point))
        return self._per_token(drafts / n, tokens / n)


@dataclass(frozen=True)
class SpeculativeDecoding:
    """The decode timing of an engine that speculates at ``max_batch`` running requests or fewer.

    Args:
        cost: the engine's decode cost model without speculation.
        speedup: how much faster a step of a small batch is (> 1).
        max_batch: the most running requests at which the engine speculates.
    """

    cost: CostModel
    speedup: float
    max_batch: int

    def __post_init__(self) -> None:
        if not self.speedup > 1.0:
            raise ValueError(f"speculative decoding's speed-up must be > 1, got {self.speedup}")
        if self.max_batch < 1:
            raise ValueError(f"speculative decoding's max_batch must be >= 1, got {self.max_batch}")

    def _factor(self, n_running: int) -> float:
        return self.speedup if n_running <= self.max_batch else 1.0

    def decode_seconds(self, steps: int, n_running: int, kv_tokens: int) -> float:
        """:meth:`CostModel.decode_seconds`, ``speedup`` times faster at a small batch."""
        return self.cost.decode_seconds(steps, n_running, kv_tokens) / self._factor(n_running)

    def steps_within(self, budget_s: float, n_running: int, kv_tokens: int, limit: int) -> int:
        """:meth:`CostModel.steps_within`, ``speedup`` times more steps at a small batch."""
        return self.cost.steps_within(budget_s * self._factor(n_running), n_running, kv_tokens, limit)


#: What times a simulated engine's decode steps: the cost model, or a speculating model around it.
Decode = CostModel | DraftVerification | SpeculativeDecoding

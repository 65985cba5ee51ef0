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

from dataclasses import dataclass, field

from staleflow.runtime.coordination.cost_model import CostModel

#: Per-draft-token acceptance rates ``staleflow simulate --speculation`` gives the engines: drafts
#: from the request's own tokens (vLLM's n-gram and suffix proposers, open to every system) and
#: from the other responses of its prompt too (grouped speculative decoding: Seer, arXiv 2511.14617;
#: DAS, arXiv 2511.13841). ASSUMED, not measured on a reasoning model's samples (none was
#: reachable here; docs/simulation.md says what was measured and on what).
ASSUMED_ACCEPTANCE = {"request": 0.4, "siblings": 0.6}


def geometric_tau(acceptance: float, max_drafts: int) -> tuple[float, ...]:
    """``tau(k)`` for ``k = 1..max_drafts`` when each draft token is accepted with probability
    ``acceptance`` once the ones before it were: ``(1 - a^(k+1)) / (1 - a)`` tokens per verification."""
    if not 0 <= acceptance < 1:
        raise ValueError(f"draft acceptance must be in [0, 1), got {acceptance}")
    if max_drafts < 1:
        raise ValueError(f"max_drafts must be >= 1, got {max_drafts}")
    return tuple((1 - acceptance ** (k + 1)) / (1 - acceptance) for k in range(1, max_drafts + 1))


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
    """

    cost: CostModel
    tau: tuple[float, ...]
    #: ``per_token[k]``: the cost model of a token-step with ``k`` drafts (``per_token[0]``: ``cost``)
    per_token: tuple[CostModel, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.tau:
            raise ValueError("draft verification needs tau(k) for at least one k")
        for k, tau in enumerate(self.tau, start=1):
            if not 1.0 <= tau <= k + 1:
                raise ValueError(f"tau({k}) must be in [1, {k + 1}] tokens per verification, got {tau}")
        c = self.cost
        models = [c] + [CostModel(thr=c.thr / tau, o_b=c.o_b / tau, o_k=c.o_k * (k + 1) / tau, a_b=c.a_b / tau, a_k=c.a_k / tau)
                        for k, tau in enumerate(self.tau, start=1)]
        object.__setattr__(self, "per_token", tuple(models))

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

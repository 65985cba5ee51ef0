"""Speculative decoding of the tail, as a simulated engine sees it: a decode step of an instance
running at most ``max_batch`` requests takes ``1 / speedup`` of its time.

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

from dataclasses import dataclass

from staleflow.runtime.coordination.cost_model import CostModel


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

"""Routing strategies: where a request goes (design 3.2; paper section 5, "waterfall").

:class:`ThroughputRouter` (StaleFlow): among eligible instances whose KV cache can hold the request
and that have no waiting queue, go through them by priority (newest model version first) and pick,
in the first tier where one qualifies, the instance with the largest marginal throughput gain
``T_i(S + r) - T_i(S)``; it qualifies if the gain is at least ``mu`` times the throughput of an
empty instance running the request alone. Otherwise the request stays queued.

:class:`LeastLoadedRouter` (the vanilla counterpart and the baselines): the eligible instance with
the fewest requests, up to ``max_running``; the engine queues what it cannot run yet.
"""

from __future__ import annotations

import numpy as np

from staleflow.runtime.cost_model import CostModel
from staleflow.runtime.fleet import FleetArrays


def fleet_throughput(model: CostModel, n: np.ndarray, kv: np.ndarray) -> np.ndarray:
    """``T(n, K) = n / L(n, K)`` for arrays (the cost model's formula, vectorised)."""
    latency = model.a_b + model.a_k * kv + np.maximum(model.thr, model.o_b + model.o_k * n)
    return n / latency


class ThroughputRouter:
    """Cost-model routing with the waterfall over version tiers and the threshold ``mu``."""

    def __init__(self, cost_model: CostModel, mu: float) -> None:
        self.cost_model = cost_model
        self.mu = mu

    def choose(self, fleet: FleetArrays, tokens: int, eligible: np.ndarray) -> int | None:
        mask = eligible & ~fleet.loading & (fleet.waiting == 0) & (fleet.kv + tokens <= fleet.cap)
        if not mask.any():
            return None
        gain = fleet_throughput(self.cost_model, fleet.n + 1, fleet.kv + tokens) - fleet_throughput(
            self.cost_model, fleet.n, fleet.kv
        )
        threshold = self.mu / self.cost_model.step_latency(1, tokens)
        for version in np.unique(fleet.version[mask])[::-1]:
            tier_gain = np.where(mask & (fleet.version == version), gain, -np.inf)
            best = int(np.argmax(tier_gain))
            if tier_gain[best] >= threshold:
                return best
        return None


class LeastLoadedRouter:
    """The eligible instance with the fewest requests (below ``max_running``)."""

    def __init__(self, max_running: int) -> None:
        self.max_running = max_running

    def choose(self, fleet: FleetArrays, tokens: int, eligible: np.ndarray) -> int | None:
        mask = eligible & ~fleet.loading & (fleet.n < self.max_running)
        if not mask.any():
            return None
        return int(np.argmin(np.where(mask, fleet.n, np.inf)))

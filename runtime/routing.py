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

    def choose(self, fleet: FleetArrays, tokens: int, eligible: np.ndarray, count: int = 1) -> list[int]:
        """Instances for up to ``count`` requests of ``tokens`` tokens each, one decision per request
        (the fleet is updated after each); stops at the first request that stays queued."""
        candidates = np.flatnonzero(eligible & ~fleet.loading & (fleet.waiting == 0))
        if candidates.size == 0:
            return []
        model = self.cost_model
        n, kv, cap = fleet.n[candidates], fleet.kv[candidates], fleet.cap[candidates]
        gain = fleet_throughput(model, n + 1, kv + tokens) - fleet_throughput(model, n, kv)
        threshold = self.mu / model.step_latency(1, tokens)
        versions = fleet.version[candidates]
        tiers = [versions == v for v in sorted(set(versions.tolist()), reverse=True)]
        chosen: list[int] = []
        for _ in range(count):
            usable = (gain >= threshold) & (kv + tokens <= cap)
            pick = next((int(np.argmax(np.where(tier & usable, gain, -np.inf))) for tier in tiers if (tier & usable).any()), None)
            if pick is None:
                break
            index = int(candidates[pick])
            fleet.add(index, tokens)
            chosen.append(index)
            n[pick] += 1
            kv[pick] += tokens
            gain[pick] = model.throughput(int(n[pick]) + 1, int(kv[pick]) + tokens) - model.throughput(int(n[pick]), int(kv[pick]))
        return chosen


class LeastLoadedRouter:
    """The eligible instance with the fewest requests (below ``max_running``)."""

    def __init__(self, max_running: int) -> None:
        self.max_running = max_running

    def choose(self, fleet: FleetArrays, tokens: int, eligible: np.ndarray, count: int = 1) -> list[int]:
        """Instances for up to ``count`` requests, the least loaded first (the fleet is updated)."""
        candidates = np.flatnonzero(eligible & ~fleet.loading)
        chosen: list[int] = []
        if candidates.size == 0:
            return chosen
        n = fleet.n[candidates]
        for _ in range(count):
            pick = int(np.argmin(n))
            if n[pick] >= self.max_running:
                break
            index = int(candidates[pick])
            fleet.add(index, tokens)
            chosen.append(index)
            n[pick] += 1
        return chosen

"""Migration strategy: interrupt waiting or excess requests so they can be re-routed (design 3.2).

Two triggers, as in the paper's Algorithm 5 (thresholds ``phi_wait`` and ``phi_throughput``):

* **waiting**: an instance whose engine queue holds more than ``phi_wait`` requests (its KV cache is
  full) gives up the waiting ones beyond ``phi_wait``, as many as the starved instances (below) can
  start, ``phi_wait`` each;
* **imbalance**: if the busiest instance's estimated throughput is more than ``phi_throughput``
  times that of the least busy *starved* one (an instance that can get no other work: no queued
  request and no group the protocol would admit at its version), the busiest gives up half the
  difference in requests, among those the starved one may run (its version is at least their
  group version).

Interrupted requests keep their tokens and group version; the router places them again. At most
one imbalance migration per decision, like the reference coordinator.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from staleflow.runtime.coordination.cost_model import CostModel
from staleflow.runtime.coordination.fleet import FleetArrays, InstanceView
from staleflow.runtime.coordination.routing import fleet_throughput


def plan_migration(
    views: Sequence[InstanceView],
    fleet: FleetArrays,
    cost_model: CostModel,
    phi_wait: int,
    phi_throughput: float,
    starved: np.ndarray,
) -> dict[int, list[str]]:
    """Instance index -> request ids to interrupt. ``fleet`` holds the views as arrays; ``starved``
    marks the instances that can get no other work (the only targets of imbalance migration)."""
    plan: dict[int, list[str]] = {}
    active = ~fleet.loading
    targets = int((active & starved & (fleet.waiting == 0)).sum())
    if not targets:
        return plan
    budget = targets * max(phi_wait, 1)  # no more than the starved instances can start at once
    for i, view in enumerate(views):
        if len(view.waiting) > phi_wait and not view.loading and budget > 0:
            excess = [rid for rid in view.waiting[phi_wait:] if rid in view.requests][:budget]
            if excess:
                plan[i] = excess
                budget -= len(excess)
    if active.sum() < 2:
        return plan
    throughput = fleet_throughput(cost_model, fleet.n, fleet.kv)
    low = int(np.argmin(np.where(active & starved & (fleet.waiting == 0), throughput, np.inf)))
    high = int(np.argmax(np.where(active, throughput, -np.inf)))
    if high == low or high in plan:
        return plan
    if throughput[high] <= phi_throughput * throughput[low]:
        return plan
    count = int(fleet.n[high] - fleet.n[low]) // 2
    target_version = views[low].version
    movable = [rid for rid, (_, gv) in views[high].requests.items() if gv <= target_version]
    if count > 0 and movable:
        plan[high] = movable[-count:]
    return plan

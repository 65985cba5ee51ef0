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

:func:`plan_evacuation` is the authors' coordinator's rule (psrl
``psrl/workers/gen/rollout_coordination/sync_and_migrate/sync_and_migrate_mixin.py``,
``_check_should_migrate``): every instance whose version is at most a starved instance's gets the
ratio of its throughput to that instance's (infinite over an idle one); the instance of the highest
ratio above ``phi_throughput`` gives up *all* its requests if it holds at least ``min_requests``.
:func:`plan_bounce` is the authors' engine-side loop-back (vLLM's preemption notification,
``max_num_waiting_reqs_after_preemption``): the waiting requests beyond ``phi_wait`` go back to the
router whether or not another instance could start them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from staleflow.runtime.coordination.cost_model import CostModel
from staleflow.runtime.coordination.fleet import FleetArrays, InstanceView
from staleflow.runtime.coordination.routing import fleet_throughput
from staleflow.runtime.settings.policies import SystemPolicy


def plan_moves(
    policy: SystemPolicy, views: Sequence[InstanceView], fleet: FleetArrays, cost_model: CostModel, starved: np.ndarray
) -> dict[int, list[str]]:
    """The policy's migration rule: :func:`plan_evacuation` (``evacuate``) or :func:`plan_migration` (``split``)."""
    if policy.migration_rule == "evacuate":
        return plan_evacuation(views, fleet, cost_model, policy.phi_throughput, policy.evacuate_min_requests, starved)
    return plan_migration(views, fleet, cost_model, policy.phi_wait, policy.phi_throughput, starved)


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


def plan_evacuation(
    views: Sequence[InstanceView],
    fleet: FleetArrays,
    cost_model: CostModel,
    phi_throughput: float,
    min_requests: int,
    starved: np.ndarray,
) -> dict[int, list[str]]:
    """The one instance to empty (index -> all its request ids), or nothing. ``starved`` as for
    :func:`plan_migration`; an instance with a waiting queue is never a starved one."""
    active = ~fleet.loading
    targets = np.flatnonzero(active & starved & (fleet.waiting == 0))
    if not targets.size:
        return {}
    throughput = fleet_throughput(cost_model, fleet.n, fleet.kv)
    sources = np.flatnonzero(active & (fleet.n > 0))
    # peers[s, t]: target t may take source s's requests (another instance, at least its version)
    peers = (targets[None, :] != sources[:, None]) & (fleet.version[targets][None, :] >= fleet.version[sources][:, None])
    lowest = np.where(peers, throughput[targets][None, :], np.inf).min(axis=1, initial=np.inf)
    ratio = np.zeros(len(views))
    with np.errstate(divide="ignore"):  # over an idle peer: infinite; without a peer (lowest inf): 0
        ratio[sources] = np.where(lowest == 0, np.inf, throughput[sources] / lowest)
    high = int(np.argmax(ratio))
    if ratio[high] <= phi_throughput or len(views[high].requests) < min_requests:
        return {}
    return {high: list(views[high].requests)}


def starved_instances(queued: int, pending: int, fleet: FleetArrays, can_reserve: Callable[[int], bool]) -> np.ndarray:
    """Instances that can get no other work: nothing queued (``queued`` requests), and no pending
    group (of ``pending``) admissible at their version (``can_reserve``: the protocol's)."""
    if queued:
        return np.zeros(len(fleet.n), dtype=bool)
    if not pending:
        return np.ones(len(fleet.n), dtype=bool)
    admissible = [v for v in set(fleet.version.tolist()) if can_reserve(v)]
    return ~np.isin(fleet.version, admissible)


def plan_bounce(policy: SystemPolicy, views: Sequence[InstanceView], fleet: FleetArrays) -> dict[int, list[str]]:
    """With ``waiting_bounce``: instance index -> its waiting requests beyond the first ``phi_wait``
    (instances not loading); else nothing."""
    plan: dict[int, list[str]] = {}
    if not policy.waiting_bounce:
        return plan
    phi_wait = policy.phi_wait
    for i in np.flatnonzero((fleet.waiting > phi_wait) & ~fleet.loading).tolist():
        view = views[i]
        excess = [rid for rid in view.waiting[phi_wait:] if rid in view.requests]
        if excess:
            plan[i] = excess
    return plan

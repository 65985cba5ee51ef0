"""Synchronization strategies: which instances pull a newer model version now (design 3.2).

``per_instance`` (StaleFlow): an instance behind the newest pushed version pulls when that costs
least: its KV cache is at most ``kv_fraction`` full (idle or nearly drained, so little work is
interrupted). Besides, when groups wait for admission that the protocol would admit at the newest
version but no instance can take (``starved``: the router found no room on instances at an
admissible version, or no instance's version is admissible), the least loaded instance behind pulls
at once: demand decides how many instances move, one per decision, cheapest first, and the head
buffer never stays unfillable. Instances pull one by one, not all at once.

``global_immediate``: every instance pulls as soon as a newer version is pushed (the vanilla
counterpart; AReaL / VeRL-Async style global update with partial rollout).

``global_drained``: every instance pulls together once none has a request left (VeRL, one-step-off).

``adaptive``: at every decision while instances are behind, the estimated cost of per-instance pulls
is compared with one global broadcast of the newest version (:func:`broadcast_cheaper`, from the
run's :class:`TransferCosts`), and the cheaper is taken: a broadcast sends the version to every
instance behind at once (their Pulls marked ``broadcast``), otherwise ``per_instance`` decides.
Per-instance pulls share the parameter server's egress, and the instances whose version the protocol
admits no new group at (``stuck``: they can only drain) need the version now, so they pull together;
at a tight ``eta`` most of the fleet is stuck at each version and the broadcast is cheaper, at a
loose one few are and a pull over an instance's own link is. Without transfer costs it is ``per_instance``.

What happens to the requests of an instance that pulls (interrupted and re-routed, or kept in place)
is the policy's ``pull_keeps_requests``, decided by the coordinator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from staleflow.protocol import StalenessManager
from staleflow.runtime.coordination.fleet import InstanceView


@dataclass(frozen=True)
class TransferCosts:
    """What moving one version costs (the ``adaptive`` sync's estimate): ``weights_gb`` per version,
    the parameter server's egress ``ps_gb_per_s`` (shared by the pulls in flight), one instance's
    ``link_gb_per_s``, a global broadcast's ``broadcast_gb_per_s``, and ``load_s`` an instance is
    blocked for on top of the transfer. Defaults: free."""

    weights_gb: float = 0.0
    ps_gb_per_s: float = math.inf
    link_gb_per_s: float = math.inf
    broadcast_gb_per_s: float = math.inf
    load_s: float = 0.0

    def pull_s(self, together: int) -> float:
        """Seconds one pull blocks its instance while ``together`` pulls share the server's egress."""
        return self.load_s + self.weights_gb / min(self.link_gb_per_s, self.ps_gb_per_s / max(1, together))

    def broadcast_s(self) -> float:
        """Seconds a global broadcast blocks every instance it reaches."""
        return self.load_s + self.weights_gb / self.broadcast_gb_per_s


class PullPlan(NamedTuple):
    """The instances that pull now (indices) and whether they get the version by one broadcast."""

    instances: list[int]
    broadcast: bool = False


def broadcast_cheaper(views: Sequence[InstanceView], behind: Sequence[int], manager: StalenessManager, costs: TransferCosts) -> bool:
    """Whether one broadcast to the instances ``behind`` costs fewer instance-seconds without new work
    than per-instance pulls: the ``stuck`` ones (the protocol admits no new group at their version)
    pull together, each blocked ``pull_s(stuck)``, the others one at a time, ``pull_s(1)`` each; the
    broadcast blocks each of them ``broadcast_s()`` once. What happens to their running requests is
    the same either way (the policy's ``pull_keeps_requests``); the time a stuck instance waits to
    drain before a per-instance pull is left out, so the estimate leans towards pulls."""
    admits = {version: manager.can_reserve(version) for version in {views[i].version for i in behind}}
    stuck = sum(1 for i in behind if not admits[views[i].version])
    pulls = stuck * costs.pull_s(stuck) + (len(behind) - stuck) * costs.pull_s(1)
    return len(behind) * costs.broadcast_s() < pulls


def plan_sync(
    mode: str,
    views: Sequence[InstanceView],
    latest: int | None,
    manager: StalenessManager,
    kv_fraction: float,
    starved: bool = False,
    eager: bool = False,
    costs: TransferCosts | None = None,
) -> PullPlan:
    """:func:`plan_pulls`, and for ``adaptive`` the broadcast when it is cheaper (``costs``: the
    transfers' costs it compares; None: it pulls per instance)."""
    if mode != "adaptive":
        return PullPlan(plan_pulls(mode, views, latest, manager, kv_fraction, starved, eager))
    behind = _behind(views, latest)
    if behind and costs is not None and broadcast_cheaper(views, behind, manager, costs):
        return PullPlan(behind, broadcast=True)
    return PullPlan(plan_pulls("per_instance", views, latest, manager, kv_fraction, starved, eager))


def plan_pulls(
    mode: str,
    views: Sequence[InstanceView],
    latest: int | None,
    manager: StalenessManager,
    kv_fraction: float,
    starved: bool = False,
    eager: bool = False,
) -> list[int]:
    """Indices of the instances that should pull ``latest`` now (every mode but ``adaptive``).

    ``starved``: the last decision left admissible groups unplaced for want of an instance.
    ``eager`` (freshness-aware admission, ``per_instance`` only): every instance behind pulls as
    soon as a newer version is pushed, so the groups it admits next start at the newest version
    (with in-place reloads its running requests go on; otherwise they are interrupted and re-routed).
    """
    behind = _behind(views, latest)
    if not behind:
        return []
    if mode == "global_immediate":
        return behind
    if mode == "global_drained":
        return behind if all(not v.requests for v in views) else []
    if mode != "per_instance":
        raise ValueError(f"unknown sync mode {mode!r}")
    assert latest is not None
    if eager:
        return behind
    pulls = [i for i in behind if views[i].kv_tokens <= kv_fraction * views[i].kv_capacity]
    if not pulls and starved and manager.reserve_slack(latest) > 0:
        pulls = [min(behind, key=lambda i: views[i].kv_tokens)]
    return pulls


def _behind(views: Sequence[InstanceView], latest: int | None) -> list[int]:
    """Indices of the instances below ``latest`` and not loading already."""
    return [i for i, v in enumerate(views) if latest is not None and v.version < latest and not v.loading]

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

What happens to the requests of an instance that pulls (interrupted and re-routed, or kept in place)
is the policy's ``pull_keeps_requests``, decided by the coordinator.
"""

from __future__ import annotations

from collections.abc import Sequence

from staleflow.protocol import StalenessManager
from staleflow.runtime.coordination.fleet import InstanceView


def plan_pulls(
    mode: str,
    views: Sequence[InstanceView],
    latest: int | None,
    manager: StalenessManager,
    kv_fraction: float,
    starved: bool = False,
    eager: bool = False,
) -> list[int]:
    """Indices of the instances that should pull ``latest`` now.

    ``starved``: the last decision left admissible groups unplaced for want of an instance.
    ``eager`` (freshness-aware admission, ``per_instance`` only): every instance behind pulls as
    soon as a newer version is pushed, so the groups it admits next start at the newest version
    (with in-place reloads its running requests go on; otherwise they are interrupted and re-routed).
    """
    behind = [i for i, v in enumerate(views) if latest is not None and v.version < latest and not v.loading]
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

"""Synchronization strategies: which instances pull a newer model version now (design 3.2).

``per_instance`` (StaleFlow): an instance behind the newest pushed version pulls when that costs
least: its KV cache is at most ``kv_fraction`` full (idle or nearly drained, so little work is
interrupted). An instance whose version the protocol no longer admits gets no new groups and drains
on its own; but if *no* instance can admit a group at its version while the newest version could,
the least loaded instance behind pulls at once, so that the head buffer never stays unfillable.
Instances pull one by one as each qualifies, not all at once.

``global_immediate``: every instance pulls as soon as a newer version is pushed (the vanilla
counterpart; AReaL / VeRL-Async style global update with partial rollout).

``global_drained``: every instance pulls together once none has a request left (VeRL, one-step-off).

What happens to the requests of an instance that pulls (interrupted and re-routed, or kept in place)
is the policy's ``pull_keeps_requests``, decided by the coordinator.
"""

from __future__ import annotations

from typing import Sequence

from staleflow.protocol import StalenessManager
from staleflow.runtime.fleet import InstanceView


def plan_pulls(
    mode: str,
    views: Sequence[InstanceView],
    latest: int | None,
    manager: StalenessManager,
    kv_fraction: float,
) -> list[int]:
    """Indices of the instances that should pull ``latest`` now."""
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
    pulls = [i for i in behind if views[i].kv_tokens <= kv_fraction * views[i].kv_capacity]
    if pulls:
        return pulls
    if manager.reserve_slack(latest) > 0 and not any(
        manager.reserve_slack(version) > 0 for version in {v.version for v in views}
    ):
        return [min(behind, key=lambda i: views[i].kv_tokens)]
    return []

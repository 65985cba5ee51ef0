"""Synchronization strategies: which instances pull a newer model version now (design 3.2).

``per_instance`` (StaleFlow): an instance behind the newest pushed version pulls when that costs
least (its KV cache is at most ``kv_fraction`` full: idle or nearly drained), or when the protocol
would no longer admit a group at its version but would at the newest one (it could not take new
work otherwise; this is what keeps the head buffer fillable). Instances pull one by one as each
qualifies, not all at once; running requests stay and go on with the new weights.

``global_immediate``: every instance pulls as soon as a newer version is pushed (the vanilla
counterpart; AReaL / VeRL-Async style global in-place update with partial rollout).

``global_drained``: every instance pulls together once none has a request left (VeRL, one-step-off).
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
    newest_admits = manager.reserve_slack(latest) > 0
    slack: dict[int, int] = {}
    pulls = []
    for i in behind:
        view = views[i]
        if view.version not in slack:
            slack[view.version] = manager.reserve_slack(view.version)
        drained = view.kv_tokens <= kv_fraction * view.kv_capacity
        refused = slack[view.version] == 0 and newest_admits
        if drained or refused:
            pulls.append(i)
    return pulls

"""Joining or starting the job's Ray cluster.

Ray refuses resource arguments when it connects to a running cluster ("When connecting to an
existing cluster, num_cpus and num_gpus must not be provided", ``ray.init``), and ``ray.init()``
without an address joins the cluster ``ray start`` left in Ray's temporary folder. So, as verl does
(``ray_init.num_cpus: null``, ``ray.init`` only when Ray is not initialised), a running cluster is
joined as it is and only a cluster started for the job gets ``num_cpus``/``num_gpus``. The running
cluster is found the way ``ray.init`` finds it: ``RAY_ADDRESS``, else the address ``ray start``
wrote (:func:`running_cluster_address`). Whatever ``ray.init`` refuses becomes a
:class:`ClusterStartError` naming the address and the fix (``staleflow train`` exits 2).
"""

from __future__ import annotations

import os
from typing import Any

#: ``ray.init`` arguments a running cluster refuses
RESOURCE_ARGUMENTS = ("num_cpus", "num_gpus", "resources", "object_store_memory", "labels")


class ClusterStartError(RuntimeError):
    """The job's Ray cluster could not be joined or started; the message says which and why."""


def running_cluster_address(temp_dir: str | None = None) -> str | None:
    """The address of the Ray cluster ``ray.init()`` would join: ``RAY_ADDRESS``, else the one
    ``ray start`` recorded in Ray's temporary folder (``temp_dir``; None: Ray's default); None: none runs."""
    address = os.environ.get("RAY_ADDRESS") or None
    if address is not None:
        return address
    from ray._private.services import find_bootstrap_address  # how ray.init() finds it; no public equivalent

    found: str | None = find_bootstrap_address(temp_dir)
    return found


def join_or_start(address: str | None, **ray_init: Any) -> None:
    """Connect to the cluster at ``address`` (None: the running one, :func:`running_cluster_address`)
    without resource arguments, or start a local one with ``ray_init`` (None values left out)."""
    import ray

    target = address or running_cluster_address()
    given = {k: v for k, v in ray_init.items() if v is not None}
    if target is not None:
        given = {k: v for k, v in given.items() if k not in RESOURCE_ARGUMENTS}
    try:
        if target is not None:
            ray.init(address=target, **given)
        else:
            ray.init(**given)
    except (ValueError, ConnectionError, RuntimeError, TimeoutError) as error:
        where = f"the Ray cluster at {target}" if target is not None else "a local Ray cluster"
        hint = (
            "check that `ray start` runs there and that cluster.address / RAY_ADDRESS name it"
            if target is not None
            else "check cluster.num_cpus / cluster.num_gpus, or start Ray yourself (`ray start --head`)"
        )
        raise ClusterStartError(f"could not join or start {where}: {error} ({hint})") from error


def cluster_resources(address: str) -> dict[str, float]:
    """The total resources of the running cluster at ``address`` (connects as a driver, then disconnects)."""
    import ray

    if ray.is_initialized():
        return dict(ray.cluster_resources())
    join_or_start(address, include_dashboard=False, log_to_driver=False)
    try:
        return dict(ray.cluster_resources())
    finally:
        ray.shutdown()

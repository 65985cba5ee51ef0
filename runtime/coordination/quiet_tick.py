"""Whether a decision now would read the instances' load: a quiet periodic tick needs no snapshots.

A periodic (full) tick snapshots every instance so that the decision that follows reads fresh KV
use. With a short check period (the authors' StaleFlow checks every 100 ms) most ticks find nothing
to do: no instance behind the newest version (a pull reads KV use), no waiting queue past
``phi_wait`` to bounce, no starved instance a migration could fill, nothing queued or admissible to
route, no tail of the head buffer to move. :func:`decision_reads_load` says, without changing anything, whether any of these could
happen now; when none can, the decision reads no KV use and gives no command, whatever the
snapshots would say. The run loop may then leave the snapshots out, as long as the next decision
comes at the next tick, whose snapshots replace them (see :meth:`RunLoop.run`).

"Whatever the snapshots would say" covers every field a snapshot sets, ``loading`` included: an
instance still loading (or stalled) in its last snapshot may be done in the fresh one, and then it
can pull, bounce or take part in a migration. So no test below leaves out a loading instance. (It
did, and a run stalled: chaos seed 770077, both instances behind and loading in their last
snapshots, the fresh ones left out, and nothing left to wake the loop but the next tick.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from staleflow.runtime.coordination.coordinator import Coordinator


def decision_reads_load(coordinator: Coordinator, ps_version: int | None, trainer_waits: bool) -> bool:
    """True if a decision now could read KV use or snapshot fields, or give a command (conservative:
    True whenever unsure)."""
    policy = coordinator.policy
    views = coordinator.views
    if coordinator.has_commands() or (trainer_waits and policy.proactive_abort):
        return True
    if ps_version is not None and any(v.version < ps_version for v in views):
        return True  # a pull decision reads KV use and whether the instance is done loading
    if policy.waiting_bounce and any(len(v.requests) > policy.phi_wait for v in views):
        return True  # a fresh snapshot may show more of them waiting (those routed since the last one)
    ts, manager = coordinator.ts, coordinator.manager
    if ts.queued_count():
        return True  # routing
    fleet = coordinator.fleet.synced()
    if ts.pending_count() and any(manager.can_reserve(v) for v in set(fleet.version.tolist())):
        return True  # admission may route (any cap or freshness hold left to the decision)
    if coordinator.tail is not None and coordinator.tail.active(manager):
        return True  # the tail may move
    if not policy.migration:
        return False
    targets = coordinator.starved_instances(fleet)  # any of them, waiting or not: both are snapshot fields
    if policy.migration_rule != "evacuate":
        return bool(targets.any())
    # the evacuation empties an instance holding at least evacuate_min_requests with a starved peer
    # at its version or newer: with none, it moves nothing whatever the load
    sources = np.flatnonzero(fleet.n >= policy.evacuate_min_requests)
    versions = fleet.version[targets]
    return any(bool((versions >= fleet.version[i]).sum() - targets[i]) for i in sources.tolist())

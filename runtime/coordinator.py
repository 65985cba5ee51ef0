"""The rollout coordinator: snapshots in, commands out (design 3.1; paper section 5).

It keeps a speculative view of every instance (:mod:`staleflow.runtime.fleet`), takes snapshots
that agree with it, and decides commands with the policy's strategies:

1. **Pull** (:mod:`~staleflow.runtime.sync`): instances that should load the newest version now
   (their requests are interrupted first unless the policy keeps them in place).
2. **Interrupt** (:mod:`~staleflow.runtime.migration`, on full ticks when nothing was pulled):
   waiting or excess requests go back to the trajectory server and are routed again.
3. **Route**: queued requests (partials and group members not placed yet) in priority order, each
   only to instances whose version is at least its group's version; the queue is served in order
   and a request that cannot be placed holds back the rest until the next decision.
4. **Admit**: while the queue is empty, pending groups are admitted: the router picks an instance
   among those whose version the protocol would admit, the protocol **reserves** the group at that
   version (the :class:`~staleflow.protocol.StalenessManager` is the only authority), and the
   group's requests are routed.

Group aborts (staleness GC) also go through here, so that the protocol, the trajectory server and
the speculative state change together.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from staleflow.protocol import StalenessManager
from staleflow.runtime.commands import Abort, Command, Interrupt, Pull, Route
from staleflow.runtime.cost_model import CostModel
from staleflow.runtime.fleet import FleetArrays, InstanceView
from staleflow.runtime.migration import plan_migration
from staleflow.runtime.policies import SystemPolicy
from staleflow.runtime.routing import LeastLoadedRouter, ThroughputRouter
from staleflow.runtime.sync import plan_pulls
from staleflow.runtime.trajectory_server import GroupState, TrajectoryServer
from staleflow.runtime.types import InstanceSnapshot, RolloutRequest


class Coordinator:
    """Decides Route / Interrupt / Pull / Abort commands for a fleet of rollout instances.

    Args:
        manager: the staleness protocol (reserves go through it).
        trajectory_server: where groups and requests live (local object or a Ray proxy).
        policy: the system policy (strategies and knobs).
        cost_model: the instances' decode cost model (throughput routing and migration).
        snapshots: one initial snapshot per instance (empty instances), in a fixed order.
    """

    def __init__(
        self,
        manager: StalenessManager,
        trajectory_server: TrajectoryServer,
        policy: SystemPolicy,
        cost_model: CostModel,
        snapshots: Sequence[InstanceSnapshot],
    ) -> None:
        if not snapshots:
            raise ValueError("the coordinator needs at least one rollout instance")
        self.manager = manager
        self.ts = trajectory_server
        self.policy = policy
        self.cost_model = cost_model
        self.views = [InstanceView(s) for s in snapshots]
        self._index = {v.instance_id: i for i, v in enumerate(self.views)}
        if len(self._index) != len(self.views):
            raise ValueError("instance ids must be unique")
        self.router: ThroughputRouter | LeastLoadedRouter = (
            ThroughputRouter(cost_model, policy.mu)
            if policy.routing == "throughput"
            else LeastLoadedRouter(policy.max_running)
        )
        #: admitted groups not yet removed without training (the inflight cap's accepted + running)
        self.live_groups = 0
        self._fleet = FleetArrays.of(self.views)
        self._dirty: set[int] = set()
        self._starved = False  # the last decision left admissible groups for want of an instance
        self.stats: Counter[str] = Counter()
        self.decision_seconds = 0.0

    # ----------------------------------------------------------------- observations
    def view(self, instance_id: str) -> InstanceView:
        return self.views[self._index[instance_id]]

    def observe(self, snapshot: InstanceSnapshot) -> bool:
        """Take an instance snapshot unless it contradicts the speculative state."""
        index = self._index[snapshot.instance_id]
        accepted = self.views[index].observe(snapshot)
        if accepted:
            self._dirty.add(index)
        self.stats["snapshots_accepted" if accepted else "snapshots_rejected"] += 1
        return accepted

    def forget(self, instance_id: str, request_ids: Iterable[str]) -> None:
        """These requests left the instance (finished and collected, or cancelled)."""
        index = self._index[instance_id]
        for rid in request_ids:
            self.views[index].remove(rid)
        self._dirty.add(index)

    def instance_down(self, instance_id: str) -> None:
        """The instance failed a call: it holds nothing the coordinator counts on, and gets no work
        (a loading view is skipped by routing, sync and migration) until :meth:`instance_up`."""
        index = self._index[instance_id]
        view = self.views[index]
        for rid in list(view.requests):
            view.remove(rid)
        view.loading = True
        self._dirty.add(index)

    def instance_up(self, snapshot: InstanceSnapshot) -> None:
        """A failed instance answers again, empty: its view starts afresh from ``snapshot``."""
        index = self._index[snapshot.instance_id]
        self.views[index] = InstanceView(snapshot)
        self._dirty.add(index)

    def groups_removed(self, count: int) -> None:
        """Admitted groups that ended without being trained (aborted, failed, dropped)."""
        self.live_groups -= count

    # ----------------------------------------------------------------- decisions
    def plan(self, ps_version: int | None, full: bool) -> list[Command]:
        """Commands for now. ``full``: a periodic tick (migration is considered only then)."""
        started = time.perf_counter()
        commands: list[Command] = []
        pulls = plan_pulls(
            self.policy.sync, self.views, ps_version, self.manager, self.policy.sync_kv_fraction, self._starved
        )
        for i in pulls:
            assert ps_version is not None
            view = self.views[i]
            if view.requests and not self.policy.pull_keeps_requests:
                rids = tuple(view.requests)
                self.forget(view.instance_id, rids)
                commands.append(Interrupt(view.instance_id, rids))
                self.stats["interrupted_for_pull"] += len(rids)
            commands.append(self.pull(view.instance_id, ps_version))
        fleet = self._synced_fleet()
        if full and self.policy.migration and not pulls:
            for i, rids in plan_migration(
                self.views, fleet, self.cost_model, self.policy.phi_wait, self.policy.phi_throughput,
                self._starved_instances(fleet),
            ).items():
                self.forget(self.views[i].instance_id, rids)
                commands.append(Interrupt(self.views[i].instance_id, tuple(rids)))
                self.stats["migrated_requests"] += len(rids)
            fleet = self._synced_fleet()
        routes: dict[int, list[str]] = {}
        self._starved = False
        if self.ts.queued_count() or self._admissible_versions(ps_version):
            if self._route_queue(fleet, routes):
                self._starved = not self._admit(fleet, ps_version, routes)
        elif self.ts.pending_count():
            self._starved = True  # no instance version is admissible (or the cap is reached)
        for i, rids in routes.items():
            commands.append(Route(self.views[i].instance_id, tuple(rids)))
        self.stats["pulls"] += len(pulls)
        self.decision_seconds += time.perf_counter() - started
        return commands

    def _starved_instances(self, fleet: FleetArrays) -> np.ndarray:
        """Instances that can get no other work: nothing queued, and no pending group admissible at
        their version."""
        if self.ts.queued_count():
            return np.zeros(len(self.views), dtype=bool)
        if not self.ts.pending_count():
            return np.ones(len(self.views), dtype=bool)
        admissible = [v for v in set(fleet.version.tolist()) if self.manager.can_reserve(v)]
        return ~np.isin(fleet.version, admissible)

    def _synced_fleet(self) -> FleetArrays:
        """The fleet arrays, with every view changed since the last decision copied in."""
        for i in self._dirty:
            self._fleet.update(i, self.views[i])
        self._dirty.clear()
        return self._fleet

    def pull(self, instance_id: str, version: int) -> Pull:
        """A Pull command; the view takes the new version at once (older snapshots are stale)."""
        index = self._index[instance_id]
        self.views[index].version = version
        self.views[index].loading = True
        self._dirty.add(index)
        return Pull(instance_id, version)

    def _route_queue(self, fleet: FleetArrays, routes: dict[int, list[str]]) -> bool:
        """Place queued requests in order; False if one could not be placed."""
        if self.ts.queued_count() == 0:
            return True
        batch: list[RolloutRequest] = []
        for request in self.ts.queued():
            if batch and (request.group_version, _tokens(request)) != (batch[0].group_version, _tokens(batch[0])):
                if not self._place(batch, fleet, routes):
                    return False
                batch = []
            batch.append(request)
        return self._place(batch, fleet, routes)

    def _place(self, requests: list[RolloutRequest], fleet: FleetArrays, routes: dict[int, list[str]]) -> bool:
        """Route requests that share a group version and a size; False if some stay queued."""
        if not requests:
            return True
        first = requests[0]
        chosen = self.router.choose(fleet, _tokens(first), fleet.version >= first.group_version, len(requests))
        for i, request in zip(chosen, requests):
            self._assign(i, request.request_id, _tokens(request), request.group_version, routes)
        return len(chosen) == len(requests)

    def _assign(self, i: int, rid: str, tokens: int, group_version: int, routes: dict[int, list[str]]) -> None:
        self.views[i].add(rid, tokens, group_version)
        routes.setdefault(i, []).append(rid)

    def _admissible_versions(self, ps_version: int | None) -> list[int]:
        """Instance versions at which a pending group could be admitted now (none: admit nothing)."""
        if self.ts.pending_count() == 0:
            return []
        if self.policy.admission == "inflight_cap":
            cap = (self.manager.eta + (ps_version or 0) + 1) * self.manager.batch_size
            if self.live_groups >= cap:
                return []
        versions = [v for v in set(self._fleet.version.tolist()) if self.manager.can_reserve(v)]
        if not versions:
            self.stats["admission_blocked_by_protocol"] += 1
        return versions

    def _admit(self, fleet: FleetArrays, ps_version: int | None, routes: dict[int, list[str]]) -> bool:
        """Admit pending groups while the router, the protocol (and the policy's cap) allow.

        Returns False if a group the protocol would admit found no instance (the router had no room
        at an admissible version); True if admission stopped for another reason.
        """
        while True:
            group = self.ts.next_pending()
            if group is None:
                return True
            admissible = self._admissible_versions(ps_version)
            if not admissible:
                return True
            tokens = len(group.prompt_ids)
            chosen = self.router.choose(fleet, tokens, np.isin(fleet.version, admissible))
            if not chosen:
                return False
            choice = chosen[0]
            version = int(fleet.version[choice])
            if not self.manager.reserve(group.group_id, version):
                raise RuntimeError(f"protocol refused group {group.group_id!r} at version {version} after can_reserve")
            self.live_groups += 1
            self.stats["groups_admitted"] += 1
            requests = self.ts.admit(group.group_id, version)
            self._assign(choice, requests[0].request_id, tokens, version, routes)
            if not self._place(requests[1:], fleet, routes):
                return True

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What outlives a restart: the admitted-group count (the inflight cap) and the counters.
        The speculative views are rebuilt from the instances' snapshots."""
        return {"live_groups": self.live_groups, "stats": dict(self.stats), "decision_seconds": self.decision_seconds}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.live_groups = int(state["live_groups"])
        self.stats = Counter(state["stats"])
        self.decision_seconds = float(state["decision_seconds"])

    # ----------------------------------------------------------------- aborts
    def cancel(self, pairs: Iterable[tuple[str, str]]) -> list[Command]:
        """Abort commands for ``(instance_id, request_id)`` pairs the TS cancelled."""
        by_instance: dict[str, list[str]] = {}
        for instance_id, rid in pairs:
            by_instance.setdefault(instance_id, []).append(rid)
        commands: list[Command] = []
        for instance_id, rids in by_instance.items():
            self.forget(instance_id, rids)
            commands.append(Abort(instance_id, tuple(rids)))
        return commands

    def abort_stale_groups(self) -> list[Command]:
        """Staleness GC (ROLL style): abort generating groups due in the head buffer."""
        head = self.manager.version
        stale = [
            g.group_id
            for g in self.manager.groups()
            if g.version + self.manager.eta == head and self.ts.group_state(str(g.group_id)) is GroupState.GENERATING
        ]
        pairs: list[tuple[str, str]] = []
        for group_id in stale:
            self.manager.abort(group_id)
            pairs.extend(self.ts.abort_group(str(group_id)))
        self.groups_removed(len(stale))
        self.stats["gc_aborted_groups"] += len(stale)
        return self.cancel(pairs)


def _tokens(request: RolloutRequest) -> int:
    """Tokens a request puts in the KV cache when it (re)starts: prompt and output so far."""
    return len(request.prompt_ids) + len(request.output_ids)

"""The rollout coordinator: snapshots in, commands out (design 3.1; paper section 5).

It keeps a speculative view of every instance (:mod:`staleflow.runtime.coordination.fleet`), takes snapshots
that agree with it, and decides commands with the policy's strategies:

1. **Pull** (:mod:`~staleflow.runtime.coordination.sync`): instances that should load the newest version now
   (their requests are interrupted first unless the policy keeps them in place).
2. **Interrupt** (:mod:`~staleflow.runtime.coordination.migration`, on full ticks when nothing was pulled):
   waiting or excess requests go back to the trajectory server and are routed again.
3. **Route**: queued requests (partials and group members not placed yet) in priority order, each
   only to instances whose version is at least its group's version; the queue is served in order
   and a request that cannot be placed holds back the rest until the next decision.
4. **Admit**: while the queue is empty, pending groups are admitted one at a time
   (:meth:`Coordinator.next_admission`): the router picks an instance among those whose version the
   protocol would admit (the :class:`~staleflow.protocol.StalenessManager` is the only authority);
   the caller reserves the group through :class:`~staleflow.runtime.run.group_life.GroupLife` and
   hands its requests back (:meth:`Coordinator.place_admitted`), which routes them.

The coordinator reads the protocol and the trajectory server and changes neither: its own state is
the speculative view of the fleet and its counters. Proactive abort is a decision too
(:meth:`Coordinator.proactive_aborts`); the group owner re-queues the groups and the coordinator
cancels their requests (:meth:`Coordinator.cancel`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from staleflow.protocol import StalenessManager
from staleflow.runtime.coordination.commands import Abort, Command, Interrupt, Pull, Route
from staleflow.runtime.coordination.cost_model import CostModel
from staleflow.runtime.coordination.fleet import FleetArrays, InstanceView
from staleflow.runtime.coordination.migration import plan_migration
from staleflow.runtime.coordination.routing import LeastLoadedRouter, RoundRobinRouter, ThroughputRouter
from staleflow.runtime.coordination.sync import plan_pulls
from staleflow.runtime.run.group_life import GroupLife
from staleflow.runtime.servers.request_queue import request_tokens
from staleflow.runtime.servers.trajectory_server import TrajectoryServer
from staleflow.runtime.settings.policies import SystemPolicy
from staleflow.runtime.types import InstanceSnapshot, RolloutRequest


@dataclass(frozen=True)
class Admission:
    """A decision to admit ``group_id`` at ``version`` on the instance at ``instance_index``."""

    group_id: str
    version: int
    instance_index: int


class Coordinator:
    """Decides Route / Interrupt / Pull / Abort commands for a fleet of rollout instances.

    One decision is: :meth:`plan` (pulls, interrupts, the queue's routes), then
    :meth:`next_admission` / :meth:`place_admitted` until it returns None, then :meth:`take_routes`.

    Args:
        groups: the owner of groups' life; read for the protocol, the trajectory server (local
            object or a Ray proxy) and the count of live groups.
        policy: the system policy (strategies and knobs).
        cost_model: the instances' decode cost model (throughput routing and migration).
        snapshots: one initial snapshot per instance (empty instances), in a fixed order.
    """

    def __init__(
        self,
        groups: GroupLife,
        policy: SystemPolicy,
        cost_model: CostModel,
        snapshots: Sequence[InstanceSnapshot],
    ) -> None:
        if not snapshots:
            raise ValueError("the coordinator needs at least one rollout instance")
        self.groups = groups
        self.policy = policy
        self.cost_model = cost_model
        self.views = [InstanceView(s) for s in snapshots]
        self._index = {v.instance_id: i for i, v in enumerate(self.views)}
        if len(self._index) != len(self.views):
            raise ValueError("instance ids must be unique")
        self.router: ThroughputRouter | LeastLoadedRouter | RoundRobinRouter = (
            ThroughputRouter(cost_model, policy.mu)
            if policy.routing == "throughput"
            else RoundRobinRouter(policy.max_running)
            if policy.routing == "round_robin"
            else LeastLoadedRouter(policy.max_running)
        )
        self._fleet = FleetArrays.of(self.views)
        self._dirty: set[int] = set()
        self._starved = False  # the last decision left admissible groups for want of an instance
        self._routes: dict[int, list[str]] = {}  # the decision in progress: instance index -> requests
        self._admitting = False  # the decision in progress may admit groups
        self._ps_version: int | None = None
        #: resubmit_same_instance: requests interrupted by a pull -> the index of the instance they ran on
        self._resubmit_to: dict[str, int] = {}
        #: freshness-aware admission: buffers beyond the head that admission may fill
        self.lookahead = groups.manager.eta  # as wide as the protocol at first; narrowed while the trainer does not wait
        self._steps_without_wait = 0
        self._hold_left_room = False  # since the step started, a freshness hold kept work from an instance with room
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
        if self._resubmit_to:  # its interrupted requests go wherever routing places them
            self._resubmit_to = {rid: i for rid, i in self._resubmit_to.items() if i != index}

    def instance_up(self, snapshot: InstanceSnapshot) -> None:
        """A failed instance answers again, empty: its view starts afresh from ``snapshot``."""
        index = self._index[snapshot.instance_id]
        self.views[index] = InstanceView(snapshot)
        self._dirty.add(index)

    @property
    def manager(self) -> StalenessManager:
        return self.groups.manager

    @property
    def ts(self) -> TrajectoryServer:
        return self.groups.ts

    # ----------------------------------------------------------------- decisions
    def plan(self, ps_version: int | None, full: bool) -> list[Command]:
        """Pull and Interrupt commands for now; queued requests are placed (sent by :meth:`take_routes`).

        ``full``: a periodic tick (migration is considered only then).
        """
        started = time.perf_counter()
        commands: list[Command] = []
        pulls = plan_pulls(
            self.policy.sync, self.views, ps_version, self.manager, self.policy.sync_kv_fraction, self._starved,
            eager=self.policy.freshness and self.lookahead < self.manager.eta,
        )
        for i in pulls:
            assert ps_version is not None
            view = self.views[i]
            if view.requests and not self.policy.pull_keeps_requests:
                rids = tuple(view.requests)
                self.forget(view.instance_id, rids)
                commands.append(Interrupt(view.instance_id, rids))
                self.stats["interrupted_for_pull"] += len(rids)
                if self.policy.resubmit_same_instance:
                    self._resubmit_to.update(dict.fromkeys(rids, i))
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
        self._routes = {}
        self._ps_version = ps_version
        self._starved = False
        self._admitting = False
        if self.ts.queued_count() or self._admissible_versions(ps_version):
            self._admitting = self._route_queue(fleet, self._routes)
        elif self.ts.pending_count():
            self._starved = True  # no instance version is admissible (or the cap is reached)
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
        """Place queued requests in order; False if one could not be placed. A *run* of consecutive
        requests of one group version whose tokens fall in one ``request_budget`` bucket is placed
        by one router call. Runs and their sizes are found on the queue's arrays; only the requests
        placed are read."""
        if self.ts.queued_count() == 0:
            return True
        if self._resubmit_to:
            return self._route_queue_resubmitting(fleet, routes)
        queue = self.ts.queue_view()
        for start, stop, largest in queue.runs(self.policy.request_budget):
            version = int(queue.versions[start])
            chosen = self._choose(fleet, version, largest, stop - start)
            placed = start + len(chosen)
            for i, request, size in zip(chosen, queue.requests(start, placed), queue.tokens[start:placed].tolist()):
                self._assign(i, request.request_id, size, version, routes)
            if placed < stop:
                return False
        return True

    def _route_queue_resubmitting(self, fleet: FleetArrays, routes: dict[int, list[str]]) -> bool:
        """:meth:`_route_queue` while interrupted requests wait to go back to their instance (one
        request at a time): such a request goes there once the instance has loaded the new weights
        (whatever its load: the server queues it) and waits until then; the others are routed in
        order as usual. False if a request stays queued."""
        queue = self.ts.queue_view()
        queued = queue.requests(0, len(queue))
        ids = {request.request_id for request in queued}
        self._resubmit_to = {rid: i for rid, i in self._resubmit_to.items() if rid in ids}  # cancelled ones go
        placed_all = True
        for request, tokens in zip(queued, queue.tokens.tolist()):
            rid, version = request.request_id, request.group_version
            home = self._resubmit_to.get(rid)
            if home is not None:
                if fleet.loading[home] or fleet.version[home] < version:
                    placed_all = False
                    continue
                del self._resubmit_to[rid]
                fleet.add(home, tokens)
                self._assign(home, rid, tokens, version, routes)
            elif placed_all:
                chosen = self._choose(fleet, version, tokens, 1)
                if not chosen:
                    placed_all = False
                    continue
                self._assign(chosen[0], rid, tokens, version, routes)
        return placed_all

    def _choose(self, fleet: FleetArrays, version: int, tokens: int, count: int) -> list[int]:
        """Instances for ``count`` requests of a group ``version``, each planned as ``tokens`` (the
        largest of them: the router's estimate errs on the safe side); fewer if some stay queued."""
        return self.router.choose(fleet, tokens, fleet.version >= version, count, oldest_first=True)

    def _assign(self, i: int, rid: str, tokens: int, group_version: int, routes: dict[int, list[str]]) -> None:
        self.views[i].add(rid, tokens, group_version)
        routes.setdefault(i, []).append(rid)

    def _admissible_versions(self, ps_version: int | None) -> list[int]:
        """Instance versions at which a pending group could be admitted now (none: admit nothing)."""
        if self.ts.pending_count() == 0:
            return []
        if self.policy.admission == "inflight_cap":
            cap = (self.manager.eta + (ps_version or 0) + 1) * self.manager.batch_size
            if self.groups.live >= cap:
                return []
        concurrency = self.policy.rollout_concurrency * self.manager.batch_size
        if concurrency and self.groups.running >= concurrency:
            return []
        versions = [v for v in set(self._fleet.version.tolist()) if self.manager.can_reserve(v)]
        if not versions:
            self.stats["admission_blocked_by_protocol"] += 1
            return versions
        if self.policy.freshness and len(self.manager) >= (self.lookahead + 1) * self.manager.batch_size + self.manager.redundancy:
            self.stats["admission_held_for_freshness"] += 1
            if not self._hold_left_room:
                self._hold_left_room = self._room_at(versions)
            return []
        return versions

    def _room_at(self, versions: list[int]) -> bool:
        """Whether the router would place the next pending group's first request on an instance at one of ``versions``."""
        group = self.ts.next_pending()
        if group is None:
            return False
        if self.router.has_room(self._fleet, len(group.prompt_ids), np.isin(self._fleet.version, versions)):
            self.stats["freshness_hold_left_room"] += 1
            return True
        return False

    def step_started(self, trainer_waited: bool) -> None:
        """A training step started; ``trainer_waited``: the trainer sat idle for data before it.

        Adapts the freshness-aware admission's lookahead (see :class:`SystemPolicy`): it widens by
        one when the trainer waited *and* a freshness hold since the last step kept work from an
        instance that had room (the hold cost generation; when the instances were full anyway, a
        wider lookahead would only add staleness), and narrows by one after
        ``freshness_patience`` steps in a row the trainer did not wait for, down to 0 (only the
        head buffer: lag 1 when the trainer is the bottleneck). A wait without such a hold leaves
        it as it is.
        """
        if not self.policy.freshness:
            return
        costly, self._hold_left_room = trainer_waited and self._hold_left_room, False
        if trainer_waited:
            self._steps_without_wait = 0
            if costly:
                self.lookahead = min(self.lookahead + 1, self.manager.eta)
                self.stats["freshness_widened"] += 1
            return
        self._steps_without_wait += 1
        if self._steps_without_wait >= self.policy.freshness_patience:
            self.lookahead = max(self.lookahead - 1, 0)
            self._steps_without_wait = 0

    def next_admission(self) -> Admission | None:
        """The next pending group to admit in the decision in progress, or None when admission stops.

        Admission stops when nothing is pending, no instance version is admissible (or the policy's
        cap is reached), or the router has no room at an admissible version (the fleet is then
        *starved*: a sync may be needed). The caller reserves the group (``GroupLife.admit``) and
        passes its requests to :meth:`place_admitted`.
        """
        if not self._admitting:
            return None
        started = time.perf_counter()
        try:
            group = self.ts.next_pending()
            admissible = [] if group is None else self._admissible_versions(self._ps_version)
            if group is None or not admissible:
                self._admitting = False
                return None
            tokens = len(group.prompt_ids)
            fleet = self._fleet
            chosen = []
            if self.policy.freshness:  # the newest version first: its groups start freshest
                chosen = self.router.choose(fleet, tokens, fleet.version == max(admissible))
            if not chosen:
                chosen = self.router.choose(fleet, tokens, np.isin(fleet.version, admissible))
            if not chosen:
                self._admitting = False
                self._starved = True
                return None
            return Admission(group.group_id, int(fleet.version[chosen[0]]), chosen[0])
        finally:
            self.decision_seconds += time.perf_counter() - started

    def place_admitted(self, admission: Admission, requests: Sequence[RolloutRequest]) -> None:
        """Route the requests of a group just reserved as ``admission`` decided."""
        self.stats["groups_admitted"] += 1
        self._assign(admission.instance_index, requests[0].request_id, len(requests[0].prompt_ids), admission.version, self._routes)
        members = requests[1:]
        if not members:
            return
        sizes = [request_tokens(r) for r in members]
        chosen = self._choose(self._fleet, members[0].group_version, max(sizes), len(members))
        for i, request, size in zip(chosen, members, sizes):
            self._assign(i, request.request_id, size, request.group_version, self._routes)
        if len(chosen) < len(members):
            self._admitting = False

    def take_routes(self) -> list[Command]:
        """The Route commands of the decision in progress, which ends here."""
        commands: list[Command] = [Route(self.views[i].instance_id, tuple(rids)) for i, rids in self._routes.items()]
        self._routes = {}
        self._admitting = False
        return commands

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What outlives a restart: the counters. The speculative views are rebuilt from the
        instances' snapshots."""
        return {"stats": dict(self.stats), "decision_seconds": self.decision_seconds}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
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

    def interrupt_all(self) -> list[Command]:
        """Interrupt every request the fleet holds (a checkpoint: partials go to the trajectory server)."""
        commands: list[Command] = []
        for view in self.views:
            if view.requests:
                rids = tuple(view.requests)
                self.forget(view.instance_id, rids)
                commands.append(Interrupt(view.instance_id, rids))
        return commands

    def proactive_aborts(self) -> list[str]:
        """Proactive abort (the authors' ``abort_and_truncate_strategy``): while the trainer waits
        for the head buffer, if at most ``proactive_abort`` groups due in it are still generating
        and enough finished groups wait to fill the batch without them, those groups, to re-queue."""
        threshold = self.policy.proactive_abort
        counts = self.manager.counts()
        if not threshold or not 0 < counts.running[0] <= threshold or sum(counts.done) < self.manager.batch_size:
            return []
        due = self.groups.generating_due(self.manager.version)
        if len(due) != counts.running[0]:  # some are being rewarded: they are about to be done
            return []
        self.stats["proactive_aborted_groups"] += len(due)
        return due


def decide(
    coordinator: Coordinator, groups: GroupLife, ps_version: int | None, full: bool, trainer_waits: bool = False
) -> list[Command]:
    """One whole decision: the coordinator decides, ``groups`` makes every group change it implies.

    ``trainer_waits``: the trainer is idle and cannot consume; proactive abort (if the policy has
    it) re-queues the last stragglers first, so that no route goes to a cancelled request. Returns
    the commands to carry out, in order.
    """
    commands: list[Command] = []
    if trainer_waits and coordinator.policy.proactive_abort:
        commands += coordinator.cancel(groups.requeue(coordinator.proactive_aborts()))
    commands += coordinator.plan(ps_version, full)
    while (admission := coordinator.next_admission()) is not None:
        coordinator.place_admitted(admission, groups.admit(admission.group_id, admission.version))
    commands += coordinator.take_routes()
    return commands

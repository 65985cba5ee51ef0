"""The rollout coordinator: observations in, commands out (design 3.1; paper section 5).

A core in the manner of etcd-io/raft's ``Step`` / ``Ready``: the run loop tells it what happened through one entry,
:meth:`Coordinator.step` (the records of :mod:`~staleflow.runtime.coordination.observations`), and asks it what to do with
:meth:`Coordinator.ready` (a :class:`~staleflow.runtime.coordination.commands.Ready`). Nothing calls into it from the side and it
calls nothing that changes the run: it reads the protocol and the trajectory server, and hands out commands for the instances and
group changes for :class:`~staleflow.runtime.run.group_life.GroupLife`, whose outcome the loop steps back
(:func:`staleflow.runtime.run.decision.decide` drives one decision).

It keeps a speculative view of every instance (:mod:`staleflow.runtime.coordination.fleet`), takes snapshots that agree with it,
and on each :class:`~staleflow.runtime.coordination.observations.Tick` decides with the policy's strategies:

0. **Re-queue** (proactive abort, while the trainer waits): the head buffer's last stragglers, through GroupLife.
1. **Pull** (:mod:`~staleflow.runtime.coordination.sync`): instances that should load the newest version now
   (their requests are interrupted first unless the policy keeps them in place).
2. **Interrupt** (:mod:`~staleflow.runtime.coordination.migration`): the ``waiting_bounce`` at every decision,
   migration on full ticks when nothing was pulled, and the head buffer's tail to its hosts on full ticks
   (:mod:`~staleflow.runtime.coordination.tail`): the requests go back to be routed again.
3. **Route**: queued requests (partials and group members not placed yet) in priority order, each
   only to instances whose version is at least its group's version, off the tail's hosts; with
   ``plan_growth`` the router keeps room for the KV the requests are expected to add until they
   finish (:mod:`~staleflow.runtime.coordination.lengths`); the queue is served in order
   and a request that cannot be placed holds back the rest until the next decision.
4. **Admit**: while the queue is empty, pending groups are admitted one at a time: the router picks
   an instance among those whose version the protocol would admit (the
   :class:`~staleflow.protocol.StalenessManager` is the only authority); a Ready asks for the
   admission, GroupLife reserves the group, and its requests, stepped back, are routed.

Its own state: the speculative view of the fleet, the decision in progress, commands not handed out, counters.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np
from staleflow.protocol import StalenessManager
from staleflow.runtime.coordination.commands import Abort, Admission, Command, Interrupt, Pull, Ready, Route
from staleflow.runtime.coordination.cost_model import CostModel
from staleflow.runtime.coordination.fleet import Fleet, FleetArrays, InstanceView
from staleflow.runtime.coordination.freshness import Lookahead
from staleflow.runtime.coordination.lengths import LengthModel
from staleflow.runtime.coordination.migration import plan_bounce, plan_moves, starved_instances
from staleflow.runtime.coordination.observations import (
    Admitted,
    Cancelled,
    CheckpointStarted,
    CostModelFitted,
    InstanceBack,
    InstanceLost,
    Observation,
    RequestsLeft,
    RunStarted,
    StepStarted,
    Tick,
)
from staleflow.runtime.coordination.routing import (
    PromptAffinityRouter,
    RoundRobinRouter,
    ThroughputRouter,
    make_router,
    route_interrupted,
)
from staleflow.runtime.coordination.sync import TransferCosts, plan_sync
from staleflow.runtime.coordination.tail import TailMoves, proactive_aborts
from staleflow.runtime.run.group_life import GroupLife
from staleflow.runtime.servers.request_queue import request_tokens
from staleflow.runtime.servers.trajectory_server import TrajectoryServer
from staleflow.runtime.settings.policies import SystemPolicy
from staleflow.runtime.types import Cancellations, GroupId, InstanceSnapshot, RolloutRequest


class Coordinator:
    """Decides Route / Interrupt / Pull / Abort commands for a fleet of rollout instances.

    :meth:`step` takes an observation, :meth:`ready` hands out what to do. A decision starts with a
    :class:`~staleflow.runtime.coordination.observations.Tick` and runs through the following :meth:`ready` calls: while a
    Ready asks for a group change, the next step must be its outcome.

    Args:
        groups: the owner of groups' life; read for the protocol, the trajectory server (local
            object or a Ray proxy) and the count of live groups.
        policy: the system policy (strategies and knobs).
        cost_model: the instances' decode cost model (routing, migration) until a ``CostModelFitted`` replaces it.
        snapshots: one initial snapshot per instance (empty instances), in a fixed order.
        transfer: what moving a version costs, for the ``adaptive`` sync (None: it pulls per instance).
        prefill: seconds to rebuild a context of so many tokens on an instance (tail moves weigh it;
            None: no tail moves).
    """

    def __init__(self, groups: GroupLife, policy: SystemPolicy, cost_model: CostModel, snapshots: Sequence[InstanceSnapshot],
                 transfer: TransferCosts | None = None, prefill: Callable[[int], float] | None = None) -> None:
        if not snapshots:
            raise ValueError("the coordinator needs at least one rollout instance")
        self.groups, self.policy, self.cost_model, self.transfer = groups, policy, cost_model, transfer
        self.lengths = LengthModel()  # the response lengths seen (growth planning, tail moves)
        self.fleet = Fleet(snapshots, self.lengths if policy.plan_growth else None)
        self.views = self.fleet.views  # one list: a view that starts afresh replaces its entry
        self.router = make_router(policy.routing, cost_model, policy.mu, policy.max_running)
        self._outbox: list[Command] = []  # decided, not handed out yet
        self._decision: Iterator[Ready] | None = None  # the decision in progress (after a Tick)
        self._asked: Ready | None = None  # a Ready whose group change has no outcome stepped yet
        self._starved = False  # the last decision left admissible groups for want of an instance
        self._routes: dict[int, list[str]] = {}  # the decision in progress: instance index -> requests
        self._admitting = False  # the decision in progress may admit groups
        self._ps_version: int | None = None
        #: requests interrupted by a pull (resubmit_same_instance / resend_round_robin: the instance
        #: they ran on) or moved to the tail's hosts (the host), not routed again yet -> that index
        self._interrupted: dict[str, int] = {}
        #: resend_round_robin: the turn the interrupted requests are resent by; prompt_round_robin's own
        #: (ROLL takes new prompts and resent requests from one ``get_available_dp_rank``)
        own_turn = self.router.turn if isinstance(self.router, PromptAffinityRouter) else None
        self._resend_turn = (own_turn or RoundRobinRouter(policy.max_running)) if policy.resend_round_robin else None
        #: freshness-aware admission: buffers beyond the head that admission may fill
        self.lookahead = Lookahead(groups.manager.eta, policy.freshness_patience)
        self.tail = TailMoves(cost_model, self.lengths, prefill, policy) if policy.tail_hosted and prefill else None
        self.stats: Counter[str] = Counter()
        self.decision_seconds = 0.0

    # ----------------------------------------------------------------- the core's two entries
    def step(self, observation: Observation) -> None:
        """Take what happened (see :mod:`~staleflow.runtime.coordination.observations`)."""
        if self._asked is not None:
            self._answer(self._asked, observation)
        elif isinstance(observation, InstanceSnapshot):
            self._observe(observation)
        elif isinstance(observation, RequestsLeft):
            self.fleet.forget(observation.instance_id, observation.request_ids)
            self.lengths.observe(observation.lengths)
        elif isinstance(observation, InstanceLost):
            self._instance_down(observation.instance_id)
        elif isinstance(observation, InstanceBack):
            self.fleet.back(observation.snapshot)
        elif isinstance(observation, Cancelled):
            self._cancel(observation.requests)
        elif isinstance(observation, StepStarted):
            self._step_started(observation.trainer_waited)
        elif isinstance(observation, Tick):
            if self._decision is not None:
                raise RuntimeError("a decision is in progress: call ready() until it is over before the next Tick")
            self._decision = self._decide(observation)
        elif isinstance(observation, RunStarted):
            self._outbox += [self._pull(v.instance_id, observation.version) for v in self.views if v.version != observation.version]
        elif isinstance(observation, CheckpointStarted):
            self._interrupt_all()
        elif isinstance(observation, CostModelFitted):
            self.cost_model = observation.model
            if isinstance(self.router, ThroughputRouter):
                self.router.cost_model = observation.model
        else:
            raise TypeError(f"not an observation the coordinator asked for or takes: {observation!r}")

    def starved_instances(self, fleet: FleetArrays) -> np.ndarray:
        """Instances that can get no other work (:func:`~staleflow.runtime.coordination.migration.starved_instances`)."""
        return starved_instances(self.ts.queued_count(), self.ts.pending_count(), fleet, self.manager.can_reserve)

    def has_commands(self) -> bool:
        """Whether commands decided earlier wait to be handed out."""
        return bool(self._outbox)

    def ready(self) -> Ready:
        """What to do now: the commands decided since the last call and, while a decision is in
        progress, the group change it needs next (see :class:`~staleflow.runtime.coordination.commands.Ready`)."""
        if self._asked is not None:
            raise RuntimeError("the last Ready asked for a group change: step its outcome (Cancelled or Admitted) first")
        if self._decision is not None:
            asked = next(self._decision, None)
            if asked is not None:
                self._asked = asked
                return asked
            self._decision = None
        return self._ready()

    def _ready(self, requeue: tuple[GroupId, ...] = (), admit: Admission | None = None) -> Ready:
        commands, self._outbox = tuple(self._outbox), []
        return Ready(commands, requeue, admit)

    def _answer(self, asked: Ready, outcome: Observation) -> None:
        """The outcome of the group change ``asked`` for."""
        if asked.requeue and isinstance(outcome, Cancelled):
            self._asked = None
            self._cancel(outcome.requests)
        elif asked.admit is not None and isinstance(outcome, Admitted) and outcome.admission == asked.admit:
            self._asked = None
            self._place_admitted(outcome.admission, outcome.requests)
        else:
            wanted = "Cancelled" if asked.requeue else f"Admitted for {asked.admit}"
            raise RuntimeError(f"the coordinator waits for {wanted}, got {type(outcome).__name__}")

    def _decide(self, tick: Tick) -> Iterator[Ready]:
        """One decision: yields each Ready that asks for a group change, and goes on once its outcome
        is stepped (:meth:`_answer`)."""
        if tick.trainer_waits and (due := proactive_aborts(self.groups, self.policy.proactive_abort)):
            self.stats["proactive_aborted_groups"] += len(due)  # re-queued first: no route goes to a cancelled request
            yield self._ready(requeue=tuple(due))
        self._plan(tick.ps_version, tick.full)
        while (admission := self._next_admission()) is not None:
            yield self._ready(admit=admission)
        self._take_routes()

    # ----------------------------------------------------------------- observations
    def view(self, instance_id: str) -> InstanceView:
        return self.fleet.view(instance_id)

    def holds_requests(self, instance_id: str) -> bool:
        """Whether the coordinator believes the instance holds requests (it is busy)."""
        return bool(self.fleet.view(instance_id).requests)

    def _observe(self, snapshot: InstanceSnapshot) -> None:
        """Take an instance snapshot unless it contradicts the speculative state."""
        accepted = self.fleet.observe(snapshot)
        self.stats["snapshots_accepted" if accepted else "snapshots_rejected"] += 1

    def _instance_down(self, instance_id: str) -> None:
        """The instance failed a call: no work for it until it is back (:meth:`Fleet.lose`)."""
        index = self.fleet.lose(instance_id)
        if self._interrupted:  # its interrupted requests go wherever routing places them
            self._interrupted = {rid: i for rid, i in self._interrupted.items() if i != index}
        if isinstance(self.router, PromptAffinityRouter):  # its groups are pinned afresh
            self.router.unpin_instance(index)

    @property
    def manager(self) -> StalenessManager:
        return self.groups.manager

    @property
    def ts(self) -> TrajectoryServer:
        return self.groups.ts

    # ----------------------------------------------------------------- decisions
    def _plan(self, ps_version: int | None, full: bool) -> None:
        """Pull and Interrupt commands for now; queued requests are placed (routed by :meth:`_take_routes`).

        ``full``: a periodic tick (migration is considered only then).
        """
        started, commands = time.perf_counter(), self._outbox
        pulls, broadcast = plan_sync(
            self.policy.sync, self.views, ps_version, self.manager, self.policy.sync_kv_fraction, self._starved,
            eager=self.policy.freshness and self.lookahead.width < self.manager.eta, costs=self.transfer,
        )
        for i in pulls:
            assert ps_version is not None
            view = self.views[i]
            if view.requests and not self.policy.pull_keeps_requests:
                rids = tuple(view.requests)
                self.fleet.forget(view.instance_id, rids)
                commands.append(Interrupt(view.instance_id, rids))
                self.stats["interrupted_for_pull"] += len(rids)
                if self.policy.resubmit_same_instance or self.policy.resend_round_robin:
                    self._interrupted.update(dict.fromkeys(rids, i))
            commands.append(self._pull(view.instance_id, ps_version, broadcast))
        if pulls and isinstance(self.router, PromptAffinityRouter):
            self.router.clear_pins()  # ROLL's abort_all at the weight update clears the prompt pins
        fleet = self.fleet.synced()
        fleet = self._interrupt(plan_bounce(self.policy, self.views, fleet), "bounced_requests")
        if full and self.policy.migration and not pulls:
            moves = plan_moves(self.policy, self.views, fleet, self.cost_model, self.starved_instances(fleet))
            fleet = self._interrupt(moves, "migrated_requests")
        if full and self.tail is not None:
            fleet = self._interrupt(self.tail.plan(self.views, fleet, self.groups, self._interrupted), "tail_moves")
        self._routes = {}
        self._ps_version = ps_version
        self._starved = False
        self._admitting = False
        if self.ts.queued_count() or self._admissible_versions(ps_version):
            self._admitting = self._route_queue(fleet, self._routes)
        elif self.ts.pending_count():
            self._starved = True  # no instance version is admissible (or the cap is reached)
        self.stats["broadcast_pulls" if broadcast else "pulls"] += len(pulls)
        self.decision_seconds += time.perf_counter() - started

    def _interrupt(self, plan: dict[int, list[str]], counter: str) -> FleetArrays:
        """Interrupt ``plan`` (instance index -> request ids), counted under ``counter``; the fleet's arrays after."""
        for i, rids in plan.items():
            self.fleet.forget(self.views[i].instance_id, rids)
            self._outbox.append(Interrupt(self.views[i].instance_id, tuple(rids)))
            self.stats[counter] += len(rids)
        return self.fleet.synced()

    def _pull(self, instance_id: str, version: int, broadcast: bool = False) -> Pull:
        """A Pull command; the view takes the new version at once (older snapshots are stale)."""
        self.fleet.pull(instance_id, version)
        return Pull(instance_id, version, broadcast)

    def _route_queue(self, fleet: FleetArrays, routes: dict[int, list[str]]) -> bool:
        """Place queued requests in order; False if one could not be placed. A *run* of consecutive
        requests of one group version whose tokens fall in one ``request_budget`` bucket is placed
        by one router call. Runs and their sizes are found on the queue's arrays; only the requests
        placed are read (and, planning for growth, those of each run tried). While requests
        interrupted by a pull or moved to the tail's hosts wait to be routed again, or with prompt
        affinity (new groups go on while only pinned ones wait), they go request by request
        (:func:`~staleflow.runtime.coordination.routing.route_interrupted`, :meth:`PromptAffinityRouter.route_each`)."""
        if self.ts.queued_count() == 0:
            return True
        queue = self.ts.queue_view()
        if self._interrupted or isinstance(self.router, PromptAffinityRouter):
            requests, tokens = queue.requests(0, len(queue)), queue.tokens.tolist()
            if self._interrupted:
                placed, placed_all = route_interrupted(fleet, requests, tokens, self._interrupted, self._resend_turn, self._choose)
            else:
                assert isinstance(self.router, PromptAffinityRouter)
                placed, new_groups_wait = self.router.route_each(fleet, requests, tokens)
                placed_all = not new_groups_wait
            for i, request, size in placed:
                self._assign(i, request, size, request.group_version, routes)
            return placed_all
        for start, stop, largest in queue.runs(self.policy.request_budget):
            version = int(queue.versions[start])
            growth = self.fleet.planned_growth(len(r.output_ids) for r in queue.requests(start, stop))
            chosen = self._choose(fleet, version, largest, stop - start, growth=growth)
            placed = start + len(chosen)
            for i, request, size in zip(chosen, queue.requests(start, placed), queue.tokens[start:placed].tolist()):
                self._assign(i, request, size, version, routes)
            if placed < stop:
                return False
        return True

    def _choose(
        self, fleet: FleetArrays, version: int, tokens: int, count: int, group: GroupId | None = None, growth: float = 0.0
    ) -> list[int]:
        """Instances for ``count`` requests of a group ``version``, each planned as ``tokens`` (the
        largest of them: the router's estimate errs on the safe side) that grow by ``growth``, off the
        tail's hosts; fewer if some stay queued. ``group``: theirs."""
        eligible = self._off_hosts(fleet.version >= version)
        return self.router.choose(fleet, tokens, eligible, count, oldest_first=True, group=group, growth=growth)

    def _off_hosts(self, eligible: np.ndarray) -> np.ndarray:
        """``eligible`` less the instances that host the head buffer's tail (they take no other work)."""
        return eligible if self.tail is None else eligible & ~self.tail.hosts(len(eligible))

    def _assign(self, i: int, request: RolloutRequest, tokens: int, group_version: int, routes: dict[int, list[str]]) -> None:
        self.views[i].add(request.request_id, tokens, group_version, len(request.output_ids), request.group_id)
        routes.setdefault(i, []).append(request.request_id)

    def _admissible_versions(self, ps_version: int | None) -> list[int]:
        """Instance versions at which a pending group could be admitted now (none: admit nothing)."""
        if self.ts.pending_count() == 0:
            return []
        if self.policy.admission == "inflight_cap":
            cap = (self.manager.eta + (ps_version or 0) + 1) * self.manager.batch_size
            if self.groups.live >= cap:
                return []
        if self.policy.outstanding == "ratio" and len(self.manager) >= max(1, self.manager.eta) * self.manager.batch_size:
            return []  # ROLL aa6ad590: batch_size * max(1, async_generation_ratio) prompts outstanding
        concurrency = self.policy.rollout_concurrency * self.manager.batch_size
        if concurrency and self.groups.running >= concurrency:
            return []
        versions = [v for v in set(self.fleet.arrays.version.tolist()) if self.manager.can_reserve(v)]
        if not versions:
            self.stats["admission_blocked_by_protocol"] += 1
            return versions
        if self.policy.freshness and self.lookahead.holds(len(self.manager), self.manager.batch_size, self.manager.redundancy):
            self.stats["admission_held_for_freshness"] += 1
            if not self.lookahead.hold_left_room:
                self.lookahead.hold_left_room = self._room_at(versions)
            return []
        return versions

    def _room_at(self, versions: list[int]) -> bool:
        """Whether the router would place the next pending group's first request on an instance at one of ``versions``."""
        group = self.ts.next_pending()
        if group is None:
            return False
        if self.router.has_room(self.fleet.arrays, len(group.prompt_ids), np.isin(self.fleet.arrays.version, versions)):
            self.stats["freshness_hold_left_room"] += 1
            return True
        return False

    def _step_started(self, trainer_waited: bool) -> None:
        """A training step started: the freshness-aware admission's lookahead adapts (:class:`Lookahead`)."""
        if self.policy.freshness and self.lookahead.step_started(trainer_waited, self.manager.eta):
            self.stats["freshness_widened"] += 1

    def _next_admission(self) -> Admission | None:
        """The next pending group to admit in the decision in progress, or None when admission stops.

        Admission stops when nothing is pending, no instance version is admissible (or the policy's
        cap is reached), or the router has no room at an admissible version (the fleet is then
        *starved*: a sync may be needed). GroupLife reserves the group; its requests come back to
        :meth:`_place_admitted`.
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
            tokens, growth, fleet = len(group.prompt_ids), self.fleet.planned_growth([0]), self.fleet.arrays
            eligible = self._off_hosts(np.isin(fleet.version, admissible))
            eligible, held = self.router.for_new_group(fleet, tokens, eligible)
            self.stats["admission_held_for_balance"] += int(held)
            place = partial(self.router.choose, fleet, tokens, group=group.group_id, growth=growth)
            # with freshness, the newest version first: its groups start freshest
            chosen = place(eligible & (fleet.version == max(admissible))) if self.policy.freshness else []
            chosen = chosen or place(eligible)
            if not chosen:
                self._admitting = False
                self._starved = True
                return None
            return Admission(group.group_id, int(fleet.version[chosen[0]]), chosen[0])
        finally:
            self.decision_seconds += time.perf_counter() - started

    def _place_admitted(self, admission: Admission, requests: Sequence[RolloutRequest]) -> None:
        """Route the requests of a group just reserved as ``admission`` decided."""
        self.stats["groups_admitted"] += 1
        self._assign(admission.instance_index, requests[0], len(requests[0].prompt_ids), admission.version, self._routes)
        members = requests[1:]
        if not members:
            return
        sizes = [request_tokens(r) for r in members]
        growth = self.fleet.planned_growth(len(r.output_ids) for r in members)
        chosen = self._choose(self.fleet.arrays, members[0].group_version, max(sizes), len(members), members[0].group_id, growth)
        for i, request, size in zip(chosen, members, sizes):
            self._assign(i, request, size, request.group_version, self._routes)
        if len(chosen) < len(members) and not isinstance(self.router, PromptAffinityRouter):
            self._admitting = False  # with prompt affinity the rest waits for its own instance only

    def _take_routes(self) -> None:
        """The Route commands of the decision in progress, which ends here."""
        self._outbox += [Route(self.views[i].instance_id, tuple(rids)) for i, rids in self._routes.items()]
        self._routes = {}
        self._admitting = False

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What outlives a restart: the counters. The speculative views are rebuilt from the
        instances' snapshots."""
        return {"stats": dict(self.stats), "decision_seconds": self.decision_seconds}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.stats = Counter(state["stats"])
        self.decision_seconds = float(state["decision_seconds"])

    # ----------------------------------------------------------------- aborts
    def _cancel(self, pairs: Cancellations) -> None:
        """Abort commands for running requests a group change cancelled."""
        by_instance: dict[str, list[str]] = {}
        for instance_id, rid in pairs:
            by_instance.setdefault(instance_id, []).append(rid)
        for instance_id, rids in by_instance.items():
            self.fleet.forget(instance_id, rids)
            self._outbox.append(Abort(instance_id, tuple(rids)))

    def _interrupt_all(self) -> None:
        """Interrupt every request the fleet holds (a checkpoint: partials go to the trajectory server)."""
        for view in self.views:
            if view.requests:
                rids = tuple(view.requests)
                self.fleet.forget(view.instance_id, rids)
                self._outbox.append(Interrupt(view.instance_id, rids))

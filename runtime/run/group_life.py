"""The one owner of a prompt group's life: protocol entry and trajectory-server state change together.

A group is drawn, admitted, finished, rewarded, failed, aborted, consumed, dropped or restored
only here. Each method makes the protocol transition (:class:`~staleflow.protocol.StalenessManager`:
Reserve, Occupy, Abort, Consume) and the matching trajectory-server transition in one call, so the
two can never disagree:

======================  ====================  =======================================
event                   protocol              trajectory server
======================  ====================  =======================================
drawn from the dataset  (none)                -> pending
admitted at version v   ``reserve(g, v)``     pending -> generating (requests queued)
finished                (none)                generating -> rewarding (its responses in)
rewarded                ``occupy(g)``         rewarding -> done
reward failed           ``abort(g)``          rewarding -> failed
aborted (staleness GC)  ``abort(g)``          generating -> aborted (requests cancelled)
re-queued (proactive)   ``abort(g)``          generating -> aborted; the prompt pending again
consumed                ``consume()``         done -> consumed; dropped -> dropped
restored (checkpoint)   ``restore``           the checkpoint's states
======================  ====================  =======================================

The protocol is the :class:`~staleflow.protocol.StalenessManager` for every system that keeps the
bound. The peer systems that do not (AReaL, VeRL fully async: :class:`~staleflow.runtime.settings.policies.
SystemPolicy` ``consumption``) get a :class:`CompletionLedger` in its place: the same operations,
their own consumption order, no bound, so their staleness is measured as it happens in those
systems. It lives here so that one owner still changes every group, whichever accounting a run uses.

Everything else (the coordinator's decisions, the run loop's sequencing) only reads the protocol
and the trajectory server. ``live`` counts admitted groups that have not yet left without training
(AReaL's inflight cap counts exactly these).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from staleflow.protocol import ConsumedBatch, StalenessManager
from staleflow.protocol import GroupId as ProtocolGroupId
from staleflow.protocol.errors import ConsumeNotReadyError, InvalidVersionError
from staleflow.protocol.events import CounterState, EventHook, GroupRecord, GroupStatus
from staleflow.runtime.run.rewarding import RewardOutcome
from staleflow.runtime.servers.trajectory_server import FinishOutcome, GroupState, TrajectoryServer
from staleflow.runtime.types import Cancellations, GroupId, PromptGroup, RolloutRequest, TrainingBatch, Trajectory


def runtime_ids(group_ids: Iterable[ProtocolGroupId]) -> list[GroupId]:
    """Ids the protocol hands back, as the runtime's: it reserved only ``str`` ids."""
    return [str(g) for g in group_ids]


@dataclass(frozen=True)
class Consumed:
    """One consumed batch: the protocol's decision, the trainer's data and what to cancel;
    ``wasted_tokens``: response tokens of the finished trajectories of the groups dropped."""

    protocol: ConsumedBatch
    batch: TrainingBatch
    cancel: Cancellations
    wasted_tokens: int = 0


class CompletionLedger:
    """Unbounded accounting of the peer systems that train finished groups in their own order.

    The same operations as :class:`~staleflow.protocol.StalenessManager` (reserve, occupy, abort,
    consume), without its bound: ``reserve`` always admits (the peers' own caps are the
    coordinator's admission), and ``consume`` takes ``batch_size`` finished groups in ``order``:
    ``oldest_finished`` (AReaL's ``workflow_executor``: the oldest-admitted of the finished groups)
    or ``finish_order`` (VeRL's message queue: in the order they finished). With ``filter_stale``
    finished groups older than ``eta`` versions are dropped at consume instead of trained (AReaL's
    ``should_accept_fn``). A straggler never holds the trainer back; a group may be trained more
    than ``eta`` versions after its start, which the run measures and reports.
    """

    redundancy = 0

    def __init__(self, eta: int, batch_size: int, order: str, filter_stale: bool = False) -> None:
        if order not in ("oldest_finished", "finish_order"):
            raise ValueError(f"order must be oldest_finished or finish_order, got {order!r}")
        self.eta = eta
        self.batch_size = batch_size
        self.order = order
        self.filter_stale = filter_stale
        self.version = 0
        self._versions: dict[GroupId, int] = {}  # in admission order
        self._running: set[GroupId] = set()
        self._done: dict[GroupId, None] = {}  # in finish order

    def __len__(self) -> int:
        return len(self._versions)

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._versions

    def groups(self) -> Iterator[GroupRecord]:
        for group_id, version in self._versions.items():
            status = GroupStatus.RUNNING if group_id in self._running else GroupStatus.DONE
            yield GroupRecord(group_id, version, status)

    def counts(self) -> CounterState:
        return CounterState(self.version, (len(self._running),), (len(self._done),))

    def reserve_slack(self, version: int) -> int:
        """Unbounded: any version up to the newest admits (the caller's caps decide)."""
        if not 0 <= version <= self.version:
            raise InvalidVersionError(f"version {version} is not in 0..{self.version}")
        return self.batch_size

    def can_reserve(self, version: int) -> bool:
        return self.reserve_slack(version) > 0

    def reserve(self, group_id: GroupId, version: int) -> bool:
        self.reserve_slack(version)
        if group_id in self._versions:
            raise ValueError(f"group {group_id!r} is already active")
        self._versions[group_id] = version
        self._running.add(group_id)
        return True

    def occupy(self, group_id: GroupId) -> None:
        self._running.remove(group_id)
        self._done[group_id] = None

    def abort(self, group_id: GroupId) -> None:
        del self._versions[group_id]
        self._running.discard(group_id)
        self._done.pop(group_id, None)

    def _stale(self) -> list[GroupId]:
        return [g for g in self._done if self.filter_stale and self._versions[g] + self.eta < self.version]

    def can_consume(self) -> bool:
        return len(self._done) - len(self._stale()) >= self.batch_size

    def consume(self) -> ConsumedBatch:
        dropped = self._stale()
        fresh = len(self._done) - len(dropped)
        if fresh < self.batch_size:
            past = f" (and {len(dropped)} past eta, not trained)" if dropped else ""
            raise ConsumeNotReadyError(f"{fresh} finished groups{past}, {self.batch_size} needed")
        for group_id in dropped:
            del self._done[group_id]
        if self.order == "finish_order":
            taken = list(self._done)[: self.batch_size]
        else:
            rank = {g: i for i, g in enumerate(self._versions)}
            taken = sorted(self._done, key=rank.__getitem__)[: self.batch_size]
        for group_id in taken:
            del self._done[group_id]
        versions = tuple(self._versions.pop(g) for g in taken)
        for group_id in dropped:
            del self._versions[group_id]
        batch = ConsumedBatch(self.version, tuple(taken), versions, tuple(dropped))
        self.version += 1
        return batch

    def add_event_hook(self, hook: Any) -> None:
        raise ValueError(
            "this system trains in completion order without the staleness protocol: it emits no protocol "
            "events (traces, checkers and checkpoints are for systems that keep the bound)"
        )

    def snapshot(self) -> dict[str, Any]:
        raise ValueError("a completion-order system has no protocol snapshot (checkpoints need the protocol)")


class GroupLife:
    """Changes groups in the protocol and the trajectory server together (see the module table).

    Args:
        manager: the staleness protocol; the only authority on admission and consumption.
        trajectory_server: a local :class:`TrajectoryServer` or a proxy with the same methods.
    """

    def __init__(self, manager: StalenessManager | CompletionLedger, trajectory_server: TrajectoryServer) -> None:
        self.manager = manager
        self.ts = trajectory_server
        self.live = 0
        self.running = 0  # admitted groups still generating or rewarding (AReaL's ``running``)
        self.requeued = 0
        self.wasted_tokens = 0  # response tokens of finished trajectories never trained

    def add(self, groups: Iterable[PromptGroup]) -> None:
        """Prompt groups drawn from the dataset: they wait pending for admission."""
        self.ts.add_groups(groups)

    def admit(self, group_id: GroupId, version: int) -> list[RolloutRequest]:
        """Reserve ``group_id`` at ``version`` and queue its requests.

        The caller decided with :meth:`StalenessManager.can_reserve`; a refusal here is a bug in
        that decision and raises before the trajectory server changes.
        """
        if not self.manager.reserve(group_id, version):
            raise RuntimeError(f"protocol refused group {group_id!r} at version {version} after can_reserve")
        self.live += 1
        self.running += 1
        return self.ts.admit(group_id, version)

    def finish(self, instance_id: str, trajectory: Trajectory) -> FinishOutcome:
        """A request finished on ``instance_id``: kept if its group still needs it; the group's last
        needed response moves it to rewarding, and the outcome hands over the group to reward."""
        return self.ts.finish(instance_id, trajectory)

    def reward(self, outcome: RewardOutcome) -> bool:
        """Apply a reward outcome: Occupy, or (the scorer raised or timed out) Abort as failed.

        Returns False, changing nothing, if the group ended while its reward ran (it was dropped or
        aborted); True otherwise.
        """
        group_id = outcome.group_id
        if self.ts.group_state(group_id) is not GroupState.REWARDING:
            return False
        self.running -= 1
        if outcome.error is not None:
            self.ts.fail_group(group_id, outcome.error)
            self.manager.abort(group_id)
            self.live -= 1
        else:
            self.ts.set_rewards(group_id, outcome.rewards)
            self.manager.occupy(group_id)
        return True

    def abort(self, group_ids: Sequence[GroupId]) -> Cancellations:
        """Abort admitted groups that will not be trained; returns their running requests."""
        cancel: list[tuple[str, str]] = []
        for group_id in group_ids:
            if self.ts.group_state(group_id) in (GroupState.GENERATING, GroupState.REWARDING):
                self.running -= 1
            self.wasted_tokens += self._finished_tokens(group_id)
            self.manager.abort(group_id)
            cancel.extend(self.ts.abort_group(group_id))
        self.live -= len(group_ids)
        return tuple(cancel)

    def requeue(self, group_ids: Sequence[GroupId]) -> Cancellations:
        """Proactive abort: abort these generating groups and queue their prompts again (as new
        pending groups, ``<id>~r<n>``, sampled afresh: the prompt's next ``resamples`` entry, if it
        has one, becomes its ``sample_metadata``); returns their running requests."""
        prompts = [self.ts.group(g) for g in group_ids]
        cancel = self.abort(group_ids)
        for prompt in prompts:
            self.requeued += 1
            again = replace(prompt, group_id=f"{prompt.group_id.split('~')[0]}~r{self.requeued}", metadata=dict(prompt.metadata))
            if prompt.resamples:
                again = replace(again, sample_metadata=prompt.resamples[0], resamples=prompt.resamples[1:])
            self.ts.add_groups([again])
        return cancel

    def consume(self) -> Consumed:
        """Consume the next batch (the caller checked ``manager.can_consume()``)."""
        batch = self.manager.consume()
        dropped = runtime_ids(batch.dropped)
        wasted = sum(self._finished_tokens(g) for g in dropped)
        self.running -= sum(self.ts.group_state(g) in (GroupState.GENERATING, GroupState.REWARDING) for g in dropped)
        training_batch, cancel = self.ts.take_batch(batch.version, runtime_ids(batch.group_ids), dropped)
        self.live -= len(batch.dropped)
        self.wasted_tokens += wasted
        return Consumed(batch, training_batch, cancel, wasted)

    def _finished_tokens(self, group_id: GroupId) -> int:
        return sum(len(t.output_ids) for t in self.ts.trajectories(group_id))

    def generating_due(self, buffer_index: int) -> list[GroupId]:
        """Groups still generating whose deadline is ``buffer_index`` (read only)."""
        eta = self.manager.eta
        due = runtime_ids(g.group_id for g in self.manager.groups() if g.version + eta == buffer_index and g.status is GroupStatus.RUNNING)
        return [g for g in due if self.ts.group_state(g) is GroupState.GENERATING]

    # ----------------------------------------------------------------- checkpoints
    def restore(
        self, protocol_snapshot: Mapping[str, Any], server_state: Mapping[str, Any], event_hooks: Iterable[EventHook]
    ) -> None:
        """Replace the protocol by a restored one and the trajectory server's contents by ``server_state``."""
        self.manager = StalenessManager.restore(protocol_snapshot)
        for hook in event_hooks:
            self.manager.add_event_hook(hook)
        self.ts.load_state_dict(server_state)

    def state_dict(self) -> dict[str, Any]:
        return {"live": self.live, "running": self.running, "requeued": self.requeued, "wasted_tokens": self.wasted_tokens}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.live = int(state["live"])
        self.running = int(state.get("running", 0))
        self.requeued = int(state.get("requeued", 0))
        self.wasted_tokens = int(state.get("wasted_tokens", 0))

"""The one owner of a prompt group's life: protocol entry and trajectory-server state change together.

A group is admitted, rewarded, failed, aborted, consumed or dropped only here. Each method makes
the protocol transition (:class:`~staleflow.protocol.StalenessManager`: Reserve, Occupy, Abort,
Consume) and the matching trajectory-server transition in one call, so the two can never disagree:

======================  ====================  =======================================
event                   protocol              trajectory server
======================  ====================  =======================================
admitted at version v   ``reserve(g, v)``     pending -> generating (requests queued)
rewarded                ``occupy(g)``         rewarding -> done
reward failed           ``abort(g)``          rewarding -> failed
aborted (staleness GC)  ``abort(g)``          generating -> aborted (requests cancelled)
consumed                ``consume()``         done -> consumed; dropped -> dropped
======================  ====================  =======================================

Everything else (the coordinator's decisions, the run loop's sequencing) only reads the protocol
and the trajectory server. ``live`` counts admitted groups that have not yet left without training
(AReaL's inflight cap counts exactly these).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from staleflow.protocol import ConsumedBatch, StalenessManager
from staleflow.protocol.events import EventHook
from staleflow.runtime.rewarding import RewardOutcome
from staleflow.runtime.trajectory_server import GroupState, TrajectoryServer
from staleflow.runtime.types import RolloutRequest, TrainingBatch

#: ``(instance_id, request_id)`` pairs of running requests a transition cancelled (to abort).
Cancellations = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Consumed:
    """One consumed batch: the protocol's decision, the trainer's data and what to cancel."""

    protocol: ConsumedBatch
    batch: TrainingBatch
    cancel: Cancellations


class GroupLife:
    """Changes groups in the protocol and the trajectory server together (see the module table).

    Args:
        manager: the staleness protocol; the only authority on admission and consumption.
        trajectory_server: a local :class:`TrajectoryServer` or a proxy with the same methods.
    """

    def __init__(self, manager: StalenessManager, trajectory_server: TrajectoryServer) -> None:
        self.manager = manager
        self.ts = trajectory_server
        self.live = 0

    def admit(self, group_id: str, version: int) -> list[RolloutRequest]:
        """Reserve ``group_id`` at ``version`` and queue its requests.

        The caller decided with :meth:`StalenessManager.can_reserve`; a refusal here is a bug in
        that decision and raises before the trajectory server changes.
        """
        if not self.manager.reserve(group_id, version):
            raise RuntimeError(f"protocol refused group {group_id!r} at version {version} after can_reserve")
        self.live += 1
        return self.ts.admit(group_id, version)

    def reward(self, outcome: RewardOutcome) -> bool:
        """Apply a reward outcome: Occupy, or (the scorer raised or timed out) Abort as failed.

        Returns False, changing nothing, if the group ended while its reward ran (it was dropped or
        aborted); True otherwise.
        """
        group_id = outcome.group_id
        if self.ts.group_state(group_id) is not GroupState.REWARDING:
            return False
        if outcome.error is not None:
            self.ts.fail_group(group_id, outcome.error)
            self.manager.abort(group_id)
            self.live -= 1
        else:
            self.ts.set_rewards(group_id, outcome.rewards)
            self.manager.occupy(group_id)
        return True

    def abort(self, group_ids: Sequence[str]) -> Cancellations:
        """Abort admitted groups that will not be trained; returns their running requests."""
        cancel: list[tuple[str, str]] = []
        for group_id in group_ids:
            self.manager.abort(group_id)
            cancel.extend(self.ts.abort_group(group_id))
        self.live -= len(group_ids)
        return tuple(cancel)

    def consume(self) -> Consumed:
        """Consume the next batch (the caller checked ``manager.can_consume()``)."""
        batch = self.manager.consume()
        training_batch, cancel = self.ts.take_batch(
            batch.version, [str(g) for g in batch.group_ids], [str(g) for g in batch.dropped]
        )
        self.live -= len(batch.dropped)
        return Consumed(batch, training_batch, cancel)

    def generating_due(self, buffer_index: int) -> list[str]:
        """Groups still generating whose deadline is ``buffer_index`` (read only)."""
        eta = self.manager.eta
        return [
            str(g.group_id)
            for g in self.manager.groups()
            if g.version + eta == buffer_index and self.ts.group_state(str(g.group_id)) is GroupState.GENERATING
        ]

    # ----------------------------------------------------------------- checkpoints
    def restore(self, protocol_snapshot: Mapping[str, Any], event_hooks: Iterable[EventHook]) -> None:
        """Replace the protocol by a restored one (the trajectory server is restored by its owner)."""
        self.manager = StalenessManager.restore(protocol_snapshot)
        for hook in event_hooks:
            self.manager.add_event_hook(hook)

    def state_dict(self) -> dict[str, Any]:
        return {"live": self.live}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.live = int(state["live"])

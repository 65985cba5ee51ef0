"""AReaL 1.0.4's ``StalenessManager`` interface driven by the protocol (:class:`ProtocolStalenessManager`),
the piece of ``staleflow_protocol.bindings.areal`` that AReaL's dispatcher calls."""

from __future__ import annotations

import threading
from typing import Any, Optional

from areal.api import RolloutStat
from areal.infra import workflow_context

from ..locked import LockedStalenessManager


def rank_batch_size(consumer_batch_size: int, data_parallel_size: int = 1) -> int:
    """AReaL's per-rank consumer batch: ``consumer_batch_size // data_parallel_size``, at least 1 (AReaL
    clamps 0 to 1, so a job whose batch is smaller than its data-parallel size runs 1 per rank)."""
    return max(1, consumer_batch_size // data_parallel_size)


def check_protocol_matches(protocol: LockedStalenessManager, max_staleness: int, consumer_batch_size: int,
                           data_parallel_size: int = 1) -> None:
    """Refuse a protocol whose eta is not ``max_staleness`` (AReaL's ``max_head_offpolicyness``) or whose
    batch size is not AReaL's per-rank ``consumer_batch_size`` (:func:`rank_batch_size`), naming both values:
    otherwise the bound or the trained batch silently changes."""
    rank_batch = rank_batch_size(consumer_batch_size, data_parallel_size)
    mismatches = []
    if protocol.eta != max_staleness:
        mismatches.append(f"the protocol's eta is {protocol.eta} but AReaL's max_head_offpolicyness is {max_staleness}")
    if protocol.batch_size != rank_batch:
        if data_parallel_size != 1:
            split = f" // {data_parallel_size} data-parallel ranks = {rank_batch}"
        else:
            split = f" (AReaL runs {rank_batch})" if rank_batch != consumer_batch_size else ""
        mismatches.append(f"the protocol's batch_size is {protocol.batch_size} but AReaL's consumer_batch_size is "
                          f"{consumer_batch_size}{split}")
    if mismatches:
        raise ValueError("protocol and AReaL rollout config disagree: " + "; ".join(mismatches))


class ProtocolStalenessManager:
    """AReaL's ``StalenessManager`` driven by the protocol (thread-safe), built from AReaL's own arguments.

    ``version_provider``, ``max_concurrent_rollouts``, ``consumer_batch_size`` and ``max_staleness`` are
    AReaL's (kept as its public attributes): ``max_concurrent_rollouts`` caps the running rollouts (0 counts
    as 1, as in AReaL), and the protocol's eta is ``max_staleness`` and its batch size ``consumer_batch_size``
    (0 counts as 1). ``protocol``: the staleness manager to drive (it must have that eta and batch size,
    :func:`check_protocol_matches`); a new one when None.

    AReaL calls it from its producer thread (``get_capacity``, ``on_rollout_submitted``), from the
    event loop running the episodes (``on_rollout_accepted`` / ``rejected``) and from the trainer's
    thread. ``version_provider`` is the inference engine or controller (``get_version()``).
    ``consumes=False`` marks a rank that never consumes (SPMD mode under model parallelism: only
    data-parallel heads draw prompts, the other ranks of a head's group receive its batch).
    """

    def __init__(self, version_provider: Any, max_concurrent_rollouts: int, consumer_batch_size: int, max_staleness: int,
                 *, protocol: Optional[LockedStalenessManager] = None, consumes: bool = True) -> None:
        if protocol is None:
            protocol = LockedStalenessManager.create(eta=max_staleness, batch_size=rank_batch_size(consumer_batch_size))
        check_protocol_matches(protocol, max_staleness, consumer_batch_size)
        self.protocol = protocol
        self.version_provider = version_provider
        self.max_concurrent_rollouts = max_concurrent_rollouts
        self.consumer_batch_size = consumer_batch_size
        self.max_staleness = max_staleness
        self.consumes = consumes
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._stat = RolloutStat()
        self._unreserved = 0  # submitted to the runner, episode not started: capacity they will take
        self._untracked = 0  # accepted without a task id in AReaL's context: counted as AReaL counts them
        self._started: set[int] = set()  # tasks whose episode asked for a reservation
        self._reserved: set[int] = set()  # tasks the protocol admitted
        self._finished: set[int] = set()  # tasks whose result AReaL has (accepted or rejected)
        self._rejected: list[tuple[int, bool]] = []  # (task, refused at start) to collect
        self._errors: list[BaseException] = []

    # ------------------------------------------------------------- AReaL's StalenessManager API
    def get_pending_limit(self) -> int:
        """At most this many tasks wait for admission: all the protocol can ever hold."""
        return self.protocol.capacity(self.protocol.eta)

    def get_capacity(self) -> int:
        """New episodes the protocol would admit now at the engine's version (minus those starting),
        capped by ``max_concurrent_rollouts`` minus the running ones, as AReaL caps them."""
        version = min(int(self.version_provider.get_version()), self.protocol.version)
        slack = self.protocol.reserve_slack(version)
        with self._lock:
            running: int = self._stat.running
            return min(slack - self._unreserved - self._untracked, max(1, self.max_concurrent_rollouts) - running)

    def on_rollout_enqueued(self) -> None:
        with self._lock:
            self._stat.enqueued += 1

    def on_rollout_submitted(self) -> None:
        with self._lock:
            self._stat.enqueued -= 1
            self._stat.running += 1
            self._unreserved += 1

    def on_rollout_accepted(self) -> None:
        """The episode returned a trajectory that ``should_accept_fn`` kept: the group is done."""
        self._finish(workflow_context.get().task_id, accepted=True)

    def on_rollout_rejected(self) -> None:
        """The episode returned None, was filtered, failed, or was refused admission."""
        self._finish(workflow_context.get().task_id, accepted=False)

    def on_version_recovered(self, version: int) -> None:
        """AReaL's resume hook (RLTrainer calls it after recover, on every rank): the protocol must match.
        A rank that never consumes has an idle protocol at version 0 whatever the step: it must hold
        nothing, and there is nothing to match."""
        if not self.consumes:
            if self.protocol.version != 0 or len(self.protocol):
                raise ValueError(f"a rank that never consumes has a protocol at version {self.protocol.version} "
                                 f"holding {len(self.protocol)} group(s): it was used for training")
            return
        if version != self.protocol.version:
            raise ValueError(
                f"recovered model version {version} but the protocol is at {self.protocol.version}: "
                "restore the protocol snapshot saved with the checkpoint (RecoverableLoader)"
            )

    def get_stats(self) -> RolloutStat:
        with self._lock:
            s = self._stat
            return RolloutStat(accepted=s.accepted, enqueued=s.enqueued, rejected=s.rejected, running=s.running)

    # ------------------------------------------------------------- protocol side
    def admit(self, task_id: int, version: int) -> bool:
        """Reserve the group of ``task_id`` at ``version`` (when its episode starts)."""
        with self._lock:
            if task_id not in self._started:
                self._started.add(task_id)
                self._unreserved -= 1
        try:
            admitted = self.protocol.reserve(task_id, version)
        except Exception as error:  # e.g. an engine ahead of the trainer: surface it to the trainer
            with self._changed:
                self._errors.append(error)
                self._changed.notify_all()
            raise
        if admitted:
            with self._lock:
                self._reserved.add(task_id)
        return admitted

    def _finish(self, task_id: Optional[int], accepted: bool) -> None:
        with self._lock:
            self._stat.running -= 1
            self._stat.accepted += accepted
            self._stat.rejected += not accepted
            # an episode that never asked for admission (evaluation) is not the protocol's: its place is
            # given back; one without AReaL's task context (callbacks played by hand) is counted as AReaL
            # counts it, an accepted one keeping its place against the capacity
            wrapped = task_id in self._started
            if not wrapped:
                self._unreserved -= 1
                self._untracked += task_id is None and accepted
            reserved = task_id in self._reserved
        if task_id is None or not wrapped:
            return
        if reserved:
            with self.protocol.locked() as manager:  # consume may have dropped it meanwhile
                if task_id in manager:
                    (manager.occupy if accepted else manager.abort)(task_id)
        with self._changed:
            self._finished.add(task_id)
            if not accepted:
                self._rejected.append((task_id, not reserved))
            self._changed.notify_all()

    def wait_for_change(self, timeout: float) -> None:
        with self._changed:
            self._changed.wait(timeout)

    def raise_errors(self) -> None:
        with self._lock:
            if self._errors:
                raise RuntimeError(f"protocol error in a rollout: {self._errors[0]}") from self._errors[0]

    def take_rejected(self) -> list[tuple[int, bool]]:
        """Finished tasks without a trajectory to train: ``(task id, refused at episode start)``."""
        with self._lock:
            rejected, self._rejected = self._rejected, []
            return rejected

    def is_finished(self, task_id: int) -> bool:
        with self._lock:
            return task_id in self._finished

    def forget(self, task_id: int) -> None:
        """Drop the bookkeeping of a task whose result has been collected."""
        with self._lock:
            for tasks in (self._started, self._reserved, self._finished):
                tasks.discard(task_id)

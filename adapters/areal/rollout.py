"""The AReaL binding: a staleness manager, a workflow wrapper and a batch source (see ``__init__``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from areal.api import RolloutStat, RolloutWorkflow
from areal.infra import workflow_context
from areal.infra.workflow_executor import WorkflowExecutor
from staleflow.protocol import ConsumedBatch, LockedStalenessManager


class ProtocolStalenessManager:
    """Drop-in for ``areal.infra.staleness_manager.StalenessManager`` driven by the protocol.

    ``WorkflowExecutor`` calls it from its producer thread (``get_capacity``, ``on_rollout_submitted``),
    from the event loop running the episodes (``on_rollout_accepted`` / ``rejected``) and from the
    caller's thread; the protocol is a :class:`LockedStalenessManager` and the counters have their
    own lock. ``version_provider`` is the inference engine (``get_version()``).
    """

    def __init__(
        self,
        protocol: LockedStalenessManager,
        version_provider: Any,
        max_concurrent_rollouts: int | None = None,
    ) -> None:
        self.protocol = protocol
        self.version_provider = version_provider
        self.max_concurrent_rollouts = max_concurrent_rollouts
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._stat = RolloutStat()
        self._unreserved = 0  # submitted to the runner, episode not started: capacity they will take
        self._started: set[int] = set()  # tasks whose episode asked for a reservation
        self._reserved: set[int] = set()  # tasks the protocol admitted (active or consumed/dropped)
        self._finished: set[int] = set()  # tasks whose result AReaL has (accepted or rejected)
        self._rejected: list[int] = []  # finished tasks whose (None) result must be collected
        self._errors: list[BaseException] = []

    # ------------------------------------------------------------- AReaL's StalenessManager API
    def get_pending_limit(self) -> int:
        """At most this many tasks may wait for admission: all the protocol can ever hold."""
        return self.protocol.capacity(self.protocol.eta)

    def get_capacity(self) -> int:
        """New episodes the protocol would admit now at the engine's version (minus those in flight)."""
        version = min(int(self.version_provider.get_version()), self.protocol.version)
        slack = self.protocol.reserve_slack(version)
        with self._lock:
            capacity = slack - self._unreserved
            if self.max_concurrent_rollouts:
                capacity = min(capacity, self.max_concurrent_rollouts - self._stat.running)
            return capacity

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
        task_id = self._current_task()
        self._finish(task_id, accepted=True)

    def on_rollout_rejected(self) -> None:
        """The episode returned None, was filtered, failed, or was refused admission: abort it."""
        task_id = self._current_task()
        self._finish(task_id, accepted=False)

    def on_version_recovered(self, version: int) -> None:
        """AReaL's checkpoint-resume hook: the protocol must have been restored from its snapshot."""
        if version != self.protocol.version:
            raise ValueError(
                f"recovered model version {version} but the protocol is at {self.protocol.version}: "
                "restore the protocol snapshot saved with the checkpoint (LockedStalenessManager.restore)"
            )

    def get_stats(self) -> RolloutStat:
        with self._lock:
            s = self._stat
            return RolloutStat(accepted=s.accepted, enqueued=s.enqueued, rejected=s.rejected, running=s.running)

    # ------------------------------------------------------------- protocol side
    def admit(self, task_id: int, version: int) -> bool:
        """Reserve the group of ``task_id`` at ``version`` (called when the episode starts)."""
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

    def _current_task(self) -> int | None:
        return workflow_context.get().task_id

    def _finish(self, task_id: int | None, accepted: bool) -> None:
        with self._lock:
            self._stat.running -= 1
            if accepted:
                self._stat.accepted += 1
            else:
                self._stat.rejected += 1
            # a task that never reached ProtocolWorkflow (an evaluation episode, or a workflow the
            # host submitted without ProtocolBatches) is not the protocol's: only release its slot
            wrapped = task_id in self._started
            if task_id is not None and not wrapped:
                self._unreserved -= 1
            reserved = task_id in self._reserved
        if task_id is None or not wrapped:
            return
        if reserved:
            with self.protocol.locked() as manager:  # consume may have dropped it meanwhile
                if task_id in manager:
                    if accepted:
                        manager.occupy(task_id)
                    else:
                        manager.abort(task_id)
        with self._changed:
            self._finished.add(task_id)
            if not accepted:
                self._rejected.append(task_id)
            self._changed.notify_all()

    def wait_for_change(self, timeout: float) -> None:
        with self._changed:
            self._changed.wait(timeout)

    def raise_errors(self) -> None:
        with self._lock:
            if self._errors:
                raise RuntimeError(f"protocol error in a rollout: {self._errors[0]}") from self._errors[0]

    def take_rejected(self) -> list[int]:
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


class ProtocolWorkflow(RolloutWorkflow):
    """Wraps the host's workflow: reserve at the engine's version when AReaL starts the episode.

    A refused reservation returns None (AReaL counts the task rejected; the refusal is in the
    protocol trace). Evaluation episodes (``is_eval``) bypass the protocol.
    """

    def __init__(self, inner: RolloutWorkflow, staleness: ProtocolStalenessManager) -> None:
        self.inner = inner
        self.staleness = staleness

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
        context = workflow_context.get()
        if not context.is_eval:
            assert context.task_id is not None, "ProtocolWorkflow runs inside AReaL's WorkflowExecutor"
            if not self.staleness.admit(context.task_id, int(engine.get_version())):
                return None
        return await self.inner.arun_episode(engine, data)


@dataclass(frozen=True)
class TrainBatch:
    """One consumed batch and its trajectories, ``trajectories[i]`` being task ``batch.group_ids[i]``."""

    batch: ConsumedBatch
    trajectories: list[dict[str, Any]]


class ProtocolBatches:
    """Replaces ``WorkflowExecutor.prepare_batch``: train exactly what the protocol consumes.

    Keeps up to ``get_pending_limit()`` tasks submitted through AReaL's ``submit`` (AReaL's producer
    thread admits them as the protocol's capacity allows), waits until ``consume()`` is enabled,
    then fetches each consumed task with AReaL's ``wait_for_task``. Tasks dropped by the protocol
    (``redundancy > 0``) and rejected tasks are collected and discarded, never trained.
    """

    def __init__(
        self,
        executor: WorkflowExecutor,
        staleness: ProtocolStalenessManager,
        workflow: RolloutWorkflow,
        data: Iterator[dict[str, Any]],
        should_accept_fn: Callable[[dict[str, Any]], bool] | None = None,
    ) -> None:
        self.executor = executor
        self.staleness = staleness
        self.workflow = ProtocolWorkflow(workflow, staleness)
        self.data = data
        self.should_accept_fn = should_accept_fn
        self._outstanding: set[int] = set()  # submitted, result not collected
        self._discard: set[int] = set()  # results to collect and throw away

    def prepare_batch(self, timeout: float = 300.0) -> TrainBatch:
        deadline = time.monotonic() + timeout
        protocol = self.staleness.protocol
        while True:
            self.staleness.raise_errors()
            self._collect_discarded()
            self._top_up()
            batch = protocol.try_consume()
            if batch is not None:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"no batch after {timeout} s; protocol counts {protocol.counts()}")
            self.staleness.wait_for_change(0.05)
        # capacity grew: wake AReaL's producer thread, which sleeps until its queue changes
        if not self.executor.is_paused():
            self.executor.resume()
        trajectories = []
        for group_id in batch.group_ids:
            task_id = int(group_id)  # the protocol's group ids are AReaL's task ids
            trajectory = self.executor.wait_for_task(task_id, timeout=max(1.0, deadline - time.monotonic()))
            if trajectory is None:
                raise RuntimeError(f"task {task_id} was consumed by the protocol but AReaL has no trajectory")
            trajectories.append(trajectory)
            self._outstanding.discard(task_id)
            self.staleness.forget(task_id)
        self._discard.update(int(group_id) for group_id in batch.dropped)
        return TrainBatch(batch, trajectories)

    def _top_up(self) -> None:
        while len(self._outstanding) < self.staleness.get_pending_limit():
            task_id = self.executor.submit(
                data=next(self.data), workflow=self.workflow, should_accept_fn=self.should_accept_fn
            )
            self._outstanding.add(task_id)

    def _collect_discarded(self) -> None:
        self._discard.update(self.staleness.take_rejected())
        for task_id in list(self._discard):
            if self.staleness.is_finished(task_id):
                self.executor.wait_for_task(task_id, timeout=30.0)
                self._discard.discard(task_id)
                self._outstanding.discard(task_id)
                self.staleness.forget(task_id)

    @property
    def outstanding(self) -> int:
        return len(self._outstanding)

"""StaleFlow's protocol as a drop-in for AReaL 1.0.4 (``pip install --no-deps ./protocol`` beside AReaL).

Imports ``areal`` and this package only. AReaL's rollout machinery runs unchanged (its dispatcher
threads, async task runner and the host's ``RolloutWorkflow``); its count-based staleness control
is replaced by the protocol at AReaL's own extension points (docs/integrating.md, "AReaL"):

- :class:`ProtocolStalenessManager` stands in for ``areal.infra.staleness_manager.StalenessManager``:
  ``get_capacity`` is the protocol's reserve slack at the engine's version; the completion callbacks
  become ``occupy`` / ``abort`` of the task id AReaL keeps in its ``workflow_context``;
- :class:`ProtocolWorkflowExecutor` is AReaL's ``WorkflowExecutor`` (the path of ``RemoteInfEngine``:
  :func:`use_protocol` swaps it in after ``engine.initialize``) and :class:`ProtocolRolloutController`
  its ``RolloutController`` (the single-controller default path): both reserve a task when its
  episode starts, at the engine's version, and their ``prepare_batch`` (RLTrainer's arguments) returns
  exactly the trajectories of the protocol's consumed batch;
- :class:`ProtocolBatches` is the batch source both use: task ids are group ids, a task refused at
  episode start gives its prompt back (it is submitted again, never lost), and ``state_dict`` /
  ``load_state_dict`` carry the protocol snapshot and the untrained prompts through AReaL's recover
  machinery (wrap the train dataloader in :class:`RecoverableLoader`).
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

from areal.api import RolloutStat, RolloutWorkflow
from areal.infra import RolloutController, workflow_context
from areal.infra.workflow_context import WorkflowContext
from areal.infra.workflow_executor import WorkflowExecutor
from areal.utils.data import cycle_dataloader

from ..events import ConsumedBatch
from ..locked import LockedStalenessManager
from ..trace_file import TraceFile

TracePath = Union[str, Path]
#: ``submit(data, task_id)``: hand one prompt to AReaL under the given task id.
Submit = Callable[[Any, int], Any]


class ProtocolStalenessManager:
    """AReaL's ``StalenessManager`` interface driven by the protocol (thread-safe).

    AReaL calls it from its producer thread (``get_capacity``, ``on_rollout_submitted``), from the
    event loop running the episodes (``on_rollout_accepted`` / ``rejected``) and from the trainer's
    thread. ``version_provider`` is the inference engine or controller (``get_version()``).
    """

    def __init__(self, protocol: LockedStalenessManager, version_provider: Any, max_concurrent_rollouts: Optional[int] = None) -> None:
        self.protocol = protocol
        self.version_provider = version_provider
        self.max_concurrent_rollouts = max_concurrent_rollouts
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._stat = RolloutStat()
        self._unreserved = 0  # submitted to the runner, episode not started: capacity they will take
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
        """New episodes the protocol would admit now at the engine's version (minus those starting)."""
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
        self._finish(workflow_context.get().task_id, accepted=True)

    def on_rollout_rejected(self) -> None:
        """The episode returned None, was filtered, failed, or was refused admission."""
        self._finish(workflow_context.get().task_id, accepted=False)

    def on_version_recovered(self, version: int) -> None:
        """AReaL's resume hook (RLTrainer calls it after recover): the protocol must match."""
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
            # an episode that never asked for admission (evaluation) is not the protocol's
            wrapped = task_id in self._started
            if task_id is not None and not wrapped:
                self._unreserved -= 1
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


class ProtocolWorkflow(RolloutWorkflow):
    """Wraps the host's workflow (executor path): reserve at the engine's version when the episode
    starts; a refusal returns None (AReaL counts it rejected; :class:`ProtocolBatches` resubmits the
    prompt). Evaluation episodes bypass the protocol."""

    def __init__(self, inner: Any, staleness: ProtocolStalenessManager) -> None:
        self.inner = inner
        self.staleness = staleness

    async def arun_episode(self, engine: Any, data: Any) -> Any:
        context = workflow_context.get()
        if not context.is_eval:
            if context.task_id is None:
                raise RuntimeError("ProtocolWorkflow runs inside AReaL's WorkflowExecutor (no task id)")
            if not self.staleness.admit(context.task_id, int(engine.get_version())):
                return None
        return await self.inner.arun_episode(engine, data)


@dataclass(frozen=True)
class TrainBatch:
    """One consumed batch: ``trajectories[i]`` is task ``batch.group_ids[i]``'s. ``dropped_prompts``
    are the prompts of the tasks ``batch.dropped`` names: the protocol dropped them (``redundancy``
    surplus whose deadline passed), so they are spent, as a prompt ``should_accept_fn`` filters is."""

    batch: ConsumedBatch
    trajectories: list[Any]
    dropped_prompts: list[Any]


class ProtocolBatches:
    """Train exactly what the protocol consumes (AReaL's own consumer takes the oldest finished).

    Keeps up to ``get_pending_limit()`` tasks submitted under its own task ids (a counter: the group
    ids), waits until ``consume()`` is enabled, then fetches each consumed task with AReaL's
    ``wait_for_task``. Dropped and rejected tasks are collected and thrown away; the prompt of a task
    refused at episode start is submitted again before any new prompt. ``trace_path``: a JSONL
    protocol trace, opened by the first :meth:`prepare` (a new file) or by :meth:`load_state_dict`
    (a new segment appended): a recovered life continues the trace its predecessor wrote.
    """

    def __init__(self, staleness: ProtocolStalenessManager, wait_for_task: Callable[..., Any], wake: Callable[[], None],
                 trace_path: Optional[TracePath] = None) -> None:
        self.staleness = staleness
        self.wait_for_task = wait_for_task
        self.wake = wake
        self.trace = TraceFile(trace_path)
        self.next_task_id = 0
        self.last: Optional[TrainBatch] = None
        self._prompts: dict[int, Any] = {}  # submitted, result not collected: task id -> prompt
        self._retry: collections.deque[Any] = collections.deque()  # prompts to submit before new ones
        self._discard: set[int] = set()  # results to collect and throw away
        self._loader_batches: Optional[Iterator[Any]] = None  # the dataloader's batches, cycled
        # prompts of the loader batch last drawn, not submitted yet: the loader's own state counts them
        # as handed out, so a checkpoint must carry them (state_dict) or they would be lost
        self._drawn: collections.deque[Any] = collections.deque()

    @property
    def protocol(self) -> LockedStalenessManager:
        return self.staleness.protocol

    def prepare(self, dataloader: Any, submit: Submit, timeout: float = 300.0) -> list[Any]:
        """The next consumed batch's trajectories (also ``self.last``), prompts drawn from ``dataloader``
        (cycled, cached on the first call as AReaL's ``prepare_batch`` does)."""
        if self._loader_batches is None:
            self._loader_batches = iter(cycle_dataloader(dataloader))
            self.trace.start(self.protocol)
        deadline = time.monotonic() + timeout
        while True:
            self.staleness.raise_errors()
            self._collect_discarded()
            self._top_up(submit)
            batch = self.protocol.try_consume()
            if batch is not None:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"no batch after {timeout} s; protocol counts {self.protocol.counts()}")
            self.staleness.wait_for_change(0.05)
        self.wake()  # capacity grew: AReaL's producer thread sleeps until its queue changes
        trajectories = []
        for group_id in batch.group_ids:
            task_id = int(group_id)
            trajectory = self.wait_for_task(task_id, timeout=max(1.0, deadline - time.monotonic()))
            if trajectory is None:
                raise RuntimeError(f"task {task_id} was consumed by the protocol but AReaL has no trajectory")
            trajectories.append(trajectory)
            del self._prompts[task_id]
            self.staleness.forget(task_id)
        dropped = [int(group_id) for group_id in batch.dropped]
        self._discard.update(dropped)
        self.last = TrainBatch(batch, trajectories, [self._prompts[task_id] for task_id in dropped])
        return trajectories

    def _top_up(self, submit: Submit) -> None:
        while len(self._prompts) < self.staleness.get_pending_limit():
            data = self._retry.popleft() if self._retry else self._next_prompt()
            task_id, self.next_task_id = self.next_task_id, self.next_task_id + 1
            self._prompts[task_id] = data
            submit(data, task_id)

    def _next_prompt(self) -> Any:
        assert self._loader_batches is not None
        while not self._drawn:
            self._drawn.extend(next(self._loader_batches))
        return self._drawn.popleft()

    def _collect_discarded(self) -> None:
        for task_id, refused in self.staleness.take_rejected():
            self._discard.add(task_id)
            if refused:  # never burn a prompt on a refusal: it is tried again
                self._retry.append(self._prompts[task_id])
        for task_id in list(self._discard):
            if self.staleness.is_finished(task_id):
                self.wait_for_task(task_id, timeout=30.0, raise_timeout=False)
                self._discard.discard(task_id)
                self._prompts.pop(task_id, None)
                self.staleness.forget(task_id)

    @property
    def outstanding(self) -> int:
        return len(self._prompts)

    # ------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The protocol snapshot and every prompt not yet trained (to retry, in flight, drawn from the
        loader and not submitted yet)."""
        return {"protocol": self.protocol.snapshot(), "next_task_id": self.next_task_id,
                "prompts": [*self._retry, *self._prompts.values(), *self._drawn]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore before any task is submitted: the protocol from its snapshot; its unconsumed groups
        died with the old process, so each is aborted (traced) and its prompt submitted again."""
        if self._prompts or self._loader_batches is not None:
            raise RuntimeError("load_state_dict must come before the first prepare_batch")
        protocol = LockedStalenessManager.restore(state["protocol"])
        self.staleness.protocol = protocol
        self.trace.resume(protocol)
        for group in protocol.groups():
            protocol.abort(group.group_id)
        self.next_task_id = int(state["next_task_id"])
        self._retry.extend(state["prompts"])

    def close(self) -> None:
        self.trace.close()


class RecoverableLoader:
    """The train dataloader as AReaL's recover machinery sees it: ``RecoverHandler.dump`` saves
    ``dataloader.state_dict()`` per data-parallel rank, ``load`` restores it; this wrapper adds the
    protocol's state (:meth:`ProtocolBatches.state_dict`). Everything else goes to the loader.

    ``batches`` may be bound later (:meth:`bind`): RLTrainer builds its dataloader before its rollout;
    a protocol state loaded before then is applied when the batches are bound."""

    def __init__(self, loader: Any, batches: Optional[ProtocolBatches] = None) -> None:
        self.loader = loader
        self.batches = batches
        self._pending: Optional[dict[str, Any]] = None  # protocol state loaded before bind

    def bind(self, batches: ProtocolBatches) -> None:
        self.batches = batches
        if self._pending is not None:
            state, self._pending = self._pending, None
            batches.load_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        if self.batches is None:
            raise RuntimeError("RecoverableLoader has no ProtocolBatches bound: nothing to save the protocol from")
        return {"loader": self.loader.state_dict(), "staleflow_protocol": self.batches.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state["loader"])
        if self.batches is None:
            self._pending = state["staleflow_protocol"]
        else:
            self.batches.load_state_dict(state["staleflow_protocol"])

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class ProtocolWorkflowExecutor(WorkflowExecutor):
    """AReaL's ``WorkflowExecutor`` with the protocol's staleness control and batches.

    ``prepare_batch`` has the executor's signature (``RemoteInfEngine.prepare_batch``, which RLTrainer
    calls with ``workflow_kwargs`` and ``group_size``, resolves the workflow and passes the rest);
    ``dynamic_bs`` is accepted and has no effect: a protocol batch is always ``batch_size`` groups.
    """

    def __init__(self, config: Any, inference_engine: Any, protocol: LockedStalenessManager,
                 trace_path: Optional[TracePath] = None) -> None:
        self.staleness = ProtocolStalenessManager(protocol, inference_engine, config.max_concurrent_rollouts)
        super().__init__(config, inference_engine, staleness_manager=self.staleness)
        self.batches = ProtocolBatches(self.staleness, self.wait_for_task, self._wake, trace_path)

    def initialize(self, logger: Any = None, train_data_parallel_size: Optional[int] = None) -> None:
        """AReaL's ``initialize``. ``max_concurrent_rollouts`` is the trainer's, over its data-parallel
        ranks: as AReaL's own manager does, this rank's executor caps its share ``max_concurrent_rollouts // dp``
        (``dp``: ``train_data_parallel_size``, else AReaL's from ``torch.distributed``)."""
        if self.config.max_concurrent_rollouts:
            dp = train_data_parallel_size if train_data_parallel_size is not None else self._resolve_dp_world_size()
            self.staleness.max_concurrent_rollouts = max(1, self.config.max_concurrent_rollouts // dp)
        super().initialize(logger=logger, train_data_parallel_size=train_data_parallel_size)

    def _wake(self) -> None:
        if not self.is_paused():
            self.resume()

    def prepare_batch(self, dataloader: Any, workflow: Any, should_accept_fn: Any = None, dynamic_bs: bool = False) -> list[Any]:
        wrapped = ProtocolWorkflow(workflow, self.staleness)
        return self.batches.prepare(
            dataloader, lambda data, task_id: self.submit(data=data, workflow=wrapped, should_accept_fn=should_accept_fn, task_id=task_id))

    def destroy(self) -> None:
        super().destroy()
        self.batches.close()


def executor_owner(engine: Any) -> Any:
    """The engine that owns the executor: ``engine`` itself (a ``RemoteInfEngine``), or the
    ``RemoteInfEngine`` that AReaL's ``RemoteSGLangEngine`` / ``RemotevLLMEngine`` wrap (composition, in
    ``_engine``): theirs expose ``workflow_executor`` read-only and delegate to the wrapped engine."""
    declared = getattr(type(engine), "workflow_executor", None)
    if isinstance(declared, property) and declared.fset is None:
        return engine._engine
    return engine


def use_protocol(engine: Any, protocol: LockedStalenessManager, trace_path: Optional[TracePath] = None,
                 train_data_parallel_size: Optional[int] = None) -> ProtocolWorkflowExecutor:
    """After ``engine.initialize(...)`` (a ``RemoteInfEngine``, which builds its own executor, or one of
    AReaL's engines wrapping it, :func:`executor_owner`): replace that executor with a
    :class:`ProtocolWorkflowExecutor` through the owner's ``workflow_executor`` setter. The engine's
    ``prepare_batch``, ``submit`` and ``wait`` then go through the protocol."""
    owner = executor_owner(engine)
    old = owner.workflow_executor
    executor = ProtocolWorkflowExecutor(owner.config, owner, protocol, trace_path)
    executor.initialize(logger=old.logger, train_data_parallel_size=train_data_parallel_size)
    old.destroy()
    owner.workflow_executor = executor
    return executor


class ProtocolRolloutController(RolloutController):
    """AReaL's ``RolloutController`` (the single-controller path) with the protocol.

    ``initialize`` builds AReaL's controller, then gives its dispatcher a
    :class:`ProtocolStalenessManager`; each task is reserved when the dispatcher starts it, at the
    controller's version (the version its workers run); ``prepare_batch`` has RLTrainer's arguments.
    """

    def __init__(self, *args: Any, protocol: LockedStalenessManager, trace_path: Optional[TracePath] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.protocol = protocol
        self.trace_path = trace_path

    def initialize(self, *args: Any, **kwargs: Any) -> None:
        super().initialize(*args, **kwargs)
        self.staleness = ProtocolStalenessManager(self.protocol, self, self.config.max_concurrent_rollouts)
        self._staleness_manager = self.staleness
        self.dispatcher.staleness_manager = self.staleness
        self.batches = ProtocolBatches(self.staleness, self._wait_for_trajectory, self._wake, self.trace_path)

    def _wait_for_trajectory(self, task_id: int, timeout: float, raise_timeout: bool = True) -> Any:
        result = self.dispatcher.wait_for_task(task_id, timeout, raise_timeout)
        return None if result is None else result.trajectory

    def _wake(self) -> None:
        if not self.dispatcher.is_paused():
            self.dispatcher.resume()

    def _create_submit_callback(self, pending_task: Any) -> Any:
        submit_then_wait = super()._create_submit_callback(pending_task)

        async def admit_then_submit() -> Any:
            workflow_context.set(WorkflowContext(is_eval=pending_task.is_eval, task_id=pending_task.task_id))
            if not pending_task.is_eval and not self.staleness.admit(pending_task.task_id, int(self.get_version())):
                self.staleness.on_rollout_rejected()
                return None
            return await submit_then_wait()

        return admit_then_submit

    def prepare_batch(self, dataloader: Any, workflow: Any, workflow_kwargs: Optional[dict[str, Any]] = None,
                      should_accept_fn: Optional[str] = None, group_size: int = 1, dynamic_bs: bool = False) -> list[Any]:
        def submit(data: Any, task_id: int) -> Any:
            return self.submit(data=data, workflow=workflow, workflow_kwargs=workflow_kwargs,
                               should_accept_fn=should_accept_fn, task_id=task_id, group_size=group_size)

        return self.batches.prepare(dataloader, submit)

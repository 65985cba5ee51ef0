"""StaleFlow's protocol as a drop-in for AReaL 1.0.4 (``pip install --no-deps ./protocol`` beside AReaL).

Imports ``areal`` and this package only. AReaL's rollout machinery runs unchanged (its dispatcher
threads, async task runner and the host's ``RolloutWorkflow``); its count-based staleness control
is replaced by the protocol at AReaL's own extension points (docs/integrating.md, "AReaL"):

- :class:`ProtocolStalenessManager` (``.areal_staleness``) stands in for ``areal.infra.staleness_manager.StalenessManager``
  (built from its arguments, with its public attributes and its concurrency cap):
  ``get_capacity`` is the protocol's reserve slack at the engine's version; the completion callbacks
  become ``occupy`` / ``abort`` of the task id AReaL keeps in its ``workflow_context``;
- :class:`ProtocolWorkflowExecutor` is AReaL's ``WorkflowExecutor`` (the path of ``RemoteInfEngine``:
  :func:`use_protocol` swaps it in after ``engine.initialize``) and :class:`ProtocolRolloutController`
  its ``RolloutController`` (the single-controller default path): both reserve a task when its
  episode starts, at the engine's version, and their ``prepare_batch`` (RLTrainer's arguments) returns
  exactly the trajectories of the protocol's consumed batch; their direct ``submit``, ``wait`` and
  ``rollout_batch`` are refused by name (they would bypass admission), and a protocol whose eta or
  batch size is not the config's is refused when they are built (:func:`check_config_matches`);
- :class:`ProtocolBatches` (``.areal_batches``) is the batch source both use: task ids are group ids,
  counted from :data:`FIRST_TASK_ID` (clear of AReaL's own ids), a task refused at episode start gives
  its prompt back (it is submitted again, never lost), and ``state_dict`` / ``load_state_dict`` carry
  the protocol snapshot and the untrained prompts through AReaL's recover machinery (wrap the train
  dataloader in :class:`RecoverableLoader`).
"""

from __future__ import annotations

from typing import Any, Optional

from areal.api import RolloutWorkflow
from areal.infra import RolloutController, workflow_context
from areal.infra.workflow_context import WorkflowContext
from areal.infra.workflow_executor import WorkflowExecutor

from ..locked import LockedStalenessManager
from .areal_batches import FIRST_TASK_ID, ProtocolBatches, RecoverableLoader, TracePath, TrainBatch
from .areal_staleness import ProtocolStalenessManager, check_protocol_matches, rank_batch_size

__all__ = ["BYPASS_REFUSED", "FIRST_TASK_ID", "ProtocolBatches", "ProtocolRolloutController", "ProtocolStalenessManager",
           "ProtocolWorkflow", "ProtocolWorkflowExecutor", "RecoverableLoader", "RefusesBypasses", "TracePath", "TrainBatch",
           "check_config_matches", "executor_owner", "protocol_for_config", "rank_batch_size", "use_protocol"]

#: What a direct ``submit`` / ``wait`` / ``rollout_batch`` on a protocol-owned training rollout hears.
BYPASS_REFUSED = (
    "{cls}.{method} would bypass the protocol's admission (its results carry no staleness bound, and "
    "wait/rollout_batch would take trajectories the protocol has reserved for its batches): train with "
    "prepare_batch, and evaluate with a rollout of its own (PPOTrainer's eval_rollout)"
)


def check_config_matches(protocol: LockedStalenessManager, config: Any, data_parallel_size: int = 1) -> None:
    """Refuse a protocol whose eta or batch size is not AReaL's: ``max_head_offpolicyness`` must be the
    protocol's eta and ``consumer_batch_size`` (the trainer's, split over ``data_parallel_size`` ranks
    as AReaL's own staleness manager splits it, :func:`rank_batch_size`) its batch size, or the trained
    batch silently changes."""
    check_protocol_matches(protocol, config.max_head_offpolicyness, config.consumer_batch_size, data_parallel_size)


def protocol_for_config(config: Any, data_parallel_size: int = 1, redundancy: int = 0) -> LockedStalenessManager:
    """A protocol for AReaL's rollout ``config`` on one of ``data_parallel_size`` ranks: eta
    ``max_head_offpolicyness``, batch size the rank's share of ``consumer_batch_size`` as AReaL splits it
    (:func:`rank_batch_size`: at least 1, where ``consumer_batch_size // data_parallel_size`` would be 0)."""
    return LockedStalenessManager.create(eta=config.max_head_offpolicyness, redundancy=redundancy,
                                         batch_size=rank_batch_size(config.consumer_batch_size, data_parallel_size))


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



class RefusesBypasses:
    """Mixed in before AReaL's executor or controller: the training rollout's direct ``submit``,
    ``wait`` and ``rollout_batch`` are refused by name (the protocol's own submissions call AReaL's
    ``submit`` on the base class)."""

    def submit(self, *args: Any, **kwargs: Any) -> int:
        raise RuntimeError(BYPASS_REFUSED.format(cls=type(self).__name__, method="submit"))

    def wait(self, *args: Any, **kwargs: Any) -> list[Any]:
        raise RuntimeError(BYPASS_REFUSED.format(cls=type(self).__name__, method="wait"))

    def rollout_batch(self, *args: Any, **kwargs: Any) -> list[Any]:
        raise RuntimeError(BYPASS_REFUSED.format(cls=type(self).__name__, method="rollout_batch"))


class ProtocolWorkflowExecutor(RefusesBypasses, WorkflowExecutor):
    """AReaL's ``WorkflowExecutor`` with the protocol's staleness control and batches.

    ``prepare_batch`` has the executor's signature (``RemoteInfEngine.prepare_batch``, which RLTrainer
    calls with ``workflow_kwargs`` and ``group_size``, resolves the workflow and passes the rest);
    ``dynamic_bs`` is accepted and has no effect: a protocol batch is always ``batch_size`` groups.
    ``submit``, ``wait`` and ``rollout_batch`` are refused (:data:`BYPASS_REFUSED`). ``consumes=False``:
    a rank that is not a data-parallel head (:class:`ProtocolStalenessManager`).
    """

    def __init__(self, config: Any, inference_engine: Any, protocol: LockedStalenessManager,
                 trace_path: Optional[TracePath] = None, consumes: bool = True) -> None:
        # AReaL's cap until initialize takes this rank's share: max_concurrent_rollouts, else consumer_batch_size
        self.staleness = ProtocolStalenessManager(inference_engine, config.max_concurrent_rollouts or config.consumer_batch_size,
                                                  protocol.batch_size, protocol.eta, protocol=protocol, consumes=consumes)
        super().__init__(config, inference_engine, staleness_manager=self.staleness)
        self.batches = ProtocolBatches(self.staleness, self.wait_for_task, self._wake, trace_path)

    def initialize(self, logger: Any = None, train_data_parallel_size: Optional[int] = None) -> None:
        """AReaL's ``initialize``. ``max_concurrent_rollouts`` (unset: ``consumer_batch_size``, AReaL's
        default) and ``consumer_batch_size`` are the trainer's, over its data-parallel ranks: as AReaL's own
        executor builds its manager, this rank's caps its share ``max(1, max_concurrent_rollouts // dp)``
        (``dp``: ``train_data_parallel_size``, else AReaL's from ``torch.distributed``), and its protocol must
        have AReaL's eta and per-rank batch size ``max(1, consumer_batch_size // dp)`` (:func:`check_config_matches`)."""
        dp = train_data_parallel_size if train_data_parallel_size is not None else self._resolve_dp_world_size()
        check_config_matches(self.staleness.protocol, self.config, dp)
        self.staleness.max_concurrent_rollouts = max(1, self.max_concurrent_rollouts // dp)
        self.staleness.consumer_batch_size = rank_batch_size(self.consumer_batch_size, dp)
        super().initialize(logger=logger, train_data_parallel_size=train_data_parallel_size)

    def _wake(self) -> None:
        if not self.is_paused():
            self.resume()

    def prepare_batch(self, dataloader: Any, workflow: Any, should_accept_fn: Any = None, dynamic_bs: bool = False) -> list[Any]:
        wrapped = ProtocolWorkflow(workflow, self.staleness)
        return self.batches.prepare(
            dataloader, lambda data, task_id: WorkflowExecutor.submit(
                self, data=data, workflow=wrapped, should_accept_fn=should_accept_fn, task_id=task_id))

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
                 train_data_parallel_size: Optional[int] = None, consumes: bool = True) -> ProtocolWorkflowExecutor:
    """After ``engine.initialize(...)`` (a ``RemoteInfEngine``, which builds its own executor, or one of
    AReaL's engines wrapping it, :func:`executor_owner`): replace that executor with a
    :class:`ProtocolWorkflowExecutor` through the owner's ``workflow_executor`` setter. The engine's
    ``prepare_batch`` then goes through the protocol, and its ``submit``, ``wait`` and ``rollout_batch``
    are refused. ``consumes=False`` on a rank that is not a data-parallel head."""
    owner = executor_owner(engine)
    old = owner.workflow_executor
    executor = ProtocolWorkflowExecutor(owner.config, owner, protocol, trace_path, consumes)
    executor.initialize(logger=old.logger, train_data_parallel_size=train_data_parallel_size)
    old.destroy()
    owner.workflow_executor = executor
    return executor


class ProtocolRolloutController(RefusesBypasses, RolloutController):
    """AReaL's ``RolloutController`` (the single-controller path) with the protocol.

    ``initialize`` builds AReaL's controller, then gives its dispatcher a
    :class:`ProtocolStalenessManager`; each task is reserved when the dispatcher starts it, at the
    controller's version (the version its workers run); ``prepare_batch`` has RLTrainer's arguments.
    It takes AReaL's own arguments (``inf_engine, config, scheduler``), and ``protocol``: one with the
    config's eta and ``consumer_batch_size`` (the controller serves every data-parallel rank:
    :func:`check_config_matches`), or, when None, a new one (:func:`protocol_for_config`). ``submit``,
    ``wait`` and ``rollout_batch`` are refused (:data:`BYPASS_REFUSED`).
    """

    def __init__(self, *args: Any, protocol: Optional[LockedStalenessManager] = None, trace_path: Optional[TracePath] = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if protocol is None:
            protocol = protocol_for_config(self.config)
        check_config_matches(protocol, self.config)
        self.protocol = protocol
        self.trace_path = trace_path

    def initialize(self, *args: Any, **kwargs: Any) -> None:
        super().initialize(*args, **kwargs)
        areal = self.staleness_manager  # the one AReaL's initialize built: the drop-in takes its arguments
        self.staleness = ProtocolStalenessManager(self, areal.max_concurrent_rollouts, areal.consumer_batch_size, areal.max_staleness,
                                                  protocol=self.protocol)
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
            return RolloutController.submit(self, data=data, workflow=workflow, workflow_kwargs=workflow_kwargs,
                               should_accept_fn=should_accept_fn, task_id=task_id, group_size=group_size)

        return self.batches.prepare(dataloader, submit)

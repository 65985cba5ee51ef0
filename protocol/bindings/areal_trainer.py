"""AReaL 1.0.4's ``RLTrainer`` (``areal.trainer.rl_trainer.PPOTrainer``) with the protocol saved and
restored by AReaL's own ``RecoverHandler``.

``PPOTrainer.__init__`` builds the train dataloader, then the rollout, then runs
``recover_handler.load(..., self.train_dataloader, ...)`` and the rollout staleness manager's
``on_version_recovered``, all before a caller could wrap anything. :class:`ProtocolTrainerHooks`
overrides the two factory methods that run before the load, so the load already sees the protocol:

- ``_create_dataloader`` wraps the train loader in a :class:`~staleflow_protocol.bindings.areal.RecoverableLoader`
  (no batches yet: a protocol state loaded before the rollout exists waits in it);
- ``_init_rollout`` (the training rollout; evaluation rollouts are left alone) puts the protocol in
  the rollout AReaL builds: in single-controller mode (AReaL's default) AReaL's own ``_init_rollout``
  asks the backend's engine class for its controller (``as_controller``), and while it runs those
  classes build a :class:`~staleflow_protocol.bindings.areal.ProtocolRolloutController` instead of a
  ``RolloutController``; in SPMD mode it swaps the engine's executor for a
  :class:`~staleflow_protocol.bindings.areal.ProtocolWorkflowExecutor` (:func:`use_protocol`). Either way the
  loader is bound to the protocol's batches. In SPMD mode a rank that is not a data-parallel head
  (tensor, context or pipeline parallelism) never consumes: its protocol is marked so, stays idle at
  version 0 and accepts ``on_version_recovered(n)``; ``prepare_batch`` there is refused.

``RecoverHandler.dump`` then saves the protocol with ``train_dataloader.state_dict()``, ``load``
restores it, and ``on_version_recovered`` checks that the restored protocol matches the checkpoint.
Use: ``class ProtocolRLTrainer(ProtocolTrainerHooks, PPOTrainer)``, built with the extra keyword
``protocol=`` (and ``trace_path=``). This module does not import ``areal.trainer`` (it needs the
``datasets`` package and more), so it imports wherever ``staleflow_protocol.bindings.areal`` does.

Not covered: the experimental ``RolloutControllerV2`` (rollout config ``_version="v2"``), which AReaL
builds directly; the hooks refuse it by name.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

from areal.engine import RemoteSGLangEngine, RemotevLLMEngine
from areal.infra import RolloutController

from ..locked import LockedStalenessManager
from .areal import ProtocolRolloutController, RecoverableLoader, TracePath, use_protocol

#: The engine classes whose ``as_controller`` AReaL's ``PPOTrainer._init_rollout`` calls in
#: single-controller mode (its ``sglang`` and ``vllm`` backends).
CONTROLLER_FACTORIES = (RemoteSGLangEngine, RemotevLLMEngine)


@contextlib.contextmanager
def controllers_with_protocol(protocol: LockedStalenessManager, trace_path: Optional[TracePath]) -> Iterator[None]:
    """While open, :data:`CONTROLLER_FACTORIES` build a :class:`ProtocolRolloutController` with
    ``protocol`` where they would build AReaL's ``RolloutController``; their own ``as_controller`` is
    back on exit. For a trainer's construction (one thread), not for code running beside it."""
    originals = {cls: cls.__dict__.get("as_controller") for cls in CONTROLLER_FACTORIES}  # None: inherited

    def as_controller(cls: Any, config: Any, scheduler: Any) -> ProtocolRolloutController:
        return ProtocolRolloutController(cls, config=config, scheduler=scheduler, protocol=protocol, trace_path=trace_path)

    try:
        for cls in originals:
            cls.as_controller = classmethod(as_controller)
        yield
    finally:
        for cls, original in originals.items():
            if original is None:
                del cls.as_controller
            else:
                cls.as_controller = original


class ProtocolTrainerHooks:
    """Mix in before AReaL's trainer class (see the module docstring)."""

    config: Any
    actor: Any
    actor_alloc: Any
    train_dataloader: Any

    def __init__(self, *args: Any, protocol: LockedStalenessManager, trace_path: Optional[TracePath] = None, **kwargs: Any) -> None:
        self.staleflow_protocol = protocol
        self.staleflow_trace_path = trace_path
        super().__init__(*args, **kwargs)

    def _create_dataloader(self, dataset: Any, dataset_config: Any, rank: int, world_size: int) -> Any:
        loader = super()._create_dataloader(dataset, dataset_config=dataset_config, rank=rank, world_size=world_size)  # type: ignore[misc]
        return RecoverableLoader(loader) if dataset_config is self.config.train_dataset else loader

    def _init_rollout(self, rollout_config: Any, is_eval: bool = False, lora_path: Optional[str] = None) -> Any:
        if is_eval:
            return super()._init_rollout(rollout_config, is_eval=is_eval, lora_path=lora_path)  # type: ignore[misc]
        if not isinstance(self.train_dataloader, RecoverableLoader):
            raise RuntimeError("the train dataloader was not built by _create_dataloader (online mode has no prompts to protect)")
        with controllers_with_protocol(self.staleflow_protocol, self.staleflow_trace_path):
            rollout = super()._init_rollout(rollout_config, is_eval=is_eval, lora_path=lora_path)  # type: ignore[misc]
        if isinstance(rollout, ProtocolRolloutController):  # single-controller mode
            self.train_dataloader.bind(rollout.batches)
        elif hasattr(rollout, "workflow_executor") and not isinstance(rollout, RolloutController):  # SPMD: an engine per rank
            # under model parallelism only data-parallel heads consume (AReaL's DistRolloutCoordinator);
            # the other ranks' protocol stays idle at version 0 through dump, load and on_version_recovered
            executor = use_protocol(rollout, self.staleflow_protocol, self.staleflow_trace_path,
                                    train_data_parallel_size=self.actor_alloc.parallel.dp_size,
                                    consumes=bool(self.actor.is_data_parallel_head()))
            self.train_dataloader.bind(executor.batches)
        else:
            raise NotImplementedError(
                f"PPOTrainer built a {type(rollout).__name__} for its rollout: the protocol hooks cover AReaL's "
                "RolloutController (single-controller mode, rollout config _version v1) and its engines in SPMD mode")
        return rollout

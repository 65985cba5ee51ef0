"""AReaL 1.0.4's ``RLTrainer`` (``areal.trainer.rl_trainer.PPOTrainer``) with the protocol saved and
restored by AReaL's own ``RecoverHandler``.

``PPOTrainer.__init__`` builds the train dataloader, then the rollout, then runs
``recover_handler.load(..., self.train_dataloader, ...)`` and the rollout staleness manager's
``on_version_recovered``, all before a caller could wrap anything. :class:`ProtocolTrainerHooks`
overrides the two factory methods that run before the load, so the load already sees the protocol:

- ``_create_dataloader`` wraps the train loader in a :class:`~staleflow_protocol.areal.RecoverableLoader`
  (no batches yet: a protocol state loaded before the rollout exists waits in it);
- ``_init_rollout`` (the training rollout; evaluation rollouts are left alone) swaps the engine's
  executor for a :class:`~staleflow_protocol.areal.ProtocolWorkflowExecutor` (:func:`use_protocol`) and
  binds the loader to its batches.

``RecoverHandler.dump`` then saves the protocol with ``train_dataloader.state_dict()``, ``load``
restores it, and ``on_version_recovered`` checks that the restored protocol matches the checkpoint.
Use: ``class ProtocolRLTrainer(ProtocolTrainerHooks, PPOTrainer)``, built with the extra keyword
``protocol=`` (and ``trace_path=``). This module does not import ``areal.trainer`` (it needs the
``datasets`` package and more), so it imports wherever ``staleflow_protocol.areal`` does.

Covers AReaL's SPMD path (``RemoteInfEngine`` per trainer rank). In single-controller mode the
trainer builds and initializes a plain ``RolloutController`` inside ``_init_rollout``; the hooks
refuse it (build a :class:`~staleflow_protocol.areal.ProtocolRolloutController` in your trainer).
"""

from __future__ import annotations

from typing import Any, Optional

from areal.infra import RolloutController

from .areal import RecoverableLoader, TracePath, use_protocol
from .locked import LockedStalenessManager


class ProtocolTrainerHooks:
    """Mix in before AReaL's trainer class (see the module docstring)."""

    config: Any
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
        rollout = super()._init_rollout(rollout_config, is_eval=is_eval, lora_path=lora_path)  # type: ignore[misc]
        if is_eval:
            return rollout
        if isinstance(rollout, RolloutController):
            raise NotImplementedError("single-controller mode: build a ProtocolRolloutController instead of these hooks")
        if not isinstance(self.train_dataloader, RecoverableLoader):
            raise RuntimeError("the train dataloader was not built by _create_dataloader (online mode has no prompts to protect)")
        executor = use_protocol(rollout, self.staleflow_protocol, self.staleflow_trace_path,
                                train_data_parallel_size=self.actor_alloc.parallel.dp_size)
        self.train_dataloader.bind(executor.batches)
        return rollout

"""StaleFlow's staleness protocol inside AReaL (``areal`` 1.0.x): a binding, not a re-implementation.

AReaL's own rollout machinery runs unchanged: ``WorkflowExecutor`` with its dispatcher threads, its
async task runner and the host's ``RolloutWorkflow``. Three extension points replace its
count-based staleness control with the protocol (see docs/integrating.md, "AReaL"):

- :class:`ProtocolStalenessManager` is passed as ``WorkflowExecutor(..., staleness_manager=...)``:
  AReaL's admission gate (``get_capacity``) becomes the protocol's reserve slack at the engine's
  version, and its completion callbacks become ``occupy`` (accepted) and ``abort`` (rejected,
  filtered by ``should_accept_fn``, or failed), keyed by AReaL's task id;
- :class:`ProtocolWorkflow` wraps the host's workflow: when AReaL starts the episode it reserves the
  task at the inference engine's current version (the version of the trajectory's first token);
- :class:`ProtocolBatches` replaces ``prepare_batch`` (whose consumer takes the oldest finished
  samples): it submits through ``WorkflowExecutor.submit``, takes ``consume()``'s batch and fetches
  exactly those tasks with AReaL's ``wait_for_task``; dropped and rejected tasks are discarded.

This module imports only ``staleflow.protocol`` and ``areal``.
"""

from staleflow.adapters.areal.rollout import (
    ProtocolBatches,
    ProtocolStalenessManager,
    ProtocolWorkflow,
    TrainBatch,
)

__all__ = ["ProtocolBatches", "ProtocolStalenessManager", "ProtocolWorkflow", "TrainBatch"]

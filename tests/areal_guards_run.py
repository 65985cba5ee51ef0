"""The AReaL binding's guards, run INSIDE AReaL's own venv (tests/test_areal_dropin.py; ``python -I`` this file).

``python areal_guards_run.py OUT`` prints one JSON line:

- ``config``: what building the protocol's rollout says when the protocol's eta or batch size is not
  AReaL's ``max_head_offpolicyness`` / ``consumer_batch_size`` (the SPMD executor, split over two
  data-parallel ranks; the single-controller controller; ``ProtocolTrainerHooks`` on the stand-in for
  ``PPOTrainer.__init__`` of ``areal_dropin_run.py``), and that matching ones build;
- ``bypasses``: what the SPMD executor and AReaL's ``RemotevLLMEngine`` wrapping it say to a direct
  ``submit``, ``wait`` and ``rollout_batch``;
- ``non_head``: RLTrainer's recover order on a rank that is not a data-parallel head (tensor, context or
  pipeline parallelism: AReaL 1.0.4's ``DistRolloutCoordinator`` draws batches on the heads only):
  life 0 never consumes, ``RecoverHandler.dump`` after step 3; life 1 is built again,
  ``RecoverHandler.load`` restores its idle protocol at version 0 and ``on_version_recovered(4)`` runs
  there, as AReaL calls it on every rank; the same call on a head whose protocol was not restored
  must still be refused.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))  # python -I leaves the script's folder off the path

import torch  # noqa: E402
from areal.api import StepInfo  # noqa: E402
from areal.api.cli_args import InferenceEngineConfig  # noqa: E402
from areal.engine import RemotevLLMEngine  # noqa: E402
from areal.infra.workflow_executor import WorkflowExecutor  # noqa: E402
from areal_dropin_run import (  # noqa: E402
    BATCH,
    ETA,
    VOCAB,
    WORLD,
    ExecutorEngine,
    FakeEngine,
    HookedTrainer,
    InProcessScheduler,
    NoState,
    TargetWorkflow,
    config,
    refusals,
    refused,
)
from staleflow_protocol import LockedStalenessManager  # noqa: E402
from staleflow_protocol.bindings.areal import (  # noqa: E402
    ProtocolRolloutController,
    ProtocolStalenessManager,
    ProtocolWorkflowExecutor,
    use_protocol,
)


def executor(protocol: LockedStalenessManager) -> ProtocolWorkflowExecutor:
    """A rank's executor: the trainer's config over WORLD data-parallel ranks."""
    built = ProtocolWorkflowExecutor(config(), FakeEngine(torch.zeros(VOCAB), 0), protocol)
    built.initialize(train_data_parallel_size=WORLD)
    return built


def config_guards(out: Path) -> dict[str, Any]:
    controller_config = InferenceEngineConfig(backend="vllm:d2", consumer_batch_size=BATCH, max_head_offpolicyness=ETA)
    scheduler = InProcessScheduler(FakeEngine(torch.zeros(VOCAB), 0))
    got = {
        "executor_eta": refused(lambda: executor(LockedStalenessManager.create(ETA + 1, BATCH))),
        "executor_batch": refused(lambda: executor(LockedStalenessManager.create(ETA, BATCH * WORLD))),
        "controller_batch": refused(lambda: ProtocolRolloutController(
            FakeEngine, controller_config, scheduler, protocol=LockedStalenessManager.create(ETA, BATCH * WORLD))),
        "hooks": refused(lambda: HookedTrainer(out / "hooks", torch.zeros(VOCAB), 0,
                                               protocol=LockedStalenessManager.create(ETA + 1, BATCH))),
    }
    matching = executor(LockedStalenessManager.create(ETA, BATCH))
    controller = ProtocolRolloutController(FakeEngine, controller_config, scheduler, protocol=LockedStalenessManager.create(ETA, BATCH))
    got["matching_build"] = [type(matching).__name__, type(controller).__name__]
    matching.destroy()
    return got


def bypasses() -> dict[str, list[str]]:
    built = executor(LockedStalenessManager.create(ETA, BATCH))
    engine = RemotevLLMEngine(config())  # AReaL's engine, its RemoteInfEngine's executor swapped (no server here)
    inner = engine._engine
    inner.workflow_executor = WorkflowExecutor(inner.config, inner)
    inner.workflow_executor.initialize(train_data_parallel_size=1)
    swapped = use_protocol(engine, LockedStalenessManager.create(ETA, BATCH * WORLD), train_data_parallel_size=1)
    got = {"executor": refusals(built), "engine": refusals(engine)}
    built.destroy()
    swapped.destroy()
    return got


def non_head_recover(out: Path) -> dict[str, Any]:
    policy = torch.zeros(VOCAB, requires_grad=True)
    first = HookedTrainer(out, policy, 0, head=False, protocol=LockedStalenessManager.create(ETA, BATCH), trace_path=out / "trace.jsonl")
    executor = first.rollout.workflow_executor
    got: dict[str, Any] = {"consumes": executor.staleness.consumes,
                           "prepare_batch": refused(lambda: executor.prepare_batch(first.train_dataloader, TargetWorkflow()))}
    step = StepInfo(epoch=0, epoch_step=3, global_step=3, steps_per_epoch=10**6)
    first.recover_handler.dump(first.actor, step, NoState(), NoState(), NoState(), first.train_dataloader)
    executor.destroy()
    second = HookedTrainer(out, policy, 1, head=False, protocol=LockedStalenessManager.create(ETA, BATCH), trace_path=out / "trace.jsonl")
    got.update(recovered_step=second.recover_info.last_step_info.global_step, rollout_version=second.rollout.get_version(),
               protocol_version=second.train_dataloader.batches.protocol.version)
    second.rollout.workflow_executor.destroy()
    head = ProtocolStalenessManager(FakeEngine(torch.zeros(VOCAB), 0), BATCH, BATCH, ETA)  # AReaL's arguments: a new protocol
    got["head_unrestored"] = refused(lambda: head.on_version_recovered(4))
    return got


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    try:
        result = {"config": config_guards(out), "bypasses": bypasses(), "non_head": non_head_recover(out / "non-head")}
    finally:
        for engine in ExecutorEngine.built:  # a stand-in engine's own executor, where a guard refused the swap
            if not isinstance(engine.workflow_executor, ProtocolWorkflowExecutor):
                engine.workflow_executor.destroy()
    print(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))

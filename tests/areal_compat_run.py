"""The AReaL drop-in beside AReaL 1.0.4's own classes, built from the same arguments, run INSIDE AReaL's
own venv (tests/test_areal_compat.py; ``python -I`` this file).

``python areal_compat_run.py`` prints one JSON line, a key per behaviour; a section that raises gives
``"error: <type>: <message>"`` instead, so one broken behaviour does not hide the others:

- ``default_cap``: with ``max_concurrent_rollouts`` unset, how many rollouts AReaL's dispatcher would
  start (its callbacks played until ``get_capacity()`` is 0) on AReaL's ``WorkflowExecutor`` (two
  data-parallel ranks) and ``RolloutController``, and on the drop-in's;
- ``attributes``: the managers' ``max_concurrent_rollouts``, ``consumer_batch_size``, ``max_staleness``;
- ``zero_batch``: ``consumer_batch_size`` 0 and ``max_concurrent_rollouts`` 0, and a batch smaller
  than the data-parallel size (where ``consumer_batch_size // dp`` is 0);
- ``constructor``: the drop-in's manager built by name from AReaL's own arguments, and its controller
  from AReaL's; their capacities against AReaL's in the states of AReaL's own unit tests;
- ``callbacks_without_context``: AReaL's callbacks played by hand, as its own unit tests play them;
- ``differences``: the numbers of the docs' table of intended differences (docs/integrating.md).
"""

from __future__ import annotations

import contextvars
import inspect
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))  # python -I leaves the script's folder off the path

import torch  # noqa: E402
from areal.api.cli_args import InferenceEngineConfig  # noqa: E402
from areal.infra import RolloutController, workflow_context  # noqa: E402
from areal.infra.staleness_manager import StalenessManager  # noqa: E402
from areal.infra.workflow_context import WorkflowContext  # noqa: E402
from areal.infra.workflow_executor import WorkflowExecutor  # noqa: E402
from areal_dropin_run import VOCAB, FakeEngine, InProcessScheduler  # noqa: E402
from staleflow_protocol import LockedStalenessManager  # noqa: E402
from staleflow_protocol.bindings import areal as dropin  # noqa: E402


class Version:
    """AReaL's ``VersionProvider``: a model version set by hand."""

    def __init__(self, version: int = 0) -> None:
        self.version = version

    def get_version(self) -> int:
        return self.version


def started(manager: Any, limit: int = 10_000) -> int:
    """How many rollouts AReaL's dispatcher starts on ``manager`` before ``get_capacity()`` stops it (its
    ``_has_runner_capacity``), none finishing: the callbacks it makes, played by hand."""
    count = 0
    while manager.get_capacity() > 0 and count < limit:
        manager.on_rollout_enqueued()
        manager.on_rollout_submitted()
        count += 1
    return count


def attributes(manager: Any) -> list[Any]:
    return [getattr(manager, name, "missing") for name in ("max_concurrent_rollouts", "consumer_batch_size", "max_staleness")]


def executors(config: InferenceEngineConfig, dp: int, protocol: LockedStalenessManager) -> tuple[Any, Any]:
    """AReaL's executor and the drop-in's, each initialized as rank of ``dp`` data-parallel ranks."""
    areal = WorkflowExecutor(config, FakeEngine(torch.zeros(VOCAB), 0))
    ours = dropin.ProtocolWorkflowExecutor(config, FakeEngine(torch.zeros(VOCAB), 0), protocol)
    for executor in (areal, ours):
        executor.initialize(train_data_parallel_size=dp)
    return areal, ours


def controllers(config: InferenceEngineConfig, protocol: LockedStalenessManager | None) -> tuple[Any, Any]:
    """AReaL's ``RolloutController`` and the drop-in's (``protocol`` None: its own default), initialized."""
    scheduler = InProcessScheduler(FakeEngine(torch.zeros(VOCAB), 0))
    areal = RolloutController(FakeEngine, config, scheduler)
    extra = {} if protocol is None else {"protocol": protocol}
    ours = dropin.ProtocolRolloutController(FakeEngine, config, InProcessScheduler(FakeEngine(torch.zeros(VOCAB), 0)), **extra)
    for controller in (areal, ours):
        controller.initialize(role="rollout", server_args={})
    return areal, ours


def destroy(*built: Any) -> None:
    for rollout in built:
        rollout.destroy()


def side_by_side(config: InferenceEngineConfig, measure: Callable[[Any], Any], label: str) -> dict[str, list[Any]]:
    """``measure`` of AReaL's manager and of the drop-in's, built from ``config``: on the executors of a
    rank of two data-parallel ranks (``executor ... dp 2``), and on the controllers."""
    eta, batch = config.max_head_offpolicyness, config.consumer_batch_size
    builders = {f"executor {label} dp 2": lambda: executors(config, 2, LockedStalenessManager.create(eta, batch // 2)),
                f"controller {label}": lambda: controllers(config, LockedStalenessManager.create(eta, batch))}
    got = {}
    for name, build in builders.items():
        areal, ours = build()
        got[name] = [measure(areal.staleness_manager), measure(ours.staleness_manager)]
        destroy(areal, ours)
    return got


def default_cap() -> dict[str, Any]:
    """With ``max_concurrent_rollouts`` unset AReaL caps at ``consumer_batch_size`` (per rank on the
    executor, ``max(1, .. // dp)``); the protocol's own slack is ``(eta + 1) * batch``."""
    got: dict[str, Any] = {}
    for batch, eta in ((64, 3), (16, 2)):
        config = InferenceEngineConfig(backend="vllm:d2", consumer_batch_size=batch, max_head_offpolicyness=eta)
        got.update(side_by_side(config, started, f"{batch} eta {eta}"))
        shares = (batch // 2, batch)  # a rank's of two, and the whole batch
        got[f"protocol slack {batch} eta {eta}"] = [LockedStalenessManager.create(eta, share).reserve_slack(0) for share in shares]
    return got


def attribute_values() -> dict[str, Any]:
    """AReaL's public attributes on its managers and on the drop-in's, for the same config."""
    got: dict[str, Any] = {}
    for mcr, batch, eta in ((None, 16, 2), (100, 32, 5)):
        config = InferenceEngineConfig(backend="vllm:d2", consumer_batch_size=batch, max_head_offpolicyness=eta,
                                       max_concurrent_rollouts=mcr)
        got.update(side_by_side(config, attributes, f"{mcr} {batch} {eta}"))
    return got


def zero_batch() -> dict[str, Any]:
    """AReaL clamps ``consumer_batch_size`` and ``max_concurrent_rollouts`` 0 to 1, and a rank's share
    ``consumer_batch_size // dp`` 0 to 1: a rollout of each, compared on attributes and on what it starts
    (each case reported on its own)."""

    def manager() -> list[Any]:
        areal = StalenessManager(version_provider=Version(), max_concurrent_rollouts=0, consumer_batch_size=0, max_staleness=0)
        ours = dropin.ProtocolStalenessManager(version_provider=Version(), max_concurrent_rollouts=0, consumer_batch_size=0,
                                               max_staleness=0)
        return [[*attributes(areal), started(areal)], [*attributes(ours), started(ours)], ours.protocol.batch_size]

    def executor(batch: int, mcr: int | None, dp: int) -> list[Any]:
        config = InferenceEngineConfig(consumer_batch_size=batch, max_head_offpolicyness=1, max_concurrent_rollouts=mcr)
        protocol = dropin.protocol_for_config(config, dp)  # what the docs' recipe builds for this rank
        areal, ours = executors(config, dp, protocol)
        got = [[*attributes(areal.staleness_manager), started(areal.staleness_manager)],
               [*attributes(ours.staleness), started(ours.staleness)], protocol.batch_size]
        destroy(areal, ours)
        return got

    def mismatch() -> Any:  # a protocol of 2 groups for a batch of 0: AReaL runs 1
        return section(lambda: dropin.ProtocolStalenessManager(Version(), 0, 0, 1, protocol=LockedStalenessManager.create(1, 2)))

    return {"manager 0 0 eta 0": section(manager), "executor 0 0 dp 1": section(lambda: executor(0, 0, 1)),
            "executor 3 None dp 4": section(lambda: executor(3, None, 4)), "mismatch": mismatch()}


#: AReaL's own unit tests' manager arguments (max_concurrent_rollouts, consumer_batch_size, max_staleness).
AREAL_TEST_ARGUMENTS = ((10, 4, 2), (100, 32, 10), (5, 2, 10), (100, 4, 2), (3, 2, 1), (1, 1, 0), (1000, 128, 10), (50, 16, 3))


def parameters(cls: Any) -> list[str]:
    return list(inspect.signature(cls).parameters)


def constructor() -> dict[str, Any]:
    """The drop-in's manager takes AReaL's ``StalenessManager`` arguments (by name), and its controller
    AReaL's ``RolloutController`` arguments, with no protocol given (a new one from the config)."""
    capacities = []
    for mcr, batch, eta in AREAL_TEST_ARGUMENTS:
        built = [cls(version_provider=Version(), max_concurrent_rollouts=mcr, consumer_batch_size=batch, max_staleness=eta)
                 for cls in (StalenessManager, dropin.ProtocolStalenessManager)]
        capacities.append([cls.get_capacity() for cls in built])
    config = InferenceEngineConfig(backend="vllm:d2", consumer_batch_size=16, max_head_offpolicyness=2)
    areal, ours = controllers(config, None)
    controller = [type(ours).__name__, ours.protocol.eta, ours.protocol.batch_size, started(areal.staleness_manager),
                  started(ours.staleness_manager)]
    destroy(areal, ours)
    return {"areal_params": parameters(StalenessManager), "params": parameters(dropin.ProtocolStalenessManager),
            "capacities": capacities, "controller": controller}


def callbacks_without_context() -> list[list[int]]:
    """AReaL's callbacks played by hand, outside any episode (no task id in AReaL's ``workflow_context``),
    as AReaL's own unit tests play them: for (max_concurrent_rollouts, consumer_batch_size, eta, submitted,
    then accepted, then rejected), the capacity after, on AReaL's manager and on the drop-in's."""
    got = []
    for mcr, batch, eta, submitted, accepted, rejected in ((10, 4, 2, 10, 0, 10), (20, 8, 3, 20, 15, 5), (20, 4, 2, 5, 5, 0)):
        capacities = []
        for cls in (StalenessManager, dropin.ProtocolStalenessManager):
            manager = cls(version_provider=Version(), max_concurrent_rollouts=mcr, consumer_batch_size=batch, max_staleness=eta)
            for _ in range(submitted):
                manager.on_rollout_enqueued()
                manager.on_rollout_submitted()
            for finish, count in ((manager.on_rollout_accepted, accepted), (manager.on_rollout_rejected, rejected)):
                for _ in range(count):
                    finish()
            capacities.append(manager.get_capacity())
        got.append(capacities)
    return got


def evaluation_episode() -> list[int]:
    """An evaluation episode (AReaL's context ``is_eval``, a task id) accepted on the training rollout's
    manager (eta 2, batch 4, cap 100): the capacity after, on AReaL's manager and on the drop-in's."""
    capacities = []
    for cls in (StalenessManager, dropin.ProtocolStalenessManager):
        manager = cls(version_provider=Version(), max_concurrent_rollouts=100, consumer_batch_size=4, max_staleness=2)
        manager.on_rollout_enqueued()
        manager.on_rollout_submitted()

        def evaluated(manager: Any = manager) -> None:  # inside the episode's own context, as AReaL runs it
            workflow_context.set(WorkflowContext(is_eval=True, task_id=7))
            manager.on_rollout_accepted()

        contextvars.copy_context().run(evaluated)
        capacities.append(manager.get_capacity())
    return capacities


def engine_ahead() -> list[str]:
    """An episode admitted at a version the protocol's trainer has not made (the engine ahead): what
    ``admit`` raises, and what the trainer's next check reports."""
    manager = dropin.ProtocolStalenessManager(Version(1), 100, 4, 2)
    got = []
    for check in (lambda: manager.admit(7, 1), manager.raise_errors):
        try:
            check()
            got.append("passed")
        except Exception as error:
            got.append(f"{type(error).__name__}: {error}")
    return got


def differences() -> dict[str, Any]:
    """The table's numbers. At version 5, eta 2, batch 4, no cap: AReaL's manager, new at version 5 (a
    rollout built mid-run), starts ``(eta + 5 + 1) * 4``; the drop-in's, its protocol having trained 5
    batches, ``(eta + 1) * 4``. Trained oldest first, one batch per version from 5, AReaL's sample ``i``
    (from 1) is ``(i - 1) // 4`` versions late. And AReaL's recover hook and pending limit against the drop-in's."""
    version, eta, batch = 5, 2, 4
    areal = StalenessManager(version_provider=Version(version), max_concurrent_rollouts=10_000, consumer_batch_size=batch,
                             max_staleness=eta)
    protocol = LockedStalenessManager.create(eta, batch)
    for v in range(version):  # five trained batches: the protocol at version 5
        for g in range(batch):
            protocol.reserve(f"{v}-{g}", v)
            protocol.occupy(f"{v}-{g}")
        protocol.consume()
    ours = dropin.ProtocolStalenessManager(Version(version), 10_000, batch, eta, protocol=protocol)
    admitted = [started(areal), started(ours)]
    late = [i // batch for i in range(admitted[0])]  # sample i + 1, trained at version 5 + i // batch
    excess = late[admitted[1]:]
    recovered = StalenessManager(version_provider=Version(version), max_concurrent_rollouts=10_000, consumer_batch_size=batch,
                                 max_staleness=eta)
    recovered.on_version_recovered(version)
    fresh = dropin.ProtocolStalenessManager(Version(version), 10_000, batch, eta)
    try:
        fresh.on_version_recovered(version)
        refusal = "accepted"
    except ValueError as error:
        refusal = str(error)
    pending = [areal.get_pending_limit(), fresh.get_pending_limit(),
               dropin.ProtocolStalenessManager(Version(), 10, batch, eta, protocol=LockedStalenessManager.create(eta, batch, 1))
               .get_pending_limit()]  # AReaL's, the drop-in's, the drop-in's with redundancy 1
    return {"admitted": admitted, "excess_samples": [admitted[1] + 1, admitted[0]], "excess_late": [min(excess), max(excess)],
            "past_eta": sum(lag > eta for lag in late), "recovered_areal_starts": started(recovered), "recovered_dropin": refusal,
            "pending_limit": pending, "evaluation_episode": section(evaluation_episode), "engine_ahead": section(engine_ahead)}


def section(run: Callable[[], Any]) -> Any:
    try:
        return run()
    except Exception as error:  # reported, so that each behaviour fails on its own
        return f"error: {type(error).__name__}: {error}"


def main() -> None:
    print(json.dumps({"default_cap": section(default_cap), "attributes": section(attribute_values), "zero_batch": section(zero_batch),
                      "constructor": section(constructor), "callbacks_without_context": section(callbacks_without_context),
                      "differences": section(differences)}))


if __name__ == "__main__":
    main()

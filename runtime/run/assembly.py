"""Assembling a run: the one function that turns a run's description and its parts into a
:class:`~staleflow.runtime.run.loop.RunLoop`, for ``staleflow train``, ``staleflow simulate`` and the
chaos tester alike.

A :class:`RunSpec` says what to run (the system's policy, the bound, the batch, the tick, the
reward timeout); it comes from a job config (:meth:`RunSpec.from_job`) or a simulated workload
(:meth:`RunSpec.from_workload`). :class:`~staleflow.runtime.run.loop.RunParts` are the engines, the
trainer, the prompts, the clock and the servers, which the caller builds from real or simulated
bindings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from staleflow.protocol.events import EventHook
from staleflow.runtime.interfaces import Clock
from staleflow.runtime.run.loop import RunLoop, RunParts, RunSettings
from staleflow.runtime.settings.policies import SystemPolicy, make_policy

if TYPE_CHECKING:
    from staleflow.runtime.settings.config import JobConfig
    from staleflow.runtime.settings.workload import Workload

#: The coordinator's full-tick period when a run does not set one: one simulated second on a
#: virtual clock (simulated instances report events exactly), 5 ms of polling on a real one.
DEFAULT_TICK_S = {True: 1.0, False: 0.005}


@dataclass(frozen=True)
class RunSpec:
    """What to run; see :class:`~staleflow.runtime.run.loop.RunSettings` for the fields' meaning.

    ``tick_s`` None takes :data:`DEFAULT_TICK_S` for the run's clock.
    """

    policy: SystemPolicy
    eta: int
    batch_size: int
    tick_s: float | None = None
    reward_timeout_s: float = 30.0
    pending_groups: int | None = None

    @classmethod
    def from_job(cls, config: JobConfig) -> RunSpec:
        """A training job's run: its system with the knobs the config sets."""
        policy = make_policy(
            config.system.value,
            batch_redundancy=config.protocol.redundancy,
            group_redundancy=config.rollout.group_extra,
            **config.coordinator.policy_knobs(),
        )
        return cls(
            policy,
            eta=config.protocol.eta,
            batch_size=config.protocol.batch_groups,
            tick_s=config.coordinator.tick_s,
            reward_timeout_s=config.task.reward_timeout_s,
        )

    @classmethod
    def from_workload(
        cls, workload: Workload, system: str, eta: int, tick_s: float | None = None, **knobs: Any
    ) -> RunSpec:
        """A simulated workload's run of ``system`` (``knobs`` override the policy's)."""
        return cls(
            make_policy(system, **knobs),
            eta=eta,
            batch_size=workload.batch.groups_per_step,
            tick_s=workload.simulation.tick_s if tick_s is None else tick_s,
        )

    def settings(self, clock: Clock) -> RunSettings:
        return RunSettings(
            eta=self.eta,
            batch_size=self.batch_size,
            tick_s=self.tick_s if self.tick_s is not None else DEFAULT_TICK_S[clock.simulated],
            reward_timeout_s=self.reward_timeout_s,
            pending_groups=self.pending_groups,
        )


def assemble_run(
    spec: RunSpec,
    parts: RunParts,
    event_hooks: Sequence[EventHook] = (),
    trace_path: str | Path | None = None,
) -> RunLoop:
    """The run loop for ``spec`` over ``parts``; with ``trace_path`` it writes the protocol trace
    there (a resumed run appends a segment that starts from the restored protocol state)."""
    return RunLoop(parts, spec.policy, spec.settings(parts.clock), event_hooks=event_hooks, trace_path=trace_path)

"""The run loop: engines, rewards, protocol, trainer, parameter server and coordinator, on one clock.

The loop only sequences; each duty's work lives in its own module. Every change of a group goes
through :class:`~staleflow.runtime.run.group_life.GroupLife`, every engine call through the
:class:`~staleflow.runtime.run.instance_driver.InstanceDriver`, and the coordinator is fed, never
called back: what the driver observed and what GroupLife cancelled is stepped into it
(:meth:`Coordinator.step <staleflow.runtime.coordination.coordinator.Coordinator.step>`), and the
commands its ``ready()`` hands out are carried out by the driver. Each iteration, at ``now``:

1. **collect** finished trajectories from the instances with events due (all of them when they do
   not announce event times: real engines): GroupLife keeps them and hands each complete group to
   the reward runner (:mod:`~staleflow.runtime.run.rewarding`); the coordinator is told the requests
   left, gets the snapshot, and aborts the siblings a complete group no longer needs;
2. **reward**: rewarded groups Occupy their protocol entry, a failed reward aborts the group
   (:mod:`~staleflow.runtime.run.group_life`, the one owner of a group's life);
3. **train**: a finished step's weights are published (:mod:`~staleflow.runtime.run.weight_sync`:
   in the background with a real clock, so the push overlaps the next step; failed pushes retried
   in order), and an idle trainer starts the next step as soon as the protocol can Consume a batch
   (the coordinator is told the step started, and aborts what the batch's drops cancelled);
4. **observe**: every ``tick_s``, every instance's snapshot is refreshed and failed instances are
   probed (:mod:`~staleflow.runtime.run.instance_driver`, :mod:`~staleflow.runtime.run.instance_health`),
   and the coordinator gets what they showed (after the refill, which they do not depend on); on a
   simulated clock a *quiet* tick, whose decision reads no instance's load, takes them only if
   something happens before the next tick (:mod:`~staleflow.runtime.coordination.quiet_tick`);
5. **refill** the pending prompt groups from the dataset (through GroupLife);
6. **decide**: a :class:`~staleflow.runtime.coordination.observations.Tick` starts a decision; the
   re-queues and admissions it asks for are made through GroupLife and stepped back
   (:func:`~staleflow.runtime.run.decision.decide`), and its Abort / Pull / Interrupt / Route
   commands are carried out;
7. **advance**: the clock sleeps (real) or jumps (virtual) to the earliest of the next tick, the
   trainer's next event and the engines' next events.

Every protocol operation goes to the manager's event hooks (e.g. a JSONL trace writer). Statistics
are in :mod:`~staleflow.runtime.run.run_stats`, the checkpoint format in :mod:`~staleflow.runtime.run.run_state`.
Use :func:`~staleflow.runtime.run.assembly.assemble_run` to build a loop from its parts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from staleflow.protocol import StalenessManager
from staleflow.protocol.events import EventHook
from staleflow.protocol.trace import JsonlTraceWriter
from staleflow.runtime.coordination.commands import Command
from staleflow.runtime.coordination.coordinator import Coordinator
from staleflow.runtime.coordination.cost_fit import OnlineCostModel
from staleflow.runtime.coordination.cost_model import CostModel
from staleflow.runtime.coordination.observations import (
    Cancelled,
    CheckpointStarted,
    CostModelFitted,
    InstanceLost,
    Observation,
    RequestsLeft,
    RunStarted,
    StepStarted,
    Tick,
)
from staleflow.runtime.coordination.quiet_tick import decision_reads_load
from staleflow.runtime.interfaces import Clock, RolloutEngine, Trainer
from staleflow.runtime.run.decision import decide
from staleflow.runtime.run.group_life import CompletionLedger, GroupLife
from staleflow.runtime.run.instance_driver import InstanceDriver
from staleflow.runtime.run.rewarding import RewardFn, RewardRunner
from staleflow.runtime.run.run_spec import RunSpec
from staleflow.runtime.run.run_state import STATE_FORMAT, check_run_state
from staleflow.runtime.run.run_stats import RunMetrics, RunStats
from staleflow.runtime.run.weight_sync import WeightPublisher
from staleflow.runtime.servers.audit import AuditReport, held_at_last_collect
from staleflow.runtime.servers.parameter_server import ParameterServer
from staleflow.runtime.servers.trajectory_server import TrajectoryServer
from staleflow.runtime.types import Cancellations, PromptGroup

__all__ = ["RunLoop", "RunMetrics", "RunParts", "RunStalledError"]


class RunStalledError(RuntimeError):
    """Nothing can happen any more: no event is due and the trainer cannot get a batch."""


@dataclass
class RunParts:
    """The parts a run drives.

    ``engines``: the rollout instances (empty, at version 0 unless the run is resumed); ``trainer``: its ``weights()`` at
    start are version 0; ``prompts``: prompt groups, drawn as needed (with group redundancy a group with ``n_extra == 0``
    gets the policy's); ``cost_model``: the instances' cost model (routing, migration), fixed or fitted online to the
    engines' decode steps (:class:`~staleflow.runtime.coordination.cost_fit.OnlineCostModel`); ``clock``: virtual for
    simulated parts, real for real ones; the servers: objects or Ray proxies (fresh in-process ones by default);
    ``reward_fn(trajectory, group_metadata) -> float`` (None: no rewards, as in simulation); ``prefill(tokens)``: seconds
    an instance takes to rebuild a context of so many tokens (tail moves weigh it; None: no tail moves).
    """

    engines: Sequence[RolloutEngine]
    trainer: Trainer
    prompts: Iterable[PromptGroup]
    cost_model: CostModel | OnlineCostModel
    clock: Clock
    trajectory_server: TrajectoryServer | None = None
    parameter_server: ParameterServer | None = None
    reward_fn: RewardFn | None = None
    prefill: Callable[[int], float] | None = None


class RunLoop:
    """Drives one run (the module docstring lists its duties).

    Args:
        parts: what it drives (:class:`RunParts`).
        spec: the system's policy, the bound, the batch... (:class:`~staleflow.runtime.run.run_spec.RunSpec`).
        event_hooks: protocol event hooks (metrics, checkers).
        trace_path: write the protocol trace here (JSONL, checkable by ``staleflow verify``); a
            resumed run appends a new segment that starts from the restored protocol state.
        trace_refusals: trace every refused reserve too (the chaos tester validates them); by
            default they are only counted (``manager.stats()``), which keeps a trace small.
    """

    def __init__(
        self, parts: RunParts, spec: RunSpec, event_hooks: Sequence[EventHook] = (), trace_path: str | Path | None = None,
        trace_refusals: bool = False,
    ) -> None:
        self.spec = spec
        self.policy = policy = spec.policy
        self.clock = parts.clock
        self.tick_s = spec.tick_for(self.clock)
        self.trainer = parts.trainer
        self.stats = RunStats()
        self.ts = parts.trajectory_server if parts.trajectory_server is not None else TrajectoryServer()
        self.ps = parts.parameter_server if parts.parameter_server is not None else ParameterServer()
        self._event_hooks = list(event_hooks)
        self._trace_path = trace_path
        self._trace_refusals = trace_refusals
        self._trace: JsonlTraceWriter | None = None
        self._resumed = False
        eta = policy.protocol_eta(spec.eta)
        manager: StalenessManager | CompletionLedger
        if policy.keeps_bound:
            manager = StalenessManager(eta, spec.batch_size, policy.batch_redundancy)
        else:
            if trace_path is not None:
                raise ValueError(f"system {policy.name!r} does not keep the bound: it has no protocol trace to write")
            manager = CompletionLedger(eta, spec.batch_size, policy.consumption, policy.filter_stale)
        for hook in self._event_hooks:
            manager.add_event_hook(hook)
        self.groups = GroupLife(manager, self.ts)
        self.instances = InstanceDriver(parts.engines, self.ts, self.ps, self.clock, self.stats.counters)
        self.costs = OnlineCostModel.of(parts.cost_model)
        self.coordinator = Coordinator(
            self.groups, policy, self.costs.model, self.instances.first_snapshots(), spec.transfer, parts.prefill)
        self.weights = WeightPublisher(self.ps, background=not self.clock.simulated, counters=self.stats.counters)
        self.rewards = RewardRunner(parts.reward_fn, spec.reward_timeout_s)
        self._prompts: Iterator[PromptGroup] = iter(parts.prompts)
        self._prompts_drawn = 0
        self._pending_target = spec.pending_groups or 2 * spec.batch_size * (manager.eta + 1)
        self._training: int | None = None  # buffer index of the running step
        self._next_tick = 0.0
        self._started = False
        self._same_time = 0

    @property
    def manager(self) -> StalenessManager | CompletionLedger:
        """The staleness protocol (replaced when a checkpoint is loaded), or a peer system's ledger."""
        return self.groups.manager

    @property
    def engines(self) -> dict[str, RolloutEngine]:
        return self.instances.engines

    # ----------------------------------------------------------------- the loop
    def run(self, steps: int, on_step: Callable[[], None] | None = None) -> RunMetrics:
        """Run until ``steps`` more training steps have finished; returns the metrics of the run so far.
        ``on_step`` is called after each finished step (progress reports); the metrics, whose audit
        walks every request of the run, are computed once at the end."""
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        if not self._started:
            self._start()
        target = self.stats.steps_done + steps
        idle_iterations = 0
        while self.stats.steps_done < target:
            now = self.clock.now()
            progress = self._collect(now)  # 1
            progress |= self._apply_rewards()  # 2
            done = self.stats.steps_done
            progress |= self._train(now, target)  # 3
            progress |= self.weights.retry()
            if on_step is not None and self.stats.steps_done > done:
                on_step()
            full = now >= self._next_tick
            self._refill()  # 5
            trainer_waits = self._training is None and not self.manager.can_consume()
            tick = Tick(self.ps.latest_version(), full, trainer_waits)
            quiet = full and self._quiet(tick)
            if full and not quiet:  # 4
                self._observe(self.instances.refresh(now, self.tick_s))
            if full:
                self._next_tick = now + self.tick_s
                if self.costs.due(now) and self.costs.refit(now, self.instances.decode_steps()):
                    self.coordinator.step(CostModelFitted(self.costs.model))
            commands = decide(self.coordinator, self.groups, tick)  # 6
            if quiet:
                self._settle_quiet(now, commands)
            self._carry_out(commands)
            self.stats.instances_busy(now, {iid: self.coordinator.holds_requests(iid) for iid in self.instances.take_touched()})
            progress |= bool(commands)
            idle_iterations = 0 if progress else idle_iterations + 1
            self._advance(now, idle_iterations)  # 7
        return self.metrics()

    def _quiet(self, tick: Tick) -> bool:
        """Whether this tick's snapshots may wait (:mod:`~staleflow.runtime.coordination.quiet_tick`):
        a simulated run, every instance up, and a decision that reads no instance's load."""
        return (
            self.clock.simulated
            and not self.instances.down
            and not decision_reads_load(self.coordinator, tick.ps_version, tick.trainer_waits)
        )

    def _settle_quiet(self, now: float, commands: Sequence[Command]) -> None:
        """After a quiet tick's decision: if nothing comes before the next tick (which snapshots every
        instance again), the snapshots left out are never read and are only counted as taken; else
        they are taken now, at the same time and before any command, as the tick would have."""
        trainer_next = self.trainer.next_event_time()
        if commands or self.instances.event_before(self._next_tick) or (trainer_next is not None and trainer_next < self._next_tick):
            self._observe(self.instances.refresh(now, self.tick_s))
        else:
            self.instances.defer_refresh(now, self.tick_s)
            self.stats.counters["quiet_ticks"] += 1

    def _attach_trace(self) -> None:
        """Start writing the trace before the first protocol operation (after a checkpoint load,
        so that a resumed segment starts from the restored state)."""
        if self._trace_path is not None and self._trace is None:
            self._trace = JsonlTraceWriter.attach(
                self.manager, self._trace_path, "a" if self._resumed else "w", refusals=self._trace_refusals)

    def _start(self) -> None:
        self._started = True
        self._attach_trace()
        now = self.clock.now()
        self.stats.start(now)
        self._next_tick = now
        if self.ps.latest_version() is None:
            self.weights.push_now(self.manager.version, self.trainer.weights(), "the initial weights")
        latest = self.ps.latest_version()
        assert latest is not None
        self.coordinator.step(RunStarted(latest))
        self._carry_out(self.coordinator.ready().commands)

    def _observe(self, observations: Iterable[Observation]) -> None:
        """Hand what was observed to the coordinator, in order."""
        for observation in observations:
            self.coordinator.step(observation)

    def _carry_out(self, commands: Sequence[Command]) -> None:
        """Carry out commands on the instances; the coordinator is told of any instance lost doing so."""
        self._observe(self.instances.execute(commands))

    def _abort(self, cancelled: Cancellations) -> None:
        """Abort running requests a group change cancelled."""
        self.coordinator.step(Cancelled(cancelled))
        self._carry_out(self.coordinator.ready().commands)

    def _advance(self, now: float, idle_iterations: int) -> None:
        times = [self._next_tick]
        trainer_next = self.trainer.next_event_time()
        if trainer_next is not None:
            times.append(trainer_next)
        times.extend(t for t in self.instances.next_event.values() if t is not None)
        wake = max(min(times), now)
        if self.clock.simulated:
            self._same_time = self._same_time + 1 if wake == now else 0
            if (idle_iterations > 2 and not self._has_work()) or self._same_time > 1000:
                raise RunStalledError(self._stall_reason(now))
        self.clock.sleep_until(wake)

    def _has_work(self) -> bool:
        return (
            self._training is not None
            or self.rewards.pending() > 0
            or any(v.requests for v in self.coordinator.views)
            or any(v.loading for v in self.coordinator.views)
            or self.weights.behind
            or bool(self.instances.down)
            or self.ps.latest_version() != self.manager.version  # a push not visible yet
        )

    def _stall_reason(self, now: float) -> str:
        return (
            f"run stalled at t={now:.3f}: step {self.stats.steps_done}, protocol counts {self.manager.counts()}, "
            f"{self.ts.queued_count()} queued requests, {self.ts.pending_count()} pending groups, "
            "no engine or trainer event due"
        )

    # ----------------------------------------------------------------- 1. collect
    def _collect(self, now: float) -> bool:
        progress = False
        for iid in self.instances.due(now):
            progress |= self._collect_from(iid)
        return progress

    def _collect_from(self, iid: str) -> bool:
        if iid in self.instances.down:
            return False
        trajectories = self.instances.collect(iid)
        if isinstance(trajectories, InstanceLost):
            self.coordinator.step(trajectories)
            return True
        cancel: list[tuple[str, str]] = []
        for trajectory in trajectories:
            outcome = self.groups.finish(iid, trajectory)
            self.stats.tokens_generated += len(trajectory.output_ids)
            if outcome.completed is not None:
                group = outcome.completed.group
                self.rewards.submit(group.group_id, outcome.completed.trajectories, group.metadata)
            cancel.extend(outcome.cancel)
            self.stats.counters["cancelled_requests"] += len(outcome.cancel)
        if trajectories:
            left = tuple(t.request_id for t in trajectories), tuple(len(t.output_ids) for t in trajectories)
            self.coordinator.step(RequestsLeft(iid, *left))
        observations = self.instances.look(iid)
        self._observe(observations)
        if isinstance(observations[-1], InstanceLost):
            return True
        if cancel:
            self._abort(tuple(cancel))
        return bool(trajectories)

    # ----------------------------------------------------------------- 2. reward
    def _apply_rewards(self, block: bool = False) -> bool:
        outcomes = self.rewards.poll(block=block or self.clock.simulated)
        for outcome in outcomes:
            if self.groups.reward(outcome) and outcome.error is not None:
                self.stats.counters["reward_failures"] += 1
        return bool(outcomes)

    # ----------------------------------------------------------------- 3. train
    def _train(self, now: float, target: int) -> bool:
        progress = False
        if self._training is not None:
            result = self.trainer.poll()
            if result is None:
                return False
            if result.version != self._training + 1:
                raise RuntimeError(
                    f"trainer produced version {result.version} from buffer {self._training}; expected {self._training + 1}"
                )
            self.weights.push(result.version, self.trainer.weights())
            self._training = None
            self.stats.step_finished(now, result.metrics)
            progress = True
        if self.stats.steps_done < target and self.manager.can_consume():
            idle = now - self.stats.last_step_end  # the first step always waits for its batch: no sign the lookahead is short
            waited = self.stats.steps_done > 0 and idle > (0.0 if self.clock.simulated else 2 * self.tick_s)
            self.coordinator.step(StepStarted(trainer_waited=waited))
            consumed = self.groups.consume()
            self.stats.batch_consumed(consumed.protocol, consumed.batch, len(consumed.cancel))
            self._abort(consumed.cancel)
            self.trainer.start_step(consumed.batch)
            self._training = consumed.protocol.version
            progress = True
        return progress

    # ----------------------------------------------------------------- 5. refill
    def _refill(self) -> None:
        while self.ts.pending_count() < self._pending_target:
            group = next(self._prompts, None)
            if group is None:
                return
            if self.policy.group_redundancy and group.n_extra == 0:
                group = replace(group, n_extra=self.policy.group_redundancy)
            self.groups.add([group])
            self._prompts_drawn += 1

    # ----------------------------------------------------------------- results
    def audit(self) -> AuditReport:
        """Collect from every engine, then check that the TS and the engines agree on every request
        (:func:`~staleflow.runtime.servers.audit.held_at_last_collect`: engines decode on while asked)."""
        self._attach_trace()
        for iid in self.instances.engines:
            self._collect_from(iid)
        held, lost = self.instances.held_requests()
        self._observe(lost)
        placed = self.ts.running_on()
        for iid in self.instances.engines:
            self._collect_from(iid)
        return self.ts.audit(held_at_last_collect(held, placed, self.ts.running_on(), self.instances.down))

    def metrics(self) -> RunMetrics:
        now = self.clock.now()
        report = self.audit()
        coordinator = {k: float(v) for k, v in self.coordinator.stats.items()}
        coordinator["decision_seconds"] = self.coordinator.decision_seconds
        metrics = self.stats.metrics(
            now, self.policy.name, self.instances.engines, report, coordinator,
            late_discards=self.ts.late_discards(), groups=self.groups, eta=self.spec.eta,
        )
        return replace(metrics, cost_fit=self.costs.figures(now))

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """A checkpoint between steps (:mod:`~staleflow.runtime.run.run_state`).

        Every running request is interrupted first, so its partial is in the trajectory server.
        The trainer must be idle (as it is when :meth:`run` returns); its own weights and optimizer
        state are the trainer's checkpoint, at version ``parameter_server.latest_version``.
        """
        if self._training is not None:
            raise RuntimeError("cannot checkpoint while a training step runs; checkpoint after run() returns")
        self._attach_trace()
        self.weights.wait()
        self.weights.flush("a checkpoint")  # it records the trainer's version as pushed
        self.coordinator.step(CheckpointStarted())
        self._carry_out(self.coordinator.ready().commands)
        for iid in self.instances.engines:
            self._collect_from(iid)
        while self.rewards.pending():
            self._apply_rewards(block=True)
        return {
            "format": STATE_FORMAT,
            "protocol": self.manager.snapshot(),
            "trajectory_server": self.ts.state_dict(),
            "parameter_server": self.ps.state_dict(),
            "groups": self.groups.state_dict(),
            "coordinator": self.coordinator.state_dict(),
            "instances_down": self.instances.down_state(),
            "prompts_drawn": self._prompts_drawn,
            **self.stats.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` (before :meth:`run`). The trainer must be at the saved version.

        The protocol is restored with every active group's version, so the bound holds across the
        resume; the caller skips ``state['prompts_drawn']`` prompts of its dataset.
        """
        if self._started or self._trace is not None:
            raise RuntimeError("load a checkpoint before the first run(), audit() or state_dict()")
        check_run_state(state, self.manager)
        self.groups.restore(state["protocol"], state["trajectory_server"], self._event_hooks)
        self.groups.load_state_dict(state["groups"])
        self._resumed = True
        saved = state["parameter_server"]["latest_version"]
        latest = self.ps.latest_version()
        if saved is not None and (latest is None or latest < saved):
            self.ps.push(saved, self.trainer.weights())
        self._prompts_drawn = int(state["prompts_drawn"])
        self.coordinator.load_state_dict(state["coordinator"])
        self._observe(self.instances.restore_down(state.get("instances_down", {})))  # absent from checkpoints before 2026-12
        self.stats.load_state_dict(state)

    def close(self) -> None:
        if self._trace is not None:
            self._trace.close()
        self.weights.close()
        self.rewards.close()
        self.instances.close()
        self.trainer.close()

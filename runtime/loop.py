"""The run loop: engines, rewards, protocol, trainer, parameter server and coordinator, on one clock.

Each iteration, at the clock's ``now``:

1. collect finished trajectories from the engines that have events due (all engines when they do
   not announce event times: real engines), hand them to the trajectory server, cancel siblings a
   complete group no longer needs, and send complete groups to the reward runner;
2. rewarded groups **Occupy** their protocol entry (a failed reward aborts the group);
3. the trainer: a finished step's weights are **pushed** to the parameter server (in the
   background with a real clock, so the push overlaps the next step), and an idle trainer starts
   the next step as soon as the protocol can **Consume** a batch;
4. the coordinator decides Pull / Interrupt / Route (+ Reserve) commands; every ``tick_s`` it first
   refreshes every instance's snapshot and may migrate;
5. the commands are carried out; then the clock sleeps (real) or jumps (virtual) to the earliest of
   the next tick, the trainer's next event and the engines' next events.

Every protocol operation goes to the manager's event hooks (e.g. a JSONL trace writer).

Faults: an engine call or weight transfer that raises :data:`INSTANCE_FAILURES` marks the instance
failed: the requests the trajectory server places on it go back to the queue from their last
partial, it gets no work until a probe (every tick) finds it answering and empty, and whatever it
still held is discarded. A failed push is retried in order; a pushed version not yet visible counts
as pending work. ``docs/reliability.md`` lists the faults these were found with.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from staleflow.protocol import StalenessManager
from staleflow.protocol.events import EventHook
from staleflow.protocol.trace import JsonlTraceWriter
from staleflow.runtime.clock import VirtualClock
from staleflow.runtime.commands import Abort, Command, Interrupt, Pull, Route
from staleflow.runtime.coordinator import Coordinator
from staleflow.runtime.cost_model import CostModel
from staleflow.runtime.interfaces import Clock, RolloutEngine, Trainer
from staleflow.runtime.parameter_server import ParameterServer, VersionNotAvailableError
from staleflow.runtime.policies import SystemPolicy
from staleflow.runtime.rewarding import RewardFn, RewardRunner
from staleflow.runtime.trajectory_server import (
    AuditReport,
    GroupState,
    TrajectoryServer,
)
from staleflow.runtime.types import InstanceSnapshot, PromptGroup

STATE_FORMAT = "staleflow.run_loop/1"
#: What a failed engine call or weight transfer raises (a dead actor, a lost connection): the
#: instance's state is then unknown, and the loop recovers its requests from the trajectory server.
INSTANCE_FAILURES = (ConnectionError, TimeoutError, VersionNotAvailableError)
#: Attempts at a push the loop cannot go on without (the first one; any left before a checkpoint).
PUSH_ATTEMPTS = 10


class RunStalledError(RuntimeError):
    """Nothing can happen any more: no event is due and the trainer cannot get a batch."""


@dataclass
class RunMetrics:
    """What a run measured. Times are the clock's seconds (virtual in simulation).

    ``tokens_generated``: response tokens of every finished trajectory (kept or not);
    ``tokens_trained``: response tokens of the trajectories in consumed batches; ``tokens_per_s``:
    trained tokens per second of the run. ``staleness_per_buffer[b][s]``: groups of batch ``b``
    generated ``s`` versions before it; ``staleness_histogram`` sums them over batches.
    ``dropped``: groups dropped by the protocol as redundancy waste; ``gc_aborted``: groups the
    staleness GC aborted; ``reward_failures``: groups whose reward raised or timed out;
    ``cancelled_requests``: group-level redundancy siblings cancelled. ``lost`` and ``duplicated``
    come from the trajectory-server audit at the end of the run and must be zero.
    """

    system: str
    steps: int
    elapsed_s: float
    tokens_generated: int
    tokens_trained: int
    tokens_per_s: float
    step_times_s: list[float]
    step_time_s: float
    utilisation: float
    instance_busy_fraction: dict[str, float]
    staleness_per_buffer: dict[int, dict[int, int]]
    staleness_histogram: dict[int, int]
    max_staleness: int
    dropped: int
    gc_aborted: int
    reward_failures: int
    cancelled_requests: int
    late_discards: int
    lost: int
    duplicated: int
    audit_ok: bool
    coordinator: dict[str, float]
    train_metrics: list[dict[str, float]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class RunLoop:
    """Drives one run.

    Args:
        engines: the rollout instances (each a :class:`RolloutEngine`; empty, at version 0 unless
            the run is resumed).
        trainer: the :class:`Trainer`; its ``weights()`` at start are version 0.
        prompts: prompt groups, drawn as needed. If the policy has group redundancy and a group has
            ``n_extra == 0``, the loop sets ``n_extra``; in simulation ``metadata['response_lengths']``
            must then have ``n_samples + n_extra`` entries.
        policy: the system (:func:`~staleflow.runtime.policies.make_policy`).
        eta: the staleness bound asked for (a policy may run with a smaller one: sync uses 0).
        batch_size: groups per training batch (``B``).
        cost_model: the instances' cost model (routing, migration).
        clock: :class:`~staleflow.runtime.clock.VirtualClock` for simulated parts,
            :class:`~staleflow.runtime.clock.RealClock` for real ones.
        trajectory_server, parameter_server: objects or Ray proxies; fresh in-process ones by default.
        reward_fn: ``reward_fn(trajectory, group_metadata) -> float``; None: no rewards (simulation).
        reward_timeout_s: per-group reward timeout (wall clock).
        tick_s: period of full coordinator ticks (snapshots of every instance, migration); with a
            real clock also the polling period. Default: 1 s virtual, 5 ms real.
        event_hooks: protocol event hooks (metrics, tests).
        trace_path: write the protocol trace here (JSONL, checkable by ``staleflow verify``); a
            resumed run appends a new segment that starts from the restored protocol state.
        pending_groups: how many drawn prompt groups to keep waiting for admission (default
            ``2 * batch_size * (eta + 1)``).
    """

    def __init__(
        self,
        *,
        engines: Sequence[RolloutEngine],
        trainer: Trainer,
        prompts: Iterable[PromptGroup],
        policy: SystemPolicy,
        eta: int,
        batch_size: int,
        cost_model: CostModel,
        clock: Clock,
        trajectory_server: TrajectoryServer | None = None,
        parameter_server: ParameterServer | None = None,
        reward_fn: RewardFn | None = None,
        reward_timeout_s: float = 30.0,
        tick_s: float | None = None,
        event_hooks: Sequence[EventHook] = (),
        pending_groups: int | None = None,
        trace_path: str | Path | None = None,
    ) -> None:
        self._virtual = isinstance(clock, VirtualClock)
        tick_s = tick_s if tick_s is not None else (1.0 if self._virtual else 0.005)
        if tick_s <= 0:
            raise ValueError(f"tick_s must be > 0, got {tick_s}")
        self.policy = policy
        self.clock = clock
        self.trainer = trainer
        self.engines = {engine.instance_id: engine for engine in engines}
        if len(self.engines) != len(engines):
            raise ValueError("engine instance ids must be unique")
        self.ts = trajectory_server if trajectory_server is not None else TrajectoryServer()
        self.ps = parameter_server if parameter_server is not None else ParameterServer()
        self._event_hooks = list(event_hooks)
        self._trace_path = trace_path
        self._trace: JsonlTraceWriter | None = None
        self._resumed = False
        self.manager = StalenessManager(policy.protocol_eta(eta), batch_size, policy.batch_redundancy)
        for hook in self._event_hooks:
            self.manager.add_event_hook(hook)
        self._down: set[str] = set()
        self.coordinator = Coordinator(
            self.manager, self.ts, policy, cost_model, [self._first_snapshot(e) for e in self.engines.values()]
        )
        self.rewards = RewardRunner(reward_fn, reward_timeout_s)
        self._prompts: Iterator[PromptGroup] = iter(prompts)
        self._prompts_drawn = 0
        self._pending_target = pending_groups or 2 * batch_size * (self.manager.eta + 1)
        self._tick_s = tick_s
        self._pusher = None if self._virtual else ThreadPoolExecutor(1, thread_name_prefix="push")
        self._push_future: Future[None] | None = None
        self._unpushed: list[tuple[int, Any]] = []  # failed pushes, retried in order
        self._training: int | None = None  # buffer index of the running step
        self._steps_done = 0
        self._last_step_end = 0.0
        self._next_tick = 0.0
        self._started = False
        self._same_time = 0
        self._next_event: dict[str, float | None] = {iid: None for iid in self.engines}
        self._busy_since: dict[str, float] = {}
        self._busy_total: dict[str, float] = defaultdict(float)
        self._touched: set[str] = set()
        self._observed_at: dict[str, float] = {}
        self._run_start = 0.0
        self._tokens_generated = 0
        self._tokens_trained = 0
        self._step_times: list[float] = []
        self._train_metrics: list[dict[str, float]] = []
        self._staleness: dict[int, Counter[int]] = {}
        self._counters: Counter[str] = Counter()

    # ----------------------------------------------------------------- the loop
    def run(self, steps: int, on_step: Callable[[], None] | None = None) -> RunMetrics:
        """Run until ``steps`` more training steps have finished; returns the metrics of the run so far.

        ``on_step`` is called after each finished step (progress reports); the metrics, whose audit
        walks every request of the run, are computed once at the end.
        """
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        if not self._started:
            self._start()
        target = self._steps_done + steps
        idle_iterations = 0
        while self._steps_done < target:
            now = self.clock.now()
            progress = self._collect(now)
            progress |= self._apply_rewards()
            done = self._steps_done
            progress |= self._train(now, target)
            progress |= self._retry_pushes()
            if on_step is not None and self._steps_done > done:
                on_step()
            full = now >= self._next_tick
            if full:
                self._refresh_snapshots(now)
                self._next_tick = now + self._tick_s
            self._refill()
            commands: list[Command] = []
            if self.policy.gc_stale and self._training is None and not self.manager.can_consume():
                commands += self.coordinator.abort_stale_groups()  # first: no route to a cancelled request
            commands += self.coordinator.plan(self.ps.latest_version(), full)
            self._execute(commands)
            self._mark_busy(now)
            progress |= bool(commands)
            idle_iterations = 0 if progress else idle_iterations + 1
            self._advance(now, idle_iterations)
        return self.metrics()

    def _start(self) -> None:
        self._started = True
        if self._trace_path is not None:
            self._trace = JsonlTraceWriter.attach(self.manager, self._trace_path, "a" if self._resumed else "w")
        self._run_start = self.clock.now()
        self._next_tick = self._run_start
        self._last_step_end = self._run_start
        if self.ps.latest_version() is None:
            self._unpushed.append((self.manager.version, self.trainer.weights()))
            self._flush_pushes("the initial weights")
        latest = self.ps.latest_version()
        assert latest is not None
        self._execute([self.coordinator.pull(v.instance_id, latest) for v in self.coordinator.views if v.version != latest])

    def _advance(self, now: float, idle_iterations: int) -> None:
        times = [self._next_tick]
        trainer_next = self.trainer.next_event_time()
        if trainer_next is not None:
            times.append(trainer_next)
        times.extend(t for t in self._next_event.values() if t is not None)
        wake = max(min(times), now)
        if self._virtual:
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
            or bool(self._unpushed)
            or bool(self._down)
            or self.ps.latest_version() != self.manager.version  # a push not visible yet
        )

    def _stall_reason(self, now: float) -> str:
        return (
            f"run stalled at t={now:.3f}: step {self._steps_done}, protocol counts {self.manager.counts()}, "
            f"{self.ts.queued_count()} queued requests, {self.ts.pending_count()} pending groups, "
            "no engine or trainer event due"
        )

    # ----------------------------------------------------------------- engines
    def _due_engines(self, now: float) -> list[str]:
        return [iid for iid, t in self._next_event.items() if t is None or t <= now]

    def _collect(self, now: float) -> bool:
        progress = False
        for iid in self._due_engines(now):
            progress |= self._collect_from(iid)
        return progress

    def _collect_from(self, iid: str) -> bool:
        if iid in self._down:
            return False
        try:
            return self._collect_from_engine(iid)
        except INSTANCE_FAILURES:
            self._instance_failed(iid)
            return True

    def _collect_from_engine(self, iid: str) -> bool:
        engine = self.engines[iid]
        trajectories = engine.collect()
        cancel: list[tuple[str, str]] = []
        for trajectory in trajectories:
            outcome = self.ts.finish(iid, trajectory)
            self._tokens_generated += len(trajectory.output_ids)
            self.coordinator.forget(iid, [trajectory.request_id])
            if outcome.group_complete:
                group = self.ts.group(trajectory.group_id)
                self.rewards.submit(group.group_id, self.ts.trajectories(group.group_id), group.metadata)
            cancel.extend(outcome.cancel)
            self._counters["cancelled_requests"] += len(outcome.cancel)
        self.coordinator.observe(engine.snapshot())
        self._observed_at[iid] = self.clock.now()
        self._next_event[iid] = engine.next_event_time()
        self._touched.add(iid)
        if cancel:
            self._execute(self.coordinator.cancel(cancel))
        return bool(trajectories)

    def _refresh_snapshots(self, now: float) -> None:
        """Snapshot every instance not observed within the last tick."""
        for iid, engine in self.engines.items():
            if iid in self._down:
                self._probe(iid)
            elif now - self._observed_at.get(iid, -math.inf) >= self._tick_s:
                try:
                    self.coordinator.observe(engine.snapshot())
                except INSTANCE_FAILURES:
                    self._instance_failed(iid)
                    continue
                self._observed_at[iid] = now
                self._touched.add(iid)

    # ----------------------------------------------------------------- failed instances
    def _first_snapshot(self, engine: RolloutEngine) -> InstanceSnapshot:
        """The engine's snapshot; if it is down, or holds requests this loop did not route (left
        from before a restart), an empty loading one: the instance is then probed every tick."""
        try:
            snapshot = engine.snapshot()
            if not (snapshot.running or snapshot.waiting):
                return snapshot
        except INSTANCE_FAILURES:
            pass
        self._down.add(engine.instance_id)
        return InstanceSnapshot(engine.instance_id, 0, (), (), 0, 0, 0.0, self.clock.now(), loading=True)

    def _instance_failed(self, iid: str) -> None:
        """An engine call failed: whatever the instance held is presumed lost. Its requests go back
        to the queue from the last partial the trajectory server has, and it gets no work until a
        probe finds it answering (then anything it still holds is discarded, so nothing runs twice)."""
        placed = sorted(self.ts.running_on().get(iid, ()))
        self.coordinator.instance_down(iid)
        self.ts.requeue([self.ts.request(rid) for rid in placed], iid)
        self._down.add(iid)
        self._next_event[iid] = None
        self._touched.add(iid)
        self._counters["instance_failures"] += 1
        self._counters["requests_recovered"] += len(placed)

    def _probe(self, iid: str) -> None:
        """Bring a failed instance back once it answers and holds nothing (late results dropped)."""
        engine = self.engines[iid]
        try:
            late = engine.collect()
            held = engine.snapshot()
            if held.running or held.waiting:
                engine.abort([*held.running, *held.waiting])
                return  # taken back on a later probe, once a snapshot shows it empty
            snapshot = engine.snapshot()
            next_event = engine.next_event_time()
        except INSTANCE_FAILURES:
            return
        if snapshot.running or snapshot.waiting:
            return
        self._counters["late_results_discarded"] += len(late)
        self._down.discard(iid)
        self.coordinator.instance_up(snapshot)
        self._next_event[iid] = next_event
        self._touched.add(iid)

    def _execute(self, commands: Sequence[Command]) -> None:
        for command in commands:
            if command.instance_id in self._down:
                continue  # its requests were re-queued; requests routed to it are still queued
            try:
                self._execute_one(command)
            except INSTANCE_FAILURES:
                self._instance_failed(command.instance_id)

    def _execute_one(self, command: Command) -> None:
        engine = self.engines[command.instance_id]
        if isinstance(command, Route):
            engine.submit(self.ts.mark_routed(command.request_ids, command.instance_id))
        elif isinstance(command, Interrupt):
            self.ts.requeue(engine.interrupt(command.request_ids), command.instance_id)
        elif isinstance(command, Pull):
            version, weights = self.ps.pull(command.version)
            engine.load_weights(version, weights)
        elif isinstance(command, Abort):
            engine.abort(command.request_ids)
        else:
            raise TypeError(f"unknown command {command!r}")
        self._counters[f"command_{type(command).__name__.lower()}"] += 1
        self._next_event[command.instance_id] = engine.next_event_time()
        self._touched.add(command.instance_id)

    def _mark_busy(self, now: float) -> None:
        for iid in self._touched:
            busy = bool(self.coordinator.view(iid).requests)
            since = self._busy_since.get(iid)
            if busy and since is None:
                self._busy_since[iid] = now
            elif not busy and since is not None:
                self._busy_total[iid] += now - since
                del self._busy_since[iid]
        self._touched.clear()

    # ----------------------------------------------------------------- rewards, protocol, trainer
    def _apply_rewards(self, block: bool = False) -> bool:
        outcomes = self.rewards.poll(block=block or self._virtual)
        for outcome in outcomes:
            if self.ts.group_state(outcome.group_id) is not GroupState.REWARDING:
                continue  # dropped while its reward ran
            if outcome.error is not None:
                self.ts.fail_group(outcome.group_id, outcome.error)
                self.manager.abort(outcome.group_id)
                self.coordinator.groups_removed(1)
                self._counters["reward_failures"] += 1
            else:
                self.ts.set_rewards(outcome.group_id, outcome.rewards)
                self.manager.occupy(outcome.group_id)
        return bool(outcomes)

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
            self._push(result.version, self.trainer.weights())
            self._training = None
            self._steps_done += 1
            self._step_times.append(now - self._last_step_end)
            self._last_step_end = now
            self._train_metrics.append(dict(result.metrics))
            progress = True
        if self._steps_done < target and self.manager.can_consume():
            self._start_step(now)
            progress = True
        return progress

    def _push(self, version: int, weights: Any) -> None:
        if self._pusher is None:
            self._unpushed.append((version, weights))
            self._retry_pushes()
            return
        if self._push_future is not None:
            self._push_future.result()  # one writer: the previous push finishes first
        self._push_future = self._pusher.submit(self.ps.push, version, weights)

    def _retry_pushes(self) -> bool:
        """Push what failed to push before, oldest first; True if something was pushed."""
        pushed = False
        while self._unpushed:
            try:
                self.ps.push(*self._unpushed[0])
            except INSTANCE_FAILURES:
                self._counters["push_failures"] += 1
                return pushed
            self._unpushed.pop(0)
            pushed = True
        return pushed

    def _flush_pushes(self, needed_by: str) -> None:
        """Retry the failed pushes until none is left; raise after :data:`PUSH_ATTEMPTS` rounds."""
        for _ in range(PUSH_ATTEMPTS):
            if not self._unpushed:
                return
            self._retry_pushes()
        if self._unpushed:
            raise RuntimeError(f"version {self._unpushed[0][0]} could not be pushed in {PUSH_ATTEMPTS} attempts ({needed_by} needs it)")

    def _start_step(self, now: float) -> None:
        batch = self.manager.consume()
        training_batch, cancel = self.ts.take_batch(
            batch.version, [str(g) for g in batch.group_ids], [str(g) for g in batch.dropped]
        )
        self.coordinator.groups_removed(len(batch.dropped))
        self._counters["dropped"] += len(batch.dropped)
        self._staleness[batch.version] = Counter(batch.version - v for v in batch.group_versions)
        self._tokens_trained += sum(len(t.output_ids) for ts in training_batch.groups.values() for t in ts)
        self._execute(self.coordinator.cancel(cancel))
        self._counters["cancelled_requests"] += len(cancel)
        self.trainer.start_step(training_batch)
        self._training = batch.version

    def _refill(self) -> None:
        while self.ts.pending_count() < self._pending_target:
            group = next(self._prompts, None)
            if group is None:
                return
            if self.policy.group_redundancy and group.n_extra == 0:
                group = replace(group, n_extra=self.policy.group_redundancy)
            self.ts.add_groups([group])
            self._prompts_drawn += 1

    # ----------------------------------------------------------------- results
    def audit(self) -> AuditReport:
        """Collect from every engine, then check that the TS and the engines agree on every request."""
        for iid in self.engines:
            self._collect_from(iid)
        held: dict[str, set[str]] = {}
        for iid, engine in self.engines.items():
            if iid in self._down:
                continue
            try:
                snapshot = engine.snapshot()
            except INSTANCE_FAILURES:
                self._instance_failed(iid)
                continue
            held[iid] = set(snapshot.running) | set(snapshot.waiting)
        for iid in self.engines:
            self._collect_from(iid)
        return self.ts.audit(held)

    def metrics(self) -> RunMetrics:
        now = self.clock.now()
        elapsed = max(now - self._run_start, 1e-12)
        busy = dict(self._busy_total)
        for iid, since in self._busy_since.items():
            busy[iid] = busy.get(iid, 0.0) + now - since
        busy_fraction = {iid: busy.get(iid, 0.0) / elapsed for iid in self.engines}
        histogram: Counter[int] = Counter()
        for counts in self._staleness.values():
            histogram.update(counts)
        report = self.audit()
        coordinator = {k: float(v) for k, v in self.coordinator.stats.items()}
        coordinator["decision_seconds"] = self.coordinator.decision_seconds
        coordinator.update({k: float(v) for k, v in self._counters.items() if k.startswith("command_")})
        return RunMetrics(
            system=self.policy.name,
            steps=self._steps_done,
            elapsed_s=elapsed,
            tokens_generated=self._tokens_generated,
            tokens_trained=self._tokens_trained,
            tokens_per_s=self._tokens_trained / elapsed,
            step_times_s=list(self._step_times),
            step_time_s=sum(self._step_times) / len(self._step_times) if self._step_times else 0.0,
            utilisation=sum(busy_fraction.values()) / len(busy_fraction),
            instance_busy_fraction=busy_fraction,
            staleness_per_buffer={b: dict(sorted(c.items())) for b, c in sorted(self._staleness.items())},
            staleness_histogram=dict(sorted(histogram.items())),
            max_staleness=max(histogram, default=0),
            dropped=self._counters["dropped"],
            gc_aborted=int(self.coordinator.stats["gc_aborted_groups"]),
            reward_failures=self._counters["reward_failures"],
            cancelled_requests=self._counters["cancelled_requests"],
            late_discards=self.ts.late_discards,
            lost=len(report.lost),
            duplicated=len(report.duplicated),
            audit_ok=report.ok,
            coordinator=coordinator,
            train_metrics=list(self._train_metrics),
        )

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """A checkpoint between steps: protocol, trajectory server (with partials), PS version, counters.

        Every running request is interrupted first, so its partial is in the trajectory server.
        The trainer must be idle (as it is when :meth:`run` returns); its own weights and optimizer
        state are the trainer's checkpoint, at version ``parameter_server.latest_version``.
        """
        if self._training is not None:
            raise RuntimeError("cannot checkpoint while a training step runs; checkpoint after run() returns")
        if self._push_future is not None:
            self._push_future.result()
        self._flush_pushes("a checkpoint")  # it records the trainer's version as pushed
        commands: list[Command] = []
        for view in self.coordinator.views:
            if view.requests:
                rids = tuple(view.requests)
                self.coordinator.forget(view.instance_id, rids)
                commands.append(Interrupt(view.instance_id, rids))
        self._execute(commands)
        for iid in self.engines:
            self._collect_from(iid)
        while self.rewards.pending():
            self._apply_rewards(block=True)
        return {
            "format": STATE_FORMAT,
            "protocol": self.manager.snapshot(),
            "trajectory_server": self.ts.state_dict(),
            "parameter_server": self.ps.state_dict(),
            "steps_done": self._steps_done,
            "prompts_drawn": self._prompts_drawn,
            "coordinator": self.coordinator.state_dict(),
            "counters": dict(self._counters),
            "tokens": [self._tokens_generated, self._tokens_trained],
            "staleness": {str(b): {str(s): n for s, n in c.items()} for b, c in self._staleness.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` (before :meth:`run`). The trainer must be at the saved version.

        The protocol is restored with every active group's version, so the bound holds across the
        resume; the caller skips ``state['prompts_drawn']`` prompts of its dataset.
        """
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a run-loop checkpoint (expected format {STATE_FORMAT!r})")
        if self._started:
            raise RuntimeError("load a checkpoint before the first run()")
        self._check_checkpoint(state)
        self.manager = StalenessManager.restore(state["protocol"])
        for hook in self._event_hooks:
            self.manager.add_event_hook(hook)
        self.coordinator.manager = self.manager
        self._resumed = True
        self.ts.load_state_dict(state["trajectory_server"])
        saved = state["parameter_server"]["latest_version"]
        latest = self.ps.latest_version()
        if saved is not None and (latest is None or latest < saved):
            self.ps.push(saved, self.trainer.weights())
        self._steps_done = int(state["steps_done"])
        self._prompts_drawn = int(state["prompts_drawn"])
        self.coordinator.load_state_dict(state["coordinator"])
        self._counters = Counter(state["counters"])
        self._tokens_generated, self._tokens_trained = state["tokens"]
        self._staleness = {int(b): Counter({int(s): n for s, n in c.items()}) for b, c in state["staleness"].items()}

    def _check_checkpoint(self, state: Mapping[str, Any]) -> None:
        """Refuse, naming the problem and before changing anything, a checkpoint this loop cannot continue."""
        sections = ("protocol", "trajectory_server", "parameter_server", "steps_done", "prompts_drawn",
                    "coordinator", "counters", "tokens", "staleness")
        missing = [name for name in sections if name not in state]
        if missing:
            raise ValueError(f"run-loop checkpoint lacks {', '.join(missing)}")
        protocol = state["protocol"]
        for name in ("eta", "batch_size", "redundancy"):
            if protocol.get(name) != getattr(self.manager, name):
                raise ValueError(
                    f"checkpoint has protocol {name}={protocol.get(name)!r}, this run {name}={getattr(self.manager, name)}"
                )
        pushed = state["parameter_server"].get("latest_version")
        if pushed is not None and pushed > protocol.get("version", -1):
            raise ValueError(
                f"checkpoint is inconsistent: parameter-server version {pushed} is ahead of protocol version "
                f"{protocol.get('version')}"
            )

    def close(self) -> None:
        if self._trace is not None:
            self._trace.close()
        if self._push_future is not None:
            self._push_future.result()
        if self._pusher is not None:
            self._pusher.shutdown()
        self.rewards.close()
        for engine in self.engines.values():
            try:
                engine.close()
            except INSTANCE_FAILURES:
                pass  # a dead instance has nothing left to close
        self.trainer.close()

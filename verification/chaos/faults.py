"""Seeded fault injectors around the runtime's seams, for deterministic simulation testing.

Each injector wraps one seam and behaves like it, except when its seeded draws say otherwise:

* :class:`FaultyEngine` (a :class:`~staleflow.runtime.interfaces.RolloutEngine`): the instance
  **crashes** mid-generation (its work is lost; every call raises :class:`InstanceCrashedError`
  until it comes back empty at version 0, as a restarted Ray actor does), **stalls** (it makes no
  progress for a while), a **Pull fails** (``load_weights`` raises :class:`WeightSyncError`
  before changing anything) or is **slow** (the instance is blocked longer), its **finished
  trajectories are delayed** in transit, and its **snapshots arrive late or out of order** (an
  older snapshot is delivered instead of the current one).
* :class:`FaultyTrainer`: a training step takes longer than it should.
* :class:`FaultyParameterServer`: a **Push fails** (raises :class:`WeightSyncError`, nothing is
  stored) or is **slow** (the version becomes visible to readers only later).
* :func:`faulty_reward`: a reward function that **raises** or **hangs** for chosen requests.
* :func:`restart_loop`: the **coordinator restarts** from its last state: the run loop's
  checkpoint goes through JSON (as ``staleflow train`` writes it) into a fresh loop.

Time is the run's virtual clock. An engine does not see that clock directly but a
:class:`LaggingClock` that stands still while the instance is stalled, so a stall is real lost
time for the simulated instance, through the public ``Clock`` seam only. Draws come from
``random.Random`` seeded by ``(seed, injector name)``; the run loop calls the seams in a
deterministic order, so one seed always gives the same faults at the same virtual times. Reward
functions run on threads: their faults are keyed by request id instead, so the order in which
threads run does not matter. Every injected fault is recorded in the shared :class:`FaultPlan`.
"""

from __future__ import annotations

import json
import math
import random
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from staleflow.runtime.interfaces import Clock, RolloutEngine, Trainer
from staleflow.runtime.run.rewarding import RewardFn
from staleflow.runtime.servers.parameter_server import ParameterServer, VersionNotAvailableError
from staleflow.runtime.types import (
    InstanceSnapshot,
    RolloutRequest,
    TrainingBatch,
    TrainResult,
    Trajectory,
)
from staleflow.verification.chaos.plan import FaultKind, FaultPlan


class InstanceCrashedError(ConnectionError):
    """The rollout instance is gone (as a dead Ray actor): its running requests are lost."""


class WeightSyncError(ConnectionError):
    """A weight transfer failed in transit; nothing changed on either side, it may be retried."""


class RewardFaultError(RuntimeError):
    """A reward function failed on a trajectory (the injected 'reward throws' fault)."""


# ----------------------------------------------------------------------------- clocks


class LaggingClock:
    """The run's clock minus the time an instance spent stalled (it stands still during a stall).

    ``now() = base.now() - lag``; the lag grows at rate 1 inside stall windows. Stalls are added at
    the current time, so one open window plus the total of the closed ones describe it.
    """

    def __init__(self, base: Clock) -> None:
        self._base = base
        self._closed_lag = 0.0
        self._start = base.now()
        self._length = 0.0

    def now(self) -> float:
        return self._local_at(self._base.now())

    def _local_at(self, t: float) -> float:
        return t - self._closed_lag - min(max(t - self._start, 0.0), self._length)

    def sleep_until(self, deadline: float) -> None:
        raise RuntimeError("an instance's lagging clock is read-only; the run loop owns time")

    def stall(self, seconds: float) -> None:
        """Stand still for ``seconds`` from now (extends a stall in progress)."""
        t = self._base.now()
        if t < self._start + self._length:
            self._length += seconds
        else:
            self._closed_lag += self._length
            self._start, self._length = t, seconds

    def to_base(self, local: float) -> float:
        """The earliest run time at which this clock reads ``local``."""
        frozen_at = self._start - self._closed_lag
        t = local + self._closed_lag + (0.0 if local <= frozen_at else self._length)
        while self._local_at(t) < local:  # undo rounding: never wake the loop before the event
            t = math.nextafter(t, math.inf)
        return t

    def stalled_until(self) -> float:
        return self._start + self._length


# ----------------------------------------------------------------------------- engines

#: ``make_engine(instance_id, clock, version) -> RolloutEngine``: builds (and rebuilds) an instance.
EngineFactory = Callable[[str, Clock, int], RolloutEngine]


class FaultyEngine:
    """A rollout instance with crashes, stalls, failed or slow Pulls, late finishes, stale snapshots.

    The inner engine is built by ``make_engine`` on a :class:`LaggingClock`; after a crash it is
    rebuilt empty at version 0 once ``rates.restart_s`` have passed. Finished trajectories held
    back in transit still count as running in snapshots (from outside, a request whose result has
    not arrived is still running), and an abort drops them as it would inside the engine.
    """

    def __init__(self, instance_id: str, clock: Clock, make_engine: EngineFactory, plan: FaultPlan) -> None:
        self.instance_id = instance_id
        self._clock = clock
        self._make = make_engine
        self._plan = plan
        self._rng = plan.rng(f"engine/{instance_id}")
        self._local = LaggingClock(clock)
        self._inner: RolloutEngine | None = make_engine(instance_id, self._local, 0)
        self._down_until = 0.0
        self._next_crash = self._next_time(plan.rates.crash_per_s)
        self._next_stall = self._next_time(plan.rates.stall_per_s)
        self._in_transit: list[tuple[float, Trajectory]] = []
        self._snapshots: list[InstanceSnapshot] = []

    # ------------------------------------------------------------------ the RolloutEngine seam
    def submit(self, requests: Sequence[RolloutRequest]) -> None:
        self._live().submit(requests)

    def interrupt(self, request_ids: Sequence[str]) -> list[RolloutRequest]:
        engine = self._live()
        # One channel per instance is FIFO: a finish sent before the interrupt's reply arrives first,
        # so finished results of interrupted requests are due now (the next collect has them).
        partials = engine.interrupt(request_ids)  # skips finished ones, in transit or not
        self._receive(engine)
        now = self._clock.now()
        ids = set(request_ids)
        self._in_transit = [(min(at, now) if t.request_id in ids else at, t) for at, t in self._in_transit]
        return partials

    def abort(self, request_ids: Sequence[str]) -> None:
        engine = self._live()
        ids = set(request_ids)
        self._in_transit = [(at, t) for at, t in self._in_transit if t.request_id not in ids]
        engine.abort(request_ids)

    def load_weights(self, version: int, weights: Any, broadcast: bool = False) -> None:
        engine = self._live()
        if self._plan.happens(self._rng, self._plan.rates.pull_fail):
            self._plan.record(FaultKind.PULL_FAIL, self.instance_id, f"version {version}")
            raise WeightSyncError(f"{self.instance_id}: transfer of version {version} failed")
        engine.load_weights(version, weights, broadcast)
        if self._plan.happens(self._rng, self._plan.rates.pull_slow):
            seconds = self._plan.delay(self._rng)
            self._local.stall(seconds)
            self._plan.record(FaultKind.PULL_SLOW, self.instance_id, f"version {version}, +{seconds:.2f} s")

    def snapshot(self) -> InstanceSnapshot:
        current = self._true_snapshot()
        self._snapshots = [*self._snapshots[-3:], current]
        if len(self._snapshots) > 1 and self._plan.happens(self._rng, self._plan.rates.snapshot_stale):
            stale = self._snapshots[self._rng.randrange(len(self._snapshots) - 1)]
            self._plan.record(FaultKind.SNAPSHOT_STALE, self.instance_id, f"from t={stale.time:.2f}")
            return stale
        return current

    def collect(self) -> list[Trajectory]:
        self._receive(self._live())
        now = self._clock.now()
        due = [t for at, t in self._in_transit if at <= now]
        self._in_transit = [(at, t) for at, t in self._in_transit if at > now]
        return due

    def next_event_time(self) -> float | None:
        now = self._clock.now()
        if self._inner is None:
            return self._down_until
        times = [self._next_crash, self._next_stall, *(at for at, _ in self._in_transit)]
        local = self._live().next_event_time()
        if local is not None:
            times.append(self._local.to_base(local))
        upcoming = [t for t in times if t is not None]
        return max(now, min(upcoming)) if upcoming else None

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()

    # ------------------------------------------------------------------ internals
    def _receive(self, engine: RolloutEngine) -> None:
        """Put the engine's newly finished trajectories in transit, some of them delayed."""
        now = self._clock.now()
        for trajectory in engine.collect():
            arrival = now
            if self._plan.happens(self._rng, self._plan.rates.finish_delay):
                seconds = self._plan.delay(self._rng)
                self._plan.record(FaultKind.FINISH_DELAY, self.instance_id, f"{trajectory.request_id} +{seconds:.2f} s")
                arrival += seconds
            self._in_transit.append((arrival, trajectory))

    def _next_time(self, rate: float) -> float | None:
        return self._clock.now() + self._rng.expovariate(rate) if rate > 0 else None

    def _live(self) -> RolloutEngine:
        """The inner engine after any fault due now; raises while the instance is down."""
        now = self._clock.now()
        if self._inner is None:
            if now < self._down_until:
                raise InstanceCrashedError(f"{self.instance_id} is down (crashed; back at t={self._down_until:.2f})")
            self._local = LaggingClock(self._clock)
            self._inner = self._make(self.instance_id, self._local, 0)
            self._next_crash = self._next_time(self._plan.rates.crash_per_s)
        if self._next_stall is not None and now >= self._next_stall:
            self._next_stall = self._next_time(self._plan.rates.stall_per_s)
            if self._plan.active:
                seconds = self._plan.delay(self._rng)
                self._local.stall(seconds)
                self._plan.record(FaultKind.INSTANCE_STALL, self.instance_id, f"{seconds:.2f} s")
        if self._next_crash is not None and now >= self._next_crash:
            self._next_crash = self._next_time(self._plan.rates.crash_per_s)
            if self._plan.active:
                self._crash(now)
        if self._inner is None:
            raise InstanceCrashedError(f"{self.instance_id} crashed at t={now:.2f}")
        return self._inner

    def _crash(self, now: float) -> None:
        assert self._inner is not None
        snapshot = self._inner.snapshot()
        lost = len(snapshot.running) + len(snapshot.waiting) + len(self._in_transit)
        self._inner.close()
        self._inner = None
        self._in_transit = []
        self._snapshots = []
        self._down_until = now + self._plan.rates.restart_s
        self._plan.record(FaultKind.INSTANCE_CRASH, self.instance_id, f"{lost} requests lost")

    def _true_snapshot(self) -> InstanceSnapshot:
        engine = self._live()
        snapshot = engine.snapshot()
        in_transit = tuple(t.request_id for _, t in self._in_transit)
        return InstanceSnapshot(
            instance_id=snapshot.instance_id,
            version=snapshot.version,
            running=snapshot.running + in_transit,
            waiting=snapshot.waiting,
            kv_tokens=snapshot.kv_tokens,
            kv_capacity=snapshot.kv_capacity,
            tokens_per_s=snapshot.tokens_per_s,
            time=self._clock.now(),
            loading=snapshot.loading or self._local.stalled_until() > self._clock.now(),
        )


# ----------------------------------------------------------------------------- trainer


class FaultyTrainer:
    """A trainer whose steps sometimes take longer (the result is held back for a while)."""

    def __init__(self, inner: Trainer, clock: Clock, plan: FaultPlan) -> None:
        self._inner = inner
        self._clock = clock
        self._plan = plan
        self._rng = plan.rng("trainer")
        self._held: TrainResult | None = None
        self._release = 0.0
        self._extra = 0.0
        self.batches: list[TrainingBatch] = []

    def start_step(self, batch: TrainingBatch) -> None:
        self.batches.append(batch)
        self._extra = 0.0
        if self._plan.happens(self._rng, self._plan.rates.train_slow):
            self._extra = self._plan.delay(self._rng)
            self._plan.record(FaultKind.TRAIN_SLOW, "trainer", f"buffer {batch.version} +{self._extra:.2f} s")
        self._inner.start_step(batch)

    def poll(self) -> TrainResult | None:
        if self._held is None:
            self._held = self._inner.poll()
            if self._held is None:
                return None
            self._release = self._clock.now() + self._extra
        if self._clock.now() < self._release:
            return None
        result, self._held = self._held, None
        return result

    def weights(self) -> Any:
        return self._inner.weights()

    def next_event_time(self) -> float | None:
        if self._held is not None:
            return self._release
        return self._inner.next_event_time()

    def close(self) -> None:
        self._inner.close()


# ----------------------------------------------------------------------------- parameter server


class FaultyParameterServer:
    """A parameter server whose pushes sometimes fail or become visible late.

    A delayed version is stored but hidden from ``latest_version``, ``versions`` and ``pull`` until
    its time; the next push waits for it (one writer), as a real push pipeline would.
    """

    def __init__(self, inner: ParameterServer, clock: Clock, plan: FaultPlan) -> None:
        self._inner = inner
        self._clock = clock
        self._plan = plan
        self._rng = plan.rng("parameter_server")
        self._visible: int | None = None
        self._hidden: tuple[int, float] | None = None  # (version, visible at)

    def push(self, version: int, weights: Any) -> None:
        self._reveal()
        if self._hidden is not None:
            self._visible, self._hidden = self._hidden[0], None  # the previous push completes first
        if self._plan.happens(self._rng, self._plan.rates.push_fail):
            self._plan.record(FaultKind.PUSH_FAIL, "parameter_server", f"version {version}")
            raise WeightSyncError(f"push of version {version} failed")
        self._inner.push(version, weights)
        if self._visible is not None and self._plan.happens(self._rng, self._plan.rates.push_slow):
            seconds = self._plan.delay(self._rng)
            self._hidden = (version, self._clock.now() + seconds)
            self._plan.record(FaultKind.PUSH_SLOW, "parameter_server", f"version {version} +{seconds:.2f} s")
        else:
            self._visible = version

    def latest_version(self) -> int | None:
        self._reveal()
        return self._visible

    def versions(self) -> tuple[int, ...]:
        self._reveal()
        return tuple(v for v in self._inner.versions() if self._visible is not None and v <= self._visible)

    def pull(self, version: int | None = None) -> tuple[int, Any]:
        self._reveal()
        wanted = self._visible if version is None else version
        if wanted is None or self._visible is None or wanted > self._visible:
            raise VersionNotAvailableError(f"version {wanted} is not visible on the parameter server yet")
        return self._inner.pull(wanted)

    def state_dict(self) -> dict[str, Any]:
        return {"latest_version": self.latest_version()}

    def _reveal(self) -> None:
        if self._hidden is not None and self._clock.now() >= self._hidden[1]:
            self._visible, self._hidden = self._hidden[0], None


# ----------------------------------------------------------------------------- rewards


class HungRewards:
    """Reward calls that hang until released (the tester releases a call once the runtime has
    given up on its group, so abandoned threads never pile up and timing stays deterministic)."""

    def __init__(self) -> None:
        self._events: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def hang(self, group_id: str, limit_s: float) -> None:
        with self._lock:
            event = self._events.setdefault(group_id, threading.Event())
        event.wait(limit_s)

    def release(self, group_id: str | None = None) -> None:
        """Let hung calls of ``group_id`` (all groups: None) return; a call that starts later for
        a released group returns at once."""
        with self._lock:
            keys = list(self._events) if group_id is None else [group_id]
            for key in keys:
                self._events.setdefault(key, threading.Event()).set()


def faulty_reward(plan: FaultPlan, hung: HungRewards, hang_limit_s: float = 10.0) -> RewardFn:
    """A reward (1.0 for an even response length, else 0.0) that raises or hangs for some requests.

    The decision is a function of the seed and the request id only (reward calls run on threads).
    """

    def reward(trajectory: Trajectory, metadata: dict[str, Any]) -> float:
        draw = random.Random(f"staleflow-chaos/{plan.seed}/reward/{trajectory.request_id}").random()
        if plan.active and draw < plan.rates.reward_raise:
            plan.record(FaultKind.REWARD_RAISE, trajectory.request_id)
            raise RewardFaultError(f"reward of {trajectory.request_id} failed")
        if plan.active and draw > 1.0 - plan.rates.reward_hang:
            plan.record(FaultKind.REWARD_HANG, trajectory.request_id)
            hung.hang(trajectory.group_id, hang_limit_s)
        return 1.0 if len(trajectory.output_ids) % 2 == 0 else 0.0

    return reward


# ----------------------------------------------------------------------------- coordinator restart


def checkpoint_round_trip(state: Mapping[str, Any]) -> dict[str, Any]:
    """The run loop's checkpoint as ``staleflow train`` stores it: through JSON (raises if it is not
    JSON-serialisable, which is itself a fault: the checkpoint could not be written)."""
    return json.loads(json.dumps(state))


def restart_loop(loop: Any, make_loop: Callable[[], Any], plan: FaultPlan) -> Any:
    """Stop ``loop`` at its last state and bring up a fresh loop from it (same engines, trainer and
    parameter server; a new trajectory server, coordinator and protocol from the checkpoint)."""
    state = checkpoint_round_trip(loop.state_dict())
    plan.record(FaultKind.COORDINATOR_RESTART, "coordinator", f"at step {state['steps_done']}")
    fresh = make_loop()
    fresh.load_state_dict(state)
    return fresh

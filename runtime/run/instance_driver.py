"""The run loop's hands on the rollout instances: commands carried out, trajectories collected,
snapshots taken, failures noticed and failed instances probed back
(:mod:`staleflow.runtime.run.instance_health`).

Every engine call goes through here, and every call that raises the failure contract's errors
(:data:`~staleflow.runtime.interfaces.INSTANCE_FAILURES`) marks the instance down through
:meth:`InstanceDriver.failed`. The driver tells nobody: each method returns what it observed
(snapshots, instances lost or back: :mod:`~staleflow.runtime.coordination.observations`), in order,
and the loop hands it to the coordinator.

With a real clock the Pulls of a batch of commands run concurrently, one thread each: every pull
starts when its turn in the batch comes, a later command to the same instance waits for that
instance's pull, and all of them have ended when :meth:`InstanceDriver.execute` returns, so N pulls
hold the loop up for about one transfer rather than N. A pull that fails marks only its own instance
down; the others still finish and are recorded. With a virtual clock they run inline, in order
(simulated transfers depend on the order they start in).

The Pulls of a global broadcast (marked ``broadcast``) to several up instances get, where the
parameter server's reference allows (:class:`~staleflow.runtime.interfaces.CollectiveReference`),
the version in one collective for all of them, sent once: they are held until the batch's last one
of that version (or a later command to a member) and then start together, for the members still up
(one lost by an earlier command of the batch is left out). After a collective fails (its members
lost) later broadcasts go one load per instance, and why is logged.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

from staleflow.runtime.coordination.commands import Abort, Command, Interrupt, Pull, Route
from staleflow.runtime.coordination.cost_model import ProfileRecord
from staleflow.runtime.coordination.observations import InstanceBack, InstanceLost
from staleflow.runtime.interfaces import INSTANCE_FAILURES, Clock, CollectiveReference, RolloutEngine
from staleflow.runtime.run.instance_health import first_snapshot, probe
from staleflow.runtime.servers.parameter_server import ParameterServer
from staleflow.runtime.servers.trajectory_server import TrajectoryServer
from staleflow.runtime.types import InstanceSnapshot, Trajectory

log = logging.getLogger(__name__)

#: What the driver observes of the instances, for the coordinator.
InstanceObservation = InstanceSnapshot | InstanceLost | InstanceBack


class InstanceDriver:
    """Engines by instance id, with what the loop knows of each.

    ``down``: failed instances (no work until a probe brings them back), with ``placed_when_down``,
    the requests placed on each when it failed (a probe aborts them there); ``next_event``: when a
    simulated engine next has something to report (None: unknown, ask every iteration);
    ``touched``: instances whose load may have changed since :meth:`take_touched` was last called.
    Failures and recoveries are counted in ``counters``.
    """

    def __init__(
        self,
        engines: Sequence[RolloutEngine],
        trajectory_server: TrajectoryServer,
        parameter_server: ParameterServer,
        clock: Clock,
        counters: Counter[str],
    ) -> None:
        self.engines = {engine.instance_id: engine for engine in engines}
        if len(self.engines) != len(engines):
            raise ValueError("engine instance ids must be unique")
        self.ts = trajectory_server
        self.ps = parameter_server
        self.clock = clock
        self.counters = counters
        self.down: set[str] = set()
        self.placed_when_down: dict[str, set[str]] = {}
        self.next_event: dict[str, float | None] = {iid: None for iid in self.engines}
        self.touched: set[str] = set()
        self._observed_at: dict[str, float] = {}
        self._pulls = None if clock.simulated else ThreadPoolExecutor(max(1, len(self.engines)), thread_name_prefix="pull")
        #: Why a broadcast's loads go one by one now (a collective failed: logged), None while they may share one.
        self.collective_off: str | None = None
        self._collective_lock = threading.Lock()  # the pulls' threads count collective loads and failures

    def first_snapshots(self) -> list[InstanceSnapshot]:
        """One snapshot per instance, to start the coordinator with; instances that do not answer
        or hold requests from before are down."""
        snapshots = []
        for engine in self.engines.values():
            snapshot, up = first_snapshot(engine, self.clock.now())
            if not up:
                self.down.add(engine.instance_id)
            snapshots.append(snapshot)
        return snapshots

    def due(self, now: float) -> list[str]:
        """Instances with an event due (or that do not announce event times: real engines)."""
        return [iid for iid, t in self.next_event.items() if t is None or t <= now]

    def collect(self, iid: str) -> list[Trajectory] | InstanceLost:
        """The trajectories ``iid`` finished since the last call, or the instance lost if the call failed."""
        try:
            return self.engines[iid].collect()
        except INSTANCE_FAILURES:
            return self.failed(iid)

    def look(self, iid: str) -> list[InstanceObservation]:
        """A fresh snapshot of ``iid`` after collecting from it (and the instance lost, last, if a call fails)."""
        engine = self.engines[iid]
        try:
            snapshot = engine.snapshot()
        except INSTANCE_FAILURES:
            return [self.failed(iid)]
        self._observed_at[iid] = self.clock.now()
        try:
            self.next_event[iid] = engine.next_event_time()
        except INSTANCE_FAILURES:
            return [snapshot, self.failed(iid)]
        self.touched.add(iid)
        return [snapshot]

    def refresh(self, now: float, tick_s: float) -> list[InstanceObservation]:
        """Snapshot every instance not observed within the last tick; probe the down ones."""
        observations: list[InstanceObservation] = []
        for iid, engine in self.engines.items():
            if iid in self.down:
                back = self._probe(iid)
                if back is not None:
                    observations.append(back)
            elif now - self._observed_at.get(iid, -math.inf) >= tick_s:
                try:
                    observations.append(engine.snapshot())
                except INSTANCE_FAILURES:
                    observations.append(self.failed(iid))
                    continue
                self._observed_at[iid] = now  # a snapshot changes no view's requests: not touched
        return observations

    def defer_refresh(self, now: float, tick_s: float) -> None:
        """Count every instance :meth:`refresh` would snapshot now as observed, without a snapshot
        (a quiet tick: the next tick's snapshots replace these before anything reads them)."""
        for iid in self.engines:
            if iid not in self.down and now - self._observed_at.get(iid, -math.inf) >= tick_s:
                self._observed_at[iid] = now

    def event_before(self, t: float) -> bool:
        """Whether some instance announced an event before ``t``."""
        return any(e is not None and e < t for e in self.next_event.values())

    def failed(self, iid: str) -> InstanceLost:
        """An engine call failed: whatever the instance held is presumed lost. Its requests go back
        to the queue from the last partial the trajectory server has, and it gets no work until a
        probe finds it answering (then anything it still holds is discarded, so nothing runs twice)."""
        placed = sorted(self.ts.running_on().get(iid, ()))
        self._mark_down(iid, placed)
        self.ts.requeue([self.ts.request(rid) for rid in placed], iid)
        self.counters["instance_failures"] += 1
        self.counters["requests_recovered"] += len(placed)
        return InstanceLost(iid)

    def down_state(self) -> dict[str, list[str]]:
        """The down instances and the requests placed on each when it failed (for a checkpoint)."""
        return {iid: sorted(self.placed_when_down.get(iid, ())) for iid in sorted(self.down)}

    def restore_down(self, down: Mapping[str, Iterable[str]]) -> list[InstanceLost]:
        """Instances a checkpoint found down stay down here, and a probe aborts the requests placed
        on them when they failed, even if their first snapshot shows them empty (it may be stale).
        Instances this run does not have are ignored: nothing is routed to them."""
        lost = []
        for iid, placed in down.items():
            if iid in self.engines:
                self._mark_down(iid, placed)
                lost.append(InstanceLost(iid))
        return lost

    def _mark_down(self, iid: str, placed: Iterable[str]) -> None:
        self.down.add(iid)
        self.placed_when_down.setdefault(iid, set()).update(placed)
        self.next_event[iid] = None
        self.touched.add(iid)

    def _probe(self, iid: str) -> InstanceBack | None:
        result = probe(self.engines[iid], self.placed_when_down.get(iid, ()))
        if result is None:
            return None
        self.counters["late_results_discarded"] += result.late
        self.down.discard(iid)
        self.placed_when_down.pop(iid, None)
        self.next_event[iid] = result.next_event
        self.touched.add(iid)
        return InstanceBack(result.snapshot)

    def execute(self, commands: Sequence[Command]) -> list[InstanceLost]:
        """Carry out commands in order (Pulls concurrently with a real clock: module docstring); a
        failing instance is marked down (and returned) and its later commands skipped."""
        lost: list[InstanceLost] = []
        pulls: dict[str, Future[None]] = {}
        last = self._last_broadcast_pulls(commands)
        held: dict[int, list[Pull]] = {}  # a version's broadcast Pulls, held until its last one (one collective)
        try:
            for index, command in enumerate(commands):
                iid = command.instance_id
                for version in [v for v, members in held.items() if any(p.instance_id == iid for p in members)]:
                    self._start_together(held.pop(version), pulls)  # a later command to a member: its set starts now
                if iid in pulls:  # the instance's pull ends before its next command
                    self._await_pulls({iid: pulls.pop(iid)}, lost)
                if iid in self.down:
                    continue  # its requests were re-queued; requests routed to it are still queued
                if isinstance(command, Pull) and command.version in last:
                    held.setdefault(command.version, []).append(command)
                    if index == last[command.version]:
                        self._start_together(held.pop(command.version), pulls)
                    continue
                if isinstance(command, Pull) and self._pulls is not None:
                    pulls[iid] = self._pulls.submit(self._load, command)
                    continue
                try:
                    self._execute_one(command)
                except INSTANCE_FAILURES:
                    lost.append(self.failed(iid))
        finally:
            for members in held.values():
                self._start_together(members, pulls)
            self._await_pulls(pulls, lost)
        return lost

    def _last_broadcast_pulls(self, commands: Sequence[Command]) -> dict[int, int]:
        """The index of each version's last broadcast Pull among ``commands``, where a collective may
        carry them (a real clock: its members load at once; none failed before)."""
        if self._pulls is None or self.collective_off is not None:
            return {}
        return {c.version: i for i, c in enumerate(commands) if isinstance(c, Pull) and c.broadcast}

    def _start_together(self, members: Sequence[Pull], pulls: dict[str, Future[None]]) -> None:
        """Start the held broadcast Pulls of one version at once, in one collective for those of
        their instances still up (an instance lost by an earlier command of the batch is left out)."""
        assert self._pulls is not None
        together = tuple(p.instance_id for p in members if p.instance_id not in self.down)
        for pull in members:
            if pull.instance_id in together:
                pulls[pull.instance_id] = self._pulls.submit(self._load, pull, together)

    def _await_pulls(self, pulls: Mapping[str, Future[None]], lost: list[InstanceLost]) -> None:
        """Wait for every pull of ``pulls``, then record each: done, or its instance lost (added to
        ``lost``); an error outside the failure contract is raised once every pull is recorded."""
        wait(pulls.values())
        error: Exception | None = None
        for iid, future in pulls.items():
            try:
                future.result()
                self._executed(iid, Pull.__name__)
            except INSTANCE_FAILURES:
                lost.append(self.failed(iid))
            except Exception as unexpected:  # noqa: BLE001 - raised below, after the other pulls are recorded
                error = error or unexpected
        if error is not None:
            raise error

    def _execute_one(self, command: Command) -> None:
        engine = self.engines[command.instance_id]
        if isinstance(command, Route):
            engine.submit(self.ts.mark_routed(command.request_ids, command.instance_id))
        elif isinstance(command, Interrupt):
            self.ts.requeue(engine.interrupt(command.request_ids), command.instance_id)
        elif isinstance(command, Pull):
            self._load(command)
        elif isinstance(command, Abort):
            engine.abort(command.request_ids)
        else:
            raise TypeError(f"unknown command {command!r}")
        self._executed(command.instance_id, type(command).__name__)

    def _load(self, command: Pull, together: Sequence[str] = ()) -> None:
        """The engine's side of a Pull: the version from the parameter server into the instance. A
        broadcast's load with other instances (``together``: every up instance the broadcast goes
        to) gets the version in one collective for all of them where the server's reference can
        (:class:`~staleflow.runtime.interfaces.CollectiveReference`), else as a pull."""
        version, weights = self.ps.pull(command.version)
        if not command.broadcast:
            self.engines[command.instance_id].load_weights(version, weights)
            return
        if len(together) > 1 and isinstance(weights, CollectiveReference):
            try:
                self.engines[command.instance_id].load_weights(version, weights.in_collective(together), broadcast=True)
            except INSTANCE_FAILURES as error:
                self._collective_failed(together, version, error)
                raise
            with self._collective_lock:
                self.counters["collective_loads"] += 1
            return
        self.engines[command.instance_id].load_weights(version, weights, broadcast=True)

    def _collective_failed(self, together: Sequence[str], version: int, error: Exception) -> None:
        """A member's load of a collective failed (its instance is lost; the other members', whose
        collective it is too, fail by its deadline): later broadcasts go one load per instance, and why is logged."""
        with self._collective_lock:
            if self.collective_off is not None:
                return
            self.collective_off = f"the collective of version {version} to {list(together)} failed ({error}): broadcasts go per instance"
            self.counters["collective_failures"] += 1
        log.warning(self.collective_off)

    def _executed(self, iid: str, kind: str) -> None:
        """Bookkeeping after a command of ``kind`` on ``iid`` (in the loop's thread)."""
        self.counters[f"command_{kind.lower()}"] += 1
        self.next_event[iid] = self.engines[iid].next_event_time()
        self.touched.add(iid)

    def decode_steps(self) -> list[ProfileRecord]:
        """The pure decode steps the up instances measured since the last call (for the online cost
        fit), from the engines that record them (``decode_steps()``: vLLM's and the simulated ones).
        An engine that fails to answer is skipped: the next snapshot finds it lost."""
        steps: list[ProfileRecord] = []
        for iid, engine in self.engines.items():
            drain = getattr(engine, "decode_steps", None)
            if iid in self.down or drain is None:
                continue
            try:
                steps += drain()
            except INSTANCE_FAILURES:
                continue
        return steps

    def take_touched(self) -> set[str]:
        """The instances touched since the last call (their load may have changed)."""
        touched, self.touched = self.touched, set()
        return touched

    def held_requests(self) -> tuple[dict[str, set[str]], list[InstanceLost]]:
        """What each up instance says it holds (for the audit), and the instances lost asking."""
        held: dict[str, set[str]] = {}
        lost = []
        for iid, engine in self.engines.items():
            if iid in self.down:
                continue
            try:
                snapshot = engine.snapshot()
            except INSTANCE_FAILURES:
                lost.append(self.failed(iid))
                continue
            held[iid] = set(snapshot.running) | set(snapshot.waiting)
        return held, lost

    def close(self) -> None:
        if self._pulls is not None:
            self._pulls.shutdown()
        for engine in self.engines.values():
            try:
                engine.close()
            except INSTANCE_FAILURES:
                pass  # a dead instance has nothing left to close

"""Fault injection into each recovery path of the run loop, on fake engines in virtual time.

Goal: every way the loop recovers from a failing part is exercised by a part that fails exactly
there: an instance that fails its first snapshot, keeps failing its re-probes, or fails while the
loop quiesces for a checkpoint; a parameter server whose pushes keep failing (the retries run out
with an error naming the version and who needed it); a trace whose last line a killed writer tore.
Each run must still end with nothing lost or duplicated and every group within the bound, or fail
with the error the contract promises. (A dying vLLM engine thread: tests/test_vllm_engine_failure.py;
a killed instance actor: tests/test_chaos.py; a killed driver resumed: tests/test_driver_kill.py, in
the nightly tier; a whole job resumed from a checkpoint, in CI: tests/test_train_e2e.py.)
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from runtime_fakes import FakeEngine, FakeTrainer, prompt_groups
from staleflow.protocol.trace import JsonlTraceWriter, read_trace
from staleflow.runtime.coordination.cost_model import CostModel
from staleflow.runtime.run.assembly import assemble_run
from staleflow.runtime.run.clock import VirtualClock
from staleflow.runtime.run.loop import RunParts
from staleflow.runtime.run.run_spec import RunSpec
from staleflow.runtime.run.weight_sync import PUSH_ATTEMPTS, PushFailedError
from staleflow.runtime.servers.parameter_server import ParameterServer
from staleflow.runtime.settings.policies import make_policy

MODEL = CostModel(0.0064, 0.0027, 1.231e-4, 0.0028, 3.35e-8)


class FlakyEngine(FakeEngine):
    """A fake engine whose named methods raise ConnectionError (the failure contract) while
    ``failing[method] > 0``, counting down one per call; every call is counted in ``calls``."""

    def __init__(self, *args: Any, failing: dict[str, int] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.failing = dict(failing or {})
        self.calls: dict[str, int] = {}

    def _maybe_fail(self, method: str) -> None:
        self.calls[method] = self.calls.get(method, 0) + 1
        if self.failing.get(method, 0) > 0:
            self.failing[method] -= 1
            raise ConnectionError(f"{self.instance_id}.{method}(): the instance is unreachable")

    def snapshot(self) -> Any:
        self._maybe_fail("snapshot")
        return super().snapshot()

    def collect(self) -> Any:
        self._maybe_fail("collect")
        return super().collect()

    def interrupt(self, request_ids: Any) -> Any:
        self._maybe_fail("interrupt")
        return super().interrupt(request_ids)


def _loop(engines: list[FakeEngine], clock: VirtualClock, trainer: FakeTrainer | None = None, eta: int = 1,
          parameter_server: Any = None, trace: Path | None = None, skip_prompts: int = 0) -> tuple[Any, FakeTrainer]:
    trainer = trainer or FakeTrainer(clock, 1.0)
    prompts = itertools.islice(prompt_groups(2), skip_prompts, None)  # a resumed run draws on where it stopped
    parts = RunParts(engines=engines, trainer=trainer, prompts=prompts, cost_model=MODEL, clock=clock,
                     parameter_server=parameter_server)
    return assemble_run(RunSpec(make_policy("staleflow"), eta=eta, batch_size=2, tick_s=0.5), parts, trace_path=trace), trainer


def _assert_clean(loop: Any, metrics: Any, trainer: FakeTrainer, steps: int, eta: int = 1) -> None:
    assert metrics.steps == steps and [b.version for b in trainer.batches] == list(range(steps))
    assert (metrics.lost, metrics.duplicated, metrics.audit_ok) == (0, 0, True)
    assert metrics.max_staleness <= eta
    for batch in trainer.batches:
        for group in batch.groups.values():
            assert all(batch.version - eta <= min(t.versions) and max(t.versions) <= batch.version for t in group)


@pytest.fixture
def clock() -> Iterator[VirtualClock]:
    yield VirtualClock()


def test_an_instance_failing_its_first_snapshot_starts_down_and_is_probed_back(clock: VirtualClock) -> None:
    flaky = FlakyEngine("i1", clock, failing={"snapshot": 1})
    loop, trainer = _loop([FakeEngine("i0", clock), flaky], clock)
    assert loop.instances.down == {"i1"}  # its state is unknown: no work until a probe finds it empty
    metrics = loop.run(4)
    assert loop.instances.down == set() and flaky.calls["snapshot"] >= 3  # probed, answered, used
    assert any(v.instance_id == "i1" and v.version >= 1 for v in loop.coordinator.views)  # it pulled weights: back in the fleet
    _assert_clean(loop, metrics, trainer, 4)
    loop.close()


def test_an_instance_failing_its_re_probes_stays_down_until_one_succeeds(clock: VirtualClock) -> None:
    """The first snapshot fails, then five probes fail in turn (collect, then snapshot): each failed
    probe leaves it down; the run trains on the other instance meanwhile."""
    flaky = FlakyEngine("i1", clock, failing={"snapshot": 4, "collect": 2})
    loop, trainer = _loop([FakeEngine("i0", clock), flaky], clock)
    assert loop.instances.down == {"i1"}
    metrics = loop.run(5)
    # six probes: two failed collecting, three failed the snapshot, the sixth took it back
    assert loop.instances.down == set() and flaky.failing == {"snapshot": 0, "collect": 0}
    assert flaky.calls["collect"] >= 6 and flaky.calls["snapshot"] >= 6
    _assert_clean(loop, metrics, trainer, 5)
    loop.close()


def test_a_probe_aborts_what_a_down_instance_still_holds_before_taking_it_back(clock: VirtualClock) -> None:
    """An instance that answers but holds requests this run did not route (left from before a
    restart) starts down; a probe aborts them and a later one takes it back empty."""
    from staleflow.runtime.types import RolloutRequest

    stale = FakeEngine("i1", clock)
    stale.submit([RolloutRequest("old/0", "old", [1, 2], 50, 0)])
    loop, trainer = _loop([FakeEngine("i0", clock), stale], clock)
    assert loop.instances.down == {"i1"}
    metrics = loop.run(3)
    assert loop.instances.down == set() and "old/0" not in stale.snapshot().running
    _assert_clean(loop, metrics, trainer, 3)
    loop.close()


class LaggingSnapshotEngine(FakeEngine):
    """A fake engine whose first Pull while it holds requests fails, and whose next
    ``lagging_snapshots`` snapshots then show it as it was before its last submit (a real engine
    publishes its state from its own loop: a snapshot can predate the requests last sent)."""

    def __init__(self, *args: Any, lagging_snapshots: int = 3, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lagging = 0
        self.lagging_snapshots = lagging_snapshots
        self.failed_pulls = 0
        self._before_submit: Any = None

    def submit(self, requests: Any) -> None:
        self._before_submit = super().snapshot()
        super().submit(requests)

    def load_weights(self, version: int, weights: Any) -> None:
        if self.failed_pulls == 0 and self.held():
            self.failed_pulls += 1
            self.lagging = self.lagging_snapshots
            raise ConnectionError(f"{self.instance_id}: transfer of version {version} failed")
        super().load_weights(version, weights)

    def snapshot(self) -> Any:
        if self.lagging > 0 and self._before_submit is not None:
            self.lagging -= 1
            return replace(self._before_submit, time=self.clock.now())
        return super().snapshot()


def test_a_probe_aborts_the_requests_placed_on_a_failed_instance_whatever_its_snapshot_says(clock: VirtualClock) -> None:
    """Chaos seeds 300557, 300618, 301287: a Pull failed on an instance that held requests (they go
    back to the queue), and the probe's snapshot predated them: it showed the instance empty, the
    instance came back still running them, and they ran twice. The probe now aborts every request
    placed there when it failed, whatever the snapshot shows."""
    lagging = LaggingSnapshotEngine("i1", clock)
    loop, trainer = _loop([FakeEngine("i0", clock), lagging], clock)
    metrics = loop.run(6)
    assert lagging.failed_pulls == 1 and lagging.lagging == 0  # the failure and the stale snapshots happened
    assert loop.stats.counters["requests_recovered"] > 0  # it held requests when it failed
    assert loop.instances.down == set() and loop.instances.placed_when_down == {}
    _assert_clean(loop, metrics, trainer, 6)
    loop.close()


def _fail_an_interrupt_at_the_next_checkpoint(loop: Any, engines: list[Any]) -> Any:
    """Run to a step boundary where some instance is generating; its next interrupt fails."""
    for _ in range(6):
        loop.run(1)
        busy = [e for e in engines if e.snapshot().running]
        if busy:
            busy[0].failing["interrupt"] = 1
            return busy[0]
    raise AssertionError("no instance runs requests at a step boundary")


def test_an_instance_failing_while_the_loop_quiesces_for_a_checkpoint(clock: VirtualClock) -> None:
    """state_dict() interrupts every running request; an instance that fails there is marked down,
    its requests go back to the queue from their last partial, and the checkpoint resumes cleanly."""
    engines = [FlakyEngine(f"i{k}", clock, max_running=2) for k in range(2)]
    loop, trainer = _loop(list(engines), clock, eta=2)
    flaky = _fail_an_interrupt_at_the_next_checkpoint(loop, engines)
    state = json.loads(json.dumps(loop.state_dict()))  # no error: the checkpoint is taken anyway
    assert flaky.instance_id in loop.instances.down and flaky.calls["interrupt"] >= 1
    report = loop.audit()
    assert report.ok and not report.lost, report
    loop.close()
    # Resume from that checkpoint on fresh instances: nothing lost, bound kept.
    clock2 = VirtualClock()
    trainer2 = FakeTrainer(clock2, 1.0)
    trainer2.version = trainer.version
    resumed, _ = _loop([FakeEngine("i0", clock2), FakeEngine("i1", clock2)], clock2, trainer=trainer2, eta=2,
                       skip_prompts=state["prompts_drawn"])
    resumed.load_state_dict(state)
    done = state["steps_done"]
    metrics = resumed.run(2)
    assert metrics.steps == done + 2 and (metrics.lost, metrics.duplicated, metrics.audit_ok) == (0, 0, True)
    assert [b.version for b in trainer2.batches] == [done, done + 1]
    resumed.close()


class EmptySnapshotEngine(FlakyEngine):
    """A flaky fake engine whose next ``empty_snapshots`` snapshots show it empty (stale: taken before
    its requests arrived), whatever it runs."""

    empty_snapshots = 0

    def snapshot(self) -> Any:
        snapshot = super().snapshot()
        if self.empty_snapshots > 0:
            self.empty_snapshots -= 1
            return replace(snapshot, running=(), waiting=(), kv_tokens=0)
        return snapshot


def test_a_resumed_run_keeps_an_instance_down_that_failed_before_its_checkpoint(clock: VirtualClock) -> None:
    """An instance fails its interrupt while the loop quiesces for a checkpoint (its requests go back
    to the queue, but it still runs them). The resumed loop, on the same instances, gets a stale
    empty first snapshot from it: the checkpoint's ``instances_down`` keeps it down until a probe
    aborted those requests there, so none runs twice."""
    engines = [EmptySnapshotEngine(f"i{k}", clock, max_running=2) for k in range(2)]
    loop, trainer = _loop(list(engines), clock, eta=2)
    flaky = _fail_an_interrupt_at_the_next_checkpoint(loop, engines)
    state = json.loads(json.dumps(loop.state_dict()))
    still_running = flaky.held()
    assert still_running and state["instances_down"] == {flaky.instance_id: sorted(still_running)}
    loop.close()
    flaky.empty_snapshots = 1  # the resumed loop's first snapshot of it shows nothing
    resumed, _ = _loop(list(engines), clock, trainer=trainer, eta=2, skip_prompts=state["prompts_drawn"])
    resumed.load_state_dict(state)
    assert resumed.instances.down == {flaky.instance_id} and flaky.empty_snapshots == 0
    done = state["steps_done"]
    metrics = resumed.run(3)
    assert not (flaky.held() & still_running) and resumed.instances.down == set()
    _assert_clean(resumed, metrics, trainer, done + 3, eta=2)
    resumed.close()


class FailingPushes(ParameterServer):
    """A parameter server whose pushes fail (ConnectionError) ``fail`` times, then succeed."""

    def __init__(self, fail: int) -> None:
        super().__init__()
        self.fail = fail
        self.attempts = 0

    def push(self, version: int, weights: Any) -> None:
        self.attempts += 1
        if self.fail > 0:
            self.fail -= 1
            raise ConnectionError(f"push of version {version}: the parameter server is unreachable")
        super().push(version, weights)


def test_push_retries_run_out_with_an_error_naming_the_version(clock: VirtualClock) -> None:
    server = FailingPushes(fail=PUSH_ATTEMPTS)
    loop, _ = _loop([FakeEngine("i0", clock)], clock, parameter_server=server)
    message = f"version 0 could not be pushed in {PUSH_ATTEMPTS} attempts \\(the initial weights needs it\\)"
    with pytest.raises(PushFailedError, match=message):
        loop.run(1)
    assert server.attempts == PUSH_ATTEMPTS and loop.stats.counters["push_failures"] == PUSH_ATTEMPTS
    loop.close()


def test_push_retries_that_succeed_in_time_lose_nothing(clock: VirtualClock) -> None:
    server = FailingPushes(fail=PUSH_ATTEMPTS - 1)
    loop, trainer = _loop([FakeEngine("i0", clock)], clock, parameter_server=server)
    metrics = loop.run(3)
    assert loop.stats.counters["push_failures"] == PUSH_ATTEMPTS - 1 and server.latest_version() == 3
    _assert_clean(loop, metrics, trainer, 3)
    loop.close()


def test_a_push_failing_at_a_checkpoint_runs_out_naming_the_checkpoint(clock: VirtualClock) -> None:
    server = FailingPushes(fail=0)
    loop, _ = _loop([FakeEngine("i0", clock)], clock, parameter_server=server)
    loop.run(1)
    server.fail = 10 * PUSH_ATTEMPTS
    loop.run(1)  # version 2's push fails; it is kept for a retry and the run goes on
    assert loop.weights.behind
    with pytest.raises(PushFailedError, match="version 2 could not be pushed .* \\(a checkpoint needs it\\)"):
        loop.state_dict()
    loop.close()


# ----------------------------------------------------------------------------- a torn trace


def _traced_run(path: Path, steps: int) -> None:
    clock = VirtualClock()
    loop, _ = _loop([FakeEngine("i0", clock), FakeEngine("i1", clock)], clock, trace=path)
    loop.run(steps)
    loop.close()


def test_a_torn_last_trace_line_is_ignored_by_the_reader_and_cut_before_an_append(tmp_path: Path) -> None:
    from staleflow.verification.proofs.trace_validation import validate_trace

    path = tmp_path / "trace.jsonl"
    _traced_run(path, 3)
    whole = read_trace(path)
    events = len(whole[0].events)
    last = path.read_text().splitlines()[-1]
    with open(path, "a", encoding="utf-8") as stream:
        stream.write(last[: len(last) // 2])  # the writer was killed inside its last write
    assert len(read_trace(path)[0].events) == events  # the torn event is not one
    assert validate_trace(path, use_tlc=False).ok
    # A resumed writer appends a segment on a line of its own: the torn bytes are cut first.
    from staleflow.protocol import StalenessManager

    manager = StalenessManager(eta=1, batch_size=2)
    with JsonlTraceWriter.attach(manager, path, mode="a"):
        assert manager.reserve("g", 0)
    segments = read_trace(path)
    assert len(segments) == 2 and len(segments[0].events) == events and len(segments[1].events) == 1
    assert validate_trace(path, use_tlc=False).ok


def _run_watched(loop: Any, steps: int) -> Any:
    """``loop.run(steps)`` in a thread watched for 300 s: its metrics (AssertionError if it hangs or
    ends with an error)."""
    import threading

    outcome: list[Any] = []
    runner = threading.Thread(target=lambda: outcome.append(loop.run(steps)), daemon=True)
    runner.start()
    runner.join(300)
    assert not runner.is_alive(), "the run hangs"
    assert outcome, "the run ended with an error"
    return outcome[0]


class TransferringEngine(FakeEngine):
    """A fake engine whose pulls go over a real gloo group from a
    :class:`~staleflow.adapters.rlkit.weight_sender.TransferParameterServer`, the first pull made
    while it holds requests to a receiver that hangs mid-transfer where ``stall``."""

    def __init__(self, *args: Any, server: Any, stall: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.server, self.receiver, self.stalled, self.stall = server, None, None, stall

    def load_weights(self, version: int, weights: Any) -> None:
        from staleflow.adapters.rlkit.weight_sender import TransferWeights
        from weight_receiver import GlooReceiver, StalledReceiver

        reference = TransferWeights(self.server, version)
        if self.stall and self.stalled is None and self.held():  # a worker restarted (a new group) that will hang
            self.receiver = self.stalled = StalledReceiver("hangs")
            reference.connect(self.instance_id, 1, self.receiver, backend="gloo")
        elif self.receiver is None:
            self.receiver = GlooReceiver()
            reference.connect(self.instance_id, 1, self.receiver, backend="gloo")
        try:
            reference.deliver(self.instance_id, self.receiver)
        except ConnectionError:
            self.receiver = None  # the group is gone: the next pull makes a new one
            raise
        super().load_weights(version, {k: v.clone() for k, v in self.receiver.received.items()})


class TensorTrainer(FakeTrainer):
    def weights(self) -> Any:
        import torch

        return {"w": torch.full((700,), float(self.version)), "b": torch.full((3,), float(self.version))}


def test_a_pull_whose_receiver_hangs_mid_transfer_marks_the_instance_failed_and_loses_nothing(clock: VirtualClock) -> None:
    """Finding 6 (issue 35): a receiver hung mid-transfer held the pull (and the run) forever. Now the
    transfer gives up by its deadline, the instance is marked failed, its requests are re-queued, the
    parameter server goes on serving, and the instance comes back through a new group: the run ends
    with nothing lost or duplicated and the instances holding the last version exactly."""

    import torch
    from staleflow.adapters.rlkit.weight_sender import TransferParameterServer

    server = TransferParameterServer(transfer={"backend": "gloo", "bucket_bytes": 1 << 10, "timeout_s": 1.0})
    engines = [TransferringEngine(f"i{n}", clock, server=server, stall=n == 1) for n in range(2)]
    loop, trainer = _loop(engines, clock, trainer=TensorTrainer(clock, 1.0), parameter_server=server)
    metrics = _run_watched(loop, 6)
    stalled = [e.stalled for e in engines if e.stalled is not None]
    assert len(stalled) == 1 and 0 < stalled[0].chunks_received < 3  # hung after its first chunk of 3
    assert loop.stats.counters["instance_failures"] == 1 and loop.stats.counters["requests_recovered"] > 0
    assert server.channels_opened == 4 and loop.instances.down == set()  # 2, the hanging one's, its next
    for engine in engines:
        assert torch.equal(engine.weights["w"], torch.full((700,), float(engine.version)).to(torch.bfloat16))
    _assert_clean(loop, metrics, trainer, 6)
    stalled[0].release.set()
    loop.close()


class SubprocessSyncEngine(FakeEngine):
    """A fake engine receiving its pulls through the vLLM binding's weight sync
    (:class:`~staleflow.adapters.vllm.weight_transfer.InstanceWeightSync`: scheduling paused, vLLM's
    four calls) into a vLLM-like worker behind an engine core in another process; where ``hang``,
    the worker's ``update_weights`` of the first pull made while it holds requests blocks for
    ``hang_s`` and then returns without finishing (its send completed after it gave up)."""

    def __init__(self, *args: Any, server: Any, hang: bool, hang_s: float, **kwargs: Any) -> None:
        from staleflow.adapters.vllm.weight_transfer import InstanceWeightSync
        from weight_receiver import SubprocessCoreEngine, VLLMLikeWorker

        super().__init__(*args, **kwargs)
        self.server, self.hang, self.hang_s = server, hang, hang_s
        self.worker = VLLMLikeWorker()
        self.sync = InstanceWeightSync(SubprocessCoreEngine(self.worker), self.instance_id, {}, "gloo", version=0)
        self.load_seconds: list[float] = []

    def load_weights(self, version: int, weights: Any) -> None:
        import threading
        import time

        from staleflow.adapters.rlkit.weight_sender import TransferWeights

        if self.hang and self.held():
            self.hang = False
            self.worker.hang.set()
            threading.Timer(self.hang_s, self.worker.release.set).start()
        started = time.monotonic()
        try:
            self.sync.receive(TransferWeights(self.server, version))
        finally:
            self.load_seconds.append(time.monotonic() - started)
        super().load_weights(version, {k: v.clone() for k, v in self.worker.received.items()})


def test_a_worker_blocked_in_its_update_costs_the_run_a_lost_instance_within_deadline_and_margin(
        clock: VirtualClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 45: a worker blocked in ``update_weights`` held the engine core, so the instance's
    ``resume_scheduler`` (vLLM's utility call, no timeout) waited behind it; when its send then
    completed, ``finish_weight_update`` was never called, vLLM's update stayed active, and the next
    pull's ``start_weight_update`` raised a plain error that ended the run. Now every step of a pull
    is bounded (the pull returns within the deadline plus the stated margin), every worker error is
    an instance failure, and the run ends with nothing lost or duplicated."""

    from staleflow.adapters.rlkit import bounded_calls
    from staleflow.adapters.rlkit.weight_sender import TransferParameterServer

    monkeypatch.setattr(bounded_calls, "CONTROL_CALL_S", 1.0)
    monkeypatch.setattr(bounded_calls, "SENDER_GRACE_S", 1.0)
    deadline, bound = 1.0, 1.0 + 1.0 + 4 * 1.0  # the deadline and transfer_margin_s() under these settings
    server = TransferParameterServer(transfer={"backend": "gloo", "bucket_bytes": 1 << 10, "timeout_s": deadline})
    engines = [SubprocessSyncEngine(f"i{n}", clock, server=server, hang=n == 1, hang_s=bound + 3) for n in range(2)]
    loop, trainer = _loop(engines, clock, trainer=TensorTrainer(clock, 1.0), parameter_server=server)
    metrics = _run_watched(loop, 6)
    hung = engines[1]
    assert max(hung.load_seconds) <= bound, f"a pull held the run {max(hung.load_seconds):.1f} s (bound {bound} s)"
    assert loop.stats.counters["instance_failures"] >= 1 and loop.stats.counters["requests_recovered"] > 0
    _assert_clean(loop, metrics, trainer, 6)
    hung.worker.release.set()
    loop.close()

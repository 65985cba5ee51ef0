"""Every safety check fires when a deliberately broken component gives it something to find.

Goal: an alarm that never fires proves nothing. Each case breaks one component in the way the
check exists to notice (a trajectory server whose books disagree, a protocol that consumes past
the bound or drops more than the redundancy, a trainer that stops or skips a version, a group
with a trajectory missing, a trace that the spec rejects, ...) and asserts that the check raises
its violation, naming the problem. The chaos tester's end-to-end catches (a lost partial, token
versions outside the bound) are in tests/test_chaos.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from staleflow.protocol.errors import HookError
from staleflow.protocol.events import ConsumedBatch, CounterState, ProtocolEvent
from staleflow.runtime.servers.trajectory_server import GroupState, RequestState, TrajectoryServer
from staleflow.runtime.types import PromptGroup, TrainingBatch, Trajectory
from staleflow.verification.chaos import tester as chaos
from staleflow.verification.chaos.tester import ChaosRun, LivenessViolation, SafetyViolation, draw_scenario, run_seed

# ----------------------------------------------------------------------------- the trajectory server's audit


def _server() -> tuple[TrajectoryServer, list[Any]]:
    """A server with one generating group of two requests on instance "a", and one pending group."""
    ts = TrajectoryServer()
    ts.add_groups([PromptGroup("g0", [1, 2], 2, 0, {"max_new_tokens": 4}), PromptGroup("g1", [1, 2], 2, 0, {"max_new_tokens": 4})])
    requests = ts.admit("g0", 0)
    ts.mark_routed([r.request_id for r in requests], "a")
    assert ts.audit({"a": {r.request_id for r in requests}}).ok  # healthy before the break
    return ts, requests


def _finish(ts: TrajectoryServer, request: Any) -> None:
    ts.finish("a", Trajectory(request.request_id, request.group_id, request.prompt_ids, [7], [-0.1], [0], "stop"))


def _count_wrong(ts: TrajectoryServer, _: list[Any]) -> None:
    groups, requests = ts.counts()
    ts.counts = lambda: ({**groups, "generating": groups["generating"] + 1}, requests)  # type: ignore[method-assign]


BROKEN_SERVERS: list[tuple[str, Callable[[TrajectoryServer, list[Any]], None], str]] = [
    ("group counts that do not add up", _count_wrong, "group states do not add up"),
    ("a pending group missing from the pending list", lambda ts, _: ts._pending.pop("g1"), "pending list disagrees"),
    ("a queued request missing from the queue", lambda ts, r: (ts._requests[r[0].request_id].__setattr__("state", RequestState.QUEUED)),
     "queue disagrees with request states"),
    ("a group's request forgotten", lambda ts, r: ts._requests.pop(r[1].request_id), "'g0' is missing requests"),
    ("a group done with a response missing",
     lambda ts, r: (_finish(ts, r[0]), ts._groups["g0"].__setattr__("state", GroupState.DONE)), "'g0' is done with 1 finished responses"),
    ("a group rewarding with live requests", lambda ts, _: ts._groups["g0"].__setattr__("state", GroupState.REWARDING),
     "'g0' is rewarding with"),
]


@pytest.mark.parametrize(("what", "damage", "problem"), BROKEN_SERVERS, ids=[w for w, _, _ in BROKEN_SERVERS])
def test_trajectory_server_audit_names_each_inconsistency(
    what: str, damage: Callable[[TrajectoryServer, list[Any]], None], problem: str
) -> None:
    ts, requests = _server()
    damage(ts, requests)
    report = ts.audit()
    assert not report.ok and any(problem in p for p in report.problems), report.problems


def test_trajectory_server_audit_finds_a_request_an_instance_holds_twice() -> None:
    ts, requests = _server()
    held = {r.request_id for r in requests}
    report = ts.audit({"a": held, "b": {requests[0].request_id}})
    assert not report.ok and requests[0].request_id in report.duplicated + report.orphaned, report


# ----------------------------------------------------------------------------- the chaos tester's checks


@pytest.fixture
def chaos_run(tmp_path: Path) -> Iterator[ChaosRun]:
    """A chaos run of seed 0 (no faults), its loop built and one step trained: a healthy state that
    each test breaks in one place."""
    run = ChaosRun(draw_scenario(0, kinds=[]), tmp_path / "trace.jsonl")
    run.loop = run.make_loop()
    run.step()
    yield run
    run._close()


def _consume_event(run: ChaosRun, batch: ConsumedBatch) -> ProtocolEvent:
    eta = run.loop.manager.eta
    state = CounterState(batch.version, (0,) * (eta + 1), (0,) * (eta + 1))
    return ProtocolEvent(run.events_checked + 1, "consume", None, None, None, batch, state, state)


def test_chaos_fires_on_a_batch_consumed_past_the_staleness_bound(chaos_run: ChaosRun) -> None:
    eta = chaos_run.loop.manager.eta
    stale = ConsumedBatch(version=eta + 1, group_ids=("g-old",), group_versions=(0,), dropped=())
    with pytest.raises(SafetyViolation, match=f"'g-old' of version 0 consumed in buffer {eta + 1}, eta={eta}"):
        chaos_run.check_event(_consume_event(chaos_run, stale))


def test_chaos_fires_on_more_drops_than_the_redundancy(chaos_run: ChaosRun) -> None:
    redundancy = chaos_run.loop.manager.redundancy
    dropped = tuple(f"d{i}" for i in range(redundancy + 1))
    batch = ConsumedBatch(version=1, group_ids=("g",), group_versions=(1,), dropped=dropped)
    with pytest.raises(SafetyViolation, match=f"dropped {redundancy + 1} groups, redundancy {redundancy}"):
        chaos_run.check_event(_consume_event(chaos_run, batch))


def test_chaos_fires_on_the_trajectory_servers_audit_after_an_event(chaos_run: ChaosRun) -> None:
    chaos_run.loop.ts._duplicates.append("g9/0")  # a server that accepted a result twice
    chaos_run._admitted = 0  # audit after this very event
    batch = ConsumedBatch(version=1, group_ids=(), group_versions=(), dropped=())
    with pytest.raises(SafetyViolation, match=r"trajectory server audit: duplicated \['g9/0'\]"):
        chaos_run.check_event(_consume_event(chaos_run, batch))


def test_chaos_fires_on_a_livelock_past_the_event_budget(chaos_run: ChaosRun, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that takes more protocol events than the budget (here: a budget of 3 events, below
    what any step needs, stands for a runtime that admits and aborts without training)."""
    monkeypatch.setattr(chaos, "STEP_BUDGET_EVENTS", 3)
    # raised by the check hook, so it reaches the caller inside the operation's HookError (issue 26)
    with pytest.raises(HookError) as raised:
        chaos_run.step()
    [(_, violation)] = raised.value.failures
    assert isinstance(violation, LivenessViolation)
    assert "no training step finished within 3 protocol events" in str(violation)


def test_chaos_fires_when_the_trainer_stops_advancing(chaos_run: ChaosRun, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = chaos_run.trainer._inner  # the simulated trainer inside the fault injector
    monkeypatch.setattr(trainer, "poll", lambda: None)  # a step that never finishes
    monkeypatch.setattr(trainer, "next_event_time", lambda: None)
    with pytest.raises(LivenessViolation, match="the trainer stopped advancing"):
        chaos_run.step()


def test_chaos_fires_on_a_group_with_a_trajectory_missing(chaos_run: ChaosRun) -> None:
    batch = chaos_run.trainer.batches[-1]
    group_id, trajectories = next(iter(batch.groups.items()))
    short = TrainingBatch(version=batch.version, groups={group_id: trajectories[1:]})
    with pytest.raises(SafetyViolation, match=f"group {group_id} has {len(trajectories) - 1} trajectories"):
        chaos_run.check_batches([short])


def test_chaos_fires_when_protocol_and_server_disagree_on_live_groups(chaos_run: ChaosRun) -> None:
    manager = chaos_run.loop.manager
    assert manager.reserve("ghost", manager.version)  # a group the protocol holds and the server never saw
    with pytest.raises(SafetyViolation, match="protocol and trajectory server disagree on live groups"):
        chaos_run.check_audit()


def test_chaos_fires_on_an_audit_that_finds_lost_requests(chaos_run: ChaosRun) -> None:
    ts = chaos_run.loop.ts
    ts.add_groups([PromptGroup("lost", [1, 2], 1, 0, {"max_new_tokens": 4})])
    (request,) = ts.admit("lost", chaos_run.loop.manager.version)
    ts.mark_routed([request.request_id], "i0")  # the server thinks i0 runs it; i0 never got it
    with pytest.raises(SafetyViolation, match=r"lost \['lost/0'\]"):
        chaos_run.check_audit()


def test_chaos_fires_on_a_trace_the_spec_rejects(chaos_run: ChaosRun) -> None:
    chaos_run.loop.close()
    chaos_run.loop = None
    lines = chaos_run.trace_path.read_text().splitlines()
    consumes = [i for i, line in enumerate(lines) if '"op":"consume"' in line]
    assert consumes, "the step consumed a batch"
    lines[consumes[0]] = lines[consumes[0]].replace('"op":"consume"', '"op":"abort"', 1)  # a trace that lies
    chaos_run.trace_path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SafetyViolation, match="trace rejected by the spec"):
        chaos_run.check_trace()


def test_a_fired_alarm_is_the_seeds_reported_violation(monkeypatch: pytest.MonkeyPatch) -> None:
    """run_seed turns the violation into the result (not an exception): what bench chaos reports."""
    monkeypatch.setattr(chaos, "STEP_BUDGET_EVENTS", 3)
    result = run_seed(0, kinds=[], steps_faulty=1, steps_healed=0)
    assert not result.ok and result.violation.startswith("LivenessViolation: no training step finished within 3")


# ----------------------------------------------------------------------------- the run loop's own checks


def test_run_loop_refuses_a_trainer_that_skips_a_version() -> None:
    from runtime_fakes import FakeEngine, FakeTrainer, prompt_groups
    from staleflow.runtime.coordination.cost_model import CostModel
    from staleflow.runtime.run.assembly import assemble_run
    from staleflow.runtime.run.clock import VirtualClock
    from staleflow.runtime.run.loop import RunParts
    from staleflow.runtime.run.run_spec import RunSpec
    from staleflow.runtime.settings.policies import make_policy

    class SkippingTrainer(FakeTrainer):
        def poll(self) -> Any:
            result = super().poll()
            return None if result is None else type(result)(version=result.version + 1, metrics=result.metrics)

    clock = VirtualClock()
    parts = RunParts(engines=[FakeEngine("i0", clock)], trainer=SkippingTrainer(clock, 1.0), prompts=prompt_groups(2),
                     cost_model=CostModel(0.0064, 0.0027, 1.231e-4, 0.0028, 3.35e-8), clock=clock)
    loop = assemble_run(RunSpec(make_policy("staleflow"), eta=1, batch_size=2, tick_s=0.5), parts)
    try:
        with pytest.raises(RuntimeError, match="trainer produced version 2 from buffer 0; expected 1"):
            loop.run(1)
    finally:
        loop.close()

"""Trajectory server: every request and group accounted once across route, interrupt, abort, consume."""

from __future__ import annotations

import json

import pytest
from staleflow.runtime.servers.trajectory_server import (
    GroupState,
    TrajectoryServer,
    TrajectoryServerError,
)
from staleflow.runtime.types import PromptGroup, Trajectory


def _group(gid: str = "g0", n: int = 2, extra: int = 0) -> PromptGroup:
    samples = [{"max_new_tokens": 5 + i, "seed": i} for i in range(n + extra)]
    return PromptGroup(gid, [1, 2, 3], n, extra, {"answer": "42"}, samples)


def _done(request, tokens: int = 3) -> Trajectory:
    return Trajectory(request.request_id, request.group_id, request.prompt_ids, [7] * tokens, [-0.1] * tokens, [0] * tokens, "stop")


def test_admit_creates_queued_requests_with_group_version_and_each_samples_metadata():
    ts = TrajectoryServer()
    ts.add_groups([_group(extra=1)])
    assert ts.pending_count() == 1 and ts.next_pending().group_id == "g0"
    requests = ts.admit("g0", 4)
    assert [r.request_id for r in requests] == ["g0/0", "g0/1", "g0/2"]
    assert {r.group_version for r in requests} == {4}
    assert [r.max_new_tokens for r in requests] == [5, 6, 7]
    assert [r.metadata for r in requests] == [{"answer": "42", "max_new_tokens": 5 + i, "seed": i} for i in range(3)]
    assert ts.pending_count() == 0 and ts.queued_count() == 3
    assert ts.group_state("g0") is GroupState.GENERATING


def test_group_redundancy_keeps_first_finishers_and_cancels_the_rest():
    ts = TrajectoryServer()
    ts.add_groups([_group(n=2, extra=2)])
    r0, r1, r2, _r3 = ts.admit("g0", 0)
    ts.mark_routed([r0.request_id, r1.request_id], "a")
    ts.mark_routed([r2.request_id], "b")  # r3 stays queued
    assert ts.finish("b", _done(r2)).group_complete is False
    outcome = ts.finish("a", _done(r1))
    assert outcome.kept and outcome.group_complete
    assert outcome.cancel == (("a", r0.request_id),)  # running sibling to abort; queued r3 just dropped
    assert ts.queued_count() == 0
    assert [t.request_id for t in ts.trajectories("g0")] == [r2.request_id, r1.request_id]
    late = ts.finish("a", _done(r0))  # raced the abort
    assert late.late and not late.duplicate and ts.late_discards() == 1
    groups, requests = ts.counts()
    assert groups["rewarding"] == 1
    assert requests == {"queued": 0, "running": 0, "finished": 2, "cancelled": 2}
    assert ts.audit({"a": set(), "b": set()}).ok


def test_interrupt_requeue_keeps_partial_and_version():
    ts = TrajectoryServer()
    ts.add_groups([_group(n=1)])
    (request,) = ts.admit("g0", 2)
    ts.mark_routed([request.request_id], "a")
    partial = ts.request(request.request_id)
    partial.output_ids.extend([9, 9])
    partial.versions.extend([2, 3])
    assert ts.requeue([partial], "a") == 1
    (queued,) = ts.queued()
    assert queued.output_ids == [9, 9] and queued.versions == [2, 3] and queued.group_version == 2
    with pytest.raises(TrajectoryServerError, match="requeue"):
        ts.requeue([partial], "a")  # already queued: a second return would duplicate it


def test_requeue_from_the_wrong_instance_and_double_route_are_errors():
    ts = TrajectoryServer()
    ts.add_groups([_group(n=1)])
    (request,) = ts.admit("g0", 0)
    ts.mark_routed([request.request_id], "a")
    with pytest.raises(TrajectoryServerError, match="runs on 'a'"):
        ts.requeue([request], "b")
    with pytest.raises(TrajectoryServerError, match="cannot route"):
        ts.mark_routed([request.request_id], "b")


def test_finish_from_another_instance_is_a_counted_duplicate():
    ts = TrajectoryServer()
    ts.add_groups([_group(n=1)])
    (request,) = ts.admit("g0", 0)
    ts.mark_routed([request.request_id], "a")
    outcome = ts.finish("b", _done(request))
    assert outcome.duplicate and not outcome.kept
    report = ts.audit({"a": {request.request_id}})
    assert report.duplicated == (request.request_id,) and not report.ok


def test_audit_finds_lost_and_orphaned_requests():
    ts = TrajectoryServer()
    ts.add_groups([_group(n=2)])
    r0, r1 = ts.admit("g0", 0)
    ts.mark_routed([r0.request_id, r1.request_id], "a")
    report = ts.audit({"a": {r0.request_id}, "b": {"x/0"}})
    assert report.lost == (r1.request_id,)
    assert report.orphaned == ("x/0",)
    assert not report.ok
    assert ts.audit({"a": {r0.request_id, r1.request_id}}).ok


def test_take_batch_consumes_done_groups_and_drops_with_cancellation():
    ts = TrajectoryServer()
    ts.add_groups([_group("g0", n=1), _group("g1", n=2)])
    (a,) = ts.admit("g0", 0)
    b0, _b1 = ts.admit("g1", 0)
    ts.mark_routed([a.request_id, b0.request_id], "x")
    assert ts.finish("x", _done(a, 4)).group_complete
    ts.set_rewards("g0", [1.0])
    batch, cancel = ts.take_batch(0, ["g0"], ["g1"])
    assert batch.version == 0 and list(batch.groups) == ["g0"]
    assert batch.groups["g0"][0].reward == 1.0 and len(batch.groups["g0"][0].output_ids) == 4
    assert cancel == (("x", b0.request_id),)
    assert ts.group_state("g0") is GroupState.CONSUMED and ts.group_state("g1") is GroupState.DROPPED
    with pytest.raises(TrajectoryServerError, match="consume group 'g0'"):
        ts.take_batch(1, ["g0"], [])
    assert ts.audit({"x": set()}).ok


def test_reward_failure_and_abort_states():
    ts = TrajectoryServer()
    ts.add_groups([_group("g0", n=1), _group("g1", n=1)])
    (a,) = ts.admit("g0", 0)
    ts.mark_routed([a.request_id], "x")
    ts.finish("x", _done(a))
    ts.fail_group("g0", "TimeoutError")
    assert ts.group_state("g0") is GroupState.FAILED
    (b,) = ts.admit("g1", 0)
    ts.mark_routed([b.request_id], "y")
    assert ts.abort_group("g1") == (("y", b.request_id),)
    with pytest.raises(TrajectoryServerError, match="abort group 'g1'"):
        ts.abort_group("g1")
    assert ts.audit({"x": set(), "y": set()}).ok


def test_state_dict_round_trip_and_refusal_while_running():
    ts = TrajectoryServer()
    ts.add_groups([_group("g0", n=2), _group("g1")])
    r0, r1 = ts.admit("g0", 1)
    ts.mark_routed([r0.request_id], "a")
    with pytest.raises(TrajectoryServerError, match="interrupt every instance"):
        ts.state_dict()
    partial = ts.request(r0.request_id)
    partial.output_ids.append(5)
    ts.requeue([partial], "a")
    state = json.loads(json.dumps(ts.state_dict()))
    restored = TrajectoryServer()
    restored.load_state_dict(state)
    assert restored.counts() == ts.counts()
    assert [r.request_id for r in restored.queued()] == [r0.request_id, r1.request_id]
    assert restored.request(r0.request_id).output_ids == [5]
    assert restored.next_pending().group_id == "g1"
    assert restored.audit({}).ok


def test_bad_groups_are_rejected_with_the_reason():
    ts = TrajectoryServer()
    with pytest.raises(ValueError, match="sample_metadata has 2 entries, need n_samples \\+ n_extra = 3"):
        ts.add_groups([PromptGroup("g", [1], 2, 1, {}, [{}, {}])])
    with pytest.raises(ValueError, match="a resample has 1 entries, need n_samples \\+ n_extra = 3"):
        ts.add_groups([PromptGroup("g", [1], 2, 1, {}, [{}] * 3, [[{}] * 3, [{}]])])
    ts.add_groups([_group("g")])
    with pytest.raises(TrajectoryServerError, match="added already"):
        ts.add_groups([_group("g")])
    ts.add_groups([PromptGroup("h", [1], 1)])
    with pytest.raises(ValueError, match="needs 'max_new_tokens' in its metadata or its sample_metadata"):
        ts.admit("h", 0)

"""Quiet ticks: a periodic tick whose decision reads no instance's load leaves its snapshots out,
and a run gives the same figures with them left out as with every snapshot taken."""

from __future__ import annotations

import pytest
from staleflow.protocol import StalenessManager
from staleflow.runtime.coordination.coordinator import Coordinator
from staleflow.runtime.coordination.cost_model import CostModel
from staleflow.runtime.coordination.observations import Tick
from staleflow.runtime.coordination.quiet_tick import decision_reads_load
from staleflow.runtime.run.decision import decide
from staleflow.runtime.run.group_life import GroupLife
from staleflow.runtime.run.instance_driver import InstanceDriver
from staleflow.runtime.run.loop import RunLoop
from staleflow.runtime.servers.trajectory_server import TrajectoryServer
from staleflow.runtime.settings.policies import make_policy
from staleflow.runtime.types import InstanceSnapshot, PromptGroup

MODEL = CostModel(thr=0.0064, o_b=0.0027, o_k=1.231e-4, a_b=0.0028, a_k=3.35e-8)


def _coordinator(groups: int, policy: str = "staleflow-authors") -> tuple[Coordinator, TrajectoryServer]:
    ts = TrajectoryServer()
    ts.add_groups(PromptGroup(f"g{i}", [1] * 8, 2, 0, {"max_new_tokens": 50}) for i in range(groups))
    snapshots = [InstanceSnapshot(f"i{k}", 0, (), (), 0, 100_000, 0.0, 0.0) for k in range(2)]
    return Coordinator(GroupLife(StalenessManager(1, 2), ts), make_policy(policy), MODEL, snapshots), ts


def test_a_decision_reads_the_load_only_when_something_could_be_routed_pulled_bounced_or_migrated():
    c, ts = _coordinator(groups=2)
    assert decision_reads_load(c, 0, False)  # admissible groups pending: routing reads the load
    for cmd in decide(c, c.groups, Tick(0, True, False)):
        ts.mark_routed(cmd.request_ids, cmd.instance_id)
    assert ts.pending_count() == 0 and all(v.requests for v in c.views)
    assert not decision_reads_load(c, 0, False)  # both busy, nothing pending, queued or starved
    assert decision_reads_load(c, 1, False)  # a newer version: the pull decision reads KV use
    held = tuple(c.views[0].requests)
    c.step(InstanceSnapshot("i0", 0, (), held, 10, 100_000, 0.0, 1.0))
    assert decision_reads_load(c, 0, False) == (len(held) > c.policy.phi_wait)  # a bounce
    c.step(InstanceSnapshot("i0", 0, held, (), 10, 100_000, 0.0, 1.0))
    # every instance is starved (nothing pending), but none holds the 10 requests an evacuation needs
    assert len(held) < c.policy.evacuate_min_requests and not decision_reads_load(c, 0, False)
    for k in range(c.policy.evacuate_min_requests):
        c.views[0].add(f"extra{k}", 10, 0)
    c.fleet.forget("i0", ())  # the view changed
    assert decision_reads_load(c, 0, False)  # i0 could be evacuated onto i1: the ratio reads the load
    assert decision_reads_load(_coordinator(0, "staleflow-no-migration")[0], 0, False) is False


@pytest.mark.parametrize("system", ["staleflow-authors", "staleflow"])
def test_a_run_gives_the_same_figures_with_quiet_ticks_as_with_every_snapshot_taken(monkeypatch, system):
    from staleflow.app.simulation import simulate_system
    from staleflow.runtime.settings.workload import load_workload

    workload = load_workload("small-ci")
    deferred = []
    defer = InstanceDriver.defer_refresh
    monkeypatch.setattr(InstanceDriver, "defer_refresh", lambda self, now, tick_s: (deferred.append(now), defer(self, now, tick_s)))
    quiet = simulate_system(workload, system, 1, 4, 0)
    monkeypatch.setattr(RunLoop, "_quiet", lambda self, tick: False)
    every = simulate_system(workload, system, 1, 4, 0)
    assert deferred or system == "staleflow"  # the authors' 100 ms ticks are mostly quiet (ours: 1 s, none here)
    for figures in (quiet, every):
        figures.pop("wall_s")
        figures.pop("coordinator_decision_s")
    assert quiet == every


@pytest.mark.parametrize("system", ["sync", "staleflow", "staleflow-authors"])
def test_an_instance_behind_and_loading_in_its_last_snapshot_makes_the_tick_read_the_load(system):
    """Chaos seed 770077 (``sync``): both instances were stalled (``loading``) in their last snapshots
    when version 1 was pushed. The quiet-tick test left out loading instances, so the snapshots that
    would show them done were skipped, no Pull was decided, nothing was in flight, and the run
    stopped (RunStalledError). Whether an instance is done loading is a snapshot field too."""
    c, _ = _coordinator(groups=0, policy=system)
    for view in c.views:
        c.step(InstanceSnapshot(view.instance_id, 0, (), (), 0, 100_000, 0.0, 1.0, loading=True))
    assert all(v.loading and v.version == 0 for v in c.views)
    assert decision_reads_load(c, 1, False)  # version 1 pushed: a fresh snapshot may let them pull
    c.step(InstanceSnapshot("i0", 0, (), (), 0, 100_000, 0.0, 2.0))
    c.step(InstanceSnapshot("i1", 0, (), (), 0, 100_000, 0.0, 2.0))
    assert [type(cmd).__name__ for cmd in decide(c, c.groups, Tick(1, True, True))] == ["Pull", "Pull"]


def test_requests_routed_since_the_last_snapshot_may_be_waiting_in_the_next():
    """The bounce (``waiting_bounce``) reads the snapshot's waiting queue; the requests routed after
    the last snapshot are not in it, and the next one may show them waiting past ``phi_wait``."""
    c, ts = _coordinator(groups=4)
    for cmd in decide(c, c.groups, Tick(0, True, False)):
        ts.mark_routed(cmd.request_ids, cmd.instance_id)
    busiest = max(c.views, key=lambda v: len(v.requests))
    assert len(busiest.requests) > c.policy.phi_wait and not busiest.waiting and ts.pending_count() == 0
    assert decision_reads_load(c, 0, False)
    c.step(InstanceSnapshot(busiest.instance_id, 0, (), tuple(busiest.requests), 0, 100_000, 0.0, 1.0))
    assert any(type(cmd).__name__ == "Interrupt" for cmd in decide(c, c.groups, Tick(0, True, False)))

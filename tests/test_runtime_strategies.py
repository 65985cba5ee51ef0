"""Routing, synchronization, migration, speculative snapshots, admission and policies, each on its own."""

from __future__ import annotations

import numpy as np
import pytest
from staleflow.protocol import StalenessManager
from staleflow.runtime.coordination.commands import Admission, Interrupt, Pull, Route
from staleflow.runtime.coordination.coordinator import Coordinator
from staleflow.runtime.coordination.cost_model import CostModel
from staleflow.runtime.coordination.fleet import FleetArrays, InstanceView
from staleflow.runtime.coordination.migration import plan_migration
from staleflow.runtime.coordination.observations import Admitted, Cancelled, RequestsLeft, RunStarted, StepStarted, Tick
from staleflow.runtime.coordination.routing import (
    LeastLoadedRouter,
    ThroughputRouter,
    fleet_throughput,
)
from staleflow.runtime.coordination.sync import plan_pulls
from staleflow.runtime.run.decision import decide
from staleflow.runtime.run.group_life import GroupLife
from staleflow.runtime.servers.trajectory_server import TrajectoryServer
from staleflow.runtime.settings.policies import POLICIES, make_policy
from staleflow.runtime.types import InstanceSnapshot, PromptGroup

#: The authors' Qwen-7B TP1 coefficients.
MODEL = CostModel(thr=0.0064, o_b=0.0027, o_k=1.231e-4, a_b=0.0028, a_k=3.35e-8)


def snap(iid: str, version: int = 0, running=(), waiting=(), kv: int = 0, cap: int = 100_000, loading=False):
    return InstanceSnapshot(iid, version, tuple(running), tuple(waiting), kv, cap, 0.0, 0.0, loading)


def view(iid: str, version: int = 0, n: int = 0, tokens: int = 100, cap: int = 100_000, group_version: int = 0):
    v = InstanceView(snap(iid, version, cap=cap))
    for k in range(n):
        v.add(f"{iid}-r{k}", tokens, group_version)
    return v


# ----------------------------------------------------------------------------- routing
def test_vectorised_throughput_matches_the_cost_model():
    n, kv = np.array([0.0, 1, 50, 300]), np.array([0.0, 100, 5e4, 3e5])
    expected = [MODEL.throughput(int(a), int(b)) for a, b in zip(n, kv)]
    assert fleet_throughput(MODEL, n, kv) == pytest.approx(expected)


def test_throughput_router_picks_the_largest_marginal_gain():
    # in the flat regime (n small) every added request gains ~1/L; past the knee the gain shrinks
    views = [view("busy", n=200), view("light", n=2), view("mid", n=60)]
    fleet = FleetArrays.of(views)
    assert ThroughputRouter(MODEL, 0.3).choose(fleet, 100, np.ones(3, bool)) == [1]
    assert fleet.n.tolist() == [200, 3, 60]  # the fleet is updated by the decision


def test_throughput_router_waterfall_prefers_newer_version_tier():
    views = [view("old-empty", version=0), view("new-loaded", version=1, n=30)]
    fleet = FleetArrays.of(views)
    # the old instance gains more, but the newer tier still passes mu, so it goes first
    assert ThroughputRouter(MODEL, 0.3).choose(fleet, 100, np.ones(2, bool)) == [1]
    # with a mu the loaded newer instance cannot meet, the request falls to the older tier
    views = [view("old-empty", version=0), view("new-loaded", version=1, n=400)]
    assert ThroughputRouter(MODEL, 0.3).choose(FleetArrays.of(views), 100, np.ones(2, bool)) == [0]


def test_throughput_router_keeps_request_queued_below_mu_or_without_kv_room():
    assert ThroughputRouter(MODEL, 0.3).choose(FleetArrays.of([view("a", n=2000)]), 100, np.ones(1, bool)) == []
    small = [view("a", n=1, tokens=900, cap=1000)]
    assert ThroughputRouter(MODEL, 0.3).choose(FleetArrays.of(small), 200, np.ones(1, bool)) == []
    assert ThroughputRouter(MODEL, 0.3).choose(FleetArrays.of(small), 100, np.ones(1, bool)) == [0]


def test_throughput_router_places_many_and_stops_when_gain_runs_out():
    fleet = FleetArrays.of([view("a"), view("b")])
    chosen = ThroughputRouter(MODEL, 0.3).choose(fleet, 10, np.ones(2, bool), count=10_000)
    assert 0 < len(chosen) < 10_000
    assert abs(chosen.count(0) - chosen.count(1)) <= 1  # balanced between equal instances
    gain = fleet_throughput(MODEL, fleet.n + 1, fleet.kv + 10) - fleet_throughput(MODEL, fleet.n, fleet.kv)
    assert (gain < 0.3 / MODEL.step_latency(1, 10)).all()


def test_routers_respect_eligibility_and_loading():
    views = [view("a", version=0), view("b", version=2)]
    views[1].loading = True
    fleet = FleetArrays.of(views)
    assert ThroughputRouter(MODEL, 0.3).choose(fleet, 10, fleet.version >= 1) == []
    assert LeastLoadedRouter(10).choose(fleet, 10, fleet.version >= 1) == []
    views[1].loading = False
    fleet = FleetArrays.of(views)
    assert LeastLoadedRouter(10).choose(fleet, 10, fleet.version >= 1) == [1]


def test_least_loaded_router_balances_up_to_max_running():
    fleet = FleetArrays.of([view("a", n=3), view("b", n=0)])
    assert LeastLoadedRouter(4).choose(fleet, 10, np.ones(2, bool), count=10) == [1, 1, 1, 0, 1]
    assert fleet.n.tolist() == [4, 4]
    full = view("full", n=1)
    full.waiting = ("full-r0",)
    fleet = FleetArrays.of([full, view("b", n=3)])
    assert LeastLoadedRouter(8).choose(fleet, 10, np.ones(2, bool)) == [1]  # a waiting queue counts as full


def test_least_loaded_admission_waits_for_the_least_loaded_instance_instead_of_piling_onto_one():
    """Least-requests routing (no cost model, so never "no room") used to admit every group the
    protocol allows onto the only instance at the admissible version (here the others are still
    loading it: the staggered parameter-server pulls of a global sync). A new group goes only where
    the load is no more than the fleet's least; the rest wait until the others have the version."""
    c, m, ts = _coordinator(eta=1, batch=2, instances=4, routing="least_loaded", migration=False)
    for k in (1, 2, 3):
        assert _accepts(c, snap(f"i{k}", loading=True))
    _decide(c, 0, True)
    assert [len(v.requests) for v in c.views] == [2, 0, 0, 0]  # one group (2 samples), not all 4
    assert len(m) == 1 and c.stats["admission_held_for_balance"] >= 1
    for k in (1, 2, 3):
        assert _accepts(c, snap(f"i{k}"))
    _decide(c, 0, True)
    assert len(m) == 4 and all(c.view(f"i{k}").requests for k in (1, 2, 3))  # the rest spread over the fleet


def test_least_loaded_admission_ignores_a_lost_instance():
    """A lost instance holds nothing but takes no work: it does not hold admission back."""
    from staleflow.runtime.coordination.observations import InstanceLost

    c, m, ts = _coordinator(eta=1, batch=2, instances=2, routing="least_loaded")
    c.step(InstanceLost("i1"))
    _decide(c, 0, True)
    assert len(m) == 4 and len(c.view("i0").requests) == 8


def _pileup_workload():
    """small-ci scaled to the shape where least-requests admission piled up (Qwen3-30B-A3B, 64
    instances): 16 instances with a small KV cache, parameter-server pulls 4 at a time at link speed."""
    import yaml
    from staleflow.runtime.settings.workload import parse_workload, resolve_workload_path

    data = yaml.safe_load(resolve_workload_path("small-ci").read_text())
    data.update({
        "name": "small-ci-pileup",
        "cluster": {"rollout_instances": 16, "gpus_per_instance": 1, "trainer_gpus": 4},
        "instance": {"kv_capacity_tokens": 3000, "max_running": 64, "prefill_s_per_token": 2.0e-5, "weight_load_s": 0.5},
        "network": {"weights_gb": 8.0, "ps_gb_per_s": 16.0, "link_gb_per_s": 4.0},
        "batch": {"groups_per_step": 32, "group_size": 8},
        "simulation": {"tick_s": 0.1, "event_quantum_s": 0.0},
    })
    return parse_workload(data)


def test_least_loaded_without_migration_keeps_the_fleet_busy_under_global_sync():
    """The review's collapse in small: StaleFlow with least-requests routing, no migration, global
    sync, in-place reload and parameter-server pulls. Before the balanced admission the first
    instance to load each version took the groups of the whole window (util 0.42, half the
    throughput of the same run with migration); now it stays within 15% of it."""
    from staleflow.app.simulation import simulate_system

    workload = _pileup_workload()
    knobs = {"routing": "least_loaded", "migration": False, "sync": "global_immediate", "pull_keeps_requests": True,
             "weight_transfer": "ps_pull"}
    combo = simulate_system(workload, "staleflow", 2, 8, 0, **knobs)
    migrating = simulate_system(workload, "staleflow", 2, 8, 0, **{**knobs, "migration": True})
    assert combo["utilisation"] > 0.8
    assert combo["tokens_per_s"] > 0.85 * migrating["tokens_per_s"]


# ----------------------------------------------------------------------------- synchronization
def _manager_with_head_full(eta: int = 1, batch: int = 2) -> StalenessManager:
    m = StalenessManager(eta, batch)
    for g in range(batch * (eta + 1)):
        assert m.reserve(f"g{g}", 0)
    return m


def test_per_instance_sync_pulls_drained_instances_first():
    m = StalenessManager(eta=1, batch_size=2)
    views = [view("drained", n=0), view("busy", n=10, tokens=5_000)]
    assert plan_pulls("per_instance", views, None, m, 0.1) == []
    assert plan_pulls("per_instance", views, 0, m, 0.1) == []  # nobody behind
    for g in ("a", "b"):
        m.reserve(g, 0)
        m.occupy(g)
    m.consume()  # version 1 exists now
    assert plan_pulls("per_instance", views, 1, m, 0.1) == [0]  # only the drained one: cheap


def test_per_instance_sync_pulls_the_cheapest_instance_on_demand():
    m = StalenessManager(eta=1, batch_size=2)
    for g in ("a", "b"):
        m.reserve(g, 0)
        m.occupy(g)
    m.consume()
    for g in range(2):
        assert m.reserve(f"c{g}", 0)
    assert m.reserve_slack(0) == 0 and m.reserve_slack(1) > 0
    busy = [view("busier", n=12, tokens=5_000), view("busy", n=10, tokens=5_000)]
    assert plan_pulls("per_instance", busy, 1, m, 0.1) == []  # nobody drained, nothing waiting
    # groups wait that only version 1 admits: the least loaded instance moves now
    assert plan_pulls("per_instance", busy, 1, m, 0.1, starved=True) == [1]
    for g in range(2):
        assert m.reserve(f"d{g}", 1)
    assert m.reserve_slack(1) == 0
    assert plan_pulls("per_instance", busy, 1, m, 0.1, starved=True) == []  # pulling would not help


def test_coordinator_reports_starvation_and_pulls_on_the_next_decision():
    c, m, ts = _coordinator("staleflow", eta=0, batch=2, instances=2, sync_kv_fraction=0.0)
    for cmd in _decide(c, 0, True):
        ts.mark_routed(cmd.request_ids, cmd.instance_id)
    for g in list(m.groups()):
        m.occupy(g.group_id)
    m.consume()  # version 1 trained; both instances still hold version-0 work
    commands = _decide(c, 1, False)
    assert commands == []  # nothing admissible at version 0: starved, nothing pulled yet
    pulls = [cmd for cmd in _decide(c, 1, False) if isinstance(cmd, Pull)]
    assert len(pulls) == 1 and pulls[0].version == 1


def test_global_sync_modes():
    m = StalenessManager(eta=1, batch_size=2)
    views = [view("a", n=0), view("b", n=3)]
    assert plan_pulls("global_immediate", views, 1, m, 0.1) == [0, 1]
    assert plan_pulls("global_drained", views, 1, m, 0.1) == []
    views[1] = view("b", n=0)
    assert plan_pulls("global_drained", views, 1, m, 0.1) == [0, 1]
    views[0].loading = True
    assert plan_pulls("global_immediate", views, 1, m, 0.1) == [1]


# ----------------------------------------------------------------------------- migration
def test_migration_moves_waiting_beyond_phi_wait():
    v = view("a", n=8)
    v.waiting = tuple(f"a-r{k}" for k in range(3, 8))  # 5 waiting
    plan = plan_migration([v, view("b", n=8)], FleetArrays.of([v, view("b", n=8)]), MODEL, 3, 5, np.ones(2, bool))
    assert plan == {0: ["a-r6", "a-r7"]}
    # no instance could take them (none starved): re-routing would only send them back
    assert plan_migration([v, view("b", n=8)], FleetArrays.of([v, view("b", n=8)]), MODEL, 3, 5, np.zeros(2, bool)) == {}


def test_migration_rebalances_only_requests_the_target_may_run():
    busy = view("busy", version=1, n=0)
    for k in range(10):
        busy.add(f"old{k}", 100, 0)
    for k in range(10):
        busy.add(f"new{k}", 100, 1)
    idle = view("idle", version=0)
    fleet = FleetArrays.of([busy, idle])
    plan = plan_migration([busy, idle], fleet, MODEL, 3, 5, np.array([False, True]))
    assert list(plan) == [0] and len(plan[0]) == 10
    assert all(r.startswith("old") for r in plan[0])  # group version 1 cannot go to a version-0 instance
    # an idle instance that can still get new groups is not starved: nothing moves to it
    assert plan_migration([busy, idle], fleet, MODEL, 3, 5, np.array([False, False])) == {}
    balanced = [view("a", n=10), view("b", n=9)]
    assert plan_migration(balanced, FleetArrays.of(balanced), MODEL, 3, 5, np.ones(2, bool)) == {}


# ----------------------------------------------------------------------------- coordinator
def _coordinator(policy="staleflow", eta=1, batch=2, instances=2, **knobs):
    ts = TrajectoryServer()
    ts.add_groups(PromptGroup(f"g{i}", [1] * 8, 2, 0, {"max_new_tokens": 50}) for i in range(20))
    m = StalenessManager(eta, batch)
    c = Coordinator(GroupLife(m, ts), make_policy(policy, **knobs), MODEL, [snap(f"i{k}") for k in range(instances)])
    return c, m, ts


def _decide(c, ps_version, full, trainer_waits=False):
    """One whole decision, as the run loop makes it."""
    return decide(c, c.groups, Tick(ps_version, full, trainer_waits))


def _accepts(c, snapshot) -> bool:
    """Step ``snapshot`` into the coordinator; whether it took it."""
    before = c.stats["snapshots_accepted"]
    c.step(snapshot)
    return c.stats["snapshots_accepted"] > before


def test_coordinator_admits_up_to_the_protocol_and_routes_groups():
    c, m, ts = _coordinator(eta=1, batch=2)
    commands = _decide(c, 0, True)
    routes = [cmd for cmd in commands if isinstance(cmd, Route)]
    routed = sorted(r for cmd in routes for r in cmd.request_ids)
    assert len(m) == 4  # (eta + 1) * B groups reserved at version 0
    assert all(g.version == 0 for g in m.groups())
    assert len(routed) == 8 and ts.queued_count() == 8  # routed ids are still queued until the loop executes
    assert {cmd.instance_id for cmd in routes} == {"i0", "i1"}
    assert c.stats["admission_blocked_by_protocol"] >= 1


def test_coordinator_rejects_contradicting_snapshots():
    c, _, ts = _coordinator()
    commands = _decide(c, 0, True)
    route = next(cmd for cmd in commands if isinstance(cmd, Route) and cmd.instance_id == "i0")
    ts.mark_routed(route.request_ids, "i0")
    stale = snap("i0")  # taken before the route arrived: holds fewer requests, agrees
    assert _accepts(c, stale)
    rogue = snap("i0", running=("zz/0",))
    assert not _accepts(c, rogue)  # a request the coordinator never sent there
    c.step(RunStarted(3))
    assert c.ready().commands == (Pull("i0", 3), Pull("i1", 3))
    assert not _accepts(c, snap("i0", version=0, running=route.request_ids))  # older than the pull
    assert _accepts(c, snap("i0", version=3, running=route.request_ids))
    assert c.stats["snapshots_rejected"] == 2


def test_a_decision_waits_for_the_outcome_of_each_group_change_it_asks_for():
    """step / ready: a Tick starts a decision; the coordinator reserves nothing itself, it asks for
    each admission in a Ready and goes on only once the group's requests are stepped back; a missing
    or wrong outcome and a second Tick mid-decision are refused; the decision ends with the routes."""
    c, m, ts = _coordinator(eta=0, batch=2, instances=2)
    c.step(Tick(0, full=True))
    with pytest.raises(RuntimeError, match="decision is in progress"):
        c.step(Tick(0, full=True))
    admitted: list[str] = []
    while (ready := c.ready()).waits:
        assert ready.admit is not None and ready.requeue == () and len(m) == len(admitted) // 2  # groups of 2
        with pytest.raises(RuntimeError, match="step its outcome"):
            c.ready()
        with pytest.raises(RuntimeError, match="waits for Admitted"):
            c.step(Cancelled(()))
        requests = tuple(c.groups.admit(ready.admit.group_id, ready.admit.version))
        c.step(Admitted(ready.admit, requests))
        admitted += [r.request_id for r in requests]
    assert len(m) == 2 and ready.admit is None
    assert all(isinstance(cmd, Route) for cmd in ready.commands)
    assert sorted(r for cmd in ready.commands for r in cmd.request_ids) == sorted(admitted) and len(admitted) == 4
    assert c.ready().commands == ()  # handed out once
    with pytest.raises(TypeError, match="asked for"):  # an outcome nobody asked for is no observation
        c.step(Admitted(Admission("g9", 0, 0), ()))


def test_inflight_cap_bounds_admission():
    c, _, _ = _coordinator("inflight-cap", eta=1, batch=2)
    _decide(c, 0, True)
    assert c.groups.live == 4 == (1 + 0 + 1) * 2


def _head_straggler(proactive_abort: int, finished_in_head: tuple[str, ...]):
    """eta 1, B 2: g0..g3 reserved at version 0 and routed; g2, g3 trained in batch 0, so g0, g1 are
    due in the head buffer 1; ``finished_in_head`` of them finish, and two groups reserved at
    version 1 finish (enough to fill the batch without the head's stragglers)."""
    c, m, ts = _coordinator("staleflow", eta=1, batch=2, instances=1, proactive_abort=proactive_abort)
    for cmd in _decide(c, 0, True):
        ts.mark_routed(cmd.request_ids, cmd.instance_id)
    for group_id in ("g2", "g3"):
        m.occupy(group_id)
    m.consume()
    for group_id in finished_in_head:
        m.occupy(group_id)
    for group_id in ("g4", "g5"):
        c.groups.admit(group_id, 1)
        m.occupy(group_id)
    assert not m.can_consume()
    return c, m, ts


def test_proactive_abort_requeues_the_last_stragglers_of_the_head_buffer_and_keeps_the_bound():
    """One group due in the head buffer is still generating (threshold 2): it is aborted, its prompt
    re-queued as a new pending group, and a batch of finished groups within the bound is ready."""
    c, m, ts = _head_straggler(2, ("g1",))
    pending = ts.pending_count()
    commands = _decide(c, 1, False, trainer_waits=True)
    assert c.stats["proactive_aborted_groups"] == 1 and c.groups.requeued == 1
    assert "g0" not in m and ts.pending_count() == pending + 1
    assert ts.group_state("g0").value == "aborted" and ts.group("g0~r1").prompt_ids == ts.group("g0").prompt_ids
    assert sorted(r for cmd in commands if type(cmd).__name__ == "Abort" for r in cmd.request_ids) == ["g0/0", "g0/1"]
    batch = m.consume()
    assert batch.version == 1 and all(batch.version - v <= 1 for v in batch.group_versions)
    # more groups missing than the threshold: nothing is aborted, the trainer waits
    c2, m2, _ = _head_straggler(1, ())
    _decide(c2, 1, False, trainer_waits=True)
    assert c2.stats["proactive_aborted_groups"] == 0 and "g0" in m2 and "g1" in m2


def test_requeued_prompt_takes_its_next_sample_metadata():
    ts = TrajectoryServer()
    samples, *resamples = [[{"length": n}, {"length": n + 1}] for n in (5, 7, 9)]
    ts.add_groups([PromptGroup("g0", [1] * 4, 2, 0, {"max_new_tokens": 50}, samples, resamples)])
    life = GroupLife(StalenessManager(1, 1), ts)
    life.admit("g0", 0)
    life.requeue(["g0"])
    again = ts.group("g0~r1")
    assert again.sample_metadata == [{"length": 7}, {"length": 8}] and again.resamples == [[{"length": 9}, {"length": 10}]]
    assert again.metadata == {"max_new_tokens": 50} and again.metadata is not ts.group("g0").metadata
    assert [r.metadata for r in life.admit("g0~r1", 0)] == [{"max_new_tokens": 50, "length": 7}, {"max_new_tokens": 50, "length": 8}]
    life.requeue(["g0~r1"])
    life.admit("g0~r2", 0)
    life.requeue(["g0~r2"])
    last = ts.group("g0~r3")  # no resample left: the last one is sampled again
    assert last.sample_metadata == [{"length": 9}, {"length": 10}] and last.resamples == []
    assert life.live == 0 and life.running == 0


def test_pull_interrupts_requests_unless_the_policy_keeps_them():
    for keeps in (False, True):
        c, m, ts = _coordinator("staleflow-no-sync", eta=1, batch=2, pull_keeps_requests=keeps)
        for cmd in _decide(c, 0, True):
            ts.mark_routed(cmd.request_ids, cmd.instance_id)
        held = {v.instance_id: set(v.requests) for v in c.views}
        for g in list(m.groups())[:2]:
            m.occupy(g.group_id)
        m.consume()  # the trainer made version 1
        commands = _decide(c, 1, False)
        pulls = [cmd for cmd in commands if isinstance(cmd, Pull)]
        interrupts = {cmd.instance_id: set(cmd.request_ids) for cmd in commands if isinstance(cmd, Interrupt)}
        assert {p.instance_id for p in pulls} == {"i0", "i1"}
        if keeps:
            assert interrupts == {} and all(held[v.instance_id] <= set(v.requests) for v in c.views)
        else:
            assert interrupts == held and all(held[v.instance_id].isdisjoint(v.requests) for v in c.views)
            order = [type(cmd).__name__ for cmd in commands if cmd.instance_id == "i0"]
            assert order[:2] == ["Interrupt", "Pull"]


def test_coordinator_migrates_on_full_ticks_only():
    c, _, ts = _coordinator("staleflow", eta=3, batch=8, instances=2)
    for cmd in _decide(c, 0, True):
        if isinstance(cmd, Route):
            ts.mark_routed(cmd.request_ids, cmd.instance_id)
    c.step(RequestsLeft("i1", tuple(c.views[1].requests)))  # instance 1 drained
    assert not [cmd for cmd in _decide(c, 0, False) if isinstance(cmd, Interrupt)]
    interrupts = [cmd for cmd in _decide(c, 0, True) if isinstance(cmd, Interrupt)]
    assert interrupts and interrupts[0].instance_id == "i0"


# ----------------------------------------------------------------------------- policies
def test_policies_and_their_errors():
    assert set(POLICIES) >= {"staleflow", "sync", "one-step-off", "inflight-cap", "roll-flash", "areal", "verl-async", "verl-sync"}
    assert make_policy("start-version-gc").name == "roll-flash-2026"  # the old name runs the ROLL Flash model it was replaced by
    assert make_policy("sync").protocol_eta(3) == 0
    assert make_policy("one-step-off").protocol_eta(3) == 1
    assert make_policy("one-step-off").protocol_eta(0) == 0
    assert make_policy("staleflow").protocol_eta(3) == 3
    assert make_policy("staleflow", mu=0.2).mu == 0.2
    with pytest.raises(ValueError, match="unknown system 'verl'"):
        make_policy("verl")
    with pytest.raises(ValueError, match="unknown policy knob\\(s\\) colour"):
        make_policy("staleflow", colour=1)
    with pytest.raises(ValueError, match="routing must be one of"):
        make_policy("staleflow", routing="random")
    # the synchronous systems admit exactly one batch per version: the table refuses redundancy for them
    with pytest.raises(ValueError, match="policy 'sync': batch_redundancy must be 0"):
        make_policy("sync", batch_redundancy=1)
    assert make_policy("one-step-off", batch_redundancy=1).batch_redundancy == 1
    assert [name for name, policy in POLICIES.items() if not policy.takes_redundancy] == ["verl-sync", "sync"]


def test_freshness_aware_admission_narrows_while_the_trainer_does_not_wait():
    """With freshness on, the lookahead starts at eta (the protocol's own limit), narrows by one
    after ``freshness_patience`` steps the trainer did not wait for, down to 0 (only the head
    buffer); admission then stops once the active groups fill the head buffer and ``lookahead``
    more. A wait widens it only when a hold kept work from an instance with room."""
    plain, plain_manager, _ = _coordinator("staleflow", eta=3, batch=2, instances=4)
    _decide(plain, 0, True)
    assert len(plain_manager) == 8  # (eta + 1) * B: the protocol's limit
    fresh, manager, ts = _coordinator("staleflow-fresh", eta=3, batch=2, instances=4)
    assert fresh.lookahead.width == 3
    patience = fresh.policy.freshness_patience
    for _ in range(3 * patience):
        fresh.step(StepStarted(trainer_waited=False))
    assert fresh.lookahead.width == 0
    def decide_and_route() -> None:
        for cmd in _decide(fresh, 0, True):
            if isinstance(cmd, Route):
                ts.mark_routed(cmd.request_ids, cmd.instance_id)

    decide_and_route()
    assert len(manager) == 2  # only the head buffer
    assert fresh.stats["admission_held_for_freshness"] >= 1 and fresh.stats["freshness_hold_left_room"] == 1
    fresh.step(StepStarted(trainer_waited=True))  # the hold kept work from empty instances: widen
    assert fresh.lookahead.width == 1
    decide_and_route()
    assert len(manager) == 4 and fresh.stats["freshness_hold_left_room"] == 2  # held again, room left again
    fresh.step(StepStarted(trainer_waited=False))
    # the instances report full KV caches: a hold now costs nothing, and a wait does not widen
    for v in fresh.views:
        assert _accepts(fresh, snap(v.instance_id, running=tuple(v.requests), kv=100_000))
    decide_and_route()
    assert len(manager) == 4 and fresh.stats["freshness_hold_left_room"] == 2
    fresh.step(StepStarted(trainer_waited=True))
    assert fresh.lookahead.width == 1
    for _ in range(patience):
        fresh.step(StepStarted(trainer_waited=False))
    assert fresh.lookahead.width == 0
    for _ in range(5):
        fresh.lookahead.hold_left_room = True  # as if each step's hold had left room
        fresh.step(StepStarted(trainer_waited=True))
    assert fresh.lookahead.width == 3  # never beyond eta


def test_freshness_pulls_new_weights_at_once_while_it_holds_admission():
    """Below its widest lookahead the fresh policy pulls every instance behind as soon as a
    version is pushed (they keep their requests); at eta it syncs as plain StaleFlow does."""
    m = StalenessManager(eta=2, batch_size=2)
    busy = [view("a", n=12, tokens=5_000), view("b", n=10, tokens=5_000)]
    assert plan_pulls("per_instance", busy, 1, m, 0.1) == []
    assert plan_pulls("per_instance", busy, 1, m, 0.1, eager=True) == [0, 1]
    for narrowed in (False, True):
        c, manager, ts = _coordinator("staleflow-fresh", eta=2, batch=2, instances=2)
        if narrowed:
            for _ in range(c.policy.freshness_patience):
                c.step(StepStarted(trainer_waited=False))
        for cmd in _decide(c, 0, True):
            if isinstance(cmd, Route):
                ts.mark_routed(cmd.request_ids, cmd.instance_id)
        for g in [g.group_id for g in manager.groups()][:2]:
            manager.occupy(g)
        manager.consume()  # version 1 pushed; both instances busy
        for v in c.views:
            assert _accepts(c, snap(v.instance_id, running=tuple(v.requests), kv=100_000))
        pulls = [cmd for cmd in _decide(c, 1, False) if isinstance(cmd, Pull)]
        interrupts = [cmd for cmd in _decide(c, 1, False) if isinstance(cmd, Interrupt)]
        assert len(pulls) == (2 if narrowed else 0) and interrupts == []


def test_freshness_lowers_staleness_when_the_trainer_is_the_bottleneck_and_costs_no_throughput():
    """Simulated, eta 2, 20 steps: trainer-bound (a step takes 20 s), the fresh policy trains most
    groups at lag 1 at the same throughput; rollout-bound (small-ci as shipped) it keeps the full
    lookahead and matches StaleFlow exactly."""
    from staleflow.app.simulation import simulate_system
    from staleflow.runtime.settings.workload import load_workload

    def mean(histogram: dict[str, int]) -> float:
        return sum(int(s) * n for s, n in histogram.items()) / sum(histogram.values())

    workload = load_workload("small-ci")
    slow_trainer = load_workload("small-ci-trainer-bound")
    assert slow_trainer.training.base_s == 20.0
    assert slow_trainer.model_copy(update={"training": workload.training, "name": "small-ci"}) == workload  # nothing else differs
    plain, fresh = (simulate_system(slow_trainer, s, 2, 20, 0) for s in ("staleflow", "staleflow-fresh"))
    assert plain["trainer_busy"] > 0.95 and mean(plain["staleness_histogram"]) > 1.8
    assert mean(fresh["staleness_histogram"]) < 1.3 and fresh["max_staleness"] <= 2
    assert fresh["tokens_per_s"] >= 0.97 * plain["tokens_per_s"]
    plain, fresh = (simulate_system(workload, s, 2, 20, 0) for s in ("staleflow", "staleflow-fresh"))
    assert plain["trainer_busy"] < 0.2
    assert fresh["tokens_per_s"] == plain["tokens_per_s"] and fresh["staleness_histogram"] == plain["staleness_histogram"]


def test_round_robin_goes_around_eligible_instances_and_oldest_tier_first_for_reserved_groups():
    from staleflow.runtime.coordination.routing import RoundRobinRouter

    fleet = FleetArrays.of([view("a"), view("b"), view("c")])
    router = RoundRobinRouter(max_running=2)
    assert router.choose(fleet, 10, np.ones(3, bool), count=4) == [0, 1, 2, 0]
    assert router.choose(fleet, 10, np.array([True, False, True]), count=3) == [2]  # a is full (2), b not eligible
    # the waterfall: a new group tries the newest tier, a reserved group's requests the oldest
    views = [view("old", version=0), view("new", version=1)]
    assert ThroughputRouter(MODEL, 0.3).choose(FleetArrays.of(views), 100, np.ones(2, bool)) == [1]
    assert ThroughputRouter(MODEL, 0.3).choose(FleetArrays.of(views), 100, np.ones(2, bool), oldest_first=True) == [0]


def test_planning_cost_model_has_a_seeded_estimation_error():
    off = MODEL.with_error(0.1, seed=3)
    assert off == MODEL.with_error(0.1, seed=3) and off != MODEL.with_error(0.1, seed=4)
    ratios = [getattr(off, k) / getattr(MODEL, k) for k in ("thr", "o_b", "o_k", "a_b", "a_k")]
    assert all(0.8 <= r <= 1.2 for r in ratios) and any(abs(r - 1) > 0.01 for r in ratios)
    assert MODEL.with_error(0.0, seed=3) is MODEL
    with pytest.raises(ValueError, match="estimation error must be in"):
        MODEL.with_error(0.6, seed=0)


def test_request_budget_batches_partials_into_one_router_call_and_exact_budget_routes_as_before():
    """Queued partials of many sizes: with the exact budget (1) every size is its own router call
    and the routes are those of routing the queue one request at a time (the code before
    batching); with the reference's 1024, one call places them all, each on an instance with room."""
    from dataclasses import replace as dc_replace

    def partials_queued(budget):
        c, _, ts = _coordinator("staleflow", eta=1, batch=2, instances=4, request_budget=budget)
        for cmd in _decide(c, 0, True):
            ts.mark_routed(cmd.request_ids, cmd.instance_id)
        for k, v in enumerate(c.views):
            rids = tuple(v.requests)
            c.step(RequestsLeft(v.instance_id, rids))
            ts.requeue([dc_replace(ts.request(r), output_ids=[0] * (37 * k + 5 * i)) for i, r in enumerate(rids)], v.instance_id)
        return c, ts

    calls = []
    c, ts = partials_queued(1)
    queue = ts.queued()
    original = c.router.choose
    c.router.choose = lambda *a, **k: calls.append(a[3]) or original(*a, **k)
    routes = {r: cmd.instance_id for cmd in _decide(c, 0, False) for r in cmd.request_ids}
    assert len(calls) == len({len(r.output_ids) for r in queue}) and len(routes) == len(queue) == 8
    replay, tsr = partials_queued(1)
    fleet = replay.fleet.synced()
    expected = {}
    for request in tsr.queued():  # one request at a time, as before batching
        tokens = len(request.prompt_ids) + len(request.output_ids)
        [index] = replay.router.choose(fleet, tokens, fleet.version >= request.group_version, 1, oldest_first=True)
        expected[request.request_id] = replay.views[index].instance_id
    assert routes == expected
    calls.clear()
    c, ts = partials_queued(1024)
    original = c.router.choose
    c.router.choose = lambda *a, **k: calls.append(a[3]) or original(*a, **k)
    assert sum(len(cmd.request_ids) for cmd in _decide(c, 0, False)) == 8 and calls == [8]


def test_completion_ledger_consumes_in_the_peers_orders_without_a_bound():
    """AReaL takes the oldest-admitted finished groups, VeRL's queue the first finished; neither
    waits for a straggler; with the filter, finished groups past eta are dropped at consume."""
    from staleflow.runtime.run.group_life import CompletionLedger

    for order, expected in (("oldest_finished", ("a", "b")), ("finish_order", ("c", "b"))):
        ledger = CompletionLedger(eta=1, batch_size=2, order=order)
        for group_id in ("s", "a", "b", "c"):
            assert ledger.reserve(group_id, 0)
        for group_id in ("c", "b", "a"):  # s straggles
            ledger.occupy(group_id)
        batch = ledger.consume()
        assert batch.group_ids == expected and batch.version == 0 and batch.dropped == ()
    ledger = CompletionLedger(eta=1, batch_size=1, order="oldest_finished", filter_stale=True)
    for group_id in ("old", "x", "y", "z"):
        ledger.reserve(group_id, 0)
    ledger.occupy("x")
    ledger.occupy("y")
    assert ledger.consume().group_ids == ("x",) and ledger.consume().group_ids == ("y",)  # versions 0, 1
    ledger.occupy("old")
    ledger.occupy("z")
    assert ledger.version == 2 and not ledger.can_consume()  # both are 2 versions old: past eta 1
    ledger.reserve("new", 2)
    ledger.occupy("new")
    batch = ledger.consume()
    assert batch.group_ids == ("new",) and set(batch.dropped) == {"old", "z"}
    with pytest.raises(ValueError, match="no protocol events"):
        ledger.add_event_hook(print)


def test_completion_ledger_refuses_misuse_and_keeps_its_groups_through_a_consume_that_is_not_ready():
    """The ledger's own errors (an unknown order, a version it has not reached, a group admitted
    twice, a snapshot), its view of the groups, and a consume refused for want of fresh groups: the
    stale ones it set aside are still held, dropped by the consume that succeeds."""
    from staleflow.protocol.errors import ConsumeNotReadyError, InvalidVersionError
    from staleflow.protocol.events import GroupStatus
    from staleflow.runtime.run.group_life import CompletionLedger

    with pytest.raises(ValueError, match="order must be oldest_finished or finish_order, got 'lifo'"):
        CompletionLedger(eta=1, batch_size=1, order="lifo")
    ledger = CompletionLedger(eta=0, batch_size=2, order="finish_order", filter_stale=True)
    with pytest.raises(InvalidVersionError, match="version 1 is not in 0..0"):
        ledger.reserve("a", 1)
    with pytest.raises(InvalidVersionError, match="version -1 is not in 0..0"):
        ledger.can_reserve(-1)
    for group_id in ("a", "b", "c"):
        assert ledger.can_reserve(0) and ledger.reserve(group_id, 0)
    with pytest.raises(ValueError, match="group 'a' is already active"):
        ledger.reserve("a", 0)
    ledger.occupy("a")
    ledger.occupy("b")
    assert [(r.group_id, r.version, r.status) for r in ledger.groups()] == [
        ("a", 0, GroupStatus.DONE), ("b", 0, GroupStatus.DONE), ("c", 0, GroupStatus.RUNNING)]
    assert ledger.consume().group_ids == ("a", "b") and ledger.version == 1
    ledger.occupy("c")  # now past eta 0
    ledger.reserve("d", 1)
    ledger.occupy("d")
    assert not ledger.can_consume()
    with pytest.raises(ConsumeNotReadyError, match=r"1 finished groups \(and 1 past eta, not trained\), 2 needed"):
        ledger.consume()
    assert "c" in ledger and len(ledger) == 2 and ledger.counts().done == (2,)  # c set aside, still held
    ledger.reserve("e", 1)
    ledger.occupy("e")
    batch = ledger.consume()
    assert batch.group_ids == ("d", "e") and batch.dropped == ("c",) and len(ledger) == 0 and "c" not in ledger
    ledger.reserve("f", 2)
    ledger.abort("f")
    assert len(ledger) == 0 and ledger.counts().running == (0,)
    with pytest.raises(ValueError, match="a completion-order system has no protocol snapshot"):
        ledger.snapshot()



def test_a_consume_the_completion_ledger_refuses_leaves_its_finish_order_as_it_was():
    """A refused consume changes nothing (as the protocol's operations): the stale groups it looked
    at keep their place in the finish order. It took them out and put them back at the end, behind
    groups that finished after them (fixed in 9d74391). Nothing a consume returns shows that order
    today (the stale groups are dropped by the next consume that succeeds, before any fresh group can
    turn stale), so the order is read where the ledger keeps it."""
    from staleflow.protocol.errors import ConsumeNotReadyError
    from staleflow.runtime.run.group_life import CompletionLedger

    ledger = CompletionLedger(eta=0, batch_size=2, order="finish_order", filter_stale=True)
    for group_id in ("old", "x", "y"):
        ledger.reserve(group_id, 0)
    ledger.occupy("x")
    ledger.occupy("y")
    assert ledger.consume().group_ids == ("x", "y")
    ledger.occupy("old")  # finished first of those now held, past eta 0
    ledger.reserve("new", 1)
    ledger.occupy("new")
    before = list(ledger._done)
    with pytest.raises(ConsumeNotReadyError, match=r"1 finished groups \(and 1 past eta, not trained\), 2 needed"):
        ledger.consume()
    assert list(ledger._done) == before == ["old", "new"]

# ----------------------------------------------------------------------------- StaleFlow as the authors run it
def test_evacuation_empties_the_highest_ratio_instance_only_from_ten_requests_and_only_for_a_starved_one():
    from staleflow.runtime.coordination.migration import plan_evacuation

    def fleet_of(busy_n: int, other_n: int = 2):
        views = [view("busy", n=busy_n), view("other", n=other_n), view("idle")]
        return views, FleetArrays.of(views)

    starved = np.array([False, False, True])
    views, fleet = fleet_of(10)
    assert plan_evacuation(views, fleet, MODEL, 5.0, 10, starved) == {0: [f"busy-r{k}" for k in range(10)]}  # all of them
    views, fleet = fleet_of(9)
    assert plan_evacuation(views, fleet, MODEL, 5.0, 10, starved) == {}  # the highest-ratio one holds 9 < 10
    views, fleet = fleet_of(10)
    assert plan_evacuation(views, fleet, MODEL, 5.0, 10, np.zeros(3, bool)) == {}  # no starved instance
    # a starved instance at an older version than the busy one cannot take its requests: no ratio
    views = [view("busy", version=1, n=12, group_version=1), view("idle", version=0)]
    assert plan_evacuation(views, FleetArrays.of(views), MODEL, 5.0, 10, np.array([False, True])) == {}
    # a ratio of at most phi_throughput moves nothing
    views = [view("a", n=12), view("b", n=11)]
    assert plan_evacuation(views, FleetArrays.of(views), MODEL, 5.0, 10, np.array([False, True])) == {}


def test_authors_engine_bounces_waiting_requests_beyond_phi_wait_with_no_starved_instance():
    from staleflow.runtime.coordination.migration import plan_bounce

    a = view("a", n=8)
    a.waiting = tuple(f"a-r{k}" for k in range(2, 8))  # 6 waiting
    views = [a, view("b", n=8)]
    assert plan_bounce(make_policy("staleflow-authors"), views, FleetArrays.of(views)) == {0: ["a-r5", "a-r6", "a-r7"]}
    assert plan_bounce(make_policy("staleflow"), views, FleetArrays.of(views)) == {}  # ours does not bounce
    # the coordinator carries it out at every decision (not only on full ticks), while today's
    # coordinator-side rule moves nothing when no instance is starved
    c, _, ts = _coordinator("staleflow-authors", eta=1, batch=4, instances=2)
    for cmd in _decide(c, 0, True):
        ts.mark_routed(cmd.request_ids, cmd.instance_id)
    held = tuple(c.views[0].requests)
    assert len(held) >= 5
    c.step(snap("i0", running=held[:1], waiting=held[1:], kv=sum(len(r) for r in held)))
    interrupts = [cmd for cmd in _decide(c, 0, False) if isinstance(cmd, Interrupt)]
    assert [(cmd.instance_id, cmd.request_ids) for cmd in interrupts] == [("i0", held[4:])]
    assert c.stats["bounced_requests"] == len(held) - 4


def test_authors_policy_knobs_follow_their_script():
    authors = make_policy("staleflow-authors")
    assert (authors.mu, authors.sync_kv_fraction, authors.proactive_abort, authors.max_running) == (0.3, 0.5, 0, 128)
    assert (authors.migration_rule, authors.evacuate_min_requests, authors.waiting_bounce) == ("evacuate", 10, True)
    assert authors.check_period_s == 0.1 and not authors.pull_keeps_requests and authors.keeps_bound
    assert make_policy("staleflow-authors-sync99").sync_kv_fraction == 0.99
    # our own StaleFlow stays as it was
    ours = make_policy("staleflow")
    assert (ours.migration_rule, ours.waiting_bounce, ours.check_period_s, ours.pull_keeps_requests) == ("split", False, 0.0, True)
    with pytest.raises(ValueError, match="migration_rule must be one of split, evacuate"):
        make_policy("staleflow", migration_rule="all")
    # the throughput router of the authors' policy places at most 128 requests on an instance
    router = ThroughputRouter(MODEL, 0.0, max_running=3)
    fleet = FleetArrays.of([view("a"), view("b")])
    assert sorted(router.choose(fleet, 100, np.ones(2, bool), count=10)) == [0, 0, 0, 1, 1, 1]


def test_authors_sync_interrupts_requests_which_pay_a_re_prefill_where_they_resume():
    from staleflow.adapters.sim.engine import SimEngine
    from staleflow.adapters.sim.network import prefill_seconds
    from staleflow.runtime.run.clock import VirtualClock
    from staleflow.runtime.settings.workload import REQUEST_LENGTH_KEY
    from staleflow.runtime.types import RolloutRequest

    c, m, ts = _coordinator("staleflow-authors", eta=1, batch=2)
    for cmd in _decide(c, 0, True):
        ts.mark_routed(cmd.request_ids, cmd.instance_id)
    for g in list(m.groups())[:2]:
        m.occupy(g.group_id)
    m.consume()  # version 1 is pushed; every instance's KV is below half full: both pull
    commands = _decide(c, 1, False)
    held = {cmd.instance_id: cmd.request_ids for cmd in commands if isinstance(cmd, Interrupt)}
    assert set(held) == {"i0", "i1"} and all(held.values())
    assert [type(cmd).__name__ for cmd in commands if cmd.instance_id == "i0"][:2] == ["Interrupt", "Pull"]
    # the interrupted request resumes as prompt + partial output: the engine that takes it prefills all of it
    clock = VirtualClock()
    old = SimEngine("i0", clock, MODEL, 100_000)
    old.submit([RolloutRequest("r", "g", [1] * 10, 500, 0, metadata={REQUEST_LENGTH_KEY: 400})])
    clock.sleep_until(1.0)
    old.snapshot()
    partial = old.interrupt(["r"])[0]
    context = len(partial.prompt_ids) + len(partial.output_ids)
    assert context > 10

    def finish_time(prefill_s_per_token: float) -> float:
        clock = VirtualClock()
        engine = SimEngine("i1", clock, MODEL, 100_000, prefill_s_per_token=prefill_s_per_token)
        engine.submit([partial])
        while (t := engine.next_event_time()) is not None:
            clock.sleep_until(t)
            if engine.collect():
                return clock.now()
        raise AssertionError("the partial never finished")

    assert finish_time(0.01) - finish_time(0.0) == pytest.approx(prefill_seconds(context, 0.01, 0.0))

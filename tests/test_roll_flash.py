"""ROLL Flash as its code runs: ``roll-flash`` as the paper measured it (alibaba/ROLL commit aa6ad590:
admission of ``max(1, eta)`` batches, prompts round-robin, interrupted requests resent round-robin one
at a time) and ``roll-flash-2026`` (commit 8eb27cc2: ``router.py``, ``generate_scheduler.py``; prompt-
affinity routing), the whole-fleet update pause with the trainer blocked, and the per-instance skew
figures of ``staleflow simulate``."""

from __future__ import annotations

import numpy as np
import pytest
from staleflow.adapters.sim.engine import SimEngine
from staleflow.adapters.sim.network import Broadcast
from staleflow.app.instance_skew import SkewRecorder, spread
from staleflow.app.simulation import ratios, simulate_system
from staleflow.protocol import StalenessManager
from staleflow.runtime.coordination.commands import Interrupt, Pull, Route
from staleflow.runtime.coordination.coordinator import Coordinator
from staleflow.runtime.coordination.cost_model import CostModel
from staleflow.runtime.coordination.fleet import FleetArrays, InstanceView
from staleflow.runtime.coordination.observations import Tick
from staleflow.runtime.coordination.routing import LeastLoadedRouter, PromptAffinityRouter, make_router
from staleflow.runtime.run.clock import VirtualClock
from staleflow.runtime.run.decision import decide
from staleflow.runtime.run.group_life import GroupLife
from staleflow.runtime.servers.trajectory_server import TrajectoryServer
from staleflow.runtime.settings.policies import POLICIES, SystemPolicy, make_policy
from staleflow.runtime.settings.workload import REQUEST_LENGTH_KEY, NetworkSpec, load_workload
from staleflow.runtime.types import InstanceSnapshot, PromptGroup, RolloutRequest

MODEL = CostModel(thr=0.0064, o_b=0.0027, o_k=1.231e-4, a_b=0.0028, a_k=3.35e-8)


def snap(iid: str, version: int = 0) -> InstanceSnapshot:
    return InstanceSnapshot(iid, version, (), (), 0, 100_000, 0.0, 0.0, False)


def view(iid: str, n: int = 0, tokens: int = 100, waiting: int = 0) -> InstanceView:
    v = InstanceView(snap(iid))
    for k in range(n):
        v.add(f"{iid}-r{k}", tokens, 0)
    v.waiting = tuple(f"{iid}-r{k}" for k in range(waiting))
    return v


# ----------------------------------------------------------------------------- the router
def test_affinity_pins_a_group_to_the_instance_with_fewest_requests_by_count_only():
    # i0: 2 requests holding a huge KV cache and a waiting queue; i1: 3 small requests. ROLL counts
    # requests only, so i0 takes the group (least-loaded routing avoids an instance with a queue).
    views = [view("i0", n=2, tokens=90_000, waiting=1), view("i1", n=3, tokens=10)]
    router = PromptAffinityRouter(128)
    fleet = FleetArrays.of(views)
    assert router.choose(fleet, 10, np.ones(2, bool), count=4, group="g0") == [0, 0, 0, 0]
    assert LeastLoadedRouter(128).choose(FleetArrays.of(views), 10, np.ones(2, bool)) == [1]
    # the group's later requests follow its pin although i1 now has far fewer requests
    assert router.choose(fleet, 10, np.ones(2, bool), count=2, group="g0") == [0, 0]
    assert fleet.n.tolist() == [8, 3]
    assert router.choose(fleet, 10, np.ones(2, bool), group="g1") == [1]  # a new group: fewest in flight
    assert router.pins == {"g0": 0, "g1": 1}


def test_affinity_respects_the_cap_and_waits_for_the_pinned_instance():
    router = PromptAffinityRouter(4)
    fleet = FleetArrays.of([view("i0", n=1), view("i1", n=2)])
    # pinned to i0 (1 in flight): 3 of 4 fit under the cap of 4, the last waits for i0, never i1
    assert router.choose(fleet, 10, np.ones(2, bool), count=4, group="g") == [0, 0, 0]
    assert router.choose(fleet, 10, np.ones(2, bool), group="g") == []
    fleet.n[:] = [4, 4]
    assert router.choose(fleet, 10, np.ones(2, bool), group="new") == []  # every instance at the cap
    assert not router.has_room(fleet, 10, np.ones(2, bool))


def _request(rid: str, group: str) -> RolloutRequest:
    return RolloutRequest(rid, group, [1] * 4, 10, 0)


def test_affinity_queue_walk_lets_a_pinned_request_wait_for_its_instance_only():
    router = PromptAffinityRouter(2)
    fleet = FleetArrays.of([view("i0", n=2), view("i1", n=1)])
    router.pins["old"] = 0  # i0 is at the cap
    queue = [_request("old/1", "old"), _request("a/0", "a"), _request("a/1", "a"), _request("b/0", "b"), _request("old/2", "old")]
    placed, new_groups_wait = router.route_each(fleet, queue, [4] * 5)
    # old/1 waits for i0; a pins i1 (a/0 fills it to the cap, a/1 waits there); b finds no instance
    # below the cap: it holds back later new groups, while old/2 still waits for i0 only
    assert [(i, r.request_id) for i, r, _ in placed] == [(1, "a/0")]
    assert new_groups_wait and router.pins == {"old": 0, "a": 1}
    fleet.n[:] = [1, 1]  # one request each finished
    placed, new_groups_wait = router.route_each(fleet, queue[:1] + queue[2:], [4] * 4)
    assert [(i, r.request_id) for i, r, _ in placed] == [(0, "old/1"), (1, "a/1")]
    assert new_groups_wait  # b: both instances are at the cap again


def test_affinity_pins_are_cleared_and_a_lost_instance_unpinned():
    router = PromptAffinityRouter(128)
    fleet = FleetArrays.of([view("i0"), view("i1")])
    router.choose(fleet, 10, np.ones(2, bool), group="a")
    router.choose(fleet, 10, np.ones(2, bool), group="b")
    router.unpin_instance(0)
    assert router.pins == {"b": 1}
    router.clear_pins()
    assert router.pins == {}


# ----------------------------------------------------------------------------- the coordinator
def _coordinator(policy: str, instances: int, group_size: int, groups: int = 20, eta: int = 1, **knobs):
    ts = TrajectoryServer()
    ts.add_groups(PromptGroup(f"g{i}", [1] * 8, group_size, 0, {"max_new_tokens": 50}) for i in range(groups))
    m = StalenessManager(eta, 2)
    c = Coordinator(GroupLife(m, ts), make_policy(policy, **knobs), MODEL, [snap(f"i{k}") for k in range(instances)])
    return c, m, ts


def _instances_of_groups(commands) -> dict[str, set[str]]:
    by_group: dict[str, set[str]] = {}
    for cmd in commands:
        if isinstance(cmd, Route):
            for rid in cmd.request_ids:
                by_group.setdefault(rid.split("/")[0], set()).add(cmd.instance_id)
    return by_group


def test_roll_flash_2026_routes_every_request_of_a_group_to_one_instance():
    c, m, ts = _coordinator("roll-flash-2026", instances=4, group_size=4)
    commands = decide(c, c.groups, Tick(0, True, False))
    placed = _instances_of_groups(commands)
    assert len(placed) == 4 and all(len(where) == 1 for where in placed.values())  # (eta + 1) * B groups, one instance each
    assert sorted(next(iter(w)) for w in placed.values()) == ["i0", "i1", "i2", "i3"]  # count only: an empty one each
    # the ideal-routing ablation spreads a group's requests over the instances
    c, m, ts = _coordinator("roll-flash-ideal-routing", instances=4, group_size=4)
    assert any(len(w) > 1 for w in _instances_of_groups(decide(c, c.groups, Tick(0, True, False))).values())


def test_roll_flash_2026_caps_an_instance_and_queues_the_rest_of_its_group():
    c, m, ts = _coordinator("roll-flash-2026", instances=2, group_size=4, max_running=3)
    commands = decide(c, c.groups, Tick(0, True, False))
    routed = {rid: cmd.instance_id for cmd in commands if isinstance(cmd, Route) for rid in cmd.request_ids}
    groups = _instances_of_groups(commands)
    assert all(len(where) == 1 for where in groups.values())
    assert sorted(list(routed.values()).count(i) for i in ("i0", "i1")) == [3, 3]
    # g0 pinned on i0 (3 of its 4 there), g1 on i1; the rest of each waits for its own instance
    assert ts.queued_count() > len(routed)


def test_roll_flash_2026_clears_its_pins_at_every_weight_update():
    c, m, ts = _coordinator("roll-flash-2026", instances=2, group_size=2)
    for cmd in decide(c, c.groups, Tick(0, True, False)):
        ts.mark_routed(cmd.request_ids, cmd.instance_id)
    assert isinstance(c.router, PromptAffinityRouter) and len(c.router.pins) == 4
    for g in list(m.groups())[:2]:
        m.occupy(g.group_id)
    m.consume()  # version 1: every instance pauses at once, in-flight requests interrupted
    commands = decide(c, c.groups, Tick(1, False, False))
    assert {cmd.instance_id for cmd in commands if isinstance(cmd, Pull)} == {"i0", "i1"}
    assert {cmd.instance_id for cmd in commands if isinstance(cmd, Interrupt)} == {"i0", "i1"}
    assert c.router.pins == {}  # ROLL's abort_all clears id_to_dp_rank


# ----------------------------------------------------------------------------- roll-flash (aa6ad590)
def test_roll_flash_admits_one_batch_fewer_than_roll_flash_2026():
    """ROLL aa6ad590 sends a prompt while fewer than ``batch_size * max(1, ratio)`` are outstanding:
    at eta 2 two batches, where the protocol (and roll-flash-2026) admits three; once a batch is
    consumed the cap lets exactly one more batch in."""
    outstanding = {}
    for name in ("roll-flash", "roll-flash-2026"):
        c, m, ts = _coordinator(name, instances=4, group_size=2, eta=2)
        for cmd in decide(c, c.groups, Tick(0, True, False)):
            ts.mark_routed(cmd.request_ids, cmd.instance_id)
        outstanding[name] = [len(m)]
        for g in ("g0", "g1"):
            m.occupy(g)
        m.consume()
        decide(c, c.groups, Tick(1, False, False))  # the update: every instance pulls version 1
        for k in range(4):
            c.step(snap(f"i{k}", version=1))  # loaded (the interrupted requests are left out: not needed here)
        decide(c, c.groups, Tick(1, True, False))
        outstanding[name].append(len(m))
    assert outstanding == {"roll-flash": [4, 4], "roll-flash-2026": [6, 6]}  # max(1, 2) * 2 vs (2 + 1) * 2
    c, m, ts = _coordinator("roll-flash", instances=4, group_size=2, eta=0)
    decide(c, c.groups, Tick(0, True, False))
    assert len(m) == 2  # eta 0: max(1, 0) = 1 batch, what the protocol allows too


def test_prompt_round_robin_places_groups_in_turn_whatever_the_load():
    """ROLL aa6ad590: a bare turn over every instance (``get_available_dp_rank``), each group's
    requests together on its instance whatever its load; the only cap is the fleet's: no new prompt
    while the requests in flight reach ``max_running_requests x dp_size`` (``sending_request``)."""
    # cap 8 per instance, 32 for the fleet; i0 holds 5, i1 none, i2 8, i3 7: 20 in flight
    views = [view("i0", n=5), view("i1"), view("i2", n=8), view("i3", n=7)]
    router = make_router("prompt_round_robin", MODEL, 0.3, 8)
    fleet = FleetArrays.of(views)
    eligible = np.ones(4, bool)
    placed = [router.choose(fleet, 10, eligible, group=f"g{k}") + router.choose(fleet, 10, eligible, count=3, group=f"g{k}")
              for k in range(4)]
    # g0 on i0 (the emptiest is i1), g1 on i1, g2 on i2 (past 8: no per-instance cap), then 32 in
    # flight: g3 waits, and so does any new group
    assert placed == [[0] * 4, [1] * 4, [2] * 4, []]
    assert fleet.n.tolist() == [9, 4, 12, 7] and not router.has_room(fleet, 10, eligible)
    # the 2026 router picks by load instead: the emptiest instance, and its requests stop at the cap
    router = make_router("prompt_affinity", MODEL, 0.3, 8)
    fleet = FleetArrays.of(views)
    assert router.choose(fleet, 10, eligible, count=4, group="g") == [1] * 4


def test_roll_flash_routes_groups_round_robin_through_the_coordinator():
    c, m, ts = _coordinator("roll-flash", instances=3, group_size=3, eta=3)
    commands = decide(c, c.groups, Tick(0, True, False))
    placed = _instances_of_groups(commands)
    assert all(len(where) == 1 for where in placed.values())
    assert [next(iter(placed[f"g{k}"])) for k in range(6)] == ["i0", "i1", "i2", "i0", "i1", "i2"]


def _resent_after_an_update(policy: str) -> tuple[list[str], dict[str, str]]:
    """Groups of three requests on three instances (eta 2); g0 and g1 are trained, so the update
    interrupts the requests of the others, which come back as partials once every instance has
    loaded version 1. Returns the partials in the queue's order and where each was routed."""
    c, m, ts = _coordinator(policy, instances=3, group_size=3, eta=2)
    for cmd in decide(c, c.groups, Tick(0, True, False)):
        ts.mark_routed(cmd.request_ids, cmd.instance_id)
    for g in ("g0", "g1"):
        m.occupy(g)
    m.consume()  # version 1: every instance pauses at once, its requests interrupted
    left = [g.group_id for g in m.groups()]
    for cmd in decide(c, c.groups, Tick(1, False, False)):
        if isinstance(cmd, Interrupt):
            live = [ts.request(rid) for rid in cmd.request_ids if rid.split("/")[0] in left]
            ts.requeue(live, cmd.instance_id)
    for k in range(3):
        c.step(snap(f"i{k}", version=1))  # loaded
    order = [r.request_id for r in ts.queue_view().requests(0, ts.queued_count())]
    commands = decide(c, c.groups, Tick(1, False, False))
    routed = {rid: cmd.instance_id for cmd in commands if isinstance(cmd, Route) for rid in cmd.request_ids}
    return order, {rid: routed[rid] for rid in order}


def test_roll_flash_resends_interrupted_requests_one_at_a_time_round_robin():
    """ROLL aa6ad590 resends the paused requests one by one, each to the next instance in turn, so
    a group's partials spread over the instances; roll-flash-2026 routes them again by their group,
    each group's on one instance."""
    order, where = _resent_after_an_update("roll-flash")
    assert len(order) == 6  # g2 and g3: two batches of two groups were outstanding
    # the turn goes on from where the four groups left it (i0, i1, i2, i0): i1 next
    assert [where[rid] for rid in order] == ["i1", "i2", "i0", "i1", "i2", "i0"]
    by_group = {g: {where[rid] for rid in order if rid.startswith(g + "/")} for g in ("g2", "g3")}
    assert by_group == {"g2": {"i0", "i1", "i2"}, "g3": {"i0", "i1", "i2"}}
    order, where = _resent_after_an_update("roll-flash-2026")
    assert len(order) == 12  # g2 to g5
    assert all(len({where[rid] for rid in order if rid.startswith(f"g{k}/")}) == 1 for k in range(2, 6))


def test_roll_flash_policies():
    roll, ideal = POLICIES["roll-flash-2026"], POLICIES["roll-flash-ideal-routing"]
    assert (roll.routing, roll.max_running, roll.sync, roll.weight_transfer) == ("prompt_affinity", 128, "global_immediate", "broadcast")
    assert roll.update_pause_s == ideal.update_pause_s > 0 and not roll.pull_keeps_requests
    assert (ideal.routing, ideal.max_running) == ("least_loaded", 1_000_000)
    assert (roll.outstanding, roll.resend_round_robin) == (ideal.outstanding, ideal.resend_round_robin) == ("protocol", False)
    # the paper's ROLL Flash (aa6ad590) differs from the 2026 model in exactly its four knobs
    paper = POLICIES["roll-flash"]
    assert (paper.routing, paper.outstanding, paper.resend_round_robin) == ("prompt_round_robin", "ratio", True)
    assert {k for k in SystemPolicy.__dataclass_fields__ if getattr(paper, k) != getattr(roll, k)} == {
        "name", "routing", "outstanding", "resend_round_robin", "reference_forward"}
    assert make_policy("start-version-gc").name == "roll-flash-2026"
    with pytest.raises(ValueError, match="update_pause_s"):
        make_policy("roll-flash", update_pause_s=-1.0)
    with pytest.raises(ValueError, match="outstanding"):
        make_policy("roll-flash", outstanding="eta")
    with pytest.raises(ValueError, match="resend_round_robin"):
        make_policy("roll-flash", resubmit_same_instance=True)
    # an ablation is never the best bound-keeping baseline
    figures = {"tokens_per_s": 10.0, "staleness_p99": 0}
    r = ratios({"staleflow": figures, "roll-flash": {**figures, "tokens_per_s": 5.0},
                "roll-flash-ideal-routing": {**figures, "tokens_per_s": 8.0}}, 1.0, 1)
    assert r["best-bound-keeping"] == pytest.approx(2.0)


# ----------------------------------------------------------------------------- the update pause
def test_pause_delays_every_instance_and_an_interrupted_request_pays_a_full_re_prefill():
    clock = VirtualClock()
    flat = CostModel(thr=0.01, o_b=0.0, o_k=0.0, a_b=0.0, a_k=0.0)  # 0.01 s per decode step
    link = Broadcast(NetworkSpec(weights_gb=20.0, broadcast_gb_per_s=10.0), pause_s=1.0)
    assert link.seconds == pytest.approx(3.0)  # 1 s pause + 20 GB at 10 GB/s
    engine = SimEngine("i0", clock, flat, 10_000, prefill_s_per_token=1e-3, weight_load_s=0.5, weight_link=link)
    engine.submit([RolloutRequest("g/0", "g", [1] * 100, 1000, 0, metadata={REQUEST_LENGTH_KEY: 300})])
    # prefill of the 100-token prompt (0.1 s), then 200 decode steps (2 s): the interrupt lets the
    # step in progress finish
    clock.sleep_until(2.095)
    (partial,) = engine.interrupt(["g/0"])
    assert len(partial.output_ids) == 200
    engine.load_weights(1)
    resumed = engine.snapshot()
    assert resumed.loading and engine.next_event_time() == pytest.approx(2.1 + 0.5 + 3.0)
    clock.sleep_until(5.6)
    engine.submit([partial])  # resent as prompt + partial output: 300 tokens prefilled again (0.3 s)
    while (t := engine.next_event_time()) is not None:
        clock.sleep_until(t)
        if done := engine.collect():
            break
    assert len(done[0].output_ids) == 300
    assert done[0].metadata["finish_time"] == pytest.approx(5.6 + 0.3 + 100 * 0.01)


def test_roll_flash_blocks_the_trainer_through_the_whole_update():
    """small-ci: 0.5 s load_states, no broadcast bytes, the 1 s pause; each step the trainer is busy
    base + per-token + pause + load, the per-token rate a quarter above the workload's (the reference
    model's forward pass on top of training and the recompute, 10 FLOPs per parameter instead of 8):
    the trainer's busy time gives it back exactly."""
    workload = load_workload("small-ci")
    figures = simulate_system(workload, "roll-flash", eta=1, steps=3, seed=0)
    prompt_tokens = 3 * workload.batch.groups_per_step * workload.batch.group_size * workload.prompt_tokens
    response_tokens = figures["tokens_per_s"] * figures["virtual_s"]
    pause = POLICIES["roll-flash"].update_pause_s + workload.instance.weight_load_s
    per_token = 1.25 * workload.training.per_token_s
    expected = 3 * (workload.training.base_s + pause) + per_token * (prompt_tokens + response_tokens)
    assert figures["trainer_busy"] * figures["virtual_s"] == pytest.approx(expected, rel=1e-9)


# ----------------------------------------------------------------------------- skew
def test_spread_of_four_values():
    s = spread([1, 2, 3, 6])
    assert (s["min"], s["median"], s["max"]) == (1.0, 2.5, 6.0)
    assert s["cv"] == pytest.approx(np.sqrt(3.5) / 3)
    assert spread([0, 0])["cv"] == 0.0


class _Instance:
    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self.tokens = self.done = 0

    def progress(self) -> tuple[int, int]:
        return self.tokens, self.done


def test_skew_recorder_takes_per_step_differences_per_instance():
    now = [0.0]
    busy = {"a": 0.0, "b": 0.0}
    a, b = _Instance("a"), _Instance("b")
    recorder = SkewRecorder([a, b], lambda: now[0], lambda t: dict(busy))
    # step 1 (10 s): a makes 300 tokens and 3 trajectories, busy 10 s; b 100 tokens, 1 trajectory, busy 5 s
    now[0], a.tokens, a.done, b.tokens, b.done = 10.0, 300, 3, 100, 1
    busy.update(a=10.0, b=5.0)
    recorder.step_finished()
    # step 2 (5 s): both make 50 tokens, no trajectory; a busy 5 s, b idle
    now[0], a.tokens, b.tokens = 15.0, 350, 150
    busy.update(a=15.0)
    recorder.step_finished()
    first, second = recorder.steps
    assert first["tokens"] == {"min": 100.0, "median": 200.0, "max": 300.0, "cv": pytest.approx(0.5)}
    assert first["trajectories"] == {"min": 1.0, "median": 2.0, "max": 3.0, "cv": pytest.approx(0.5)}
    assert first["utilisation"] == pytest.approx(0.75)
    assert second["tokens"]["cv"] == 0.0 and second["trajectories"]["max"] == 0.0
    assert second["utilisation"] == pytest.approx(0.5)
    figures = recorder.figures()
    assert figures["mean_tokens_cv"] == pytest.approx(0.25) and figures["mean_utilisation"] == pytest.approx(0.625)


def test_engine_progress_counts_tokens_of_a_segment_in_progress_and_finished_trajectories():
    clock = VirtualClock()
    engine = SimEngine("i0", clock, CostModel(thr=0.01, o_b=0.0, o_k=0.0, a_b=0.0, a_k=0.0), 10_000)
    engine.submit([RolloutRequest(f"g/{k}", "g", [1] * 4, 100, 0, metadata={REQUEST_LENGTH_KEY: 10 * (k + 1)}) for k in range(2)])
    clock.sleep_until(0.055)  # 5 whole steps of 2 requests
    assert engine.progress() == (10, 0)
    clock.sleep_until(0.155)  # the first finished at step 10, the second runs alone to step 15
    assert engine.progress() == (25, 1)


def test_simulate_reports_the_skew_of_every_step():
    figures = simulate_system(load_workload("small-ci"), "roll-flash", eta=1, steps=3, seed=0)
    skew = figures["instance_skew"]
    assert len(skew["per_step"]) == 3
    for step in skew["per_step"]:
        assert step["tokens"]["min"] <= step["tokens"]["median"] <= step["tokens"]["max"]
        assert 0 <= step["utilisation"] <= 1 and step["trajectories"]["cv"] >= 0
    assert skew["mean_utilisation"] == pytest.approx(np.mean([s["utilisation"] for s in skew["per_step"]]))

"""The whole run loop with small fake engines and trainer: bound kept, nothing lost, trainer advances."""

from __future__ import annotations

import json
import threading

import pytest
from runtime_fakes import FakeEngine, FakeTrainer, prompt_groups
from staleflow.runtime.coordination.cost_model import CostModel
from staleflow.runtime.run.assembly import assemble_run
from staleflow.runtime.run.clock import RealClock, VirtualClock
from staleflow.runtime.run.loop import RunParts, RunStalledError
from staleflow.runtime.run.run_spec import RunSpec
from staleflow.runtime.servers.parameter_server import ParameterServer
from staleflow.runtime.settings.policies import POLICIES, make_policy
from staleflow.runtime.types import PromptGroup, RolloutRequest

MODEL = CostModel(thr=0.0064, o_b=0.0027, o_k=1.231e-4, a_b=0.0028, a_k=3.35e-8)


def build(policy="staleflow", eta=2, batch=4, instances=4, n_samples=4, n_extra=0, step_s=1.0, prompts=None,
          clock=None, engines=None, trainer=None, tick_s=0.5, reward_fn=None, reward_timeout_s=30.0, trace_path=None):
    clock = clock or VirtualClock()
    engines = engines or [FakeEngine(f"i{k}", clock, max_running=6) for k in range(instances)]
    trainer = trainer or FakeTrainer(clock, step_s)
    events = []
    policy = policy if not isinstance(policy, str) else make_policy(policy)
    spec = RunSpec(policy, eta=eta, batch_size=batch, tick_s=tick_s, reward_timeout_s=reward_timeout_s)
    parts = RunParts(engines=engines, trainer=trainer, prompts=prompts or prompt_groups(n_samples, n_extra),
                     cost_model=MODEL, clock=clock, reward_fn=reward_fn)
    loop = assemble_run(spec, parts, event_hooks=[events.append] if policy.keeps_bound else [], trace_path=trace_path)
    return loop, trainer, engines, events


def check_bound(trainer: FakeTrainer, eta: int) -> None:
    """Every token of every trained trajectory comes from a version in [group version, b], b <= v + eta."""
    for batch in trainer.batches:
        for group in batch.groups.values():
            first = min(v for t in group for v in t.versions)
            assert batch.version - eta <= first <= batch.version
            assert all(max(t.versions) <= batch.version for t in group)


BOUNDED = sorted(name for name, policy in POLICIES.items() if policy.keeps_bound)
UNBOUNDED = sorted(set(POLICIES) - set(BOUNDED))


@pytest.mark.parametrize("name", BOUNDED)
def test_every_policy_keeps_the_bound_and_loses_nothing(name):
    loop, trainer, _, events = build(name, eta=2)
    metrics = loop.run(8)
    assert trainer.version == 8 and metrics.steps == 8
    assert [b.version for b in trainer.batches] == list(range(8))
    assert all(len(b.groups) == 4 for b in trainer.batches)
    assert metrics.max_staleness <= loop.manager.eta <= 2
    assert sum(metrics.staleness_histogram.values()) == 32
    check_bound(trainer, loop.manager.eta)
    assert metrics.audit_ok and metrics.lost == 0 and metrics.duplicated == 0
    assert metrics.tokens_trained > 0 and metrics.tokens_per_s > 0 and 0 < metrics.utilisation <= 1
    consumes = [e for e in events if e.op == "consume"]
    assert [e.batch.version for e in consumes] == list(range(8))
    json.dumps(metrics.to_dict())


class UnreachableWhile(ParameterServer):
    """A parameter server that refuses pushes (ConnectionError, the failure contract) while the clock
    is in ``[start, end)``: the versions trained meanwhile reach it, in order, at the first retry after."""

    def __init__(self, clock, start, end):
        super().__init__()
        self.clock, self.start, self.end = clock, start, end

    def push(self, version, weights):
        if self.start <= self.clock.now() < self.end:
            raise ConnectionError(f"push of version {version}: the parameter server is unreachable")
        super().push(version, weights)


class LagRecorder(FakeEngine):
    """A fake engine that records, at each snapshot, how many versions it is behind the trainer."""

    def __init__(self, *args, trainer, **kwargs):
        super().__init__(*args, **kwargs)
        self.trainer, self.lags = trainer, []

    def snapshot(self):
        self.lags.append(self.trainer.version - self.version)
        return super().snapshot()


@pytest.mark.parametrize("name", BOUNDED)
def test_every_policy_keeps_the_bound_while_its_instances_lag_past_eta(name):
    """The parameter server is unreachable from t = 2 s to 8 s: the trainer goes on while every
    instance stays on the last version pushed, more than eta versions behind. Groups may be admitted
    only at versions the protocol still admits; a reserve that admitted a group one version past
    its deadline (``_slack_at`` accepting offset -1) trains it eta + 1 versions late, or stalls the run."""
    clock = VirtualClock()
    trainer = FakeTrainer(clock, 0.5)
    engines = [LagRecorder(f"i{k}", clock, max_running=6, trainer=trainer) for k in range(4)]
    spec = RunSpec(make_policy(name), eta=2, batch_size=4, tick_s=0.5)
    parts = RunParts(engines=engines, trainer=trainer, prompts=prompt_groups(4), cost_model=MODEL, clock=clock,
                     parameter_server=UnreachableWhile(clock, 2.0, 8.0))
    loop = assemble_run(spec, parts)
    metrics = loop.run(10)
    eta = loop.manager.eta
    assert loop.stats.counters["push_failures"] > 0
    assert max(lag for e in engines for lag in e.lags) > eta, "no instance lagged past eta: the scenario tests nothing"
    assert [b.version for b in trainer.batches] == list(range(10))
    check_bound(trainer, eta)
    assert metrics.max_staleness <= eta and metrics.audit_ok and metrics.lost == 0 and metrics.duplicated == 0


def test_sync_is_on_policy_and_one_step_off_at_most_one():
    loop, _, _, _ = build("sync", eta=3)
    assert set(loop.run(4).staleness_histogram) == {0}
    loop, _, _, _ = build("one-step-off", eta=3)
    metrics = loop.run(6)
    assert set(metrics.staleness_histogram) <= {0, 1} and metrics.staleness_histogram.get(1)


def test_staleflow_uses_the_slack_and_beats_sync_on_a_skewed_workload():
    skew = (10, 10, 10, 400)
    fast, _, _, _ = build("staleflow", eta=2, step_s=0.5, prompts=prompt_groups(4, lengths=skew))
    slow, _, _, _ = build("sync", eta=2, step_s=0.5, prompts=prompt_groups(4, lengths=skew))
    a, b = fast.run(8), slow.run(8)
    assert a.max_staleness >= 1
    assert a.elapsed_s < b.elapsed_s


def test_runs_are_deterministic_with_a_virtual_clock():
    first = build("staleflow")[0].run(5).to_dict()
    second = build("staleflow")[0].run(5).to_dict()
    for key in ("decision_seconds",):
        first["coordinator"].pop(key)
        second["coordinator"].pop(key)
    assert first == second


def test_group_redundancy_cancels_extra_responses():
    loop, trainer, _, _ = build(make_policy("staleflow", group_redundancy=2), n_samples=2, n_extra=2)
    metrics = loop.run(4)
    assert metrics.cancelled_requests > 0 and metrics.audit_ok
    assert all(len(trajs) == 2 for b in trainer.batches for trajs in b.groups.values())


def test_loop_sets_n_extra_and_checks_lengths():
    loop, _, _, _ = build(make_policy("staleflow", group_redundancy=1), n_samples=2)  # lengths only for 2
    with pytest.raises(ValueError, match="sample_metadata has 2 entries, need n_samples \\+ n_extra = 3"):
        loop.run(1)


def test_batch_redundancy_drops_are_reported_and_bounded():
    lengths = (10, 15, 20, 600)
    loop, trainer, _, events = build(make_policy("staleflow", batch_redundancy=2), eta=1, prompts=prompt_groups(1, lengths=lengths))
    metrics = loop.run(6)
    drops = [len(e.batch.dropped) for e in events if e.op == "consume"]
    assert sum(drops) == metrics.dropped and max(drops) <= 2
    assert metrics.audit_ok
    check_bound(trainer, 1)


@pytest.mark.parametrize(("name", "policy"), [("roll-flash", "roll-flash"), ("start-version-gc", "roll-flash-2026")])
def test_roll_flash_waits_for_stragglers_instead_of_aborting_them(name, policy):
    """ROLL Flash, as the paper ran it and as its 2026 code runs (old name start-version-gc), waits
    for the oldest start step: nothing is aborted, nothing churns, the bound holds."""
    lengths = (10, 10, 10, 10, 10, 10, 10, 900)
    loop, trainer, _, events = build(name, eta=1, n_samples=1, prompts=prompt_groups(1, lengths=lengths))
    metrics = loop.run(6)
    assert loop.policy.name == policy and metrics.audit_ok
    assert not [e for e in events if e.op == "abort"] and metrics.proactive_aborted == 0
    check_bound(trainer, 1)


@pytest.mark.parametrize("name", UNBOUNDED)
def test_completion_order_peers_lose_nothing_and_report_their_staleness(name):
    loop, trainer, _, _ = build(name, eta=1, n_samples=1, prompts=prompt_groups(1, lengths=(10, 10, 10, 10, 10, 10, 10, 900)))
    metrics = loop.run(8)
    assert [b.version for b in trainer.batches] == list(range(8))
    assert metrics.audit_ok and metrics.lost == 0 and metrics.duplicated == 0
    assert sum(metrics.staleness_histogram.values()) == 32
    with pytest.raises(ValueError, match="does not keep the bound"):
        build(name, trace_path="unused.jsonl")


def test_areal_trains_a_straggler_past_eta_and_reports_it_and_the_filter_drops_it():
    """Every eighth response takes 900 tokens: AReaL trains the finished groups first, so the
    straggler's group is trained more than eta = 1 versions after its start, and the run reports it;
    AReaL with the filter drops such groups at consume and counts their tokens as wasted."""
    lengths = (10, 10, 10, 10, 10, 10, 10, 900)
    loop, trainer, _, _ = build("areal", eta=1, n_samples=1, prompts=prompt_groups(1, lengths=lengths))
    metrics = loop.run(10)
    assert metrics.max_staleness > 1 and metrics.past_eta_share > 0 and metrics.staleness_p99 >= 2
    stale = [b.version - min(t.versions[0] for t in g) for b in trainer.batches for g in b.groups.values()]
    assert max(stale) == metrics.max_staleness
    assert metrics.dropped == 0 and metrics.wasted_tokens == 0
    loop, trainer, _, _ = build("areal-filter", eta=1, n_samples=1, prompts=prompt_groups(1, lengths=lengths))
    metrics = loop.run(10)
    assert metrics.max_staleness <= 1 and metrics.past_eta_share == 0
    check_bound(trainer, 1)
    assert metrics.dropped > 0 and metrics.wasted_tokens >= 900 * metrics.dropped // 2


def test_failing_and_hanging_rewards_mark_groups_and_the_run_goes_on():
    hang = threading.Event()
    calls = {"n": 0}

    def reward(trajectory, metadata):
        calls["n"] += 1
        if trajectory.group_id == "g1":
            raise RuntimeError("bad answer format")
        if trajectory.group_id == "g2":
            hang.wait(30)  # hangs past the timeout (released at the end)
        return float(len(trajectory.output_ids))

    # 2 s: far above what a healthy group takes on a loaded CPU (the runner's clock is injected in its own test)
    loop, trainer, _, _ = build("staleflow", reward_fn=reward, reward_timeout_s=2.0)
    metrics = loop.run(4)
    hang.set()
    assert metrics.reward_failures == 2
    trained = [t for b in trainer.batches for ts in b.groups.values() for t in ts]
    assert trained and all(t.reward == float(len(t.output_ids)) for t in trained)
    assert {"g1", "g2"}.isdisjoint(t.group_id for t in trained)
    assert metrics.audit_ok
    loop.close()


def test_checkpoint_resume_keeps_the_bound_and_every_partial():
    loop, trainer, engines, _ = build("staleflow", eta=2, prompts=prompt_groups(4, lengths=(30, 80, 200, 15)))
    loop.run(3)
    state = json.loads(json.dumps(loop.state_dict()))
    active = {g[0]: g[1] for g in state["protocol"]["groups"]}
    assert active, "some groups are in flight at the checkpoint"
    assert not any(e.held() for e in engines)  # partials moved into the trajectory server
    clock = VirtualClock()
    resumed_trainer = FakeTrainer(clock)
    resumed_trainer.version = trainer.version
    resumed, _, new_engines, _ = build(
        "staleflow", eta=2, clock=clock, trainer=resumed_trainer,
        prompts=_skip(prompt_groups(4, lengths=(30, 80, 200, 15)), state["prompts_drawn"]),
    )
    resumed.load_state_dict(state)
    assert resumed.groups.live == loop.groups.live > 0  # the inflight-cap count
    assert len(resumed.manager) == len(loop.manager)
    metrics = resumed.run(4)
    assert metrics.steps == 7 and resumed_trainer.version == 7
    assert [b.version for b in resumed_trainer.batches] == [3, 4, 5, 6]
    versions = {g: v for b in resumed_trainer.batches for g, ts in b.groups.items() for v in [min(t.versions[0] for t in ts)]}
    carried = set(active) & set(versions)
    assert carried, "groups admitted before the checkpoint were trained after it"
    for b in resumed_trainer.batches:
        for g in b.groups:
            if g in active:
                assert active[g] <= b.version <= active[g] + 2
    check_bound(resumed_trainer, 2)
    assert metrics.audit_ok and sum(metrics.staleness_histogram.values()) == 28
    assert all(e.loads and e.loads[0] == 3 for e in new_engines)  # engines pulled the resumed version


def test_trace_file_replays_against_the_spec_mirror_across_a_resume(tmp_path):
    from staleflow.protocol.trace import read_trace
    from staleflow.verification.proofs.trace_validation import replay_mirror

    path = tmp_path / "trace.jsonl"
    loop, trainer, _, _ = build("staleflow", eta=1, trace_path=path)
    loop.run(3)
    state = loop.state_dict()
    loop.close()
    clock = VirtualClock()
    resumed_trainer = FakeTrainer(clock)
    resumed_trainer.version = trainer.version
    resumed, _, _, _ = build("staleflow", eta=1, clock=clock, trainer=resumed_trainer, trace_path=path,
                             prompts=_skip(prompt_groups(4), state["prompts_drawn"]))
    resumed.load_state_dict(state)
    resumed.run(2)
    resumed.close()
    segments = read_trace(path)
    assert len(segments) == 2
    assert segments[1].header.start == state["protocol"]
    consumes = [e.batch.version for seg in segments for e in seg.events if e.op == "consume"]
    assert consumes == [0, 1, 2, 3, 4]
    for segment in segments:
        verdict = replay_mirror(segment)
        assert verdict.accepted, verdict.reason


def _skip(groups, n):
    for _ in range(n):
        next(groups)
    return groups


def test_run_stalls_with_a_clear_error_when_prompts_run_out():
    loop, _, _, _ = build("staleflow", prompts=[PromptGroup("only", [1], 1, 0, {"max_new_tokens": 5})])
    with pytest.raises(RunStalledError, match="run stalled .* step 0"):
        loop.run(1)


def test_real_clock_run_with_polling_engines():
    clock = RealClock()
    engines = [FakeEngine(f"i{k}", clock, tokens_per_s=4000, load_s=0.002, announce_events=False) for k in range(2)]
    loop, trainer, _, _ = build("staleflow", eta=1, batch=2, n_samples=2, clock=clock, engines=engines,
                                trainer=FakeTrainer(clock, 0.01), prompts=prompt_groups(2, lengths=(8, 12, 20)), tick_s=0.002)
    metrics = loop.run(3)
    loop.close()
    assert trainer.version == 3 and metrics.audit_ok and metrics.max_staleness <= 1
    assert loop.ps.latest_version() == 3


class FinishesAfterSnapshot(FakeEngine):
    """A fake engine that keeps decoding while the audit asks it what it holds, as a real one does:
    once ``racing``, every request it holds at a snapshot has finished by its next collect."""

    racing = False
    _asked = False

    def snapshot(self):
        self._asked = self.racing
        return super().snapshot()

    def collect(self):
        if self._asked:
            self.clock.sleep_until(self.clock.now() + 1000.0)
        return super().collect()


def test_the_audit_counts_no_request_that_finished_while_it_was_asking_as_orphaned():
    """Engines decode on between the audit's snapshot and its last collect (a real clock, real
    engines): a request held at the snapshot and finished just after has left the trajectory server,
    and is not an orphan. A request an engine holds that was never placed there still is."""
    clock = VirtualClock()
    engines = [FinishesAfterSnapshot(f"i{k}", clock, max_running=4) for k in range(2)]
    loop, _, _, _ = build("staleflow", eta=1, batch=2, n_samples=2, clock=clock, engines=engines,
                          prompts=prompt_groups(2, lengths=(300, 400, 500)))
    loop.run(2)
    held_before = {iid: engine.held() for iid, engine in loop.instances.engines.items()}
    assert any(held_before.values())
    for engine in engines:
        engine.racing = True
    report = loop.audit()
    assert report.ok and report.orphaned == () and report.lost == (), report
    assert not any(engine.held() for engine in engines)
    for engine in engines:
        engine.racing = engine._asked = False
    engines[0].submit([RolloutRequest("stray/0", "stray", [1, 2], max_new_tokens=10_000, group_version=0)])
    assert loop.audit().orphaned == ("stray/0",)


def test_on_step_reports_each_finished_step_once():
    loop, trainer, _, _ = build("staleflow", eta=2)
    seen = []
    loop.run(5, on_step=lambda: seen.append(trainer.version))
    assert seen == [1, 2, 3, 4, 5]
    loop.run(2, on_step=lambda: seen.append(trainer.version))
    assert seen == [1, 2, 3, 4, 5, 6, 7]


class RecordingEngine(FakeEngine):
    """A fake engine that records every request submitted to any instance, in ``submits``."""

    def __init__(self, *args, submits, **kwargs):
        super().__init__(*args, **kwargs)
        self.submits = submits

    def submit(self, requests):
        super().submit(requests)
        for request in requests:
            self.submits.setdefault(request.request_id, []).append(self.instance_id)


@pytest.mark.parametrize("same_instance", [True, False])
def test_areal_resubmits_a_request_interrupted_by_a_weight_update_to_the_instance_it_ran_on(same_instance):
    """AReaL keeps one server per request across interruptions: every request a pull interrupted
    goes back, with its tokens so far, to the instance it ran on. The same run with routing alone
    (round robin) sends some of them elsewhere."""
    clock, submits = VirtualClock(), {}
    engines = [RecordingEngine(f"i{k}", clock, max_running=6, submits=submits) for k in range(3)]
    policy = make_policy("areal", resubmit_same_instance=same_instance)
    loop, trainer, _, _ = build(policy, eta=1, n_samples=2, clock=clock, engines=engines,
                                prompts=prompt_groups(2, lengths=(10, 300, 40, 20, 500, 60, 15)))
    metrics = loop.run(8)
    assert metrics.audit_ok and metrics.lost == 0 and metrics.duplicated == 0
    resubmitted = {rid: where for rid, where in submits.items() if len(where) > 1}
    assert loop.coordinator.stats["interrupted_for_pull"] >= len(resubmitted) > 3
    moved = [rid for rid, where in resubmitted.items() if len(set(where)) > 1]
    assert (moved == []) is same_instance, moved


class _Flaky(FakeEngine):
    """A fake engine whose snapshots fail while ``failing``."""

    failing = False

    def snapshot(self):
        if self.failing:
            raise ConnectionError(f"{self.instance_id} does not answer")
        return super().snapshot()


def test_the_instance_driver_returns_what_it_observed_in_order():
    """No coordinator behind it: a refresh returns each instance's snapshot, a failure as the
    instance lost (its requests back in the queue), and a probe that finds it empty as it back."""
    from collections import Counter

    from staleflow.runtime.coordination.observations import InstanceBack, InstanceLost
    from staleflow.runtime.run.instance_driver import InstanceDriver
    from staleflow.runtime.servers.parameter_server import ParameterServer
    from staleflow.runtime.servers.trajectory_server import TrajectoryServer

    clock = VirtualClock()
    a, b = FakeEngine("a", clock), _Flaky("b", clock)
    ts = TrajectoryServer()
    ts.add_groups([next(prompt_groups(2))])
    driver = InstanceDriver([a, b], ts, ParameterServer(), clock, Counter())
    assert [s.instance_id for s in driver.first_snapshots()] == ["a", "b"] and driver.down == set()
    requests = ts.admit("g0", 0)
    ts.mark_routed([r.request_id for r in requests], "b")
    b.failing = True
    observations = driver.refresh(0.0, tick_s=1.0)
    assert [type(o).__name__ for o in observations] == ["InstanceSnapshot", "InstanceLost"]
    assert observations[1] == InstanceLost("b") and driver.down == {"b"} and ts.queued_count() == 2
    b.failing = False
    clock.sleep_until(1.0)
    observations = driver.refresh(1.0, tick_s=1.0)
    assert [type(o).__name__ for o in observations] == ["InstanceSnapshot", "InstanceBack"]
    assert isinstance(observations[1], InstanceBack) and observations[1].snapshot.instance_id == "b" and driver.down == set()
    # a plain snapshot changes no instance's requests: only the failed and recovered one is touched
    assert driver.take_touched() == {"b"} and driver.take_touched() == set()


def test_group_life_hands_over_the_group_it_completes():
    """Finishing goes through GroupLife: the response that completes a group hands over the group and
    its kept trajectories (what the loop rewards), and cancels the sibling still running."""
    from staleflow.protocol import StalenessManager
    from staleflow.runtime.run.group_life import GroupLife
    from staleflow.runtime.servers.trajectory_server import GroupState, TrajectoryServer
    from staleflow.runtime.types import Trajectory

    ts = TrajectoryServer()
    life = GroupLife(StalenessManager(1, 1), ts)
    group = PromptGroup("g0", [1, 2], 2, 1, {"answer": "4", "max_new_tokens": 8})
    life.add([group])
    requests = life.admit("g0", 0)
    ts.mark_routed([r.request_id for r in requests], "i0")
    done = [Trajectory(r.request_id, "g0", r.prompt_ids, [3], [-0.1], [0], "stop") for r in requests]
    assert life.finish("i0", done[0]).completed is None
    outcome = life.finish("i0", done[2])
    assert outcome.completed is not None and outcome.completed.group.metadata == {"answer": "4", "max_new_tokens": 8}
    assert outcome.completed.trajectories == (done[0], done[2]) and outcome.cancel == (("i0", "g0/1"),)
    assert ts.group_state("g0") is GroupState.REWARDING


def test_one_run_spec_describes_the_run_and_its_tick_follows_the_clock():
    """The loop takes the RunSpec itself: its bound (the policy's own when smaller), batch and tick;
    a tick left out is one simulated second on a virtual clock and 5 ms of polling on a real one."""
    with pytest.raises(ValueError, match="tick_s must be > 0, got 0"):
        RunSpec(make_policy("staleflow"), eta=2, batch_size=4, tick_s=0)
    spec = RunSpec(make_policy("sync"), eta=3, batch_size=4)
    assert (spec.tick_for(VirtualClock()), spec.tick_for(RealClock())) == (1.0, 0.005)
    loop, _, _, _ = build("sync", eta=3, tick_s=None)
    assert loop.spec.eta == 3 and loop.manager.eta == 0 and loop.tick_s == 1.0

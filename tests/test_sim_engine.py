"""The simulated rollout engine: step latency from the cost model, KV limits, interrupt/resume, abort, Pull."""

from __future__ import annotations

import pytest
from staleflow.adapters.sim.engine import FAKE_LOGPROB, SimEngine
from staleflow.adapters.sim.speculation import SpeculativeDecoding
from staleflow.runtime.coordination.cost_model import CostModel
from staleflow.runtime.interfaces import RolloutEngine
from staleflow.runtime.run.clock import VirtualClock
from staleflow.runtime.settings.workload import REQUEST_LENGTH_KEY
from staleflow.runtime.types import RolloutRequest

COST = CostModel(thr=0.01, o_b=0.002, o_k=1e-4, a_b=0.002, a_k=1e-6)


def request(rid: str, length: int, prompt: int = 10, version: int = 0, max_new: int = 10_000) -> RolloutRequest:
    return RolloutRequest(rid, "g", [1] * prompt, max_new, version, metadata={REQUEST_LENGTH_KEY: length})


def run_to_idle(engine: SimEngine, clock: VirtualClock) -> dict[str, tuple[float, object]]:
    """Jump the clock from event to event; return each trajectory with the time it was collected."""
    out = {}
    while (t := engine.next_event_time()) is not None:
        clock.sleep_until(t)
        for trajectory in engine.collect():
            out[trajectory.request_id] = (clock.now(), trajectory)
    return out


def expected_time(steps: int, n: int, kv: int) -> float:
    """Sum of per-step latencies, one step at a time: what the engine must reproduce in closed form."""
    total = 0.0
    for _ in range(steps):
        total += COST.step_latency(n, kv)
        kv += n
    return total


def test_is_a_rollout_engine() -> None:
    """Every method of the seam, with the seam's parameters (isinstance on a Protocol checks names only)."""
    import inspect

    engine = SimEngine("i", VirtualClock(), COST, 1000)
    assert isinstance(engine, RolloutEngine)
    members = [n for n, v in vars(RolloutEngine).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert members, "the seam has methods"
    for name in members:
        wanted = list(inspect.signature(getattr(RolloutEngine, name)).parameters)[1:]
        assert list(inspect.signature(getattr(engine, name)).parameters) == wanted, name


def test_step_latency_follows_the_cost_model() -> None:
    clock = VirtualClock()
    engine = SimEngine("i0", clock, COST, 100_000)
    engine.submit([request("a", 50), request("b", 120), request("c", 120)])
    done = run_to_idle(engine, clock)
    t_a = expected_time(50, 3, 30)
    # after a finishes, b and c continue with K = 2 * (10 + 50)
    t_bc = t_a + expected_time(70, 2, 2 * 60)
    assert done["a"][0] == pytest.approx(t_a, rel=1e-12)
    assert done["b"][0] == pytest.approx(t_bc, rel=1e-12)
    assert done["c"][0] == pytest.approx(t_bc, rel=1e-12)
    trajectory = done["b"][1]
    assert len(trajectory.output_ids) == 120 and trajectory.versions == [0] * 120
    assert trajectory.logprobs == [FAKE_LOGPROB] * 120
    assert trajectory.finish_reason == "stop"
    assert engine.progress() == (50 + 120 + 120, 3)


def test_snapshot_mid_run_reports_running_kv_and_throughput() -> None:
    clock = VirtualClock()
    engine = SimEngine("i0", clock, COST, 100_000)
    engine.submit([request("a", 1000), request("b", 1000)])
    engine.snapshot()
    t10 = expected_time(10, 2, 20)
    clock.sleep_until(t10 + 1e-9)  # just after step 10 ended
    snap = engine.snapshot()
    assert snap.running == ("a", "b") and snap.waiting == ()
    assert snap.kv_tokens == 20 + 2 * 10
    assert snap.tokens_per_s == pytest.approx(20 / (t10 + 1e-9))
    assert snap.version == 0 and not snap.loading and snap.kv_capacity == 100_000


def test_max_new_tokens_caps_the_response() -> None:
    clock = VirtualClock()
    engine = SimEngine("i0", clock, COST, 100_000)
    engine.submit([request("a", 500, max_new=40)])
    (_, trajectory), = run_to_idle(engine, clock).values()
    assert len(trajectory.output_ids) == 40 and trajectory.finish_reason == "length"


def test_requests_that_do_not_fit_the_kv_cache_wait() -> None:
    clock = VirtualClock()
    # capacity 100: a (prompt 40) is admitted; b (prompt 40) needs 40 + 2 more for the next step
    engine = SimEngine("i0", clock, COST, 100)
    engine.submit([request("a", 30, prompt=40), request("b", 10, prompt=40), request("c", 5, prompt=40)])
    snap = engine.snapshot()
    assert snap.running == ("a", "b") and snap.waiting == ("c",)
    done = run_to_idle(engine, clock)
    # b finishes after 10 steps of two requests; c starts then (KV 50 + 40 + 2 <= 100)
    t_b = expected_time(10, 2, 80)
    assert done["b"][0] == pytest.approx(t_b)
    assert done["c"][0] == pytest.approx(t_b + expected_time(5, 2, 50 + 40))
    assert set(done) == {"a", "b", "c"}


def test_kv_overflow_preempts_the_latest_request_which_keeps_its_tokens() -> None:
    clock = VirtualClock()
    engine = SimEngine("i0", clock, COST, 60)
    engine.submit([request("a", 30, prompt=10), request("b", 30, prompt=10)])  # 20 + 2 per step
    # K reaches 60 after 20 steps: the next step needs 62, so b (admitted last) is preempted
    clock.sleep_until(expected_time(20, 2, 20) + 1e-9)
    snap = engine.snapshot()
    assert snap.running == ("a",) and snap.waiting == ("b",) and snap.kv_tokens == 30
    done = run_to_idle(engine, clock)
    assert len(done["b"][1].output_ids) == 30 and len(done["a"][1].output_ids) == 30
    # b resumed only after a finished (a alone: 10 more steps)
    assert done["b"][0] > done["a"][0]


def test_max_running_limits_the_batch() -> None:
    clock = VirtualClock()
    engine = SimEngine("i0", clock, COST, 100_000, max_running=2)
    engine.submit([request(r, 10) for r in "abc"])
    snap = engine.snapshot()
    assert snap.running == ("a", "b") and snap.waiting == ("c",)


def test_interrupt_returns_partials_that_resume_elsewhere_with_versions() -> None:
    clock = VirtualClock()
    first = SimEngine("i0", clock, COST, 100_000)
    first.submit([request("a", 100), request("b", 100)])
    clock.sleep_until(expected_time(30, 2, 20) + 1e-9)  # step 31 has just begun: it completes first
    (partial,) = first.interrupt(["a"])
    assert len(partial.output_ids) == 31 and partial.versions == [0] * 31
    assert partial.logprobs == [FAKE_LOGPROB] * 31 and partial.remaining_tokens == 10_000 - 31
    assert first.snapshot().running == ("b",)
    assert first.interrupt(["nope"]) == []

    second = SimEngine("i1", clock, COST, 100_000, version=2)
    start = clock.now()
    second.submit([partial])
    assert second.snapshot().kv_tokens == 10 + 31  # the partial's context is resident again
    done = run_to_idle(second, clock)
    trajectory = done["a"][1]
    assert len(trajectory.output_ids) == 100
    assert trajectory.versions == [0] * 31 + [2] * 69
    assert done["a"][0] == pytest.approx(start + expected_time(69, 1, 41))


def test_interrupt_mid_step_lets_the_step_finish() -> None:
    clock = VirtualClock()
    engine = SimEngine("i0", clock, COST, 100_000)
    engine.submit([request("a", 100)])
    clock.sleep_until(expected_time(5, 1, 10) + COST.step_latency(1, 15) / 2)  # halfway through step 6
    (partial,) = engine.interrupt(["a"])
    assert len(partial.output_ids) == 6


def test_abort_discards_running_waiting_and_uncollected_requests() -> None:
    clock = VirtualClock()
    engine = SimEngine("i0", clock, COST, 100_000, max_running=1)
    engine.submit([request("a", 5), request("b", 50), request("c", 50)])
    clock.sleep_until(expected_time(5, 1, 10) + 1e-9)  # a finished, b started
    engine.abort(["a", "b", "c"])
    assert engine.collect() == []
    snap = engine.snapshot()
    assert snap.running == () and snap.waiting == () and snap.kv_tokens == 0
    assert engine.next_event_time() is None


def test_load_weights_blocks_only_this_instance_and_switches_versions() -> None:
    clock = VirtualClock()
    engine = SimEngine("i0", clock, COST, 100_000, weight_load_s=2.0)
    other = SimEngine("i1", clock, COST, 100_000)
    engine.submit([request("a", 20)])
    other.submit([request("b", 20)])
    t11 = expected_time(11, 1, 10)
    clock.sleep_until(t11 - 1e-9)  # during step 11: it completes, then the load starts
    engine.load_weights(1, None)
    snap = engine.snapshot()
    assert snap.loading and snap.version == 1
    done = run_to_idle(engine, clock)
    assert done["a"][0] == pytest.approx(t11 + 2.0 + expected_time(9, 1, 21))
    assert done["a"][1].versions == [0] * 11 + [1] * 9
    assert not engine.snapshot().loading
    (b,) = other.collect()  # the other instance never waited
    assert b.metadata["finish_time"] == pytest.approx(expected_time(20, 1, 10))
    with pytest.raises(ValueError, match="cannot go back"):
        engine.load_weights(0, None)


def test_reload_that_recomputes_kv_costs_a_prefill_of_the_resident_tokens() -> None:
    clock = VirtualClock()
    engine = SimEngine("i0", clock, COST, 100_000, weight_load_s=1.0, prefill_s_per_token=0.01, reload_recomputes_kv=True)
    engine.submit([request("a", 20, prompt=10), request("b", 20, prompt=10)])  # 0.2 s prefill
    t5 = 0.2 + expected_time(5, 2, 20)
    clock.sleep_until(t5 - 1e-9)  # during step 5: it completes, then the load starts
    engine.load_weights(1, None)  # resident: 2 x (10 + 5) = 30 tokens -> 0.3 s more than the load
    done = run_to_idle(engine, clock)
    assert done["a"][0] == pytest.approx(t5 + 1.0 + 0.3 + expected_time(15, 2, 30))


def test_prefill_stall_delays_decode() -> None:
    clock = VirtualClock()
    engine = SimEngine("i0", clock, COST, 100_000, prefill_s_per_token=0.01)
    engine.submit([request("a", 10, prompt=50)])
    done = run_to_idle(engine, clock)
    assert done["a"][0] == pytest.approx(0.5 + expected_time(10, 1, 50))


def test_refuses_requests_newer_than_the_instance_or_too_long() -> None:
    clock = VirtualClock()
    engine = SimEngine("i0", clock, COST, 100)
    with pytest.raises(ValueError, match="needs version >= 1"):
        engine.submit([request("a", 5, version=1)])
    with pytest.raises(ValueError, match="KV tokens at its longest"):
        engine.submit([request("b", 95, prompt=10)])
    engine.submit([request("c", 5)])
    with pytest.raises(ValueError, match="already on this instance"):
        engine.submit([request("c", 5)])


def test_many_requests_take_events_not_tokens() -> None:
    """1,000 requests of up to 20,000 tokens: the event loop runs per finish, not per token."""
    clock = VirtualClock()
    engine = SimEngine("i0", clock, CostModel(0.01, 0.0, 1e-4, 0.002, 3e-8), 10_000_000, max_running=1000)
    engine.submit([request(f"r{i}", 20 * (i + 1), max_new=30_000) for i in range(1000)])
    events = 0
    while (t := engine.next_event_time()) is not None:
        clock.sleep_until(t)
        engine.collect()
        events += 1
    assert engine.progress()[0] == sum(20 * (i + 1) for i in range(1000))
    assert events == 1000


def test_a_long_partial_pays_the_attention_term_of_its_re_prefill() -> None:
    """Chunked prefill of c context tokens: c * per_token + attn * c^2 / 2."""
    from staleflow.adapters.sim.network import prefill_seconds

    assert prefill_seconds(30_000, 8.9e-5, 1.06e-8) == pytest.approx(30_000 * 8.9e-5 + 1.06e-8 * 30_000**2 / 2)
    clock = VirtualClock()
    engine = SimEngine("i0", clock, COST, 100_000, prefill_s_per_token=1e-4, prefill_attn_s_per_token2=1e-8)
    engine.submit([request("a", 1, prompt=20_000)])
    done = run_to_idle(engine, clock)
    assert done["a"][0] == pytest.approx(20_000 * 1e-4 + 1e-8 * 20_000**2 / 2 + expected_time(1, 1, 20_000))


def test_parameter_server_pulls_share_its_bandwidth_and_a_broadcast_does_not() -> None:
    from staleflow.adapters.sim.network import Broadcast, ParameterServerLink
    from staleflow.runtime.settings.workload import NetworkSpec

    net = NetworkSpec(weights_gb=60.0, ps_gb_per_s=100.0, link_gb_per_s=25.0, broadcast_gb_per_s=20.0)
    link = ParameterServerLink(net)
    assert link.transfer_s(0.0) == pytest.approx(60 / 25)  # alone: the instance's link limits
    times = [link.transfer_s(0.1) for _ in range(7)]  # 8 in flight: 100 GB/s shared
    assert times[-1] == pytest.approx(60 / (100 / 8)) and link.in_flight == 8
    assert link.transfer_s(100.0) == pytest.approx(60 / 25) and link.in_flight == 1  # the others finished
    assert Broadcast(net).transfer_s(0.0) == Broadcast(net).transfer_s(5.0) == pytest.approx(3.0)
    clock = VirtualClock()
    engine = SimEngine("i0", clock, COST, 100_000, weight_load_s=1.0, weight_link=Broadcast(net))
    engine.load_weights(1)
    assert engine.snapshot().loading and engine.next_event_time() == pytest.approx(4.0)


def test_speculation_speeds_up_only_a_small_batch() -> None:
    """With speculation (1.5x at 2 running requests or fewer), three requests decode at the plain
    rate while three run, and 1.5x faster once one has finished; progress mid-segment counts the
    faster steps too."""
    clock = VirtualClock()
    engine = SimEngine("i0", clock, SpeculativeDecoding(COST, 1.5, 2), 100_000)
    engine.submit([request("a", 50), request("b", 120), request("c", 120)])
    t_a = expected_time(50, 3, 30)
    t_half = t_a + expected_time(35, 2, 2 * 60) / 1.5
    clock.sleep_until(t_half)
    assert engine.progress()[0] == 3 * 50 + 2 * 35
    done = run_to_idle(engine, clock)
    assert done["a"][1].metadata["finish_time"] == pytest.approx(t_a, rel=1e-12)
    assert done["b"][0] == pytest.approx(t_a + expected_time(70, 2, 2 * 60) / 1.5, rel=1e-12)


@pytest.mark.parametrize("speculation", [(1.0, 8), (0.5, 8), (1.5, 0)])
def test_speculation_refuses_a_speedup_at_or_below_one_or_no_batch(speculation: tuple[float, int]) -> None:
    with pytest.raises(ValueError, match="speculative decoding's"):
        SpeculativeDecoding(COST, *speculation)


QWEN3 = CostModel(thr=0.0115108, o_b=0.0097899, o_k=1.249e-4, a_b=8.671926e-4, a_k=7.28e-8)  # psrl qwen_moe_30b.json


def test_draft_verification_costs_the_workloads_own_terms_at_every_batch_size() -> None:
    """Verifying k drafts per request reads the KV cache once and runs the matmuls over n (k + 1)
    tokens: L_verify = a_b + a_k K + max(thr, o_b + o_k n (k + 1)). On Qwen3-30B-A3B's own terms,
    with drafts accepted at 0.6 each, a full instance at a long context (26 requests, 226k KV
    tokens) verifies 3 drafts and makes a token 1.65x faster; 512 requests over short contexts
    draft nothing (a plain step); a lone 41k-token request drafts the most allowed."""
    from staleflow.adapters.sim.speculation import DraftVerification, geometric_tau

    tau = geometric_tau(0.6, 8)
    assert tau[:3] == pytest.approx((1.6, 1.96, 2.176))
    spec = DraftVerification(QWEN3, tau)
    plain = 8.671926e-4 + 7.28e-8 * 226_000 + (0.0097899 + 1.249e-4 * 26)  # L(26, 226k): the o-term above thr
    verify3 = 8.671926e-4 + 7.28e-8 * 226_000 + (0.0097899 + 1.249e-4 * 26 * 4)
    assert QWEN3.step_latency(26, 226_000) == pytest.approx(plain)
    assert spec.verify_latency(26, 226_000, 3) == pytest.approx(verify3)
    assert spec.drafts(26, 226_000) == 3
    assert spec.step_latency(26, 226_000) == pytest.approx(verify3 / 2.176)
    assert plain / spec.step_latency(26, 226_000) == pytest.approx(1.647, abs=1e-3)
    assert spec.drafts(512, 100_000) == 0 and spec.step_latency(512, 100_000) == QWEN3.step_latency(512, 100_000)
    assert spec.drafts(1, 41_000) == 8
    # a token-step's cost model at k drafts is L_verify / tau(k), linear in K: the engine's closed form holds
    assert spec.per_token[3].step_latency(26, 226_000) == pytest.approx(verify3 / 2.176)
    assert spec.decode_seconds(100, 26, 226_000) == pytest.approx(
        sum(spec.verify_latency(26, 226_000 + 26 * s, 3) / 2.176 for s in range(100)))
    with pytest.raises(ValueError, match=r"tau\(2\) must be in \[1, 3\]"):
        DraftVerification(QWEN3, (1.5, 3.5))


def test_an_engine_verifying_drafts_finishes_a_lone_long_request_sooner_by_the_model() -> None:
    """A lone 4,000-token response on a Qwen3 instance: 8 drafts per step at acceptance 0.6 (tau(8)
    = 2.47 tokens a step). One request's 9 tokens a step stay under the memory-bound floor ``thr``,
    so a verification costs what a plain step does and the response finishes tau(8) times sooner,
    at the per-token model's closed form (the engine's steps stay one token each)."""
    from staleflow.adapters.sim.speculation import DraftVerification, geometric_tau

    spec = DraftVerification(QWEN3, geometric_tau(0.6, 8))
    times = {}
    for name, model in (("plain", QWEN3), ("spec", spec)):
        clock = VirtualClock()
        engine = SimEngine("i0", clock, model, 300_000)
        engine.submit([request("a", 4000, prompt=500)])
        done = run_to_idle(engine, clock)
        times[name] = done["a"][1].metadata["finish_time"]
        assert len(done["a"][1].output_ids) == 4000
    assert times["spec"] == pytest.approx(spec.per_token[8].decode_seconds(4000, 1, 500), rel=1e-12)
    assert times["plain"] / times["spec"] == pytest.approx(spec.tau[7], rel=1e-9) and spec.tau[7] == pytest.approx(2.4748, abs=1e-4)


def test_drafts_per_request_go_where_they_are_likeliest_accepted() -> None:
    """Two requests, one at acceptance 0.2 (position 0), one at 0.8 (position 100), up to 2 drafts,
    L_verify = 1 + 0.25 (n + D) over D drafts in all. One k for both: k = 1 emits 1.8 + 1.2 = 3
    tokens for 2.0 s, 1.333 s per token-step of the two (k = 0: 1.5, k = 2: 2 x 2.5 / 3.68 = 1.359).
    Per request, both drafts go to the 0.8 one (marginals 0.8, 0.64 before 0.2): 1 + 1.8 + 0.64 =
    3.44 tokens for 2.0 s, 1.163 s. At one acceptance the drafts are the uniform k, except at the
    memory-bound floor: 10 requests at 0.5 where L = max(15, 10 + D) draft 5 in all (12 s a
    token-step), where one k can only make 10 (13.33 s) or none (15 s)."""
    from staleflow.adapters.sim.speculation import DraftVerification, geometric_tau

    linear = CostModel(thr=0.0, o_b=0.0, o_k=0.25, a_b=1.0, a_k=0.0)
    profile = ((0, 0.2), (100, 0.8))
    uniform, budgets = (DraftVerification(linear, geometric_tau(0.5, 2), profile, b) for b in (False, True))
    assert uniform.at_positions([0, 100], 0).step_latency(2, 0) == pytest.approx(2 * 2.0 / 3.0)
    assert budgets.at_positions([0, 100], 0).step_latency(2, 0) == pytest.approx(2 * 2.0 / 3.44)
    floor = CostModel(thr=15.0, o_b=0.0, o_k=1.0, a_b=0.0, a_k=0.0)
    one = {b: DraftVerification(floor, geometric_tau(0.5, 2), ((0, 0.5),), b).at_positions([7] * 10, 0) for b in (False, True)}
    assert (one[False].step_latency(10, 0), one[True].step_latency(10, 0)) == pytest.approx((10 * 20 / 15, 12.0))
    with pytest.raises(ValueError, match="by_position must rise from position 0"):
        DraftVerification(linear, (1.5,), ((10, 0.5),))


def test_an_acceptance_that_is_one_rate_everywhere_times_the_engine_as_before() -> None:
    """Qwen3's terms at acceptance 0.6: one rate by position gives each token-step the cost of the
    plain model's cheapest k at every batch and KV (per request too: above the floor the marginals
    tie), and an engine's finish times to the last digit. A rate that rises along the response
    (0.3 to 0.8), 12 requests 1,000 tokens or more in when 12 more join: drafting per request
    finishes them sooner in all than one k for all."""
    from staleflow.adapters.sim.speculation import DraftVerification, geometric_tau

    tau = geometric_tau(0.6, 8)
    plain = DraftVerification(QWEN3, tau)
    for budgets in (False, True):
        flat = DraftVerification(QWEN3, tau, ((0, 0.6),), budgets)
        for n, kv in ((1, 41_000), (26, 226_000), (128, 300_000), (512, 100_000)):
            assert flat.at_positions([500] * n, kv).step_latency(n, kv) == pytest.approx(plain.step_latency(n, kv), rel=1e-12)
    finish = {}
    for name, model in (("plain", plain), ("flat", DraftVerification(QWEN3, tau, ((0, 0.6),), True)),
                        ("uniform", DraftVerification(QWEN3, tau, ((0, 0.3), (1000, 0.8)))),
                        ("budgets", DraftVerification(QWEN3, tau, ((0, 0.3), (1000, 0.8)), True))):
        clock = VirtualClock()
        engine = SimEngine("i0", clock, model, 300_000)
        engine.submit([request(f"r{i}", 3000 + 100 * i, prompt=500) for i in range(12)])
        clock.sleep_until(12.0)
        assert engine.snapshot().kv_tokens > 12 * 1500
        engine.submit([request(f"s{i}", 2000 + 100 * i, prompt=500) for i in range(12)])
        finish[name] = {rid: t.metadata["finish_time"] for rid, (_, t) in run_to_idle(engine, clock).items()}
    assert finish["flat"] == pytest.approx(finish["plain"], rel=1e-12)
    assert sum(finish["budgets"].values()) < sum(finish["uniform"].values())

"""Routing that plans for the KV growth of running requests, the length model behind it, and the
head buffer's tail moved to a lightly loaded instance (runtime/coordination/lengths.py, tail.py)."""

from __future__ import annotations

import numpy as np
from staleflow.protocol import StalenessManager
from staleflow.runtime.coordination.commands import Interrupt, Route
from staleflow.runtime.coordination.coordinator import Coordinator
from staleflow.runtime.coordination.cost_model import CostModel
from staleflow.runtime.coordination.fleet import InstanceView
from staleflow.runtime.coordination.lengths import LengthModel
from staleflow.runtime.coordination.observations import RequestsLeft, RunStarted, Tick
from staleflow.runtime.run.decision import decide
from staleflow.runtime.run.group_life import GroupLife
from staleflow.runtime.servers.trajectory_server import TrajectoryServer
from staleflow.runtime.settings.policies import make_policy
from staleflow.runtime.types import InstanceSnapshot, PromptGroup

MODEL = CostModel(thr=0.0064, o_b=0.0027, o_k=1.231e-4, a_b=0.0028, a_k=3.35e-8)
PROMPT = 8


def snap(iid: str, running=(), kv: int = 0, cap: int = 10_000, tokens_per_s: float = 0.0, time: float = 0.0, loading=False,
         version: int = 0):
    return InstanceSnapshot(iid, version, tuple(running), (), kv, cap, tokens_per_s, time, loading)


def coordinator(system: str, cap: int = 10_000, instances: int = 2, eta: int = 1, batch: int = 2, loading=(), **knobs):
    ts = TrajectoryServer()
    ts.add_groups(PromptGroup(f"g{i}", [1] * PROMPT, 2, 0, {"max_new_tokens": 8_000}) for i in range(20))
    m = StalenessManager(eta, batch)
    snapshots = [snap(f"i{k}", cap=cap, loading=k in loading) for k in range(instances)]
    c = Coordinator(GroupLife(m, ts), make_policy(system, **knobs), MODEL, snapshots, prefill=lambda tokens: 1e-4 * tokens)
    return c, m, ts


def routed(commands) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for cmd in commands:
        if isinstance(cmd, Route):
            out.setdefault(cmd.instance_id, []).extend(cmd.request_ids)
    return out


def test_length_model_gives_the_conditional_expectation_of_the_rest():
    rng = np.random.default_rng(0)
    lengths = rng.lognormal(7, 0.8, 2000).astype(int)
    model = LengthModel(window=4096, tail_samples=16, warmup=32)
    assert not model.ready and model.expected_remaining(np.array([0, 100])).tolist() == [0, 0]
    model.observe(lengths.tolist())
    assert model.ready
    for g in (0, 500, 1500, 4000):
        above = lengths[lengths > g]
        assert len(above) >= 16
        assert np.isclose(model.expected_remaining(np.array([g]))[0], above.mean() - g)
    # past nearly all the lengths seen: the mean of the 16 longest stands in, never below 0
    top = np.sort(lengths)[-16:].mean()
    assert np.isclose(model.expected_remaining(np.array([top - 10]))[0], 10)
    assert model.expected_remaining(np.array([lengths.max() + 1]))[0] == 0
    # a window: only the last lengths count
    small = LengthModel(window=32, tail_samples=4, warmup=32)
    small.observe([10_000] * 32 + [100] * 32)
    assert np.isclose(small.expected_remaining(np.array([0]))[0], 100)


def test_a_view_estimates_each_requests_progress_from_the_instance_rate():
    """Two requests decode on an instance making 100 tokens/s: over 10 s each made 500 tokens."""
    view = InstanceView(snap("i0"))
    view.add("a", 108, 0, generated=100, group="g")
    view.add("b", 8, 0, generated=0, group="g")
    assert view.observe(snap("i0", running=("a", "b"), kv=1_116, tokens_per_s=100.0, time=10.0))
    assert view.generated(["a", "b"]).tolist() == [600, 500]
    generated, prompts = view.progress()
    assert generated.tolist() == [600, 500] and prompts.tolist() == [8, 8]
    # the arrays kept between calls follow the requests that come and go, and the steps made
    view.remove("a")
    view.add("c", 58, 0, generated=50, group="h")
    assert [a.tolist() for a in view.progress()] == [[500, 50], [8, 8]]
    assert view.observe(snap("i0", running=("b", "c"), kv=1_066, tokens_per_s=100.0, time=11.0))
    assert [a.tolist() for a in view.progress()] == [[550, 100], [8, 8]]


def test_admission_keeps_room_for_the_growth_of_running_requests():
    """Responses are seen to run 4,000 tokens; an instance holds 10,000 KV tokens. A response just
    started (8 prompt tokens) is expected to reach 4,008: two fit an instance, a third cannot grow
    there. Today's rule (the KV in use now: 8 tokens a request) places all eight requests of the four
    groups the protocol admits, four an instance, which overflow as they grow; planning for growth
    places two an instance and leaves the rest pending."""
    def place(system: str) -> dict[str, list[str]]:
        c, _, _ = coordinator(system)
        c.step(RequestsLeft("i0", (), (4_000,) * 64))  # lengths seen (requests of another run: no ids here)
        return routed(decide(c, c.groups, Tick(0, True)))

    growing = place("staleflow")
    assert {i: len(r) for i, r in growing.items()} == {"i0": 2, "i1": 2}
    today = place("staleflow-no-growth")
    assert max(len(r) for r in today.values()) * (PROMPT + 4_000) > 10_000


def test_the_head_buffers_tail_moves_to_a_light_instance_and_new_groups_stay_off_it():
    """eta 1, batch 2: g0..g3 reserved and routed; g2, g3 trained, so g0 and g1 are due in the head
    buffer; g1 finishes, g0 is the tail (one group of two: tail_share 0.5). Its requests run on a
    busy instance (KV nearly full); the other instance, loading weights while they were routed,
    is idle. The cost model says they finish
    sooner there even after a re-prefill: they are interrupted, routed to the idle instance when
    they come back, and no new group goes there while it hosts them."""
    c, m, ts = coordinator("staleflow-tail", cap=100_000, tail_share=0.5, loading=(1,))
    c.step(RequestsLeft("i0", (), (4_000,) * 64))
    placed = routed(decide(c, c.groups, Tick(0, True)))
    busy, light = "i0", "i1"
    assert list(placed) == [busy]
    ts.mark_routed(placed[busy], busy)
    for group_id in ("g2", "g3"):
        m.occupy(group_id)
    m.consume()
    m.occupy("g1")
    left = {iid: tuple(r for r in rids if not r.startswith("g0/")) for iid, rids in placed.items()}
    for iid, rids in left.items():
        c.step(RequestsLeft(iid, rids))
    tail = ("g0/0", "g0/1")
    c.step(RunStarted(1))  # both instances load version 1, so that new groups can be admitted
    c.ready()
    c.step(snap(busy, running=tail, kv=60_000, cap=100_000, version=1))
    c.step(snap(light, cap=100_000, version=1))

    commands = decide(c, c.groups, Tick(1, True))
    assert [sorted(cmd.request_ids) for cmd in commands if isinstance(cmd, Interrupt) and cmd.instance_id == busy] == [list(tail)]
    assert c.stats["tail_moves"] == 2
    assert all(not r.startswith("g0/") for r in routed(commands).get(light, []))  # back in the queue first
    for iid, rids in routed(commands).items():
        ts.mark_routed(rids, iid)
    ts.requeue([ts.request(rid) for rid in tail], busy)
    again = routed(decide(c, c.groups, Tick(1, True)))
    assert sorted(again[light]) == list(tail)
    assert c.stats["groups_admitted"] > 4  # new groups were admitted, none on the host
    admitted = [r for rids in (*routed(commands).values(), *again.values()) for r in rids if not r.startswith("g0/")]
    assert admitted and all(r in (routed(commands).get(busy, []) + again.get(busy, [])) for r in admitted)


def test_the_kv_reserve_is_the_expected_peak_not_every_final_size_at_once():
    """Two requests of 10 KV tokens, one expected to finish in 5 steps and one in 100: the cache
    peaks at 110 just before the long one finishes (the short one is gone by then), 90 above the 20
    held now; planning for both final sizes at once (15 + 110 = 125) would hold back 105."""
    import numpy as np
    from staleflow.runtime.coordination.fleet import kv_peak_growth

    assert kv_peak_growth(np.array([10.0, 10.0]), np.array([100.0, 5.0])) == 90.0
    # finishing together, the peak is every final size: 2 x (10 + 50) - 20
    assert kv_peak_growth(np.array([10.0, 10.0]), np.array([50.0, 50.0])) == 100.0
    # a short request that holds much: the peak is just before it finishes (1,003 + 4), not at the end (11)
    assert kv_peak_growth(np.array([1000.0, 1.0]), np.array([3.0, 10.0])) == 6.0
    assert kv_peak_growth(np.array([]), np.array([])) == 0.0


def test_the_kv_peaks_of_many_instances_in_one_pass_are_each_instance_alone_to_the_bit():
    """Growth planning estimates every changed view's peak in one pass (`kv_peak_growths`): each set's
    figure equals what the set alone gives, bit for bit (the run's decisions must not move), with
    ties in the remaining steps, fractional KV (progress estimates) and empty sets among them."""
    import numpy as np
    from staleflow.runtime.coordination.fleet import kv_peak_growth, kv_peak_growths

    rng = np.random.default_rng(7)
    sizes = [0, 1, 7, 9, 130, 0, 513, 40]
    kvs = [rng.integers(100, 5000, n) + rng.random(n) for n in sizes]
    remaining = [rng.choice([0.0, 17.25, 900.5, 4000.0], n) if i % 2 else rng.random(n) * 3000 for i, n in enumerate(sizes)]
    together = kv_peak_growths(np.concatenate(kvs), np.array([len(kv) for kv in kvs]), np.concatenate(remaining))
    alone = [kv_peak_growth(kv, r) for kv, r in zip(kvs, remaining)]
    assert together.tolist() == alone and together[0] == together[5] == 0.0 and together.max() > 0
    # the one-set form is the reference formula of the test above: max_k sum_{r_i >= r_k} (kv_i + r_k) - sum kv
    kv, r = kvs[4], remaining[4]
    reference = max(sum(kv[i] + r[k] for i in range(len(kv)) if r[i] >= r[k]) for k in range(len(kv))) - kv.sum()
    assert np.isclose(alone[4], max(0.0, reference), rtol=1e-12)


def test_the_kv_table_adds_each_row_as_numpy_adds_it_alone():
    """Growth planning sums each instance's KV from its row of a padded table (`row_sums`), all rows
    at once: every row's sum equals numpy's own sum of that row alone, bit for bit, for rows of every
    length to 300 (numpy's pairwise summation: one after the other below 8 entries, eight running sums
    to 128, halves beyond), and for a few rows (summed one by one). Adding a row from left to right
    differs in many rows: the order of additions shows."""
    from staleflow.runtime.coordination.fleet import row_sums

    rng = np.random.default_rng(3)
    for counts in (np.arange(301), np.array([0, 7, 300])):
        table = np.zeros((len(counts), 304))
        for j, n in enumerate(counts.tolist()):
            table[j, :n] = rng.random(n) * 10.0 ** rng.uniform(0, 6, n)  # magnitudes far apart
        alone = [table[j, :n].copy().sum() for j, n in enumerate(counts.tolist())]
        assert row_sums(table, counts).tolist() == alone
        if len(counts) > 3:
            left_to_right = np.cumsum(table, axis=1)[:, -1].tolist()
            assert sum(a != b for a, b in zip(left_to_right, alone)) > 50

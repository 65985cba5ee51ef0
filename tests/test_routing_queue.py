"""The incremental routing queue decides exactly as sorting the queue and walking it request by
request did (the code before :mod:`staleflow.runtime.servers.request_queue`), over randomized states."""

from __future__ import annotations

import copy
import random
from dataclasses import replace

import numpy as np
import pytest
from staleflow.protocol import StalenessManager
from staleflow.runtime.coordination.coordinator import Coordinator
from staleflow.runtime.coordination.cost_model import CostModel
from staleflow.runtime.run.group_life import GroupLife
from staleflow.runtime.servers import request_queue
from staleflow.runtime.servers.trajectory_server import TrajectoryServer
from staleflow.runtime.settings.policies import make_policy
from staleflow.runtime.types import InstanceSnapshot, PromptGroup, RolloutRequest

MODEL = CostModel(thr=0.0064, o_b=0.0027, o_k=1.231e-4, a_b=0.0028, a_k=3.35e-8)


def _tokens(request: RolloutRequest) -> int:
    return len(request.prompt_ids) + len(request.output_ids)


def _reference_order(ts: TrajectoryServer, arrivals: list[str]) -> list[RolloutRequest]:
    """The queue as it was built before: arrival order, stably sorted by (version, -output tokens)."""
    return sorted((ts.request(rid) for rid in arrivals), key=lambda r: (r.group_version, -len(r.output_ids)))


class _Workload:
    """A trajectory server driven by random admissions, routes, re-queues (partials of random
    lengths, often equal), aborts and checkpoint round trips; ``arrivals`` is the queue in arrival
    order, kept by the test alone."""

    def __init__(self, rng: random.Random, groups: int = 60) -> None:
        self.rng = rng
        self.ts = TrajectoryServer()
        self.ts.add_groups(
            PromptGroup(f"g{i}", [1] * rng.choice((5, 40, 70, 150)), rng.randint(1, 6), 0, {"max_new_tokens": 5000})
            for i in range(groups)
        )
        self.arrivals: list[str] = []
        self.pending = [f"g{i}" for i in range(groups)]
        self.generating: list[str] = []

    def admit(self) -> None:
        if self.pending:
            group_id = self.pending.pop(0)
            self.arrivals += [r.request_id for r in self.ts.admit(group_id, self.rng.randint(0, 3))]
            self.generating.append(group_id)

    def route(self, instance: str = "src") -> None:
        queued = self.ts.queued()
        for request in self.rng.sample(queued, self.rng.randint(0, len(queued))):
            self.ts.mark_routed([request.request_id], instance)
            self.arrivals.remove(request.request_id)

    def requeue(self) -> None:
        running = sorted(self.ts.running_on().get("src", ()))
        for rid in self.rng.sample(running, self.rng.randint(0, len(running))):
            output = [0] * self.rng.choice((0, 3, 3, 50, 64, 65, 130))
            self.ts.requeue([replace(self.ts.request(rid), output_ids=output)], "src")
            self.arrivals.append(rid)

    def abort(self) -> None:
        if self.generating:
            group_id = self.generating.pop(self.rng.randrange(len(self.generating)))
            self.ts.abort_group(group_id)
            self.arrivals = [rid for rid in self.arrivals if self.ts.request(rid).group_id != group_id]

    def round_trip(self) -> None:
        """Checkpoint and restore (possible only while nothing runs)."""
        if not self.ts.running_on():
            restored = TrajectoryServer()
            restored.load_state_dict(self.ts.state_dict())
            self.ts = restored

    def step(self) -> None:
        getattr(self, self.rng.choice(("admit", "admit", "route", "requeue", "requeue", "abort", "round_trip")))()


@pytest.mark.parametrize("reclaim_after", [2, 1024])
def test_queue_order_matches_sorting_the_queue_after_every_change(monkeypatch, reclaim_after):
    """After each random change, queued() and queue_view() agree with a stable sort of the queue in
    arrival order, as the trajectory server sorted it at every call before (with departed slots
    reclaimed all the time, and rarely)."""
    monkeypatch.setattr(request_queue, "_RECLAIM_AFTER", reclaim_after)
    checked = 0
    for seed in range(12):
        work = _Workload(random.Random(seed))
        for _ in range(120):
            work.step()
            expected = _reference_order(work.ts, work.arrivals)
            assert [r.request_id for r in work.ts.queued()] == [r.request_id for r in expected]
            view = work.ts.queue_view()
            assert view.versions.tolist() == [r.group_version for r in expected]
            assert view.tokens.tolist() == [_tokens(r) for r in expected]
            assert work.ts.queued_count() == len(expected) == len(view)
            checked += len(expected)
        assert work.ts.audit().problems == ()
    assert checked > 5000


def test_queue_refuses_a_request_queued_twice_and_removing_one_not_queued():
    queue = request_queue.RequestQueue()
    request = RolloutRequest("g/0", "g", [1, 2], 10, 0)
    queue.add(request)
    with pytest.raises(ValueError, match="queued already"):
        queue.add(request)
    queue.remove("g/0")
    with pytest.raises(KeyError):
        queue.remove("g/0")
    assert len(queue) == 0 and queue.in_order() == []


def _reference_route_queue(c: Coordinator, queue: list[RolloutRequest]) -> tuple[dict[int, list[str]], bool, int]:
    """The coordinator's queue walk before the incremental queue: consecutive requests of one
    version and budget bucket form a batch, placed by one router call planned at its largest size;
    the first batch not wholly placed stops the walk. Returns the routes, whether the whole queue
    was placed, and how many of the last batch were."""
    fleet = c.fleet.synced()
    budget = c.policy.request_budget
    batches: list[tuple[tuple[int, int], list[RolloutRequest]]] = []
    for request in queue:
        tokens = _tokens(request)
        key = (request.group_version, tokens if budget <= 1 else -(-tokens // budget))
        if batches and batches[-1][0] == key:
            batches[-1][1].append(request)
        else:
            batches.append((key, [request]))
    routes: dict[int, list[str]] = {}
    for (version, _), batch in batches:
        eligible = fleet.version >= version
        chosen = c.router.choose(fleet, max(_tokens(r) for r in batch), eligible, len(batch), oldest_first=True)
        for i, request in zip(chosen, batch):
            c.views[i].add(request.request_id, _tokens(request), version)
            routes.setdefault(i, []).append(request.request_id)
        if len(chosen) < len(batch):
            return routes, False, len(chosen)
    return routes, True, len(batch)


def _random_coordinator(rng: random.Random) -> tuple[Coordinator, list[str]]:
    """A fleet of random versions, loads, capacities and waiting queues, and a queue of fresh
    requests and partials (see :class:`_Workload`); ``arrivals``: the queue in arrival order."""
    work = _Workload(rng, groups=rng.randint(3, 40))
    for _ in range(rng.randint(5, 60)):
        work.step()
    versions = [rng.randint(0, 3) for _ in range(rng.randint(1, 12))]
    snapshots = [
        InstanceSnapshot(f"i{k}", v, (), (), 0, rng.choice((300, 2000, 20_000)), 0.0, 0.0, rng.random() < 0.1)
        for k, v in enumerate(versions)
    ]
    system, knobs = rng.choice([
        ("staleflow", {"mu": rng.choice((0.0, 0.2, 0.6))}),
        ("staleflow-no-routing", {"max_running": rng.randint(1, 12)}),
        ("areal", {"max_running": rng.randint(1, 12)}),
    ])
    policy = make_policy(system, request_budget=rng.choice((0, 1, 7, 64, 1024)), **knobs)
    c = Coordinator(GroupLife(StalenessManager(3, 4), work.ts), policy, MODEL, snapshots)
    for k, view in enumerate(c.views):
        fillers = [f"x{k}/{j}" for j in range(rng.randint(0, 8))]
        for rid in fillers:
            view.add(rid, rng.randint(10, 200), rng.randint(0, view.version))
        view.waiting = tuple(rid for rid in fillers if rng.random() < 0.2)
        c.fleet._changed.add(k)
    return c, work.arrivals


def test_routing_decisions_match_the_request_by_request_walk_over_random_states():
    """Same routes (instance, requests, order), same fleet arrays and views, same verdict on
    whether the queue was placed, for every router and request budget."""
    outcomes = {"all placed": 0, "stopped in a run partly placed": 0, "stopped at a run not placed": 0}
    for seed in range(400):
        rng = random.Random(seed)
        c, arrivals = _random_coordinator(rng)
        if not c.ts.queued_count():
            continue
        reference = copy.deepcopy(c)
        expected_routes, expected_placed, last_run_placed = _reference_route_queue(reference, _reference_order(reference.ts, arrivals))
        c._plan(None, full=False)
        placed_all = c._admitting  # the queue was placed: the decision may admit groups
        c._take_routes()
        routes = {c.fleet.index(cmd.instance_id): list(cmd.request_ids) for cmd in c.ready().commands}
        assert list(routes.items()) == list(expected_routes.items()), f"seed {seed}"
        assert placed_all == expected_placed, f"seed {seed}"
        for name in ("n", "kv"):
            assert np.array_equal(getattr(c.fleet.arrays, name), getattr(reference.fleet.arrays, name)), f"seed {seed}: {name}"
        assert [v.requests for v in c.views] == [v.requests for v in reference.views], f"seed {seed}"
        outcomes[
            "all placed" if expected_placed else "stopped in a run partly placed" if last_run_placed else "stopped at a run not placed"
        ] += 1
    assert min(outcomes.values()) >= 20, outcomes


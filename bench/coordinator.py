"""Coordinator decision time per tick at cluster scale (128 instances / 10,000 in-flight requests, and
1,024 / 100,000).

Setup: simulated instances with the Qwen3-30B-A3B workload's cost model and KV capacity, a
staleness protocol with ``eta = 3`` and a batch size chosen so that the protocol holds the target
number of requests (groups of 16); the coordinator admits and routes groups until the protocol
refuses. Then, on a virtual clock advancing one tick (1 s) at a time, every tick is timed:

* ``observe``: taking one snapshot of every instance (the loop's full-tick refresh);
* ``plan``: the coordinator's decision on a full tick (pulls, migration, routing, admission), in the
  steady state where every request is placed;
* ``plan, 1% re-routed``: the same after 1% of the in-flight requests were interrupted back to the
  trajectory server (partials to place again: the migration / partial-rollout path).

Responses are long (20,000 tokens), so the in-flight set stays the same during the measurement.
Each figure is measured as wall time and as the process's CPU time (``time.process_time``: on a
machine shared with other jobs the wall time also counts the time the process waited for a core),
and the full (generation 2) garbage collections that ran inside the timed sections are counted: one
costs a few hundred ms at 100,000 requests, whatever code happens to allocate when it is due.
"In flight" counts the requests of admitted groups; the throughput router leaves some of them
queued when no instance gains enough from one more request (the ``mu`` test), as it would in a run.

Reproduce: ``staleflow bench coordinator [--scales 128x10000 1024x100000] [--ticks 20] [--json]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import statistics
import sys
import time
from typing import Any

DEFAULT_SCALES = ("128x10000", "1024x100000")
GROUP_SIZE = 16
ETA = 3
RESPONSE_TOKENS = 20_000
TICK_S = 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scales", nargs="+", default=list(DEFAULT_SCALES), metavar="INSTANCESxREQUESTS",
                        help=f"cluster sizes to measure (default: {' '.join(DEFAULT_SCALES)})")
    parser.add_argument("--ticks", type=int, default=20, help="ticks timed per measurement (default: 20)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON only")


def parse_scale(text: str) -> tuple[int, int]:
    """``INSTANCESxREQUESTS`` (e.g. ``128x10000``) as the two numbers; ValueError for anything else."""
    try:
        instances, requests = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"scale {text!r}: expected INSTANCESxREQUESTS, e.g. 128x10000") from None
    if instances < 1 or requests < GROUP_SIZE:
        raise ValueError(f"scale {text!r}: need >= 1 instance and >= {GROUP_SIZE} requests")
    return instances, requests


def _summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_ms": 1e3 * statistics.median(ordered),
        "p95_ms": 1e3 * ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)],
        "max_ms": 1e3 * ordered[-1],
    }


class _Timer:
    """Wall and CPU seconds of the timed sections, by name, and the full collections inside them."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.wall: dict[str, list[float]] = {name: [] for name in names}
        self.cpu: dict[str, list[float]] = {name: [] for name in names}
        self.full_gc = dict.fromkeys(names, 0)
        self._collections = 0

    def __enter__(self) -> _Timer:
        gc.callbacks.append(self._count)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._count)

    def _count(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and info["generation"] == 2:
            self._collections += 1

    def timed(self, name: str, action: Any) -> Any:
        collections = self._collections
        wall, cpu = time.perf_counter(), time.process_time()
        result = action()
        self.cpu[name].append(time.process_time() - cpu)
        self.wall[name].append(time.perf_counter() - wall)
        self.full_gc[name] += self._collections - collections
        return result


def measure(instances: int, requests: int, ticks: int, seed: int) -> dict[str, Any]:
    """Fill a fleet of ``instances`` with about ``requests`` in-flight requests and time ``ticks`` ticks."""
    from staleflow.adapters.sim.engine import SimEngine
    from staleflow.protocol import StalenessManager
    from staleflow.runtime.coordination.commands import Route
    from staleflow.runtime.coordination.coordinator import Coordinator
    from staleflow.runtime.coordination.observations import RequestsLeft, Tick
    from staleflow.runtime.run.clock import VirtualClock
    from staleflow.runtime.run.decision import decide
    from staleflow.runtime.run.group_life import GroupLife
    from staleflow.runtime.servers.trajectory_server import TrajectoryServer
    from staleflow.runtime.settings.policies import make_policy
    from staleflow.runtime.settings.workload import load_workload
    from staleflow.runtime.types import PromptGroup

    workload = load_workload("qwen3-30b-a3b-128gpu")
    cost = workload.build_cost_model()
    batch_size = math.ceil(requests / (GROUP_SIZE * (ETA + 1)))
    clock = VirtualClock()
    engines = [
        SimEngine(f"i{i}", clock, cost, workload.instance.kv_capacity_tokens, max_running=workload.instance.max_running)
        for i in range(instances)
    ]
    by_id = {e.instance_id: e for e in engines}
    manager = StalenessManager(ETA, batch_size)
    ts = TrajectoryServer()
    prompt = [1] * workload.prompt_tokens
    ts.add_groups(
        PromptGroup(f"g{i}", list(prompt), GROUP_SIZE, metadata={"max_new_tokens": RESPONSE_TOKENS})
        for i in range(batch_size * (ETA + 1))
    )
    groups = GroupLife(manager, ts)
    coordinator = Coordinator(groups, make_policy("staleflow"), cost, [e.snapshot() for e in engines])

    def execute(commands: list[Any]) -> None:
        for command in commands:
            if not isinstance(command, Route):
                raise RuntimeError(f"unexpected command during the benchmark: {command!r}")
            by_id[command.instance_id].submit(ts.mark_routed(command.request_ids, command.instance_id))

    fill_started = time.perf_counter()
    while commands := decide(coordinator, groups, Tick(0, full=False)):
        execute(commands)
    fill_s = time.perf_counter() - fill_started
    on_instances = sum(len(v.requests) for v in coordinator.views)
    admitted = len(manager) * GROUP_SIZE

    def observe() -> None:
        for engine in engines:
            coordinator.step(engine.snapshot())

    rng = random.Random(seed)
    with _Timer(("observe", "plan", "plan_rerouted_1pct")) as timer:
        for _ in range(ticks):
            clock.sleep_until(clock.now() + TICK_S)
            timer.timed("observe", observe)
            execute(timer.timed("plan", lambda: decide(coordinator, groups, Tick(0, full=True))))
            on_instance = [(v.instance_id, rid) for v in coordinator.views for rid in v.requests]
            for instance_id, rid in rng.sample(on_instance, max(1, len(on_instance) // 100)):
                coordinator.step(RequestsLeft(instance_id, (rid,)))
                ts.requeue(by_id[instance_id].interrupt([rid]), instance_id)
            execute(timer.timed("plan_rerouted_1pct", lambda: decide(coordinator, groups, Tick(0, full=True))))

    return {
        "instances": instances,
        "in_flight_requests": admitted,
        "on_instances": on_instances,
        "batch_size": batch_size,
        "eta": ETA,
        "fill_s": fill_s,
        **{name: _summary(samples) for name, samples in timer.wall.items()},
        "cpu": {name: _summary(samples) for name, samples in timer.cpu.items()},
        "full_gc": timer.full_gc,
        "queued_after": ts.queued_count(),
    }


def run(args: argparse.Namespace) -> int:
    try:
        scales = [parse_scale(s) for s in args.scales]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.ticks < 1:
        print("error: --ticks must be >= 1", file=sys.stderr)
        return 2
    results = [measure(instances, requests, args.ticks, args.seed) for instances, requests in scales]
    command = "staleflow bench coordinator --scales " + " ".join(args.scales) + f" --ticks {args.ticks}"
    if args.json:
        print(json.dumps({"results": results, "reproduce": command}, indent=2))
        return 0
    print(f"Coordinator decision time per tick (eta={ETA}, groups of {GROUP_SIZE}, {args.ticks} ticks each):")
    for r in results:
        print(
            f"  {r['instances']:>5} instances, {r['in_flight_requests']:>7,} in flight "
            f"({r['on_instances']:,} on instances, the rest queued by the router's mu test): "
            f"plan {r['plan']['median_ms']:.1f} ms (p95 {r['plan']['p95_ms']:.1f}), "
            f"plan with 1% re-routed {r['plan_rerouted_1pct']['median_ms']:.1f} ms "
            f"(p95 {r['plan_rerouted_1pct']['p95_ms']:.1f}), "
            f"snapshot refresh {r['observe']['median_ms']:.1f} ms; fill {r['fill_s']:.1f} s; "
            f"in CPU time: plan {r['cpu']['plan']['median_ms']:.1f} ms (p95 {r['cpu']['plan']['p95_ms']:.1f}), "
            f"with 1% re-routed {r['cpu']['plan_rerouted_1pct']['median_ms']:.1f} ms "
            f"(p95 {r['cpu']['plan_rerouted_1pct']['p95_ms']:.1f}); full collections in the timed ticks: {r['full_gc']}"
        )
    print(f"Reproduce: {command}")
    return 0

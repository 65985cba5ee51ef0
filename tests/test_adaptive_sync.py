"""The ``adaptive`` sync: one global broadcast where its estimated cost is below per-instance pulls
(a tight bound leaves most instances unable to admit at their version), per-instance pulls elsewhere;
the simulator times a broadcast load as a broadcast."""

from __future__ import annotations

from staleflow.app.simulation import simulate_system
from staleflow.protocol import StalenessManager
from staleflow.runtime.coordination.commands import Pull
from staleflow.runtime.coordination.coordinator import Coordinator
from staleflow.runtime.coordination.cost_model import CostModel
from staleflow.runtime.coordination.fleet import InstanceView
from staleflow.runtime.coordination.observations import Tick
from staleflow.runtime.coordination.sync import PullPlan, TransferCosts, plan_sync
from staleflow.runtime.run.decision import decide
from staleflow.runtime.run.group_life import GroupLife
from staleflow.runtime.servers.trajectory_server import TrajectoryServer
from staleflow.runtime.settings.policies import make_policy
from staleflow.runtime.settings.workload import NetworkSpec, load_workload
from staleflow.runtime.types import InstanceSnapshot

#: qwen3-30b-a3b-128gpu's network: 61.1 GB a version, 400 GB/s of PS egress, 25 GB/s links, 20 GB/s broadcast, 1 s load.
QWEN3 = TransferCosts(weights_gb=61.1, ps_gb_per_s=400, link_gb_per_s=25, broadcast_gb_per_s=20, load_s=1.0)
MODEL = CostModel(thr=0.0064, o_b=0.0027, o_k=1.231e-4, a_b=0.0028, a_k=3.35e-8)


def _busy_views(count: int) -> list[InstanceView]:
    views = []
    for k in range(count):
        view = InstanceView(InstanceSnapshot(f"i{k}", 0, (), (), 0, 100_000, 0.0, 0.0, False))
        for r in range(10):
            view.add(f"i{k}-r{r}", 5_000, 0)
        views.append(view)
    return views


def _trained_once(eta: int) -> StalenessManager:
    """A protocol whose version 0 batch has been consumed (version 1 pushed)."""
    manager = StalenessManager(eta, 2)
    for g in ("a", "b"):
        assert manager.reserve(g, 0)
        manager.occupy(g)
    manager.consume()
    return manager


def test_adaptive_sync_broadcasts_where_the_instances_are_stuck_and_pulls_per_instance_where_they_admit() -> None:
    views = _busy_views(64)
    tight = _trained_once(eta=0)  # version 0 admits nothing any more: every instance is stuck
    assert not tight.can_reserve(0)
    # 64 pulls sharing 400 GB/s: 64 x (1 + 61.1 / 6.25) s > 64 x (1 + 61.1 / 20) s of broadcast
    assert plan_sync("adaptive", views, 1, tight, 0.1, costs=QWEN3) == PullPlan(list(range(64)), broadcast=True)
    assert plan_sync("per_instance", views, 1, tight, 0.1, costs=QWEN3) == PullPlan([])  # busy: nobody pulls yet
    loose = _trained_once(eta=3)  # version 0 still admits: pulls one at a time over 25 GB/s links are cheaper
    assert loose.can_reserve(0)
    assert plan_sync("adaptive", views, 1, loose, 0.1, costs=QWEN3) == PullPlan([])
    # free transfers, or no costs known (a training job): per-instance pulls
    assert plan_sync("adaptive", views, 1, tight, 0.1, costs=TransferCosts()) == PullPlan([])
    assert plan_sync("adaptive", views, 1, tight, 0.1) == PullPlan([])


def test_the_coordinator_hands_out_broadcast_pulls_for_every_instance_behind() -> None:
    ts = TrajectoryServer()
    manager = _trained_once(eta=0)
    snapshots = [InstanceSnapshot(f"i{k}", 0, (), (), 90_000, 100_000, 0.0, 0.0, False) for k in range(3)]  # too full to pull
    slow_ps = TransferCosts(weights_gb=10, ps_gb_per_s=5, link_gb_per_s=5, broadcast_gb_per_s=100)
    coordinator = Coordinator(GroupLife(manager, ts), make_policy("staleflow", sync="adaptive"), MODEL, snapshots, slow_ps)
    commands = decide(coordinator, GroupLife(manager, ts), Tick(1, True, False))
    assert [c for c in commands if isinstance(c, Pull)] == [Pull(f"i{k}", 1, broadcast=True) for k in range(3)]
    assert coordinator.stats["broadcast_pulls"] == 3 and coordinator.stats["pulls"] == 0


def test_a_broadcast_load_on_a_parameter_server_link_takes_the_broadcast_time_and_no_egress() -> None:
    from staleflow.adapters.sim.network import ParameterServerLink

    link = ParameterServerLink(NetworkSpec(weights_gb=60, ps_gb_per_s=100, link_gb_per_s=25, broadcast_gb_per_s=20))
    assert link.transfer_s(0.0, broadcast=True) == 3.0
    assert link.in_flight == 0
    assert link.transfer_s(0.0) == 60 / 25


def test_a_simulated_run_at_a_tight_bound_broadcasts_where_the_network_favours_it_and_pulls_where_it_does_not() -> None:
    """The same adaptive run on two networks: a slow parameter server and a fast broadcast (pulls
    of stuck instances cost more: it broadcasts), then a fast server and links with a slow broadcast
    (it never broadcasts). Without the cost comparison it would broadcast on both."""
    base = load_workload("small-ci")
    favours_broadcast = NetworkSpec(weights_gb=10, ps_gb_per_s=5, link_gb_per_s=5, broadcast_gb_per_s=100)
    workload = base.model_copy(update={"network": favours_broadcast})
    adaptive = simulate_system(workload, "staleflow", eta=0, steps=3, seed=0, sync="adaptive")
    pulls = simulate_system(workload, "staleflow", eta=0, steps=3, seed=0)
    assert adaptive["sync_loads"]["broadcast_pulls"] > 0
    assert pulls["sync_loads"]["broadcast_pulls"] == 0 and pulls["sync_loads"]["pulls"] > 0
    assert adaptive["lost"] == adaptive["duplicated"] == 0
    assert adaptive["max_staleness"] <= 0
    favours_pulls = NetworkSpec(weights_gb=10, ps_gb_per_s=1000, link_gb_per_s=100, broadcast_gb_per_s=1)
    adaptive = simulate_system(base.model_copy(update={"network": favours_pulls}), "staleflow", eta=0, steps=3, seed=0, sync="adaptive")
    assert adaptive["sync_loads"]["broadcast_pulls"] == 0 and adaptive["sync_loads"]["pulls"] > 0, adaptive["sync_loads"]
    assert adaptive["lost"] == adaptive["duplicated"] == 0 and adaptive["max_staleness"] <= 0

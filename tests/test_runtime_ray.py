"""The run loop with the trajectory server, parameter server, engines and trainer as Ray actors."""

from __future__ import annotations

import pytest
import ray
import runtime_fakes
from runtime_fakes import FakeEngine, FakeTrainer, prompt_groups
from staleflow.adapters.ray.parameter_server import RemoteParameterServer, RemoteWeights
from staleflow.adapters.ray.placement import ActorProxy, InProcessPlacement, RayPlacement
from staleflow.runtime.coordination.cost_model import CostModel
from staleflow.runtime.run.assembly import assemble_run
from staleflow.runtime.run.clock import RealClock
from staleflow.runtime.run.loop import RunParts
from staleflow.runtime.run.run_spec import RunSpec
from staleflow.runtime.servers.trajectory_server import TrajectoryServer
from staleflow.runtime.settings.policies import make_policy


def test_in_process_placement_builds_the_part_itself():
    import collections

    placement = InProcessPlacement()
    counter = placement.place(collections.Counter, "aab")  # the arguments reach the constructor
    assert type(counter) is collections.Counter and counter.most_common(1) == [("a", 2)]
    ts = placement.place(TrajectoryServer)
    assert type(ts) is TrajectoryServer and ts.queued_count() == 0  # the part itself, not a proxy


@pytest.mark.ray
def test_loop_on_ray_actors_keeps_the_bound_and_loses_nothing(monkeypatch, ray_cluster):
    """Every part in its own actor; weights go from the parameter server's actor straight to the
    engine's: the driver only passes references (fetching one in the driver would raise here)."""
    ray.cloudpickle.register_pickle_by_value(runtime_fakes)  # workers cannot import the tests folder
    placement = RayPlacement()  # on the shared cluster (tests/conftest.py)
    try:
        clock = RealClock()  # monotonic time: the same origin in every local actor
        # one engine: each actor is a worker process, and starting one takes seconds on a loaded CPU
        engines = [placement.place(FakeEngine, "i0", clock, tokens_per_s=3000, load_s=0.005, announce_events=False)]
        trainer = placement.place(FakeTrainer, clock, 0.02)
        ts = placement.place(TrajectoryServer)
        ps = RemoteParameterServer.place(placement)

        def fetch_in_driver(self):
            raise AssertionError("the driver fetched weights")

        monkeypatch.setattr(RemoteWeights, "fetch", fetch_in_driver)  # this process only
        assert isinstance(engines[0], ActorProxy) and engines[0].instance_id == "i0"
        parts = RunParts(
            engines=engines, trainer=trainer, prompts=prompt_groups(2, lengths=(10, 20, 30)),
            cost_model=CostModel(0.0064, 0.0027, 1.231e-4, 0.0028, 3.35e-8), clock=clock,
            trajectory_server=ts, parameter_server=ps,
        )
        loop = assemble_run(RunSpec(make_policy("staleflow"), eta=1, batch_size=2, tick_s=0.005), parts)
        metrics = loop.run(3)
        assert metrics.steps == 3 and trainer.weights() == {"version": 3}
        assert ps.latest_version() == 3
        assert engines[0].loaded_weights()["version"] >= 1  # fetched by the engine's actor itself
        version, reference = ps.pull()
        assert version == 3 and isinstance(reference, RemoteWeights) and reference.version == 3
        assert metrics.max_staleness <= 1 and sum(metrics.staleness_histogram.values()) == 6
        assert metrics.audit_ok and metrics.lost == 0 and metrics.duplicated == 0
        loop.close()
    finally:
        placement.close()
    assert not placement._actors  # every actor it placed is gone (the shared cluster stays up)


@pytest.mark.ray
def test_a_parameter_server_actor_sends_versions_over_one_long_lived_group(ray_cluster):
    """Pulls from a Ray-placed transferring parameter server hand out transfer references; the
    receiver (here the driver, in a real run an engine's vLLM workers) gets every version through
    vLLM's four weight-transfer calls, over gloo, in buckets, from the server's process, on a group
    made once, whose host is the server's node IP."""
    import torch
    from staleflow.adapters.rlkit.weight_sender import TransferWeights
    from weight_receiver import GlooReceiver

    weights = {f"layer{i}.weight": torch.randn(64, 32) for i in range(5)} | {"norm.weight": torch.ones(32)}
    placement = RayPlacement()  # on the shared cluster (tests/conftest.py)
    try:
        server = RemoteParameterServer.place(placement, broadcast={"backend": "gloo", "wire_dtype": "float32", "bucket_bytes": 16 << 10})
        receiver = GlooReceiver()
        for version in (0, 1):
            server.push(version, {k: v + version for k, v in weights.items()})
            pulled, reference = server.pull()
            assert pulled == version and isinstance(reference, TransferWeights)
            if version == 0:
                reference.connect("driver", 1, receiver, backend="gloo")
            assert reference.deliver("driver", receiver) == sum(t.numel() * 4 for t in weights.values())
            assert all(torch.equal(receiver.received[k], weights[k] + version) for k in weights)
        assert receiver.groups_joined == 1 and receiver.version == "1"
        assert receiver.calls.count("init_weight_transfer_engine") == 1 and receiver.calls.count("update_weights") == 2
    finally:
        placement.close()

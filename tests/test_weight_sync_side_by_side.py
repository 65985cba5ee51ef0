"""Transfers side by side (issue 45): a Ray-placed parameter server sends one version to several
instances at once, each instance paused for its own transfer only, the version staged once, a tied
tensor sent once, and the driver's calls answered while the sends run."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from staleflow.adapters.rlkit.weight_sender import TransferParameterServer, TransferWeights
from weight_receiver import GlooReceiver, TimedReceiver


@pytest.mark.ray
def test_three_instances_pulling_one_version_are_paused_for_their_own_transfer_not_their_place_in_a_queue(ray_cluster):
    """Issue 45: the parameter server's actor ran one call at a time, so the sends of one version to
    three instances queued and instance k was paused for about k transfers. Now they run side by
    side: the last instance's pause is within 1.5x the first's, the transfers overlap in time, and
    the driver's version query is answered while they run."""
    from staleflow.adapters.ray.parameter_server import RemoteParameterServer
    from staleflow.adapters.ray.placement import RayPlacement

    # 4 chunks of 8 MiB (more than loopback's socket buffers hold): the sender keeps pace with its receiver
    weights = {f"layer{i}.weight": torch.randn(2048, 2048) for i in range(4)}
    placement = RayPlacement()  # on the shared cluster (tests/conftest.py)
    try:
        server = RemoteParameterServer.place(placement, broadcast={"backend": "gloo", "bucket_bytes": 8 << 20, "timeout_s": 120.0})
        receivers = [TimedReceiver(chunk_s=0.3) for _ in range(3)]
        server.push(1, weights)
        _, reference = server.pull(1)
        for n, receiver in enumerate(receivers):
            reference.connect(f"i{n}", 1, receiver, backend="gloo")
        update = reference.prepare()  # staged once, before any instance pauses
        sent: dict[int, int] = {}
        threads = [threading.Thread(target=lambda n=n: sent.__setitem__(n, reference.deliver(f"i{n}", receivers[n], update)))
                   for n in range(3)]
        for thread in threads:
            thread.start()
        time.sleep(0.3)
        asked = time.monotonic()
        assert server.versions() == (1,)
        answered = time.monotonic()
        for thread in threads:
            thread.join(120)
        unique = sum(t.numel() * 2 for t in weights.values())  # bf16 on the wire
        assert sent == {0: unique, 1: unique, 2: unique}
        pauses = sorted(r.finished - r.started for r in receivers)
        assert pauses[-1] <= 1.5 * pauses[0], f"pauses grow with the queue: {pauses}"
        assert max(r.started for r in receivers) < min(r.finished for r in receivers)  # all three at once
        assert answered - asked < 0.5 * min(pauses) and answered < min(r.finished for r in receivers)
        assert all(torch.equal(r.received[k], v.to(torch.bfloat16)) for r in receivers for k, v in weights.items())
    finally:
        placement.close()


def test_a_tied_tensor_is_staged_and_sent_once():
    """Issue 45: a tied embedding (``lm_head.weight`` is ``model.embed_tokens.weight``) was staged and
    sent twice (+15% bytes on Qwen2.5-1.5B). Now the bytes sent are the model's unique bytes, the
    alias is not announced (vLLM's loader ties it again), and the version is staged once for every
    instance it goes to."""
    embed = torch.randn(64, 16)
    weights = {"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(16), "lm_head.weight": embed}
    unique = (64 * 16 + 16) * 2  # bf16
    fetched: list[int] = []

    class Counted(TransferParameterServer):
        def _tensor_items(self, version: int):  # type: ignore[no-untyped-def]
            fetched.append(version)
            return super()._tensor_items(version)

    server = Counted(transfer={"backend": "gloo"}, copy_weights=lambda w: w)
    server.push(1, weights)
    receivers = {name: GlooReceiver() for name in ("i0", "i1")}
    for name, receiver in receivers.items():
        reference = TransferWeights(server, 1)
        reference.connect(name, 1, receiver, backend="gloo")
        assert reference.deliver(name, receiver) == unique
        assert sorted(receiver.received) == ["model.embed_tokens.weight", "model.norm.weight"]
        assert torch.equal(receiver.received["model.embed_tokens.weight"], embed.to(torch.bfloat16))
    assert fetched == [1]  # staged once for both instances

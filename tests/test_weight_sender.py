"""The sender's half of weight sync through vLLM's weight-transfer API, without vLLM: the host of the
group, the backend refused where it cannot run, the buckets, and one long-lived group per instance
carrying every version with the calls vLLM's trainer-side engines make."""

from __future__ import annotations

import pytest
import torch
from staleflow.adapters.rlkit.rendezvous import node_ip_address, transfer_host
from staleflow.adapters.rlkit.weight_sender import (
    TransferBackendError,
    TransferParameterServer,
    TransferSettings,
    TransferWeights,
    WeightChannel,
)
from staleflow.adapters.rlkit.wire_chunks import receive_chunks, send_chunks
from staleflow.runtime.interfaces import TransferFailedError
from staleflow.runtime.settings.config_sections import ServersConfig
from weight_receiver import GlooReceiver, StalledReceiver, delivered_or_raised


def test_the_host_of_the_group_is_the_senders_node_ip_unless_configured():
    assert transfer_host(None, node_ip="10.1.2.3") == "10.1.2.3"
    assert transfer_host("192.168.7.7", node_ip="10.1.2.3") == "192.168.7.7"


def test_a_parameter_server_opens_its_group_on_its_node_ip_not_the_loopback():
    ip = node_ip_address()
    if ip.startswith("127."):
        pytest.skip("this machine has no address but the loopback")
    info = TransferParameterServer().open_channel("i0", receivers=2)
    assert info["master_address"] == ip and info["world_size"] == 3 and info["rank_offset"] == 1


def test_a_gloo_channel_holds_its_port_from_the_moment_it_is_opened():
    """The port handed to the workers is already the group store's: no other process can take it
    before the sender joins (a probed and released port could be, and the workers then timed out)."""
    import socket

    server = TransferParameterServer()
    info = server.open_channel("i0", receivers=1)
    with socket.socket() as other, pytest.raises(OSError):
        other.bind((info["master_address"], info["master_port"]))


def test_nccl_is_refused_with_a_clear_error_where_the_sender_has_no_gpu():
    with pytest.raises(TransferBackendError, match="nccl needs a GPU in the sending process"):
        TransferSettings(backend="nccl").resolved_backend(cuda_available=False)
    assert TransferSettings(backend="auto").resolved_backend(cuda_available=False) == "gloo"
    assert TransferSettings(backend="auto").resolved_backend(cuda_available=True) == "nccl"
    assert TransferSettings(backend="nccl").resolved_backend(cuda_available=True) == "nccl"
    if not torch.cuda.is_available():
        with pytest.raises(TransferBackendError, match="nccl needs a GPU"):
            TransferParameterServer(transfer={"backend": "nccl"})


def test_an_instance_receiving_by_another_backend_is_refused_by_name():
    server = TransferParameterServer(transfer={"backend": "gloo"})
    server.push(0, {"w": torch.ones(2)})
    with pytest.raises(TransferBackendError, match="sends by gloo but instance i0's vLLM workers receive by nccl"):
        TransferWeights(server, 0).connect("i0", 1, GlooReceiver(), backend="nccl")


def test_the_config_passes_backend_and_host_to_the_parameter_server():
    servers = ServersConfig(placement="ray", weight_transfer="broadcast", transfer_backend="nccl", transfer_host="10.0.0.9")
    assert servers.broadcast_settings() == {"backend": "nccl", "host": "10.0.0.9", "wire_dtype": "bfloat16", "bucket_bytes": 64 << 20,
                                            "timeout_s": None, "link_gb_s": 1.0}
    assert TransferSettings(**servers.broadcast_settings()).host == "10.0.0.9"


def test_the_transfer_deadline_is_a_config_key_defaulting_from_the_versions_bytes_and_the_link_rate():
    """Issue 45: the deadline was a fixed 120 s with no config key, passed from the third instance on
    by a 61 GB version. Now ``servers.transfer_timeout_s`` sets it; by default it follows from the
    bytes, the transfers the sender runs at once and ``servers.transfer_link_gb_s``, with a floor."""
    from staleflow.adapters.rlkit.weight_sender import TRANSFER_DEADLINE_FLOOR_S

    def settings(**keys: object) -> TransferSettings:
        return TransferSettings(**ServersConfig(placement="ray", weight_transfer="broadcast", **keys).broadcast_settings())

    assert settings().deadline_s(10 << 20, transfers=2) == TRANSFER_DEADLINE_FLOOR_S == 30.0  # a small model: the floor
    assert settings().deadline_s(61 * 10**9, transfers=12) == pytest.approx(4 * 61 * 12)  # 61 GB to 12 instances at 1 GB/s
    assert settings(transfer_link_gb_s=25.0).deadline_s(61 * 10**9, transfers=12) == pytest.approx(4 * 61 * 12 / 25)
    assert settings(transfer_timeout_s=600.0).deadline_s(61 * 10**9, transfers=12) == 600.0
    server = TransferParameterServer(transfer=settings(transfer_timeout_s=7.0))
    server.push(0, {"w": torch.ones(4)})
    assert server.open_channel("i0", 1)["timeout_s"] == 7.0 and server.stage(0)["deadline_s"] == 7.0
    with pytest.raises(ValueError, match="transfer_timeout_s"):
        ServersConfig(placement="ray", weight_transfer="broadcast", transfer_timeout_s=-1.0)


def test_chunks_carry_mixed_dtypes_byte_for_byte_split_anywhere():
    tensors = [("a", torch.randn(3, 4)), ("b", torch.arange(5)), ("c", torch.randn(7).to(torch.bfloat16)), ("d", torch.ones(()))]
    total = sum(t.numel() * t.element_size() for _, t in tensors)  # 48 + 40 + 14 + 4
    wire: list[torch.Tensor] = []
    sent = send_chunks(iter(tensors), total, 7, lambda n: torch.empty(n, dtype=torch.uint8), lambda c: wire.append(c.clone()))
    assert sent == total and [c.numel() for c in wire] == [7] * 15 + [1]
    chunks = iter(wire)
    back = dict(receive_chunks([(n, t.dtype, tuple(t.shape)) for n, t in tensors], 7, lambda buffer: buffer.copy_(next(chunks))))
    assert all(torch.equal(back[n], t) and back[n].dtype == t.dtype for n, t in tensors)


def test_the_parameter_servers_staging_memory_is_bounded_by_the_bucket_not_the_largest_tensor():
    """Finding 5 (issue 35): a version went out in buckets of whole tensors, so a tensor larger than
    the bucket was staged whole (vLLM's packed producer: at least twice the largest tensor on the
    parameter server's GPU, about 2.2 GB for Qwen2.5-7B's embedding). Now tensors are split across
    chunks: every staging buffer the server allocates and every broadcast is within the bucket, and
    the weights arrive exact."""
    bucket = 1 << 10
    weights = {"embed.weight": torch.randn(64, 48), "norm.weight": torch.ones(48), "layer.weight": torch.randn(16, 16)}
    largest = max(t.numel() * 2 for t in weights.values())  # bf16 on the wire
    staged: list[int] = []

    def counted(size: int) -> torch.Tensor:
        staged.append(size)
        return torch.empty(size, dtype=torch.uint8)

    server = TransferParameterServer(transfer={"backend": "gloo", "bucket_bytes": bucket}, stage=counted)
    receiver = GlooReceiver()
    for version in (1, 2):
        server.push(version, {k: v * version for k, v in weights.items()})
        reference = TransferWeights(server, version)
        if version == 1:
            reference.connect("i0", 1, receiver, backend="gloo")
        reference.deliver("i0", receiver)
        assert all(torch.equal(receiver.received[k], (v * version).to(torch.bfloat16)) for k, v in weights.items())
    # gloo broadcasts the staged host copy's own chunks: no device buffer at all
    assert largest > bucket and staged == []
    # nccl copies each chunk into one device buffer of the bucket's size (the broadcast itself stood in for)
    channel = WeightChannel(TransferSettings(backend="nccl", bucket_bytes=bucket), 1, "nccl", "127.0.0.1", stage=counted)
    channel._group, wire = object(), []
    channel._broadcast = lambda chunk, deadline: wire.append(chunk.clone())  # type: ignore[method-assign]
    version = server._staged_version(2)
    assert channel.send(version, 10.0) == version.nbytes and staged == [bucket]
    assert torch.equal(torch.cat(wire), version.buffer) and max(c.numel() for c in wire) == bucket
    channel._group = None  # (no communicator to abort)
    channel.close()
    assert max(receiver.broadcast_bytes) == bucket and sum(receiver.broadcast_bytes) == 2 * sum(t.numel() * 2 for t in weights.values())


def test_an_nccl_channel_holds_its_rendezvous_port_from_the_moment_it_is_opened():
    """Finding 6 (issue 35): the NCCL rendezvous port was chosen by binding a probe and releasing it,
    so another process could take it before vLLM's group store bound it. Now the channel listens on
    it from the start (the store takes the socket over) and releases it when closed."""
    import socket

    channel = WeightChannel(TransferSettings(backend="nccl"), receivers=1, backend="nccl", host="127.0.0.1")
    assert channel.init_info()["master_port"] == channel.port
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", channel.port))
    channel.close()
    with socket.socket() as other:
        other.bind(("127.0.0.1", channel.port))


@pytest.mark.parametrize("failure", ["dies", "hangs"])
def test_a_receiver_failing_mid_transfer_cannot_hold_the_sender_or_the_server(failure):
    """Finding 6 (issue 35): a failed transfer left the sender in its broadcast with no deadline (and
    a hung receiver held the pull forever), the parameter server's single thread behind it. Now both
    sides give up by the deadline, the instance's group is torn down, the server answers its next
    calls, and the next pull makes a new group that carries the next version exactly."""
    weights = {f"layer{i}.weight": torch.randn(32, 32) for i in range(4)}
    server = TransferParameterServer(transfer={"backend": "gloo", "bucket_bytes": 1 << 10, "timeout_s": 2.0})
    server.push(1, weights)
    stalled = StalledReceiver(failure)
    TransferWeights(server, 1).connect("i0", 1, stalled, backend="gloo")
    outcome = delivered_or_raised(TransferWeights(server, 1), "i0", stalled, wait_s=60)
    assert isinstance(outcome, TransferFailedError) and "sending version 1 to i0" in str(outcome)
    assert 0 < stalled.chunks_received < 8 and not server.channel_open("i0")  # it stopped mid-transfer (8 chunks)
    server.push(2, {k: v * 2 for k, v in weights.items()})
    assert server.pull(2)[0] == 2
    fresh = GlooReceiver()
    TransferWeights(server, 2).connect("i0", 1, fresh, backend="gloo")
    assert TransferWeights(server, 2).deliver("i0", fresh) == sum(t.numel() * 2 for t in weights.values())
    assert all(torch.equal(fresh.received[k], (v * 2).to(torch.bfloat16)) for k, v in weights.items())
    stalled.release.set()


def test_every_version_goes_over_one_long_lived_group_with_vllms_calls():
    weights = {f"layer{i}.weight": torch.randn(64, 32) for i in range(5)} | {"norm.weight": torch.ones(32)}
    server = TransferParameterServer(transfer={"backend": "gloo", "wire_dtype": "bfloat16", "bucket_bytes": 16 << 10})
    receiver = GlooReceiver()
    for version in (1, 2, 3):
        server.push(version, {k: v * version for k, v in weights.items()})
        reference = TransferWeights(server, version)
        if version == 1:
            reference.connect("i0", 1, receiver, backend="gloo")
        sent = reference.deliver("i0", receiver)
        assert sent == sum(t.numel() * 2 for t in weights.values())  # bf16 on the wire
        assert receiver.version == str(version)
        assert all(torch.equal(receiver.received[k], (v * version).to(torch.bfloat16)) for k, v in weights.items())
    assert server.channels_opened == 1 and receiver.groups_joined == 1
    assert receiver.calls == ["init_weight_transfer_engine"] + ["start_weight_update", "update_weights", "finish_weight_update"] * 3
    with pytest.raises(TransferFailedError, match="no weight channel is open for instance 'i1'"):
        TransferWeights(server, 3).deliver("i1", GlooReceiver())


def test_a_version_published_in_buckets_is_staged_bucket_by_bucket_once_never_fetched_whole():
    """Finding 8 (issue 24): a version a trainer published as buckets in Ray's object store was fetched
    whole into the parameter server's process before it was sent (a full copy per version there).
    Now its specs size the staged copy and its buckets are fetched one at a time into it, once."""
    from staleflow.adapters.ray.object_weights import ObjectStoreWeights

    weights = {f"layer{i}.weight": torch.randn(64, 32).to(torch.bfloat16) for i in range(6)} | {"step": torch.arange(3)}
    stored = [dict(list(weights.items())[:3]), dict(list(weights.items())[3:])]
    fetched: list[int] = []

    class Buckets(ObjectStoreWeights):  # the object store stood in for by a list; whole fetches refused
        def _get(self, ref):  # type: ignore[no-untyped-def]
            fetched.append(ref)
            return stored[ref]

        def fetch(self):  # type: ignore[no-untyped-def]
            raise AssertionError("the parameter server fetched the whole version")

    specs = [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in weights.items()]
    transfer = {"backend": "gloo", "wire_dtype": "bfloat16", "bucket_bytes": 8 << 10}
    server = TransferParameterServer(transfer=transfer, copy_weights=lambda w: w)
    server.push(1, Buckets([0, 1], 1, specs))
    for name in ("i0", "i1"):  # issue 45: fetched again for every instance before; now staged once for both
        receiver = GlooReceiver()
        reference = TransferWeights(server, 1)
        reference.connect(name, 1, receiver, backend="gloo")
        sent = reference.deliver(name, receiver)
        assert sent == sum(t.numel() * t.element_size() for t in weights.values())
        assert receiver.received.keys() == weights.keys() and all(torch.equal(receiver.received[k], v) for k, v in weights.items())
    assert fetched == [0, 1]  # each bucket once, in order


def test_bad_transfer_settings_and_a_pull_that_fails_are_named() -> None:
    import time

    from staleflow.adapters.rlkit.weight_sender import wait_until, wire_dtype

    with pytest.raises(TransferBackendError, match="weight-transfer backend must be auto, gloo or nccl, got 'mpi'"):
        TransferSettings(backend="mpi").resolved_backend(cuda_available=False)
    with pytest.raises(ValueError, match="wire dtype must be one of .*, got 'int4'"):
        wire_dtype("int4")
    with pytest.raises(TimeoutError, match="an NCCL broadcast did not complete before its deadline"):
        wait_until(lambda: False, time.monotonic() + 0.01, "an NCCL broadcast")

    class Unreachable:
        def pull(self, version: int) -> None:
            raise ConnectionError("the parameter server's actor died")

    with pytest.raises(TransferFailedError, match="pull of version 4: the parameter server's actor died"):
        TransferWeights(Unreachable(), 4).fetch()


def test_a_version_held_by_reference_is_fetched_once_for_every_instance_it_is_sent_to() -> None:
    """A version pushed as a reference to weights elsewhere (not buckets) is fetched whole at its first
    send and kept for the next instances; a newer version replaces it."""
    weights = {"layer.weight": torch.randn(8, 4), "norm.weight": torch.ones(4)}
    fetches: list[int] = []

    class Elsewhere:
        def __init__(self, version: int) -> None:
            self.version = version

        def fetch(self) -> dict[str, torch.Tensor]:
            fetches.append(self.version)
            return {k: v * self.version for k, v in weights.items()}

    server = TransferParameterServer(transfer={"backend": "gloo", "wire_dtype": "float32"}, copy_weights=lambda w: w)
    receivers = {name: GlooReceiver() for name in ("i0", "i1")}
    for version in (1, 2):
        server.push(version, Elsewhere(version))
        for name, receiver in receivers.items():
            reference = TransferWeights(server, version)
            if version == 1:
                reference.connect(name, 1, receiver, backend="gloo")
            assert reference.deliver(name, receiver) == sum(t.numel() * 4 for t in weights.values())
            assert all(torch.equal(receiver.received[k], v * version) for k, v in weights.items())
    assert fetches == [1, 2]

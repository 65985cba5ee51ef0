"""The sender's half of weight sync through vLLM's weight-transfer API, without vLLM: the host of the
group, the backend refused where it cannot run, the buckets, and one long-lived group per instance
carrying every version with the calls vLLM's trainer-side engines make."""

from __future__ import annotations

import pytest
import torch
from staleflow.adapters.rlkit.weight_sender import (
    TransferBackendError,
    TransferParameterServer,
    TransferSettings,
    TransferWeights,
    bucket_sizes,
    node_ip_address,
    pack_bucket,
    transfer_host,
    unpack_bucket,
)
from staleflow.runtime.interfaces import TransferFailedError
from staleflow.runtime.settings.config_sections import ServersConfig
from weight_receiver import GlooReceiver


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
    assert servers.broadcast_settings() == {"backend": "nccl", "host": "10.0.0.9", "wire_dtype": "bfloat16", "bucket_bytes": 64 << 20}
    assert TransferSettings(**servers.broadcast_settings()).host == "10.0.0.9"


def test_buckets_carry_mixed_dtypes_byte_for_byte():
    tensors = [("a", torch.randn(3, 4)), ("b", torch.arange(5)), ("c", torch.randn(7).to(torch.bfloat16))]
    flat = pack_bucket([t for _, t in tensors])
    back = dict(unpack_bucket(flat, [(n, t.dtype, tuple(t.shape)) for n, t in tensors]))
    assert all(torch.equal(back[n], t) for n, t in tensors)
    assert bucket_sizes(tensors, bucket_bytes=56) == [1, 2]  # 48 bytes, then 40 + 14


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


def test_a_version_published_in_buckets_is_sent_bucket_by_bucket_never_fetched_whole():
    """Finding 8 (issue 24): a version a trainer published as buckets in Ray's object store was fetched
    whole into the parameter server's process before it was sent (a full copy per version there).
    Now its specs announce the update and its buckets are fetched one at a time as they are sent."""
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
    receiver = GlooReceiver()
    reference = TransferWeights(server, 1)
    reference.connect("i0", 1, receiver, backend="gloo")
    sent = reference.deliver("i0", receiver)
    assert fetched == [0, 1]  # each bucket once, in order, while sending
    assert sent == sum(t.numel() * t.element_size() for t in weights.values())
    assert receiver.received.keys() == weights.keys() and all(torch.equal(receiver.received[k], v) for k, v in weights.items())

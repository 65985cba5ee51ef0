"""The sender's half of weight sync through vLLM's weight-transfer API: a parameter server that
sends a version to one rollout instance over a long-lived group, and the reference a pull hands out.

Each rollout instance gets one group, made on its first pull and kept for every later one: rank 0 is
the sender (the parameter server's process, which must hold a GPU for ``nccl``), ranks 1.. are the
instance's vLLM workers. The rendezvous host is the sender's node address (Ray's node IP), never the
loopback address of whoever reads it, unless configured. A pull of version ``v``
(:meth:`TransferWeights.deliver`) makes the calls vLLM's trainer-side engines make, through the
instance's ``VLLMWeightSyncClient``: ``init_weight_transfer_engine`` (first pull only),
``start_weight_update``, ``update_weights`` (while the sender broadcasts), then
``finish_weight_update(weight_version=str(v))``. The receiving half is vLLM's (see
:mod:`staleflow.adapters.vllm.weight_transfer`).

Transports: ``nccl`` sends with vLLM's packed producer (``vllm.distributed.weight_transfer.packed_tensor``)
over vLLM's stateless NCCL group, which vLLM's ``nccl`` worker engine receives; ``gloo`` sends buckets
of raw bytes (:func:`pack_bucket`) that the ``gloo`` worker engine receives.
"""

from __future__ import annotations

import datetime
import socket
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from staleflow.adapters.rlkit.bucketed_publish import fill_buckets
from staleflow.runtime.interfaces import TransferFailedError, WeightsReference, resolve_weights
from staleflow.runtime.servers.parameter_server import ParameterServer

BACKENDS = ("gloo", "nccl")
WIRE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
PACKED_NUM_BUFFERS = 2  # vLLM's packed NCCL transfer: buffers in flight


class TransferBackendError(ValueError):
    """A weight-transfer backend that cannot run where it was asked to (e.g. ``nccl`` without a GPU)."""


@dataclass(frozen=True)
class TransferSettings:
    """How versions move: ``backend`` (``auto``: ``nccl`` where the sender sees a GPU, else ``gloo``),
    ``host`` (the rendezvous address; None: the sender's node IP), the wire dtype and bucket size."""

    backend: str = "auto"
    host: str | None = None
    wire_dtype: str = "bfloat16"
    bucket_bytes: int = 64 << 20
    timeout_s: float = 120.0

    def resolved_backend(self, cuda_available: bool | None = None) -> str:
        """The backend this process sends with; :class:`TransferBackendError` on a bad combination."""
        cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
        if self.backend == "auto":
            return "nccl" if cuda else "gloo"
        if self.backend not in BACKENDS:
            raise TransferBackendError(f"weight-transfer backend must be auto, gloo or nccl, got {self.backend!r}")
        if self.backend == "nccl" and not cuda:
            raise TransferBackendError(
                "servers.transfer_backend=nccl needs a GPU in the sending process (the parameter server's), and it "
                "sees none: give the parameter server a GPU, or use gloo (CPU memory and TCP)"
            )
        return self.backend


def node_ip_address() -> str:
    """This node's address as other nodes reach it: Ray's node IP inside a Ray process, else the
    address of the interface that routes outwards (no packet is sent), else the loopback address."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("10.255.255.255", 1))
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def transfer_host(configured: str | None, node_ip: str | None = None) -> str:
    """The rendezvous host of a sender: ``configured`` if given, else its node's IP."""
    if configured:
        return configured
    return node_ip if node_ip is not None else node_ip_address()


# ------------------------------------------------------------------------------------ buckets
def bucket_bytes_of(specs: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]) -> int:
    return sum(torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size() for _, dtype, shape in specs)


def pack_bucket(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes, one after another, as one uint8 tensor (what a gloo bucket carries)."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def unpack_bucket(flat: torch.Tensor, specs: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of each spec ``(name, dtype, shape)``, read in order from ``flat``'s bytes."""
    offset = 0
    for name, dtype, shape in specs:
        size = bucket_bytes_of([(name, dtype, shape)])
        yield name, flat[offset : offset + size].view(dtype).view(shape)
        offset += size


def receive_buckets(group: Any, names: Sequence[str], dtype_names: Sequence[str], shapes: Sequence[Sequence[int]],
                    bucket_sizes: Sequence[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """The receiving side of a gloo bucketed broadcast from rank 0 of ``group``: ``(name, tensor)``
    of each announced tensor, bucket by bucket (a tensor is a view of its bucket's buffer)."""
    import torch.distributed as dist

    specs = [(n, getattr(torch, d), tuple(s)) for n, d, s in zip(names, dtype_names, shapes)]
    start = 0
    for count in bucket_sizes:
        bucket = specs[start : start + count]
        start += count
        flat = torch.empty(bucket_bytes_of(bucket), dtype=torch.uint8)
        options = dist.BroadcastOptions()
        options.rootRank = 0
        group.broadcast([flat], options).wait()
        yield from unpack_bucket(flat, bucket)


def wire_tensors(tensors: Iterable[tuple[str, torch.Tensor]], wire_dtype: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The floating-point tensors in ``wire_dtype`` (others as they are), in order, one at a time."""
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"wire dtype must be one of {', '.join(WIRE_DTYPES)}, got {wire_dtype!r}")
    wire = WIRE_DTYPES[wire_dtype]
    return ((name, t.to(wire) if t.is_floating_point() else t) for name, t in tensors)


def bucket_sizes(tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[int]:
    """How many tensors each bucket of at most ``bucket_bytes`` holds (a larger tensor: its own)."""
    return [len(bucket) for bucket in fill_buckets(tensors, bucket_bytes)]


@runtime_checkable
class BucketedWeights(Protocol):
    """A version stored as buckets somewhere else (Ray's object store: ``ObjectStoreWeights``) that
    can be sent without fetching it whole: its tensors' specs, and its buckets one at a time."""

    def tensor_specs(self) -> list[tuple[str, str, tuple[int, ...]]]: ...

    def buckets(self) -> Iterator[dict[str, Any]]: ...


# ------------------------------------------------------------------------------------ the channel
class WeightChannel:
    """The sender's end of one instance's long-lived group (rank 0 of ``1 + receivers``)."""

    def __init__(self, settings: TransferSettings, receivers: int, backend: str, host: str) -> None:
        self.settings = settings
        self.backend = backend
        self.host = host
        self.world_size = 1 + receivers
        self._group: Any = None
        self._store: Any = None
        if backend == "gloo":
            import torch.distributed as dist

            # The group's store listens from now on, on a port the OS chose: a port probed and released
            # could be taken by another process before the store bound it (the workers then time out).
            self._store = dist.TCPStore(host, 0, self.world_size, True, timeout=datetime.timedelta(seconds=settings.timeout_s),
                                        wait_for_workers=False)
            self.port = int(self._store.port)
        else:  # vLLM's trainer_init makes the store itself, on the port it is given
            self.port = _free_port(host)

    def init_info(self) -> dict[str, Any]:
        """What every worker's ``init_weight_transfer_engine`` takes (plain data), and ``backend``."""
        common = {"master_address": self.host, "master_port": self.port, "world_size": self.world_size, "rank_offset": 1}
        if self.backend == "nccl":
            return {"backend": "nccl", **common, "packed": True, "packed_buffer_size_bytes": self.settings.bucket_bytes,
                    "packed_num_buffers": PACKED_NUM_BUFFERS}
        return {"backend": "gloo", **common, "timeout_s": self.settings.timeout_s}

    def join(self) -> None:
        """Make the group (blocks until every worker has joined)."""
        if self.backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_common import trainer_init

            self._group = trainer_init({"master_address": self.host, "master_port": self.port, "world_size": self.world_size})
            return
        import torch.distributed as dist

        self._group = dist.ProcessGroupGloo(self._store, 0, self.world_size, datetime.timedelta(seconds=self.settings.timeout_s))

    def update_info(self, weights: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """What every worker's ``update_weights`` takes for ``weights`` (names, dtypes, shapes; the
        values may be meta tensors)."""
        tensors = list(wire_tensors(_shapes_only(weights).items(), self.settings.wire_dtype))
        info: dict[str, Any] = {
            "names": [n for n, _ in tensors],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors],
        }
        if self.backend == "gloo":
            info["bucket_sizes"] = bucket_sizes(tensors, self.settings.bucket_bytes)
        return info

    def send(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Broadcast the ``(name, tensor)`` pairs (rank 0), consumed one at a time in the order
        :meth:`update_info` announced; returns the bytes sent."""
        if self._group is None:
            raise RuntimeError("join() the channel first")
        sent = 0

        def counted(stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal sent
            for name, tensor in stream:
                sent += tensor.numel() * tensor.element_size()
                yield name, tensor

        stream = counted(wire_tensors(tensors, self.settings.wire_dtype))
        if self.backend == "nccl":
            from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

            packed_nccl_broadcast_producer(
                iterator=((n, t.cuda()) for n, t in stream), group=self._group, src=0, post_iter_func=lambda item: item[1],
                buffer_size_bytes=self.settings.bucket_bytes, num_buffers=PACKED_NUM_BUFFERS,
            )
            torch.cuda.current_stream().synchronize()
            return sent
        import torch.distributed as dist

        for bucket in fill_buckets(stream, self.settings.bucket_bytes):
            flat = pack_bucket(list(bucket.values()))
            options = dist.BroadcastOptions()
            options.rootRank = 0
            self._group.broadcast([flat], options).wait()
        return sent

    def close(self) -> None:
        if self.backend == "nccl" and self._group is not None:
            self._group.destroy()
        self._group = self._store = None


def _shapes_only(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Empty tensors of the weights' shapes and dtypes (metadata without copying the values)."""
    return {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in weights.items()}


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


# ------------------------------------------------------------------------------------ the server
class TransferParameterServer(ParameterServer):
    """A parameter server that also sends a version to an instance over that instance's long-lived
    group (it runs where the weights are). A version pushed as buckets elsewhere
    (:class:`BucketedWeights`: a trainer rank's buckets in Ray's object store) is sent bucket by
    bucket as each is fetched, never whole in this process; another reference is fetched whole for
    its first send and the newest one fetched is kept for the next ones. ``channels_opened`` counts
    the groups made."""

    def __init__(self, *args: Any, transfer: TransferSettings | Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.transfer = transfer if isinstance(transfer, TransferSettings) else TransferSettings(**(transfer or {}))
        self.backend = self.transfer.resolved_backend()  # a bad combination fails when the server starts
        self.channels_opened = 0
        self._channels: dict[str, WeightChannel] = {}
        self._fetched: tuple[int, Mapping[str, torch.Tensor]] | None = None
        self._fetch_lock = threading.Lock()

    def _weights(self, version: int) -> Mapping[str, torch.Tensor]:
        version, stored = self.pull(version)
        if not isinstance(stored, WeightsReference):
            return stored  # type: ignore[no-any-return]
        with self._fetch_lock:
            if self._fetched is None or self._fetched[0] != version:
                self._fetched = (version, resolve_weights(stored))
            return self._fetched[1]

    def open_channel(self, instance_id: str, receivers: int) -> dict[str, Any]:
        """A new group for ``instance_id`` (replacing its old one: a restarted instance); its init info."""
        if (old := self._channels.pop(instance_id, None)) is not None:
            old.close()
        channel = WeightChannel(self.transfer, receivers, self.backend, transfer_host(self.transfer.host))
        self._channels[instance_id] = channel
        self.channels_opened += 1
        return channel.init_info()

    def join_channel(self, instance_id: str) -> None:
        self._channel(instance_id).join()

    def update_info(self, instance_id: str, version: int) -> dict[str, Any]:
        stored = self.pull(version)[1]
        if isinstance(stored, BucketedWeights):
            specs = stored.tensor_specs()
            return self._channel(instance_id).update_info({n: torch.empty(s, dtype=getattr(torch, d), device="meta") for n, d, s in specs})
        return self._channel(instance_id).update_info(self._weights(version))

    def send(self, instance_id: str, version: int) -> int:
        """Broadcast ``version`` to ``instance_id``'s workers; the bytes sent once they have it."""
        stored = self.pull(version)[1]
        if isinstance(stored, BucketedWeights):
            return self._channel(instance_id).send(item for bucket in stored.buckets() for item in bucket.items())
        return self._channel(instance_id).send(self._weights(version).items())

    def _channel(self, instance_id: str) -> WeightChannel:
        if instance_id not in self._channels:
            raise TransferFailedError(f"no weight channel is open for instance {instance_id!r}")
        return self._channels[instance_id]


class WeightSyncClient(Protocol):
    """vLLM's ``VLLMWeightSyncClient``: the four control-plane calls of one inference engine."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any]) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


class TransferWeights:
    """A reference to a version that moves through vLLM's weight-transfer API into the instance that
    loads it. ``server`` is a :class:`TransferParameterServer` or a proxy of one in another process.
    :meth:`fetch` gives the whole state dict instead, for engines that cannot receive a transfer."""

    def __init__(self, server: Any, version: int) -> None:
        self._server = server
        self.version = version

    def fetch(self) -> Any:
        try:
            return self._server.pull(self.version)[1]
        except ConnectionError as error:
            raise TransferFailedError(f"pull of version {self.version}: {error}") from error

    def connect(self, instance_id: str, receivers: int, client: WeightSyncClient, backend: str) -> None:
        """Make ``instance_id``'s long-lived group: the server opens it, the instance's ``receivers``
        workers join it (``init_weight_transfer_engine``). ``backend``: the one the instance's vLLM
        workers were built with; a different one on the server is refused."""
        info = self._server.open_channel(instance_id, receivers)
        sending = info.pop("backend")
        if sending != backend:
            raise TransferBackendError(
                f"the parameter server sends by {sending} but instance {instance_id}'s vLLM workers receive by {backend} "
                "(servers.transfer_backend must match the instances' devices: nccl for GPU instances, gloo for CPU ones)"
            )
        _together(lambda: self._server.join_channel(instance_id), lambda: client.init_weight_transfer_engine(info),
                  f"joining the weight channel of {instance_id}")

    def deliver(self, instance_id: str, client: WeightSyncClient) -> int:
        """Send this version over ``instance_id``'s group (made by :meth:`connect`) and finish the
        update with it as the weight version; returns the bytes sent."""
        update = self._server.update_info(instance_id, self.version)
        client.start_weight_update()
        sent = _together(lambda: self._server.send(instance_id, self.version), lambda: client.update_weights(update),
                         f"sending version {self.version} to {instance_id}")
        client.finish_weight_update(weight_version=str(self.version))
        return int(sent)

    def __repr__(self) -> str:
        return f"TransferWeights(version={self.version})"


def _together(sender: Any, receiver: Any, what: str) -> Any:
    """Run ``sender`` in a thread while ``receiver`` runs here (both meet in one collective); the
    sender's result, or :class:`TransferFailedError` with the first error."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(sender())
        except Exception as error:  # noqa: BLE001 - reported below
            outcome.append(error)

    thread = threading.Thread(target=run, name=what, daemon=True)
    thread.start()
    try:
        receiver()
    except Exception as error:  # the sender may wait in the collective until its timeout: not joined
        raise TransferFailedError(f"{what} failed on the receiving side: {error}") from error
    thread.join()
    result = outcome[0] if outcome else TransferFailedError("the sender ended without a result")
    if isinstance(result, BaseException):
        raise TransferFailedError(f"{what} failed on the sending side: {result}") from result
    return result



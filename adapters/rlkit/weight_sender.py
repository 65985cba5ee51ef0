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

Transports: both send the same chunks (:mod:`~staleflow.adapters.rlkit.wire_chunks`: the tensors'
bytes cut into chunks of at most the bucket size, a larger tensor split across chunks, staged in one
buffer), ``nccl`` over vLLM's stateless NCCL group from a GPU buffer, ``gloo`` over a gloo group from
a CPU one; the worker engines of :mod:`staleflow.adapters.vllm.weight_transfer` receive them.

A failed or stuck transfer: the sender gives up by ``timeout_s`` after it began (NCCL: its
broadcasts waited for until then), the server tears the instance's group down (an NCCL group is
unusable after a failed broadcast) and answers its next call; the instance side waits for both
halves no longer than that (and a little grace) and raises :class:`TransferFailedError`, which the
run loop handles as a lost instance (its requests re-queued); its next pull makes a new group.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from staleflow.adapters.rlkit.weight_checksum import VersionReferences
from staleflow.adapters.rlkit.wire_chunks import Spec, nbytes, receive_chunks, send_chunks
from staleflow.runtime.interfaces import TransferFailedError, WeightsReference, resolve_weights
from staleflow.runtime.servers.parameter_server import ParameterServer, VersionNotAvailableError

BACKENDS = ("gloo", "nccl")
WIRE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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


# ------------------------------------------------------------------------------------ the wire
def wire_tensors(tensors: Iterable[tuple[str, torch.Tensor]], wire_dtype: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The floating-point tensors in ``wire_dtype`` (others as they are), in order, one at a time."""
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"wire dtype must be one of {', '.join(WIRE_DTYPES)}, got {wire_dtype!r}")
    wire = WIRE_DTYPES[wire_dtype]
    return ((name, t.to(wire) if t.is_floating_point() else t) for name, t in tensors)


def wire_specs(weights: Mapping[str, torch.Tensor], wire_dtype: str) -> list[Spec]:
    """``(name, dtype, shape)`` of each tensor as it travels (``wire_dtype`` for floating point);
    the values may be meta tensors."""
    meta = ((n, torch.empty(t.shape, dtype=t.dtype, device="meta")) for n, t in weights.items())
    return [(n, t.dtype, tuple(t.shape)) for n, t in wire_tensors(meta, wire_dtype)]


def wait_until(ready: Callable[[], bool], deadline: float, what: str) -> None:
    """Return once ``ready()``; TimeoutError naming ``what`` if ``time.monotonic()`` passes ``deadline`` first."""
    while not ready():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} did not complete before its deadline")
        time.sleep(0.001)


def received_specs(names: Sequence[str], dtype_names: Sequence[str], shapes: Sequence[Sequence[int]]) -> list[Spec]:
    """The specs of an update as announced (:meth:`WeightChannel.update_info`'s three lists)."""
    return [(n, getattr(torch, d), tuple(s)) for n, d, s in zip(names, dtype_names, shapes, strict=True)]


def receive_gloo(group: Any, specs: Sequence[Spec], bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The receiving side of a gloo transfer from rank 0 of ``group``: ``(name, tensor)`` of each
    announced tensor, chunk by chunk (:func:`~staleflow.adapters.rlkit.wire_chunks.receive_chunks`)."""
    import torch.distributed as dist

    def receive(buffer: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        group.broadcast([buffer], options).wait()

    return receive_chunks(specs, bucket_bytes, receive)


@runtime_checkable
class BucketedWeights(Protocol):
    """A version stored as buckets somewhere else (Ray's object store: ``ObjectStoreWeights``) that
    can be sent without fetching it whole: its tensors' specs, and its buckets one at a time."""

    def tensor_specs(self) -> list[tuple[str, str, tuple[int, ...]]]: ...

    def buckets(self) -> Iterator[dict[str, Any]]: ...


# ------------------------------------------------------------------------------------ the channel
class WeightChannel:
    """The sender's end of one instance's long-lived group (rank 0 of ``1 + receivers``). Its
    rendezvous port is bound from the moment the channel is made (a port probed and released could
    be taken by another process before the group bound it; the workers then time out). A transfer
    stages its chunks (:mod:`~staleflow.adapters.rlkit.wire_chunks`) in one buffer from ``stage``
    (default: on the sending device) and ends by ``settings.timeout_s`` after it began, done or not:
    a receiver that died or hangs cannot hold the sender (and so the parameter server) in a
    broadcast. After a failed transfer the group is unusable: :meth:`close` it."""

    def __init__(self, settings: TransferSettings, receivers: int, backend: str, host: str,
                 stage: Callable[[int], torch.Tensor] | None = None) -> None:
        self.settings = settings
        self.backend = backend
        self.host = host
        self.world_size = 1 + receivers
        self._stage = stage or self._device_buffer
        self._group: Any = None
        self._store: Any = None
        self._listen: socket.socket | None = None
        if backend == "gloo":
            import torch.distributed as dist

            # The group's store listens from now on, on a port the OS chose.
            self._store = dist.TCPStore(host, 0, self.world_size, True, timeout=datetime.timedelta(seconds=settings.timeout_s),
                                        wait_for_workers=False)
            self.port = int(self._store.port)
        else:  # vLLM's group store takes this listening socket over when the group is made
            self._listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._listen.bind((host, 0))
            self._listen.listen()
            self.port = int(self._listen.getsockname()[1])

    def init_info(self) -> dict[str, Any]:
        """What every worker's ``init_weight_transfer_engine`` takes (plain data), and ``backend``."""
        common = {"master_address": self.host, "master_port": self.port, "world_size": self.world_size, "rank_offset": 1}
        if self.backend == "nccl":
            return {"backend": "nccl", **common, "packed": True, "packed_buffer_size_bytes": self.settings.bucket_bytes}
        return {"backend": "gloo", **common, "timeout_s": self.settings.timeout_s, "bucket_bytes": self.settings.bucket_bytes}

    def join(self) -> None:
        """Make the group (blocks until every worker has joined)."""
        if self.backend == "nccl":
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup
            from vllm.utils.nccl import unpinned_nccl_env

            listen, self._listen = self._listen, None
            rendezvous = StatelessProcessGroup.create(self.host, self.port, 0, self.world_size,
                                                      store_timeout=int(self.settings.timeout_s), listen_socket=listen)
            with unpinned_nccl_env():
                self._group = PyNcclCommunicator(rendezvous, device=torch.cuda.current_device())
            return
        import torch.distributed as dist

        self._group = dist.ProcessGroupGloo(self._store, 0, self.world_size, datetime.timedelta(seconds=self.settings.timeout_s))

    def update_info(self, weights: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """What every worker's ``update_weights`` takes for ``weights`` (names, dtypes, shapes; the
        values may be meta tensors)."""
        specs = wire_specs(weights, self.settings.wire_dtype)
        return {"names": [n for n, _, _ in specs], "dtype_names": [str(d).removeprefix("torch.") for _, d, _ in specs],
                "shapes": [list(s) for _, _, s in specs]}

    def send(self, tensors: Iterable[tuple[str, torch.Tensor]], specs: Sequence[Spec]) -> int:
        """Broadcast the ``(name, tensor)`` pairs (rank 0), consumed one at a time in the order of
        ``specs`` (:meth:`update_info`'s), by ``settings.timeout_s`` from now (TimeoutError, or the
        transport's error, after it); returns the bytes sent."""
        if self._group is None:
            raise RuntimeError("join() the channel first")
        deadline = time.monotonic() + self.settings.timeout_s
        total = sum(nbytes(dtype, shape) for _, dtype, shape in specs)
        return send_chunks(wire_tensors(tensors, self.settings.wire_dtype), total, self.settings.bucket_bytes,
                           self._stage, lambda chunk: self._broadcast(chunk, deadline))

    def _broadcast(self, chunk: torch.Tensor, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"the transfer did not complete within {self.settings.timeout_s} s")
        if self.backend == "nccl":  # enqueued on the stream; its completion waited for until the deadline
            self._group.broadcast(chunk, src=0, stream=torch.cuda.current_stream())
            done = torch.cuda.Event()
            done.record()
            wait_until(done.query, deadline, "an NCCL broadcast")
            return
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.timeout = datetime.timedelta(seconds=remaining)
        self._group.broadcast([chunk], options).wait()

    def _device_buffer(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8, device="cuda" if self.backend == "nccl" else "cpu")

    def close(self) -> None:
        """Tear the group down (NCCL: the communicator aborted, which ends a broadcast still in
        flight) and release the port."""
        if self.backend == "nccl" and self._group is not None:
            self._group.destroy()
        if self._listen is not None:
            self._listen.close()
        self._group = self._store = self._listen = None


# ------------------------------------------------------------------------------------ the server
class TransferParameterServer(ParameterServer):
    """A parameter server that also sends a version to an instance over that instance's long-lived
    group (it runs where the weights are). A version pushed as buckets elsewhere
    (:class:`BucketedWeights`: a trainer rank's buckets in Ray's object store) is sent bucket by
    bucket as each is fetched, never whole in this process; another reference is fetched whole for
    its first send and the newest one fetched is kept for the next ones. ``channels_opened`` counts
    the groups made."""

    def __init__(self, *args: Any, transfer: TransferSettings | Mapping[str, Any] | None = None,
                 stage: Callable[[int], torch.Tensor] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stage = stage  # the staging buffers' allocator (None: on the sending device)
        self.transfer = transfer if isinstance(transfer, TransferSettings) else TransferSettings(**(transfer or {}))
        self.backend = self.transfer.resolved_backend()  # a bad combination fails when the server starts
        self.channels_opened = 0
        self._channels: dict[str, WeightChannel] = {}
        self._fetched: tuple[int, Mapping[str, torch.Tensor]] | None = None
        self._fetch_lock = threading.Lock()
        self._references = VersionReferences(lambda version: wire_tensors(self._tensor_items(version), self.transfer.wire_dtype))

    def push(self, version: int, weights: Any) -> None:
        super().push(version, weights)
        self._references.prepare(version, self.versions())  # the weight check's, computed in the background

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
        channel = WeightChannel(self.transfer, receivers, self.backend, transfer_host(self.transfer.host), stage=self._stage)
        self._channels[instance_id] = channel
        self.channels_opened += 1
        return {**channel.init_info(), "deadline_s": self.transfer.timeout_s}

    def join_channel(self, instance_id: str) -> None:
        self._guarded(instance_id, "joining the group", lambda channel: channel.join())

    def update_info(self, instance_id: str, version: int) -> dict[str, Any]:
        """What ``instance_id``'s workers' ``update_weights`` takes for ``version``, and
        ``deadline_s``: how long the instance waits for the transfer."""
        info = self._channel(instance_id).update_info(self._meta(version))
        return {**info, "deadline_s": self.transfer.timeout_s}

    def send(self, instance_id: str, version: int) -> int:
        """Broadcast ``version`` to ``instance_id``'s workers; the bytes sent once they have it. A
        transfer that fails or passes its deadline tears the group down and raises
        :class:`TransferFailedError`."""
        tensors = self._tensor_items(version)
        specs = wire_specs(self._meta(version), self.transfer.wire_dtype)
        return int(self._guarded(instance_id, f"sending version {version}", lambda channel: channel.send(tensors, specs)))

    def weight_mismatches(self, version: int, ranks: Sequence[Mapping[str, Any]], seed: int) -> list[str] | None:
        """The layers of an instance's ranks (their responses after loading ``version``) that differ
        from ``version`` as it was sent (in the wire dtype); None when the server no longer holds that
        version. The expected responses are computed once per version, in the background as the
        version is pushed once checks are on (:class:`~staleflow.adapters.rlkit.weight_checksum.VersionReferences`),
        a bucketed version read bucket by bucket, never gathered whole."""
        try:
            return self._references.mismatches(version, ranks, seed)
        except (VersionNotAvailableError, CancelledError):  # dropped before or while its responses were computed
            return None

    def _tensor_items(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """``version``'s ``(name, tensor)`` pairs: bucket by bucket as each is fetched for a bucketed one."""
        stored = self.pull(version)[1]
        if isinstance(stored, BucketedWeights):
            return (item for bucket in stored.buckets() for item in bucket.items())
        return iter(self._weights(version).items())

    def channel_open(self, instance_id: str) -> bool:
        """Whether ``instance_id`` has a group (none after a failed transfer tore it down)."""
        return instance_id in self._channels

    def _meta(self, version: int) -> Mapping[str, torch.Tensor]:
        stored = self.pull(version)[1]
        if isinstance(stored, BucketedWeights):
            return {n: torch.empty(s, dtype=getattr(torch, d), device="meta") for n, d, s in stored.tensor_specs()}
        return self._weights(version)

    def _guarded(self, instance_id: str, what: str, action: Callable[[WeightChannel], Any]) -> Any:
        """``action`` on ``instance_id``'s channel; on any failure the channel is closed and dropped
        (the group is unusable) and :class:`TransferFailedError` raised."""
        channel = self._channel(instance_id)
        try:
            return action(channel)
        except Exception as error:  # noqa: BLE001 - every transport failure ends the group
            del self._channels[instance_id]
            channel.close()
            raise TransferFailedError(f"{what} of instance {instance_id!r} failed; its group was torn down: {error}") from error

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
        deadline = info.pop("deadline_s")
        _together(lambda: self._server.join_channel(instance_id), lambda: client.init_weight_transfer_engine(info),
                  f"joining the weight channel of {instance_id}", deadline)

    def deliver(self, instance_id: str, client: WeightSyncClient) -> int:
        """Send this version over ``instance_id``'s group (made by :meth:`connect`) and finish the
        update with it as the weight version; returns the bytes sent."""
        update = self._server.update_info(instance_id, self.version)
        deadline = update.pop("deadline_s")
        client.start_weight_update()
        sent = _together(lambda: self._server.send(instance_id, self.version), lambda: client.update_weights(update),
                         f"sending version {self.version} to {instance_id}", deadline)
        client.finish_weight_update(weight_version=str(self.version))
        return int(sent)

    def mismatches(self, ranks: Sequence[Mapping[str, Any]], seed: int) -> list[str] | None:
        """The server's verdict on an instance's ranks after loading this version
        (:meth:`TransferParameterServer.weight_mismatches`)."""
        return self._server.weight_mismatches(self.version, ranks, seed)  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return f"TransferWeights(version={self.version})"


#: How much longer than the sender's deadline the instance side waits for it (a remote call's latency).
SENDER_GRACE_S = 5.0


def _together(sender: Callable[[], Any], receiver: Callable[[], Any], what: str, deadline_s: float) -> Any:
    """Run ``sender`` and ``receiver`` in threads of their own (both meet in one collective) and wait
    for both, no longer than ``deadline_s`` (the sender's own deadline) plus :data:`SENDER_GRACE_S`;
    the sender's result, or :class:`TransferFailedError` naming the side that failed or did not
    finish. A side still running then is left behind (a daemon thread); the sender ends by its own
    deadline."""
    outcome: dict[str, Any] = {}

    def run(side: str, call: Callable[[], Any]) -> None:
        try:
            outcome[side] = call()
        except Exception as error:  # noqa: BLE001 - reported below
            outcome[side] = error

    threads = {side: threading.Thread(target=run, args=(side, call), name=f"{what} ({side})", daemon=True)
               for side, call in (("receiving", receiver), ("sending", sender))}
    for thread in threads.values():
        thread.start()
    end = time.monotonic() + deadline_s + SENDER_GRACE_S
    for thread in threads.values():
        thread.join(max(0.0, end - time.monotonic()))
    for side in threads:
        result = outcome.get(side)
        if isinstance(result, BaseException):
            raise TransferFailedError(f"{what} failed on the {side} side: {result}") from result
    late = [side for side, thread in threads.items() if thread.is_alive()]
    if late:
        raise TransferFailedError(f"{what}: the {' and the '.join(late)} side did not finish within {deadline_s} s")
    return outcome["sending"]

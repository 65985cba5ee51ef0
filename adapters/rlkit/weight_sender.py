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
bytes cut into chunks of at most the bucket size, a larger tensor split across chunks), read from
the version staged once in the server's process (:mod:`~staleflow.adapters.rlkit.staged_version`),
``nccl`` over vLLM's stateless NCCL group through one GPU buffer, ``gloo`` over a gloo group from
the host buffer itself; the worker engines of :mod:`staleflow.adapters.vllm.weight_transfer`
receive them. Sends to different instances run side by side (the server is thread-safe, each
channel under its own lock); an instance has the version staged (:meth:`TransferWeights.prepare`)
before it pauses, so it pauses for its own transfer only. A global broadcast's loads may instead
share one collective, the version sent once (:mod:`~staleflow.adapters.rlkit.collective`).

A failed or stuck transfer: both ends give up by the transfer's deadline
(:meth:`TransferSettings.deadline_s`: ``servers.transfer_timeout_s``, or from the version's bytes);
the server tears the instance's group down (an NCCL group is unusable after a failed broadcast) and
answers its next call; the instance side waits for both halves no longer than that (and
:mod:`~staleflow.adapters.rlkit.bounded_calls`' grace), for each control call no longer than its bound, and raises
:class:`TransferFailedError` (:class:`UpdateLeftOpenError` once vLLM's update began), which the run
loop handles as a lost instance (its requests re-queued); its next pull makes a new group.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from staleflow.adapters.rlkit import bounded_calls
from staleflow.adapters.rlkit.rendezvous import transfer_host
from staleflow.adapters.rlkit.staged_version import StagedVersion, stage
from staleflow.adapters.rlkit.weight_checksum import VersionReferences
from staleflow.adapters.rlkit.wire_chunks import send_chunks
from staleflow.runtime.interfaces import TransferFailedError, WeightsReference, resolve_weights
from staleflow.runtime.servers.parameter_server import ParameterServer, VersionNotAvailableError

BACKENDS = ("gloo", "nccl")
WIRE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class TransferBackendError(ValueError):
    """A weight-transfer backend that cannot run where it was asked to (e.g. ``nccl`` without a GPU)."""


#: The shortest transfer deadline, whatever the version's size (a group's set-up, a remote call's latency).
TRANSFER_DEADLINE_FLOOR_S = 30.0
#: How many times its expected duration a transfer may take before it is given up.
TRANSFER_DEADLINE_SLACK = 4.0


@dataclass(frozen=True)
class TransferSettings:
    """How versions move: ``backend`` (``auto``: ``nccl`` where the sender sees a GPU, else ``gloo``),
    ``host`` (the rendezvous address; None: the sender's node IP), the wire dtype and bucket size.

    ``timeout_s``: the deadline of one transfer; None: :meth:`deadline_s` of the version's bytes at
    ``link_gb_s``, the sender's expected link rate (gigabytes per second, shared by the transfers it
    runs at once)."""

    backend: str = "auto"
    host: str | None = None
    wire_dtype: str = "bfloat16"
    bucket_bytes: int = 64 << 20
    timeout_s: float | None = None
    link_gb_s: float = 1.0

    def deadline_s(self, nbytes: int = 0, transfers: int = 1) -> float:
        """The deadline of a transfer of ``nbytes`` while ``transfers`` run from this sender at once:
        ``timeout_s`` if set, else ``max(TRANSFER_DEADLINE_FLOOR_S, TRANSFER_DEADLINE_SLACK *
        nbytes * transfers / link rate)``."""
        if self.timeout_s is not None:
            return self.timeout_s
        expected = nbytes * max(1, transfers) / (self.link_gb_s * 1e9)
        return max(TRANSFER_DEADLINE_FLOOR_S, TRANSFER_DEADLINE_SLACK * expected)

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


# ------------------------------------------------------------------------------------ the wire
def wire_dtype(name: str) -> torch.dtype:
    """The torch dtype of wire dtype ``name``; ValueError naming the choices for another."""
    if name not in WIRE_DTYPES:
        raise ValueError(f"wire dtype must be one of {', '.join(WIRE_DTYPES)}, got {name!r}")
    return WIRE_DTYPES[name]


def wait_until(ready: Callable[[], bool], deadline: float, what: str) -> None:
    """Return once ``ready()``; TimeoutError naming ``what`` if ``time.monotonic()`` passes ``deadline`` first."""
    while not ready():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} did not complete before its deadline")
        time.sleep(0.001)


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
    broadcasts a :class:`~staleflow.adapters.rlkit.staged_version.StagedVersion`'s chunks (gloo: the
    host buffer's own views; nccl: each copied into one device buffer of the bucket's size from
    ``stage``) and ends by its deadline, done or not: a receiver that died or hangs cannot hold the
    sender in a broadcast. One transfer at a time per channel (its lock); channels of different
    instances send at the same time. After a failed transfer the group is unusable: :meth:`close` it."""

    def __init__(self, settings: TransferSettings, receivers: int, backend: str, host: str,
                 stage: Callable[[int], torch.Tensor] | None = None) -> None:
        self.settings = settings
        self.backend = backend
        self.host = host
        self.world_size = 1 + receivers
        self.lock = threading.Lock()
        self._stage = stage or self._device_buffer
        self._group: Any = None
        self._store: Any = None
        self._listen: socket.socket | None = None
        self._join_s = settings.deadline_s()
        if backend == "gloo":
            import torch.distributed as dist

            # The group's store listens from now on, on a port the OS chose.
            self._store = dist.TCPStore(host, 0, self.world_size, True, timeout=datetime.timedelta(seconds=self._join_s),
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
        return {"backend": "gloo", **common, "timeout_s": self._join_s, "bucket_bytes": self.settings.bucket_bytes}

    def join(self) -> None:
        """Make the group (blocks until every worker has joined)."""
        if self.backend == "nccl":
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup
            from vllm.utils.nccl import unpinned_nccl_env

            listen, self._listen = self._listen, None
            rendezvous = StatelessProcessGroup.create(self.host, self.port, 0, self.world_size,
                                                      store_timeout=int(self._join_s), listen_socket=listen)
            with unpinned_nccl_env():
                self._group = PyNcclCommunicator(rendezvous, device=torch.cuda.current_device())
            return
        import torch.distributed as dist

        self._group = dist.ProcessGroupGloo(self._store, 0, self.world_size, datetime.timedelta(seconds=self._join_s))

    def send(self, staged: StagedVersion, deadline_s: float) -> int:
        """Broadcast ``staged``'s chunks (rank 0) by ``deadline_s`` from now (TimeoutError, or the
        transport's error, after it); returns the bytes sent."""
        if self._group is None:
            raise RuntimeError("join() the channel first")
        deadline = time.monotonic() + deadline_s
        if self.backend == "gloo":  # gloo reads host memory: the staged buffer's own chunks
            for chunk in staged.chunks(self.settings.bucket_bytes):
                self._broadcast(chunk, deadline)
            return staged.nbytes
        return send_chunks([("version", staged.buffer)], staged.nbytes, self.settings.bucket_bytes, self._stage,
                           lambda chunk: self._broadcast(chunk, deadline))

    def _broadcast(self, chunk: torch.Tensor, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the transfer did not complete within its deadline")
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
        return torch.empty(size, dtype=torch.uint8, device="cuda")

    def close(self) -> None:
        """Tear the group down (NCCL: the communicator aborted, which ends a broadcast still in
        flight) and release the port."""
        if self.backend == "nccl" and self._group is not None:
            self._group.destroy()
        if self._listen is not None:
            self._listen.close()
        self._group = self._store = self._listen = None


# ------------------------------------------------------------------------------------ the server
#: How many staged versions the server keeps (the newest ones still held): the instances of a
#: decision pull one version, and those lagging within the bound the one before.
STAGED_VERSIONS = 2


class TransferParameterServer(ParameterServer):
    """A parameter server that also sends a version to an instance over that instance's long-lived
    group (it runs where the weights are). Thread-safe: in a threaded actor
    (:meth:`~staleflow.adapters.ray.parameter_server.RemoteParameterServer.place`) the sends to
    different instances run side by side, each under its channel's lock, and pushes, pulls and
    version queries are not held up by them.

    A version is staged once (:mod:`~staleflow.adapters.rlkit.staged_version`: fetched from where it
    is held, in buckets where it was published so, converted to the wire dtype, a tied tensor
    once) by the first instance that needs it (:meth:`stage`, called before the instance pauses),
    and every send of it reads that copy; the :data:`STAGED_VERSIONS` newest are kept.
    ``channels_opened`` counts the groups made."""

    def __init__(self, *args: Any, transfer: TransferSettings | Mapping[str, Any] | None = None,
                 stage: Callable[[int], torch.Tensor] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stage = stage  # the device buffers' allocator (None: on the sending GPU)
        self.transfer = transfer if isinstance(transfer, TransferSettings) else TransferSettings(**(transfer or {}))
        self.backend = self.transfer.resolved_backend()  # a bad combination fails when the server starts
        wire_dtype(self.transfer.wire_dtype)
        self.channels_opened = 0
        self.bytes_sent = 0  # by every transfer, to any instance or collective
        self._channels: dict[str, WeightChannel] = {}
        self._channels_lock = threading.Lock()
        self._staged: dict[int, StagedVersion] = {}
        self._staging_lock = threading.Lock()
        self._fetched: tuple[int, Mapping[str, torch.Tensor]] | None = None
        self._fetch_lock = threading.Lock()
        self._references = VersionReferences(self._wire_items)

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
        """A new group for ``instance_id`` (replacing its old one: a restarted instance); its init
        info, and ``deadline_s``: how long joining it may take."""
        channel = WeightChannel(self.transfer, receivers, self.backend, transfer_host(self.transfer.host), stage=self._stage)
        with self._channels_lock:
            old = self._channels.pop(instance_id, None)
            self._channels[instance_id] = channel
            self.channels_opened += 1
        if old is not None:
            with old.lock:
                old.close()
        return {**channel.init_info(), "deadline_s": self.transfer.deadline_s()}

    def join_channel(self, instance_id: str) -> None:
        self._guarded(instance_id, "joining the group", lambda channel: channel.join())

    def stage(self, version: int, transfers: int | None = None) -> dict[str, Any]:
        """Stage ``version`` here if it is not yet (the sender ready: an instance calls this before
        it pauses), and what every worker's ``update_weights`` takes for it (names, dtypes, shapes),
        with ``deadline_s``: how long its transfer may take (:meth:`TransferSettings.deadline_s` of
        its bytes, ``transfers`` sending at once; None: every open channel)."""
        staged = self._staged_version(version)
        with self._channels_lock:
            transfers = len(self._channels) if transfers is None else transfers
        return {**staged.update_info(), "deadline_s": self.transfer.deadline_s(staged.nbytes, transfers)}

    def send(self, instance_id: str, version: int, deadline_s: float | None = None) -> int:
        """Broadcast ``version`` to ``instance_id``'s workers by ``deadline_s`` (None: that of
        :meth:`stage`); the bytes sent once they have it. A transfer that fails or passes its
        deadline tears the group down and raises :class:`TransferFailedError`."""
        staged = self._staged_version(version)
        deadline = self.stage(version)["deadline_s"] if deadline_s is None else deadline_s
        return self._counted(self._guarded(instance_id, f"sending version {version}", lambda channel: channel.send(staged, deadline)))

    def _counted(self, sent: int) -> int:
        with self._channels_lock:
            self.bytes_sent += sent
        return int(sent)

    def _staged_version(self, version: int) -> StagedVersion:
        with self._staging_lock:
            staged = self._staged.get(version)
            if staged is None:
                specs = [(name, t.dtype, tuple(t.shape)) for name, t in self._meta(version).items()]
                staged = stage(version, self._tensor_items(version), specs, wire_dtype(self.transfer.wire_dtype),
                               pinned=self.backend == "nccl")
                held = set(self.versions())
                self._staged = {v: kept for v, kept in self._staged.items() if v in held} | {version: staged}
                for old in sorted(self._staged)[:-STAGED_VERSIONS]:
                    del self._staged[old]
            return staged

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

    def _wire_items(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """``version``'s ``(name, tensor)`` pairs as they travel: floating point in the wire dtype."""
        wire = wire_dtype(self.transfer.wire_dtype)
        return ((name, t.to(wire) if t.is_floating_point() else t) for name, t in self._tensor_items(version))

    def _tensor_items(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """``version``'s ``(name, tensor)`` pairs: bucket by bucket as each is fetched for a bucketed one."""
        stored = self.pull(version)[1]
        if isinstance(stored, BucketedWeights):
            return (item for bucket in stored.buckets() for item in bucket.items())
        return iter(self._weights(version).items())

    def channel_open(self, instance_id: str) -> bool:
        """Whether ``instance_id`` has a group (none after a failed transfer tore it down)."""
        with self._channels_lock:
            return instance_id in self._channels

    def _meta(self, version: int) -> Mapping[str, torch.Tensor]:
        stored = self.pull(version)[1]
        if isinstance(stored, BucketedWeights):
            return {n: torch.empty(s, dtype=getattr(torch, d), device="meta") for n, d, s in stored.tensor_specs()}
        return self._weights(version)

    def _guarded(self, instance_id: str, what: str, action: Callable[[WeightChannel], Any]) -> Any:
        """``action`` on ``instance_id``'s channel, under its lock; on any failure the channel is
        closed and dropped (the group is unusable) and :class:`TransferFailedError` raised."""
        channel = self._channel(instance_id)
        with channel.lock:
            try:
                return action(channel)
            except Exception as error:  # noqa: BLE001 - every transport failure ends the group
                with self._channels_lock:
                    if self._channels.get(instance_id) is channel:
                        del self._channels[instance_id]
                channel.close()
                raise TransferFailedError(f"{what} of instance {instance_id!r} failed; its group was torn down: {error}") from error

    def _channel(self, instance_id: str) -> WeightChannel:
        with self._channels_lock:
            if instance_id not in self._channels:
                raise TransferFailedError(f"no weight channel is open for instance {instance_id!r}")
            return self._channels[instance_id]


class WeightSyncClient(Protocol):
    """vLLM's ``VLLMWeightSyncClient``: the four control-plane calls of one inference engine."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any]) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


def check_backend(sending: str, receiving: str, instance_id: str) -> None:
    """:class:`TransferBackendError` unless the server sends by the transport the instance's workers receive by."""
    if sending != receiving:
        raise TransferBackendError(
            f"the parameter server sends by {sending} but instance {instance_id}'s vLLM workers receive by {receiving} "
            "(servers.transfer_backend must match the instances' devices: nccl for GPU instances, gloo for CPU ones)"
        )


class UpdateLeftOpenError(TransferFailedError):
    """A transfer failed after the instance's weight update began: its weights are part old, part new."""


class TransferWeights:
    """A reference to a version that moves through vLLM's weight-transfer API into the instance that
    loads it. ``server`` is a :class:`TransferParameterServer` or a proxy of one in another process.
    :meth:`fetch` gives the whole state dict instead, for engines that cannot receive a transfer."""

    #: The worker-side group its transfers arrive on (the instance's own; a collective's: ``collective``).
    channel = "instance"

    def __init__(self, server: Any, version: int) -> None:
        self._server = server
        self.version = version

    def fetch(self) -> Any:
        try:
            return self._server.pull(self.version)[1]
        except ConnectionError as error:
            raise TransferFailedError(f"pull of version {self.version}: {error}") from error

    def connect(self, instance_id: str, receivers: int, client: WeightSyncClient, backend: str, held: object = None) -> object:
        """Make ``instance_id``'s long-lived group, unless it holds one (``held``: what the last call
        returned): the server opens it, the instance's ``receivers`` workers join it
        (``init_weight_transfer_engine``). ``backend``: the one the instance's vLLM workers were built
        with (:func:`check_backend`). Returns what the instance holds now."""
        if held is not None:
            return held
        info = dict(self._server.open_channel(instance_id, receivers))
        check_backend(info.pop("backend"), backend, instance_id)
        deadline = info.pop("deadline_s")
        bounded_calls.together(lambda: self._server.join_channel(instance_id), lambda: client.init_weight_transfer_engine(info),
                               f"joining the weight channel of {instance_id}", deadline)
        return instance_id

    def _send(self, instance_id: str, deadline_s: float, group: object = None) -> int:
        return int(self._server.send(instance_id, self.version, deadline_s))

    def prepare(self) -> dict[str, Any]:
        """Have the sender stage this version (:meth:`TransferParameterServer.stage`), before the
        instance pauses: what its workers' ``update_weights`` takes, and ``deadline_s``."""
        try:
            return dict(self._server.stage(self.version))
        except ConnectionError as error:
            raise TransferFailedError(f"staging version {self.version}: {error}") from error

    def deliver(self, instance_id: str, client: WeightSyncClient, update: Mapping[str, Any] | None = None, group: object = None) -> int:
        """Send this version over ``instance_id``'s group (``group``: what :meth:`connect` returned)
        and finish the update with it as the weight version; returns the bytes sent. ``update``: what
        :meth:`prepare` returned (None: prepared here). Each step is bounded
        (:mod:`~staleflow.adapters.rlkit.bounded_calls`): the transfer by its deadline and a grace,
        the update's start and finish as control calls;
        a failure once the update began raises :class:`UpdateLeftOpenError`."""
        info = dict(update if update is not None else self.prepare())
        deadline = float(info.pop("deadline_s"))
        info["timeout_s"] = deadline  # the workers' receive is bounded by it too
        bounded_calls.bounded(client.start_weight_update, f"starting the weight update of {instance_id}", bounded_calls.CONTROL_CALL_S)
        try:
            sent = bounded_calls.together(lambda: self._send(instance_id, deadline, group),
                                          lambda: client.update_weights(info), f"sending version {self.version} to {instance_id}", deadline)
            bounded_calls.bounded(lambda: client.finish_weight_update(weight_version=str(self.version)),
                                  f"finishing the weight update of {instance_id}", bounded_calls.CONTROL_CALL_S)
        except TransferFailedError as error:
            raise UpdateLeftOpenError(f"{error} (the weight update of {instance_id} was left open)") from error
        return int(sent)

    def mismatches(self, ranks: Sequence[Mapping[str, Any]], seed: int) -> list[str] | None:
        """The server's verdict on an instance's ranks after loading this version
        (:meth:`TransferParameterServer.weight_mismatches`)."""
        return self._server.weight_mismatches(self.version, ranks, seed)  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return f"TransferWeights(version={self.version})"

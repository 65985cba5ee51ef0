"""Moving a version's weights by a collective broadcast, in buckets, from the parameter server to the
workers of one rollout instance (gloo on CPU, NCCL on GPU: the same calls, another backend).

A transfer is described by a :class:`TransferPlan` (plain data: it crosses vLLM's msgpack RPC and
Ray): the rendezvous address, the backend, the wire dtype and the tensors grouped into buckets of at
most ``bucket_bytes``. The sender (rank 0, :func:`send`) flattens each bucket into one tensor in the
wire dtype and broadcasts it; each receiver (:func:`receive`) gets the bucket and yields its tensors
by name, in the model's dtype, ready for vLLM's ``reload_weights``. Every transfer has its own
process group (a fresh TCP store port), so pulls of different instances never share a channel and a
pull never stops other instances from generating.
"""

from __future__ import annotations

import datetime
import socket
import threading
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from staleflow.runtime.interfaces import TransferFailedError, WeightsReference, resolve_weights
from staleflow.runtime.servers.parameter_server import ParameterServer

WIRE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # the dtype the receiver restores (the trainer's)


@dataclass(frozen=True)
class TransferPlan:
    """One broadcast of ``version``: ``buckets`` of tensor specs, sent in ``wire_dtype``."""

    version: int
    host: str
    port: int
    backend: str
    wire_dtype: str
    buckets: tuple[tuple[TensorSpec, ...], ...]
    world_size: int = 2
    timeout_s: float = 120.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TransferPlan:
        buckets = tuple(tuple(TensorSpec(s["name"], tuple(s["shape"]), s["dtype"]) for s in b) for b in data["buckets"])
        return cls(**{**data, "buckets": buckets})

    @property
    def wire_bytes(self) -> int:
        size = torch.tensor([], dtype=WIRE_DTYPES[self.wire_dtype]).element_size()
        return sum(_numel(s.shape) * size for bucket in self.buckets for s in bucket)


def plan_transfer(
    weights: Mapping[str, torch.Tensor],
    version: int,
    *,
    host: str = "127.0.0.1",
    backend: str = "gloo",
    wire_dtype: str = "bfloat16",
    bucket_bytes: int = 64 << 20,
    receivers: int = 1,
) -> TransferPlan:
    """Group ``weights`` into buckets of at most ``bucket_bytes`` on the wire (a larger tensor gets a
    bucket of its own) and pick a free rendezvous port on ``host``."""
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"wire dtype must be one of {', '.join(WIRE_DTYPES)}, got {wire_dtype!r}")
    size = torch.tensor([], dtype=WIRE_DTYPES[wire_dtype]).element_size()
    buckets: list[tuple[TensorSpec, ...]] = []
    current: list[TensorSpec] = []
    used = 0
    for name, tensor in weights.items():
        spec = TensorSpec(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
        nbytes = tensor.numel() * size
        if current and used + nbytes > bucket_bytes:
            buckets.append(tuple(current))
            current, used = [], 0
        current.append(spec)
        used += nbytes
    if current:
        buckets.append(tuple(current))
    return TransferPlan(version, host, _free_port(host), backend, wire_dtype, tuple(buckets), world_size=1 + receivers)


def send(weights: Mapping[str, torch.Tensor], plan: TransferPlan) -> int:
    """Broadcast ``weights`` as ``plan`` says (rank 0); returns the bytes sent. Blocks until every
    receiver has joined and received (or raises :class:`TransferFailedError`)."""
    group = _join(plan, rank=0)
    wire = WIRE_DTYPES[plan.wire_dtype]
    sent = 0
    try:
        for bucket in plan.buckets:
            flat = torch.cat([weights[s.name].detach().to(_device(plan), wire).reshape(-1) for s in bucket])
            _broadcast(group, flat)
            sent += flat.numel() * flat.element_size()
    except RuntimeError as error:
        raise TransferFailedError(f"broadcast of version {plan.version} failed: {error}") from error
    return sent


def receive(plan: TransferPlan, rank: int = 1) -> Iterator[tuple[str, torch.Tensor]]:
    """Receive ``plan``'s buckets (rank >= 1) and yield ``(name, tensor)`` in the sender's dtype."""
    group = _join(plan, rank=rank)
    wire = WIRE_DTYPES[plan.wire_dtype]
    try:
        for bucket in plan.buckets:
            flat = torch.empty(sum(_numel(s.shape) for s in bucket), dtype=wire, device=_device(plan))
            _broadcast(group, flat)
            offset = 0
            for spec in bucket:
                n = _numel(spec.shape)
                yield spec.name, flat[offset : offset + n].view(spec.shape).to(getattr(torch, spec.dtype))
                offset += n
    except RuntimeError as error:
        raise TransferFailedError(f"receiving version {plan.version} failed: {error}") from error


def _join(plan: TransferPlan, rank: int) -> Any:
    timeout = datetime.timedelta(seconds=plan.timeout_s)
    try:
        store = dist.TCPStore(plan.host, plan.port, plan.world_size, rank == 0, timeout=timeout)
        if plan.backend == "gloo":
            return dist.ProcessGroupGloo(store, rank, plan.world_size, timeout)
        if plan.backend == "nccl":  # GPU: the same broadcast over NCCL
            return dist.ProcessGroupNCCL(store, rank, plan.world_size)
    except RuntimeError as error:
        raise TransferFailedError(f"joining the transfer of version {plan.version} failed: {error}") from error
    raise ValueError(f"unknown backend {plan.backend!r} (gloo or nccl)")


def _device(plan: TransferPlan) -> str:
    return "cuda" if plan.backend == "nccl" else "cpu"


def _broadcast(group: Any, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


class BroadcastParameterServer(ParameterServer):
    """A parameter server that can also send a version by broadcast (it runs where the weights are:
    in its own actor, beside the trainer). A version pushed as a reference (a trainer rank's copy in
    Ray's object store) is fetched into this process for its first broadcast; the newest version
    fetched is kept for the next ones."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fetched: tuple[int, Mapping[str, torch.Tensor]] | None = None
        self._fetch_lock = threading.Lock()

    def _weights(self, version: int) -> tuple[int, Mapping[str, torch.Tensor]]:
        version, stored = self.pull(version)
        if not isinstance(stored, WeightsReference):
            return version, stored
        with self._fetch_lock:
            if self._fetched is None or self._fetched[0] != version:
                self._fetched = (version, resolve_weights(stored))
            return self._fetched

    def broadcast_plan(self, version: int, receivers: int, wire_dtype: str, bucket_bytes: int, backend: str, host: str) -> dict[str, Any]:
        """The plan of a broadcast of ``version`` to ``receivers`` workers (plain data)."""
        version, weights = self._weights(version)
        plan = plan_transfer(
            weights, version, host=host, backend=backend, wire_dtype=wire_dtype, bucket_bytes=bucket_bytes, receivers=receivers
        )
        return plan.to_dict()

    def broadcast(self, plan: dict[str, Any]) -> int:
        """Send the version of ``plan`` (rank 0); returns the bytes sent once every receiver has it."""
        transfer = TransferPlan.from_dict(plan)
        _, weights = self._weights(transfer.version)
        return send(weights, transfer)


class BroadcastWeights:
    """A reference to a version that moves by broadcast into the instance that loads it.

    ``server`` is a :class:`BroadcastParameterServer` or a proxy of one in another process. The
    loading engine calls :meth:`open` (the server starts sending, in a thread here that waits for
    it), joins the broadcast with the returned plan in its workers, then :meth:`close` (the bytes
    sent, or the sender's error). :meth:`fetch` gives the whole state dict instead, for engines
    that cannot join a broadcast.
    """

    def __init__(
        self, server: Any, version: int, *, wire_dtype: str = "bfloat16", bucket_bytes: int = 64 << 20,
        backend: str = "gloo", host: str = "127.0.0.1",
    ) -> None:
        self._server = server
        self.version = version
        self._settings = (wire_dtype, bucket_bytes, backend, host)
        self._sender: threading.Thread | None = None
        self._outcome: list[Any] = []

    def fetch(self) -> Any:
        try:
            return self._server.pull(self.version)[1]
        except ConnectionError as error:
            raise TransferFailedError(f"pull of version {self.version}: {error}") from error

    def open(self, receivers: int = 1) -> TransferPlan:
        wire_dtype, bucket_bytes, backend, host = self._settings
        plan = TransferPlan.from_dict(self._server.broadcast_plan(self.version, receivers, wire_dtype, bucket_bytes, backend, host))

        def run() -> None:
            try:
                self._outcome.append(self._server.broadcast(plan.to_dict()))
            except Exception as error:  # noqa: BLE001 - reported by close()
                self._outcome.append(error)

        self._sender = threading.Thread(target=run, name=f"broadcast-v{self.version}", daemon=True)
        self._sender.start()
        return plan

    def close(self) -> int:
        """Wait for the sender; the bytes it sent, or :class:`TransferFailedError`."""
        if self._sender is None:
            raise RuntimeError("open() the broadcast first")
        self._sender.join()
        outcome = self._outcome.pop() if self._outcome else TransferFailedError("the sender ended without a result")
        if isinstance(outcome, BaseException):
            raise TransferFailedError(f"sending version {self.version} failed: {outcome}") from outcome
        return int(outcome)

    def __getstate__(self) -> dict[str, Any]:  # a reference crosses processes; a running sender does not
        return {"_server": self._server, "version": self.version, "_settings": self._settings, "_sender": None, "_outcome": []}

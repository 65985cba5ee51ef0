"""A stand-in for an instance's vLLM workers in weight-transfer tests without vLLM: the four
control-plane calls of vLLM's ``VLLMWeightSyncClient``, receiving a gloo transfer as one worker
(rank 1) does, and recording the calls, the tensors received and the size of every broadcast;
:class:`StalledReceiver` dies or hangs after its first chunk; :class:`TimedReceiver` takes
``chunk_s`` over each chunk and records when its update started and finished."""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from runtime_fakes import FakeEngine
from staleflow.adapters.rlkit.wire_receive import receive_gloo, received_specs


class GlooReceiver:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.groups_joined = 0
        self.received: dict[str, torch.Tensor] = {}
        self.version: str | None = None
        self._group: Any = None
        self._bucket_bytes = 0
        self.broadcast_bytes: list[int] = []

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append("init_weight_transfer_engine")
        timeout = datetime.timedelta(seconds=init_info["timeout_s"])
        store = dist.TCPStore(init_info["master_address"], init_info["master_port"], init_info["world_size"], False, timeout=timeout)
        self._group = dist.ProcessGroupGloo(store, init_info["rank_offset"], init_info["world_size"], timeout)
        self._bucket_bytes = init_info["bucket_bytes"]
        self.groups_joined += 1

    def start_weight_update(self) -> None:
        self.calls.append("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.calls.append("update_weights")
        tensors = self._stream(update_info)
        self.received.update((name, tensor.clone()) for name, tensor in tensors)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append("finish_weight_update")
        self.version = weight_version

    def _stream(self, update_info: dict[str, Any]) -> Any:
        specs = received_specs(update_info["names"], update_info["dtype_names"], update_info["shapes"])
        return ((name, tensor) for name, tensor in receive_gloo(_Counted(self._group, self.broadcast_bytes), specs, self._bucket_bytes))


class _Counted:
    """A gloo group that records the bytes of every broadcast it takes part in."""

    def __init__(self, group: Any, sizes: list[int]) -> None:
        self._group, self._sizes = group, sizes

    def broadcast(self, tensors: list[torch.Tensor], options: Any) -> Any:
        self._sizes.append(sum(t.numel() * t.element_size() for t in tensors))
        return self._group.broadcast(tensors, options)


class TimedReceiver(GlooReceiver):
    """A worker that takes ``chunk_s`` seconds over each chunk it receives (a loaded model's layers),
    recording ``started`` / ``finished``: the monotonic times of its update's start and finish."""

    def __init__(self, chunk_s: float) -> None:
        super().__init__()
        self.chunk_s = chunk_s
        self.started = self.finished = 0.0

    def start_weight_update(self) -> None:
        self.started = time.monotonic()
        super().start_weight_update()

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        super().finish_weight_update(weight_version)
        self.finished = time.monotonic()

    def _stream(self, update_info: dict[str, Any]) -> Any:
        for item in super()._stream(update_info):
            time.sleep(self.chunk_s)
            yield item


class StalledReceiver(GlooReceiver):
    """A worker that receives the first chunk of an update and then dies (``failure="dies"``: its
    group closed, the call raising) or hangs (``"hangs"``: until ``release`` is set)."""

    def __init__(self, failure: str) -> None:
        super().__init__()
        self.failure = failure
        self.release = threading.Event()
        self.chunks_received = 0

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.calls.append("update_weights")
        stream = self._stream(update_info)
        next(stream)
        self.chunks_received = len(self.broadcast_bytes)
        if self.failure == "dies":
            del stream
            self._group = None  # its sockets close, as a dead process's would
            raise RuntimeError("the worker process died")
        self.release.wait()


def delivered_or_raised(reference: Any, instance_id: str, client: Any, wait_s: float) -> Any:
    """What ``reference.deliver(instance_id, client)`` returned or raised, waited for in a thread for
    at most ``wait_s`` (an AssertionError if it is still running then: a hang)."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(reference.deliver(instance_id, client))
        except Exception as error:  # noqa: BLE001 - the outcome under test
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(wait_s)
    assert not thread.is_alive(), f"the transfer to {instance_id} still runs after {wait_s} s: it hangs"
    return outcome[0]


class VLLMLikeWorker(GlooReceiver):
    """A worker keeping vLLM's weight-update state (``gpu_worker.py``): ``start_weight_update``
    refuses while an update is active, a failed ``update_weights`` ends it, ``finish_weight_update``
    ends it. With ``hang`` set, its next ``update_weights`` waits until ``release`` and then returns
    as if the version had arrived (a send queued behind others completing after the instance gave
    up), leaving the update active."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False
        self.hang = threading.Event()
        self.release = threading.Event()

    def start_weight_update(self) -> None:
        if self.active:
            raise RuntimeError("start_weight_update called while a weight update is already active. Call finish_weight_update first.")
        super().start_weight_update()
        self.active = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        if self.hang.is_set():
            self.hang.clear()
            self.release.wait()
            return
        try:
            super().update_weights(update_info)
        except BaseException:
            self.active = False
            raise

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if not self.active:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
        super().finish_weight_update(weight_version)
        self.active = False


class SubprocessCoreEngine:
    """An ``LLMEngine`` whose engine core runs in another process (vLLM's multiprocessing client),
    stood in for by one thread running its utility calls one at a time: a ``collective_rpc`` into
    ``worker`` holds every later call (``resume_scheduler`` included) until it returns."""

    def __init__(self, worker: GlooReceiver) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.worker = worker
        self.engine_core = self
        self.utility_calls: list[str] = []
        self._core = ThreadPoolExecutor(1, thread_name_prefix="engine-core")

    def call_utility(self, method: str, *args: Any) -> Any:
        return self._core.submit(self._utility, method, args).result()

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        return self.call_utility("collective_rpc", method, kwargs or {})  # type: ignore[no-any-return]

    def set_weight_version(self, version: str) -> None:
        self.call_utility("set_weight_version", version)

    def _utility(self, method: str, args: tuple[Any, ...]) -> Any:
        self.utility_calls.append(method)
        if method == "collective_rpc":
            name, kwargs = args
            return [getattr(self.worker, name)(**kwargs)]
        return None



class ReceivingEngine(FakeEngine):
    """A fake rollout instance whose loads arrive as a vLLM engine's do: through
    :class:`~staleflow.adapters.vllm.weight_transfer.InstanceWeightSync` into a :class:`VLLMLikeWorker`
    behind an engine core in "another process" (:class:`SubprocessCoreEngine`). A load that leaves
    the update open fails the instance, as it fails a vLLM engine; :meth:`restart` gives it a new
    worker (what restarting the engine would)."""

    def __init__(self, instance_id: str, clock: Any, **kwargs: Any) -> None:
        super().__init__(instance_id, clock, **kwargs)
        self.restart()

    def restart(self) -> None:
        from staleflow.adapters.vllm.weight_transfer import InstanceWeightSync

        self.worker = VLLMLikeWorker()
        self.sync = InstanceWeightSync(SubprocessCoreEngine(self.worker), self.instance_id, {}, "gloo", self.version)
        self.dead = False

    def load_weights(self, version: int, weights: Any, broadcast: bool = False) -> None:
        from staleflow.adapters.rlkit.weight_sender import UpdateLeftOpenError

        self._alive()
        try:
            self.sync.receive(weights, weights.prepare())
        except UpdateLeftOpenError:
            self.dead = True
            raise
        super().load_weights(version, dict(self.worker.received))

    def snapshot(self) -> Any:
        self._alive()
        return super().snapshot()

    def _alive(self) -> None:
        from staleflow.runtime.interfaces import InstanceLostError

        if self.dead:
            raise InstanceLostError(f"{self.instance_id}: its weight update was left open")


class TransferringServer:
    """A parameter server in this process whose pulls hand out transfer references (as a Ray-placed
    one does), so a vLLM engine receives every version through vLLM's weight-transfer API."""

    def __init__(self, server: Any) -> None:
        self.server = server

    def push(self, version: int, weights: Any) -> None:
        self.server.push(version, weights)

    def latest_version(self) -> int | None:
        return self.server.latest_version()  # type: ignore[no-any-return]

    def versions(self) -> tuple[int, ...]:
        return self.server.versions()  # type: ignore[no-any-return]

    def pull(self, version: int | None = None) -> tuple[int, Any]:
        from staleflow.adapters.rlkit.collective import BroadcastWeights

        version = self.server.pull(version)[0]
        return version, BroadcastWeights(self.server, version)

    def state_dict(self) -> dict[str, Any]:
        return self.server.state_dict()  # type: ignore[no-any-return]


def counted_sends(monkeypatch: Any) -> list[int]:
    """The world size of the group of every send the parameter server makes from now on (1 + the
    workers it reaches), recorded as ``WeightChannel.send`` runs."""
    from staleflow.adapters.rlkit.weight_sender import WeightChannel

    sizes: list[int] = []
    send = WeightChannel.send

    def counted(self: WeightChannel, staged: Any, deadline_s: float) -> int:
        sizes.append(self.world_size)
        return send(self, staged, deadline_s)

    monkeypatch.setattr(WeightChannel, "send", counted)
    return sizes

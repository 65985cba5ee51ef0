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
from staleflow.adapters.rlkit.weight_sender import receive_gloo, received_specs


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

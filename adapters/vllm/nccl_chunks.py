"""vLLM's NCCL weight-transfer engine receiving StaleFlow's chunks (registered as backend
``staleflow_nccl`` by :func:`staleflow.adapters.vllm.weight_transfer.register_engines`; imported by
vLLM's factory in the worker process only).

vLLM's own ``nccl`` engine in packed mode receives whole tensors, packed until a buffer is full, so
its sender needs a GPU buffer of at least the largest tensor (twice, with two in flight). This engine
keeps vLLM's group, lifecycle and loading (layerwise reload around the model's ``load_weights``) and
receives the chunks of :mod:`staleflow.adapters.rlkit.wire_chunks` instead, which the gloo engine
receives too: the sender's staging buffer is bounded by the bucket size
(``packed_buffer_size_bytes`` of the init info), whatever the largest tensor. A worker keeps one
communicator per channel: its instance's own, and a collective's of several instances' workers
(:mod:`staleflow.adapters.rlkit.collective`), made by a second ``init_weight_transfer_engine``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from staleflow.adapters.rlkit.weight_sender import wait_until
from staleflow.adapters.rlkit.wire_chunks import receive_chunks
from staleflow.adapters.rlkit.wire_receive import received_specs
from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine, NCCLWeightTransferUpdateInfo


@dataclass(kw_only=True)
class ChunkedNCCLInitInfo(NCCLWeightTransferInitInfo):
    """vLLM's NCCL init info, and which of the worker's groups it makes (``instance`` or ``collective``)."""

    channel: str = "instance"


@dataclass
class ChunkedNCCLUpdateInfo(NCCLWeightTransferUpdateInfo):
    """vLLM's NCCL update info, the transfer's deadline (None: no deadline) and the group it arrives on."""

    timeout_s: float | None = None
    channel: str = "instance"


class ChunkedNCCLWeightTransferEngine(NCCLWeightTransferEngine):
    """vLLM's NCCL engine receiving chunks of at most ``packed_buffer_size_bytes``, each broadcast's
    completion waited for until the transfer's deadline: past it the communicator is aborted (which
    ends the broadcast in flight) and dropped, the update fails (vLLM ends its update state), and
    the next ``init_weight_transfer_engine`` makes a new group."""

    init_info_cls = ChunkedNCCLInitInfo
    update_info_cls = ChunkedNCCLUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.groups: dict[str, Any] = {}  # the worker's communicators by channel

    def init_transfer_engine(self, init_info: ChunkedNCCLInitInfo) -> None:  # type: ignore[override]
        old = self.groups.pop(init_info.channel, None)
        if old is not None:
            old.destroy()
        super().init_transfer_engine(init_info)
        self.groups[init_info.channel] = self.model_update_group

    def shutdown(self) -> None:
        for group in self.groups.values():
            group.destroy()
        self.groups = {}
        self.model_update_group = None

    def receive_weights(self, update_info: ChunkedNCCLUpdateInfo) -> None:  # type: ignore[override]
        group = self.groups.get(update_info.channel)
        if group is None:
            raise RuntimeError(f"the NCCL weight transfer has no {update_info.channel} group: call init_weight_transfer_engine first")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        deadline = None if update_info.timeout_s is None else time.monotonic() + update_info.timeout_s

        def receive(buffer: torch.Tensor) -> None:
            group.broadcast(buffer, src=0, stream=torch.cuda.current_stream())
            if deadline is None:
                return
            done = torch.cuda.Event()
            done.record()
            try:
                wait_until(done.query, deadline, "the weight transfer's NCCL broadcast")
            except TimeoutError:
                self.groups.pop(update_info.channel, None)
                if self.model_update_group is group:
                    self.model_update_group = None
                group.destroy()  # ncclCommAbort: the broadcast in flight ends
                raise

        specs = received_specs(update_info.names, update_info.dtype_names, update_info.shapes)
        stream = receive_chunks(specs, self.packed_buffer_size_bytes, receive, device=self.device)
        with disable_mtp_completeness_check():
            self.model.load_weights(stream)
            for _ in stream:  # what the loader left: the broadcast runs to its end on every rank
                pass

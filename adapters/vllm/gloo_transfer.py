"""vLLM's weight-transfer engine over gloo, for CPU workers (registered as backend ``gloo`` by
:func:`staleflow.adapters.vllm.weight_transfer.register_engines`; imported by vLLM's factory in
the worker process only).

The lifecycle is that of vLLM's ``nccl`` engine: ``init_transfer_engine`` joins the sender's
long-lived group once per channel (the instance's own group, and a collective of several instances'
workers kept beside it, :mod:`staleflow.adapters.rlkit.collective`); ``start_weight_update`` /
``finish_weight_update`` run vLLM's layerwise reload around the model's ``load_weights`` (checkpoint
names fused into vLLM's parameters, the CPU backend's repacked weights prepared again);
``receive_weights`` takes the chunks the sender broadcasts (:mod:`staleflow.adapters.rlkit.wire_chunks`).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from staleflow.adapters.rlkit.wire_receive import receive_gloo, received_specs
from staleflow.adapters.vllm.weight_transfer import refresh_cpu_output_layer
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Where a worker joins the sender's long-lived gloo group; its rank is ``rank_offset`` + its
    rank among the instance's workers."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    timeout_s: float = 120.0
    bucket_bytes: int = 64 << 20
    channel: str = "instance"
    """Which of the worker's groups this is: ``instance`` (its own) or ``collective``."""


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One version: every tensor's name, dtype and shape, in the order they travel, and its deadline."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    timeout_s: float | None = None
    """The transfer's deadline: the receive gives up after it (None: the group's timeout)."""
    channel: str = "instance"
    """The group the chunks arrive on."""


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """vLLM's weight-transfer lifecycle over gloo (CPU): chunks of raw bytes broadcast from rank 0."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.groups: dict[str, Any] = {}  # by channel
        self.bucket_bytes = 0

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        parallel = self.parallel_config
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        timeout = datetime.timedelta(seconds=init_info.timeout_s)
        store = dist.TCPStore(init_info.master_address, init_info.master_port, init_info.world_size, False, timeout=timeout)
        self.groups[init_info.channel] = dist.ProcessGroupGloo(store, rank, init_info.world_size, timeout)
        self.bucket_bytes = init_info.bucket_bytes

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        refresh_cpu_output_layer(self.model)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if update_info.channel not in self.groups:
            raise RuntimeError(f"the gloo weight transfer has no {update_info.channel} group: call init_weight_transfer_engine first")
        stream = self._received(update_info)
        self.model.load_weights(stream)
        for _ in stream:  # what the loader left: the broadcast runs to its end on every rank
            pass

    def _received(self, info: GlooUpdateInfo) -> Iterator[tuple[str, torch.Tensor]]:
        specs = received_specs(info.names, info.dtype_names, info.shapes)
        return receive_gloo(self.groups[info.channel], specs, self.bucket_bytes, info.timeout_s)

    def shutdown(self) -> None:
        self.groups = {}

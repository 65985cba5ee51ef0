"""A stand-in for an instance's vLLM workers in weight-transfer tests without vLLM: the four
control-plane calls of vLLM's ``VLLMWeightSyncClient``, receiving a gloo transfer as one worker
(rank 1) does, and recording the calls and the tensors received."""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from staleflow.adapters.rlkit.weight_sender import receive_buckets


class GlooReceiver:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.groups_joined = 0
        self.received: dict[str, torch.Tensor] = {}
        self.version: str | None = None
        self._group: Any = None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append("init_weight_transfer_engine")
        timeout = datetime.timedelta(seconds=init_info["timeout_s"])
        store = dist.TCPStore(init_info["master_address"], init_info["master_port"], init_info["world_size"], False, timeout=timeout)
        self._group = dist.ProcessGroupGloo(store, init_info["rank_offset"], init_info["world_size"], timeout)
        self.groups_joined += 1

    def start_weight_update(self) -> None:
        self.calls.append("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.calls.append("update_weights")
        tensors = receive_buckets(self._group, update_info["names"], update_info["dtype_names"], update_info["shapes"],
                                  update_info["bucket_sizes"])
        self.received.update((name, tensor.clone()) for name, tensor in tensors)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append("finish_weight_update")
        self.version = weight_version

"""A stand-in for an instance's vLLM workers in weight-transfer tests without vLLM: the four
control-plane calls of vLLM's ``VLLMWeightSyncClient``, receiving a gloo transfer as one worker
(rank 1) does, and recording the calls and the tensors received."""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from staleflow.adapters.rlkit.weight_sender import bucket_bytes_of, unpack_bucket


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
        columns = zip(update_info["names"], update_info["dtype_names"], update_info["shapes"])
        specs = [(n, getattr(torch, d), tuple(s)) for n, d, s in columns]
        start = 0
        for count in update_info["bucket_sizes"]:
            bucket = specs[start : start + count]
            start += count
            flat = torch.empty(bucket_bytes_of(bucket), dtype=torch.uint8)
            options = dist.BroadcastOptions()
            options.rootRank = 0
            self._group.broadcast([flat], options).wait()
            self.received.update((name, tensor.clone()) for name, tensor in unpack_bucket(flat, bucket))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append("finish_weight_update")
        self.version = weight_version

"""The cost model a job starts from, before its engines have run a step: derived from the model's
shape and the device, by the roofline of a decode step (the online fit,
:mod:`staleflow.runtime.coordination.cost_fit`, then replaces it with the engines' own figures).

A decode step of ``n`` requests holding ``K`` KV tokens reads every weight once, multiplies ``n``
tokens through them and reads the ``K`` tokens' keys and values (``L(n, K) = a_b + a_k*K +
max(thr, o_b + o_k*n)``, :class:`~staleflow.runtime.coordination.cost_model.CostModel`):

* ``thr = weight bytes / memory bandwidth``: the memory-bound floor of the matmuls;
* ``o_k = 2 x params / peak FLOP/s`` per request, ``o_b = 0``: they turn compute-bound at the
  roofline's ridge, ``n* = thr / o_k`` (about 295 on an H100 in bf16, 150 on an A100);
* ``a_k = KV bytes per token / memory bandwidth``: attention reads the cache;
* ``a_b``: the device's fixed per-step cost (scheduling, sampling, launches), an estimate.

Tensor parallelism divides bytes and FLOPs over the instance's GPUs. The KV capacity follows the
simulator workloads' rule (:class:`~staleflow.runtime.settings.workload.MemorySpec`). The device
figures are datasheet peaks (dense bf16), ``cpu`` a rough single-thread figure: the prior only has
to be of the right shape until the fit takes over.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from staleflow.runtime.coordination.cost_model import CostModel
from staleflow.runtime.settings.devices import DeviceSpec
from staleflow.runtime.settings.workload import MemorySpec


@dataclass(frozen=True)
class ModelShape:
    """What the cost of a decode step depends on: parameters (those a token goes through), bytes per
    weight, and KV-cache bytes per token (keys and values of every layer)."""

    params: float
    bytes_per_param: int
    kv_bytes_per_token: int

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], bytes_per_param: int = 2) -> ModelShape:
        """From a Hugging Face ``config.json`` of a dense decoder (hidden size, layers, attention and
        KV heads, MLP width, vocabulary; tied embeddings counted once)."""
        hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
        mlp = 3 * hidden * int(config["intermediate_size"])
        embeddings = int(config["vocab_size"]) * hidden * (1 if config.get("tie_word_embeddings") else 2)
        return cls(
            params=float(layers * (attention + mlp) + embeddings),
            bytes_per_param=bytes_per_param,
            kv_bytes_per_token=2 * layers * kv_heads * head_dim * bytes_per_param,
        )

    @property
    def weights_gb(self) -> float:
        return self.params * self.bytes_per_param / 1e9

    def cost_model(self, device: DeviceSpec, gpus: int = 1) -> CostModel:
        """The roofline prior on ``gpus`` devices of ``device`` (module docstring)."""
        bandwidth, flops = device.bandwidth * gpus, device.flops * gpus
        return CostModel(
            thr=self.params * self.bytes_per_param / bandwidth,
            o_b=0.0,
            o_k=2 * self.params / flops,
            a_b=device.step_overhead_s,
            a_k=self.kv_bytes_per_token / bandwidth,
        )

    def kv_capacity(self, device: DeviceSpec, utilization: float, gpus: int = 1, reserved_gb: float = 3.0) -> int:
        """KV-cache tokens of one instance, as vLLM accounts them (the workloads' ``instance.memory`` rule)."""
        memory = MemorySpec(
            gpu_gb=device.memory_gb, utilization=utilization, weights_gb=self.weights_gb, reserved_gb=reserved_gb,
            kv_bytes_per_token=self.kv_bytes_per_token,
        )
        return memory.kv_tokens(gpus)

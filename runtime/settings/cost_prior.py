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

A mixture-of-experts decoder (Qwen2/3-MoE's ``num_experts``, Mixtral's ``num_local_experts``)
stores every expert but sends a token through
``num_experts_per_tok`` of them: ``params`` counts those a token goes through (the FLOPs of a step),
``stored_params`` every one (a version's bytes on the wire, the weights' memory). Qwen3-30B-A3B:
3.3B and 30.5B, 61 GB a version in bf16.
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
    weight, and KV-cache bytes per token (keys and values of every layer); and ``stored_params``, every
    parameter stored (a mixture of experts' experts all counted; a dense model's are ``params``)."""

    params: float
    bytes_per_param: int
    kv_bytes_per_token: int
    stored_params: float

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], bytes_per_param: int = 2) -> ModelShape:
        """From a Hugging Face ``config.json`` of a decoder, dense or a mixture of experts (hidden size,
        layers, attention and KV heads, MLP or expert widths, vocabulary; tied embeddings counted once)."""
        hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
        embeddings = int(config["vocab_size"]) * hidden * (1 if config.get("tie_word_embeddings") else 2)
        active, stored = _mlp_params(config, hidden, layers)
        return cls(
            params=float(layers * attention + active + embeddings),
            bytes_per_param=bytes_per_param,
            kv_bytes_per_token=2 * layers * kv_heads * head_dim * bytes_per_param,
            stored_params=float(layers * attention + stored + embeddings),
        )

    @property
    def weights_gb(self) -> float:
        """Every stored weight's bytes: a version on the wire, or in an instance's memory."""
        return self.stored_params * self.bytes_per_param / 1e9

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


def _mlp_params(config: Mapping[str, Any], hidden: int, layers: int) -> tuple[int, int]:
    """The MLP parameters of every layer: those a token goes through, and those stored. A layer is
    sparse (routed experts, a router, Qwen2-MoE's gated shared expert) unless Qwen's ``mlp_only_layers``
    or ``decoder_sparse_step`` make it dense; a dense layer is ``intermediate_size`` wide."""
    dense = 3 * hidden * int(config["intermediate_size"])
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if experts == 0:
        return layers * dense, layers * dense
    width = int(config.get("moe_intermediate_size") or config["intermediate_size"])
    top_k = int(config["num_experts_per_tok"])
    shared_width = int(config.get("shared_expert_intermediate_size") or 0)
    shared = 3 * hidden * shared_width + (hidden if shared_width else 0)  # and its gate
    dense_layers = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step") or 1)
    sparse = sum(1 for i in range(layers) if i not in dense_layers and (i + 1) % step == 0)
    router = hidden * experts
    active = sparse * (3 * hidden * width * top_k + router + shared) + (layers - sparse) * dense
    stored = sparse * (3 * hidden * width * experts + router + shared) + (layers - sparse) * dense
    return active, stored

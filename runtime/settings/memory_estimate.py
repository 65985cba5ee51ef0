"""What one trainer GPU holds, estimated from the model's shape and the job's settings (the dry run).

Per GPU, in bytes (``P`` parameters, ``S`` the ranks a parameter is sharded over: FSDP's world size,
Megatron's tensor x pipeline size; Megatron here runs without its distributed optimizer):

* weights: the fp32 master copy, ``4P / S``, plus, in bf16 mixed precision, one decoder layer
  gathered in bf16 for its forward or backward (FSDP2 gathers a layer at a time);
* gradients: fp32, ``4P / S``;
* optimizer: AdamW's two fp32 moments, ``8P / S``;
* parameter server's share (trainer rank 0 only, when the server sends over NCCL from rank 0's GPU):
  its one staging buffer of ``servers.bucket_mb`` (a tensor larger than a bucket goes in pieces,
  ``adapters/rlkit/wire_chunks.py``);
* activations at ``train.micro_batch_tokens`` ``T``: with activation checkpointing each layer keeps
  its input (``2 x hidden`` bytes a token, bf16) and one layer at a time holds its working set,
  without it every layer does (``2 x (10 x hidden + 4 x intermediate)`` bytes a token: the
  attention's projections, norms and residuals, the MLP's gate, up, activation and product; flash
  attention or sdpa, no ``[T, T]`` scores); plus the log-probs of ``train.logprob_chunk`` tokens at a
  time over the vocabulary (bf16 logits, fp32 log-softmax and its gradient: 10 bytes a logit);
* a fixed reserve for the CUDA context, NCCL and the allocator's fragmentation.

Offloading (:class:`Offload`) moves the weights and gradients (``params``) or the optimizer state
to CPU memory, as FSDP2's ``CPUOffloadPolicy`` does. ``train.cpu_offload`` ``auto`` offloads where the
model state alone (weights, gradients, optimizer: 16 bytes a parameter, :func:`rank_state_bytes`)
takes more than :data:`STATE_SHARE` of the GPU (:func:`choose_offload`, which the FSDP trainer runs). The figures are
estimates of the right size, not a measurement: a plan flagged here will not fit; one that fits
may still need a margin.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

GIB = 2**30
WEIGHT_BYTES = 4  # fp32 master weights
GRADIENT_BYTES = 4  # reduced in fp32
ADAMW_BYTES = 8  # exp_avg and exp_avg_sq, fp32
#: The share of a GPU's memory the sharded model state may take before ``auto`` moves it to CPU memory
#: (the rest: activations at the micro-batch, the gathered layer, the CUDA context).
STATE_SHARE = 0.5
OFFLOAD_SETTINGS = ("auto", "on", "off")
#: the CUDA context, NCCL's buffers and the caching allocator's slack on one GPU
RUNTIME_RESERVE_BYTES = 2 * GIB


@dataclass(frozen=True)
class Offload:
    """What a trainer rank keeps in CPU memory instead of on its GPU."""

    params: bool = False
    optimizer: bool = False


@dataclass(frozen=True)
class RankState:
    """Bytes of model state one trainer rank keeps: its shard of the weights, gradients and AdamW state."""

    weights: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


def rank_state_bytes(parameters: int, world_size: int) -> RankState:
    """The model state per rank of ``parameters`` sharded over ``world_size`` ranks."""
    if parameters < 0 or world_size < 1:
        raise ValueError(f"need parameters >= 0 and world_size >= 1, got {parameters} and {world_size}")
    share = math.ceil(parameters / world_size)
    return RankState(weights=share * WEIGHT_BYTES, gradients=share * GRADIENT_BYTES, optimizer=share * ADAMW_BYTES)


def choose_offload(setting: str, parameters: int, world_size: int, device_bytes: int | None) -> bool:
    """Whether a rank on a GPU of ``device_bytes`` keeps its parameters, gradients and optimiser
    state in CPU memory: ``on`` / ``off`` as asked; ``auto``: when the state takes more than
    :data:`STATE_SHARE` of the device. Never for a rank on CPU (``device_bytes`` None): its state is in
    CPU memory already, and FSDP2's ``CPUOffloadPolicy`` needs an accelerator."""
    if setting not in OFFLOAD_SETTINGS:
        raise ValueError(f"train.cpu_offload must be one of {', '.join(OFFLOAD_SETTINGS)}, got {setting!r}")
    if device_bytes is None or setting == "off":
        return False
    return setting == "on" or rank_state_bytes(parameters, world_size).total > STATE_SHARE * device_bytes


@dataclass(frozen=True)
class TrainerShape:
    """The model's figures the estimate needs (from a Hugging Face ``config.json``)."""

    params: int
    layers: int
    hidden: int
    intermediate: int
    vocab: int

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], params: float) -> TrainerShape:
        hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
        intermediate = int(config["intermediate_size"])
        return cls(
            params=int(params), layers=int(config["num_hidden_layers"]), hidden=hidden, intermediate=intermediate,
            vocab=vocab,
        )

    @property
    def layer_params(self) -> int:
        return (self.params - self.vocab * self.hidden) // self.layers


@dataclass(frozen=True)
class TrainerMemory:
    """Bytes on the busiest trainer GPU (rank 0), by part, against the device's memory."""

    weights: int
    gradients: int
    optimizer: int
    parameter_server: int
    activations: int
    reserve: int
    device_bytes: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.parameter_server + self.activations + self.reserve

    @property
    def fits(self) -> bool:
        return self.total <= self.device_bytes

    def to_dict(self) -> dict[str, Any]:
        gib = {f"{key}_gib": round(value / GIB, 2) for key, value in asdict(self).items()}
        return {**gib, "total_gib": round(self.total / GIB, 2), "fits": self.fits}

    def describe(self) -> str:
        parts = ", ".join(f"{key} {value / GIB:.1f}" for key, value in asdict(self).items() if key != "device_bytes")
        verdict = "fits" if self.fits else "DOES NOT FIT"
        return f"{self.total / GIB:.1f} GiB of {self.device_bytes / GIB:.1f} GiB ({verdict}; GiB: {parts})"


def estimate_trainer_memory(
    shape: TrainerShape,
    *,
    shards: int,
    micro_batch_tokens: int,
    logprob_chunk: int,
    activation_checkpointing: bool,
    device_bytes: int,
    mixed_precision: bool = True,
    parameter_server_bucket_bytes: int | None = None,
    offload: Offload = Offload(),
) -> TrainerMemory:
    """The estimate of the module docstring; ``parameter_server_bucket_bytes``: the server's bucket
    when it shares rank 0's GPU (None: it does not)."""
    state = rank_state_bytes(shape.params, shards)
    gathered_layer = 2 * shape.layer_params if mixed_precision else 0
    weights = (0 if offload.params else state.weights) + gathered_layer
    gradients = 0 if offload.params else state.gradients
    optimizer = 0 if offload.optimizer else state.optimizer
    server = parameter_server_bucket_bytes or 0
    per_token = 2 * (10 * shape.hidden + 4 * shape.intermediate)
    if activation_checkpointing:
        layers = micro_batch_tokens * (shape.layers * 2 * shape.hidden + per_token)
    else:
        layers = micro_batch_tokens * shape.layers * per_token
    logits = min(logprob_chunk, micro_batch_tokens) * shape.vocab * 10
    return TrainerMemory(
        weights=int(weights), gradients=int(gradients), optimizer=int(optimizer), parameter_server=int(server),
        activations=int(layers + logits), reserve=RUNTIME_RESERVE_BYTES, device_bytes=int(device_bytes),
    )

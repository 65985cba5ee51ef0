"""What one trainer GPU holds, estimated from the model's shape and the job's settings (the dry run).

Per GPU, in bytes (``P`` parameters, ``S`` the ranks a parameter is sharded over: FSDP's world size,
Megatron's tensor x pipeline size; Megatron here runs without its distributed optimizer):

* weights: the fp32 master copy, ``4P / S``, plus, in bf16 mixed precision, one decoder layer
  gathered in bf16 for its forward or backward (FSDP2 gathers a layer at a time);
* gradients: fp32, ``4P / S``;
* optimizer: AdamW's two fp32 moments, ``8P / S``;
* parameter server's share (trainer rank 0 only, when the server sends over NCCL from rank 0's GPU):
  its two packed buffers of ``servers.bucket_mb`` plus the largest tensor, which it moves whole;
* activations at ``train.micro_batch_tokens`` ``T``: with activation checkpointing each layer keeps
  its input (``2 x hidden`` bytes a token, bf16) and one layer at a time holds its working set,
  without it every layer does (``2 x (10 x hidden + 4 x intermediate)`` bytes a token: the
  attention's projections, norms and residuals, the MLP's gate, up, activation and product; flash
  attention or sdpa, no ``[T, T]`` scores); plus the log-probs of ``train.logprob_chunk`` tokens at a
  time over the vocabulary (bf16 logits, fp32 log-softmax and its gradient: 10 bytes a logit);
* a fixed reserve for the CUDA context, NCCL and the allocator's fragmentation.

Offloading (:class:`Offload`) moves the weights and gradients (``params``) or the optimizer state
to CPU memory, as FSDP2's ``CPUOffloadPolicy`` does; the trainer's options feed it. The figures are
estimates of the right size, not a measurement: a plan flagged here will not fit; one that fits
may still need a margin.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

GIB = 2**30
#: the CUDA context, NCCL's buffers and the caching allocator's slack on one GPU
RUNTIME_RESERVE_BYTES = 2 * GIB


@dataclass(frozen=True)
class Offload:
    """What a trainer rank keeps in CPU memory instead of on its GPU."""

    params: bool = False
    optimizer: bool = False


@dataclass(frozen=True)
class TrainerShape:
    """The model's figures the estimate needs (from a Hugging Face ``config.json``)."""

    params: int
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    largest_tensor: int

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], params: float) -> TrainerShape:
        hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
        intermediate = int(config["intermediate_size"])
        return cls(
            params=int(params), layers=int(config["num_hidden_layers"]), hidden=hidden, intermediate=intermediate,
            vocab=vocab, largest_tensor=max(vocab * hidden, 2 * intermediate * hidden),
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
    sharded = shape.params / shards
    gathered_layer = 2 * shape.layer_params if mixed_precision else 0
    weights = (0 if offload.params else 4 * sharded) + gathered_layer
    gradients = 0 if offload.params else 4 * sharded
    optimizer = 0 if offload.optimizer else 8 * sharded
    server = 0 if parameter_server_bucket_bytes is None else 2 * parameter_server_bucket_bytes + 2 * shape.largest_tensor
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

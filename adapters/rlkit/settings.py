"""What a trainer binding (torch, FSDP, Megatron) is configured with: optimiser, schedule, objective,
micro-batching and compute dtype, read from a job's configuration."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from staleflow.adapters.rlkit.algorithms import Correction, LossSettings
from staleflow.adapters.rlkit.bucketed_publish import DEFAULT_PUBLISH_BUCKET_BYTES


@dataclass(frozen=True)
class TrainerSettings:
    """Optimiser, schedule and objective of a trainer binding (see ``runtime/settings/config.py``)."""

    lr: float = 3e-4
    lr_warmup_steps: int = 10
    betas: tuple[float, float] = (0.9, 0.98)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    minibatches: int = 1
    loss: LossSettings = field(default_factory=LossSettings)
    scale_advantages: bool = True
    temperature: float = 1.0
    micro_batch_tokens: int | None = None  # None: auto (resolve_micro_batch_tokens)
    attention: str = "auto"  # the attention kernel: auto (causal_lm.attention_kernel decides) or its name
    logprob_chunk: int = 1024
    activation_checkpointing: bool = False
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16: the compute dtype
    publish_bucket_bytes: int = DEFAULT_PUBLISH_BUCKET_BYTES  # rank 0 gathers a version this much at a time
    cpu_offload: str = "auto"  # fsdp: on | off | auto (runtime/settings/memory_estimate.py decides)

    @classmethod
    def from_config(cls, job: Any) -> TrainerSettings:
        """Settings of a :class:`~staleflow.runtime.settings.config.JobConfig`."""
        t = job.train
        return cls(
            lr=t.lr,
            lr_warmup_steps=t.lr_warmup_steps,
            betas=tuple(t.betas),
            weight_decay=t.weight_decay,
            grad_clip=t.grad_clip,
            minibatches=t.minibatches,
            loss=LossSettings(correction=Correction(t.correction), clip_eps=t.clip_eps, weight_cap=t.weight_cap),
            scale_advantages=t.scale_advantages,
            temperature=job.rollout.temperature,
            micro_batch_tokens=None if t.micro_batch_tokens == "auto" else t.micro_batch_tokens,
            attention=t.attention,
            logprob_chunk=t.logprob_chunk,
            activation_checkpointing=t.activation_checkpointing,
            dtype=t.dtype,
            publish_bucket_bytes=t.publish_bucket_mb << 20,
            cpu_offload=t.cpu_offload,
        )

    def compute_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype of forward and backward: ``auto`` is bf16 on a GPU and fp32 elsewhere."""
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return {"fp32": torch.float32, "bf16": torch.bfloat16}[self.dtype]

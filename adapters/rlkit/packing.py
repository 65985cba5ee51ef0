"""Sequence packing into token-budget micro-batches, and log-probs computed a chunk at a time.

A training batch is laid out as **sequences** (prompt + response, one per trajectory, no padding),
then as **micro-batches**: runs of whole sequences concatenated into one row of at most
``max_tokens`` tokens (first-fit decreasing; a sequence longer than the budget gets a micro-batch of
its own). Each sequence's ``position_ids`` restart at 0, which is how Hugging Face models see packed
sequences: with ``attention_mask=None`` they build a block-diagonal causal mask from the position
ids (dense for sdpa/eager, a block-sparse document mask for flex attention), and flash-attention
uses them as variable-length boundaries, so no token attends across sequences and no compute is
spent on padding. The dense mask makes attention cost ``T^2`` per micro-batch of ``T`` tokens, so
the default budget depends on the kernel (:func:`resolve_micro_batch_tokens`).

:func:`chunked_logprobs` turns the model's last hidden states into next-token log-probs ``chunk``
positions at a time: the ``[chunk, vocabulary]`` logits (upcast to float32) exist for one chunk at a
time; backward recomputes one chunk's logits at a time and turns them into their gradient in place,
so nothing of size ``[all tokens, vocabulary]`` is ever alive.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from staleflow.adapters.rlkit.algorithms import check_trajectory, group_advantages
from staleflow.runtime.types import TrainingBatch
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class PackedSequence:
    """One trajectory as the trainer needs it: tokens, where the response starts, and its records."""

    tokens: tuple[int, ...]
    prompt_len: int
    behaviour: tuple[float, ...]  # one per response token
    versions: tuple[int, ...]  # one per response token
    advantage: float
    reward: float

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class MicroBatch:
    """Whole sequences concatenated into one row. Per-token tensors are 1-D of ``len(self)`` and
    aligned with targets: position ``t`` predicts ``input_ids[t + 1]`` within its sequence; the last
    position of each sequence predicts nothing (target 0, mask 0)."""

    input_ids: torch.Tensor  # [1, T] long
    position_ids: torch.Tensor  # [1, T] long
    targets: torch.Tensor  # [T] long
    loss_mask: torch.Tensor  # [T] float
    behaviour: torch.Tensor  # [T] float
    versions: torch.Tensor  # [T] long, -1 off the mask
    advantages: torch.Tensor  # [T] float
    sequences: int

    def __len__(self) -> int:
        return int(self.input_ids.shape[1])

    def to(self, device: torch.device) -> MicroBatch:
        names = ("input_ids", "position_ids", "targets", "loss_mask", "behaviour", "versions", "advantages")
        moved = {k: getattr(self, k).to(device) for k in names}
        return MicroBatch(**moved, sequences=self.sequences)


def batch_sequences(batch: TrainingBatch, *, scale_advantages: bool = True) -> list[list[PackedSequence]]:
    """The batch's groups as lists of sequences with their GRPO advantages (checked as ``pack_batch`` does)."""
    if not batch.groups:
        raise ValueError(f"batch {batch.version} has no groups")
    rewards = []
    for group_id, group in batch.groups.items():
        if not group:
            raise ValueError(f"group {group_id} in batch {batch.version} has no trajectories")
        for traj in group:
            check_trajectory(traj, batch.version)
            if len(traj.prompt_ids) == 0:
                raise ValueError(f"trajectory {traj.request_id} has an empty prompt")
        rewards.append([float(t.reward) for t in group])  # type: ignore[arg-type]
    advantages = group_advantages(rewards, scale=scale_advantages).tolist()
    out: list[list[PackedSequence]] = []
    index = 0
    for group in batch.groups.values():
        seqs = []
        for traj in group:
            seqs.append(
                PackedSequence(
                    tokens=tuple(traj.prompt_ids) + tuple(traj.output_ids),
                    prompt_len=len(traj.prompt_ids),
                    behaviour=tuple(float(x) for x in traj.logprobs),
                    versions=tuple(int(v) for v in traj.versions),
                    advantage=float(advantages[index]),
                    reward=float(traj.reward),  # type: ignore[arg-type]
                )
            )
            index += 1
        out.append(seqs)
    return out


def plan_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins of at most ``max_tokens`` tokens (first-fit decreasing).

    A sequence longer than ``max_tokens`` is a bin of its own. Bins keep the input order inside.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    bins: list[list[int]] = []
    free: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        size = lengths[index]
        for b, room in enumerate(free):
            if size <= room:
                bins[b].append(index)
                free[b] -= size
                break
        else:
            bins.append([index])
            free.append(max(max_tokens - size, 0))
    return [sorted(b) for b in bins]


def split_across_ranks(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Indices of ``lengths`` spread over ``world_size`` ranks with balanced token counts (greedy LPT)."""
    heap = [(0, rank) for rank in range(world_size)]
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, rank = heapq.heappop(heap)
        shares[rank].append(index)
        heapq.heappush(heap, (load + lengths[index], rank))
    return [sorted(s) for s in shares]


def pack_micro_batch(sequences: Sequence[PackedSequence]) -> MicroBatch:
    """Concatenate whole sequences into one row (an empty list gives a 1-token row that counts nothing)."""
    if not sequences:
        zero_l, zero_f = torch.zeros(1, dtype=torch.long), torch.zeros(1)
        return MicroBatch(zero_l[None], zero_l[None], zero_l, zero_f, zero_f, zero_l - 1, zero_f, 0)
    ids, pos, targets, mask, behaviour, versions, adv = [], [], [], [], [], [], []
    for seq in sequences:
        n, p = len(seq), seq.prompt_len
        ids.extend(seq.tokens)
        pos.extend(range(n))
        targets.extend(seq.tokens[1:] + (0,))
        row_mask = [0.0] * n
        row_behaviour = [0.0] * n
        row_versions = [-1] * n
        for j, (lp, v) in enumerate(zip(seq.behaviour, seq.versions)):
            # position t predicts token t + 1: response token j sits at position p - 1 + j
            row_mask[p - 1 + j] = 1.0
            row_behaviour[p - 1 + j] = lp
            row_versions[p - 1 + j] = v
        mask.extend(row_mask)
        behaviour.extend(row_behaviour)
        versions.extend(row_versions)
        adv.extend([seq.advantage] * n)
    return MicroBatch(
        input_ids=torch.tensor([ids], dtype=torch.long),
        position_ids=torch.tensor([pos], dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        loss_mask=torch.tensor(mask, dtype=torch.float32),
        behaviour=torch.tensor(behaviour, dtype=torch.float32),
        versions=torch.tensor(versions, dtype=torch.long),
        advantages=torch.tensor(adv, dtype=torch.float32),
        sequences=len(sequences),
    )


#: The attention kernels that attend within each packed sequence without a dense ``[T, T]`` mask:
#: flash-attention's variable-length path, flex attention's block-sparse document mask.
PACKED_KERNELS = ("flash_attention_2", "flex_attention")
#: Default micro-batch budget when the attention kernel needs no dense mask (:data:`PACKED_KERNELS`):
#: its cost is linear in the budget, so large micro-batches are cheap.
VARLEN_MICRO_BATCH_TOKENS = 8192
#: Default budget when attention builds a dense block-diagonal ``[T, T]`` mask (sdpa, eager: what
#: Hugging Face models run on a CPU): every micro-batch costs ``T^2``. On the arithmetic job a step
#: took 5.1-6.2 s of training at 8,192 tokens (one micro-batch) and 0.73-1.1 s at 512 (16-17).
DENSE_MASK_MICRO_BATCH_TOKENS = 512


def auto_micro_batch_tokens(kernel: str) -> int:
    """``train.micro_batch_tokens=auto`` for attention ``kernel``: :data:`VARLEN_MICRO_BATCH_TOKENS`
    for one of :data:`PACKED_KERNELS`, else :data:`DENSE_MASK_MICRO_BATCH_TOKENS`."""
    return VARLEN_MICRO_BATCH_TOKENS if kernel in PACKED_KERNELS else DENSE_MASK_MICRO_BATCH_TOKENS


def resolve_micro_batch_tokens(causal_lm: Any, requested: int | None) -> int:
    """The micro-batch token budget: ``requested`` when set (``train.micro_batch_tokens``), else
    ``auto`` for the model's attention kernel (:func:`auto_micro_batch_tokens`)."""
    if requested is not None:
        return requested
    return auto_micro_batch_tokens(str(getattr(causal_lm.config, "_attn_implementation", None) or "eager"))


def micro_batches(sequences: Sequence[PackedSequence], max_tokens: int) -> list[MicroBatch]:
    """``sequences`` packed into token-budget micro-batches."""
    plan = plan_micro_batches([len(s) for s in sequences], max_tokens)
    return [pack_micro_batch([sequences[i] for i in indices]) for indices in plan]


# ------------------------------------------------------------------------------------- log-probs
class _ChunkLogProbs(torch.autograd.Function):
    """Log-probs of one chunk's targets; backward recomputes the chunk's logits and turns them into
    their gradient in place, so one ``[chunk, vocabulary]`` float32 tensor exists at a time.

    The matmul runs in autocast's dtype when autocast is on (else the inputs' common dtype) in both
    directions, explicitly: backward runs outside autocast, so it cannot rely on it.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        kind = hidden.device.type
        if torch.is_autocast_enabled(kind):
            dtype = torch.get_autocast_dtype(kind)
        else:
            dtype = torch.promote_types(hidden.dtype, weight.dtype)
        with torch.autocast(kind, enabled=False):
            logits = torch.nn.functional.linear(hidden.to(dtype), weight.to(dtype)).float()
            if temperature != 1.0:
                logits.div_(temperature)
            lse = torch.logsumexp(logits, dim=-1)
            out = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.dtype = temperature, dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        hidden, weight, targets, lse = ctx.saved_tensors
        h, w = hidden.to(ctx.dtype), weight.to(ctx.dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            grad = torch.nn.functional.linear(h, w).float()
            if ctx.temperature != 1.0:
                grad.div_(ctx.temperature)
            # d(logit_t - lse)/d logits = onehot(t) - softmax; times the incoming gradient (all in place)
            grad.sub_(lse.unsqueeze(-1)).exp_().neg_()
            grad.scatter_add_(-1, targets.unsqueeze(-1), torch.ones_like(lse).unsqueeze(-1))
            grad.mul_((grad_out.float() / ctx.temperature).unsqueeze(-1))
            grad = grad.to(ctx.dtype)
            grad_hidden = (grad @ w).to(hidden.dtype) if ctx.needs_input_grad[0] else None
            grad_weight = (grad.t() @ h).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None


def chunked_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, chunk: int, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probs of ``targets`` ``[T]`` from last hidden states ``[T, H]`` and the output layer ``[V, H]``.

    At most one ``[chunk, V]`` float32 logits tensor exists at a time, in forward and in backward
    (which recomputes each chunk's logits instead of keeping them).
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    parts = [
        _ChunkLogProbs.apply(hidden[start : start + chunk], weight, targets[start : start + chunk], temperature)
        for start in range(0, hidden.shape[0], chunk)
    ]
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


class LogProbModel(torch.nn.Module):
    """A Hugging Face causal LM whose forward returns next-token log-probs of a packed row.

    ``forward(input_ids [1, T], position_ids [1, T], targets [T]) -> [T]``: the backbone's last
    hidden states, then :func:`chunked_logprobs` through the output layer (tied or not). One module
    so that FSDP wraps the whole computation (the output layer's weight is gathered for it).
    """

    def __init__(self, causal_lm: torch.nn.Module, *, chunk: int = 1024, temperature: float = 1.0) -> None:
        super().__init__()
        self.causal_lm = causal_lm
        self.chunk = chunk
        self.temperature = temperature

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        backbone = self.causal_lm.get_decoder()  # type: ignore[operator]
        hidden = backbone(input_ids=input_ids, position_ids=position_ids, attention_mask=None, use_cache=False).last_hidden_state
        head = self.causal_lm.get_output_embeddings()  # type: ignore[operator]
        if getattr(head, "bias", None) is not None:
            raise ValueError("output layers with a bias are not supported by the chunked log-probs")
        return chunked_logprobs(hidden[0], head.weight, targets, chunk=self.chunk, temperature=self.temperature)


def enable_activation_checkpointing(causal_lm: torch.nn.Module) -> int:
    """Recompute each decoder layer in backward instead of keeping its activations; returns the count.

    Works in eval mode (Hugging Face's own switch needs ``model.train()``, i.e. dropout).
    """
    layers = getattr(causal_lm.get_decoder(), "layers", None)  # type: ignore[operator]
    if layers is None:
        raise ValueError(f"{type(causal_lm).__name__} has no decoder layers to checkpoint")
    for layer in layers:
        layer.forward = _checkpointed(layer.forward)
    return len(layers)


def _checkpointed(forward):  # type: ignore[no-untyped-def]
    def run(*args, **kwargs):  # type: ignore[no-untyped-def]
        if torch.is_grad_enabled():
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)

    return run

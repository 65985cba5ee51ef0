"""The RL step on packed micro-batches, shared by the one-process torch trainer and each FSDP rank.

For each minibatch (whole groups; ``train.minibatches`` optimiser steps per batch) a rank runs its
micro-batches one after the other, calling ``backward`` on each one's *summed* loss
(:func:`~staleflow.adapters.rlkit.algorithms.policy_terms`), so gradients accumulate and only one
micro-batch's activations exist at a time. After the last one the gradients are divided by the
number of counted tokens of the whole minibatch on every rank (the per-token average of
``policy_loss``, exactly, whatever the split into micro-batches and ranks), then clipped and
stepped. Ranks run the same number of micro-batches (empty ones fill up), since every FSDP forward
and backward is a collective.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from staleflow.adapters.rlkit.algorithms import Correction, LossSettings, add_sums, metrics_from_sums, policy_terms
from staleflow.adapters.rlkit.packing import MicroBatch, PackedSequence, micro_batches, pack_micro_batch


class Reducer:
    """Adds up (and takes maxima of) per-rank figures; one process: nothing to add."""

    world_size = 1

    def sums(self, values: dict[str, float]) -> dict[str, float]:
        return dict(values)

    def max_int(self, value: int) -> int:
        return value


class DistributedReducer(Reducer):
    """:class:`Reducer` over the default ``torch.distributed`` process group."""

    def __init__(self, device: torch.device) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._device = device
        self.world_size = dist.get_world_size()

    def sums(self, values: dict[str, float]) -> dict[str, float]:
        keys = sorted(k for k in values if k != "weight_max")
        total = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=self._device)
        self._dist.all_reduce(total)
        out = dict(zip(keys, total.tolist()))
        if "weight_max" in values:
            peak = torch.tensor([values["weight_max"]], dtype=torch.float64, device=self._device)
            self._dist.all_reduce(peak, op=self._dist.ReduceOp.MAX)
            out["weight_max"] = float(peak.item())
        return out

    def max_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long, device=self._device)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX)
        return int(t.item())


def split_groups(groups: Sequence[Sequence[PackedSequence]], parts: int) -> list[list[PackedSequence]]:
    """``parts`` runs of whole groups, as even as the group count allows (the minibatches of a step)."""
    if parts > len(groups):
        raise ValueError(f"{parts} minibatches but only {len(groups)} groups in the batch")
    base, extra = divmod(len(groups), parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append([seq for group in groups[start : start + size] for seq in group])
        start += size
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # an FSDP2 shard (DTensor) or a plain tensor


def train_minibatches(
    model: Callable[..., torch.Tensor],
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.nn.Parameter],
    minibatches: Sequence[Sequence[PackedSequence]],
    *,
    loss: LossSettings,
    grad_clip: float,
    max_tokens: int,
    device: torch.device,
    reducer: Reducer | None = None,
    autocast: Callable[[], Any] = contextlib.nullcontext,
) -> dict[str, float]:
    """One optimiser step per minibatch on this rank's sequences; returns the step's metrics.

    ``model(input_ids, position_ids, targets)`` gives log-probs ``[T]`` (a
    :class:`~staleflow.adapters.rlkit.packing.LogProbModel`, FSDP-wrapped or not). Metrics: the
    policy-loss diagnostics averaged over minibatches, ``grad_norm`` (max) and ``update_norm``.
    """
    reducer = reducer or Reducer()
    plans = [micro_batches(mini, max_tokens) for mini in minibatches]
    for plan in plans:  # every rank runs the same number of micro-batches (collectives)
        plan.extend(pack_micro_batch([]) for _ in range(reducer.max_int(len(plan)) - len(plan)))

    def logprobs(mb: MicroBatch) -> torch.Tensor:
        with autocast():
            return model(mb.input_ids.to(device), mb.position_ids.to(device), mb.targets.to(device)).float()

    proximal = None
    if len(plans) > 1 and loss.correction is not Correction.NONE:
        with torch.no_grad():
            proximal = [[logprobs(mb).detach() for mb in plan] for plan in plans]
    before = [_local(p).detach().clone() for p in params]
    averaged: dict[str, float] = {}
    grad_norms = []
    for index, plan in enumerate(plans):
        optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        for j, mb in enumerate(plan):
            part = mb.to(device)
            logp = logprobs(part)
            prox = proximal[index][j] if proximal is not None else logp.detach()
            loss_sum, sums = policy_terms(logp, part.behaviour, part.loss_mask, part.advantages, loss, prox)
            loss_sum.backward()
            add_sums(totals, sums)
        totals = reducer.sums(totals)
        # FSDP averages gradients over ranks; undo that and divide by the minibatch's counted tokens.
        scale = reducer.world_size / max(totals["keep"], 1.0)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        grad_norms.append(float(norm))
        optimizer.step()
        for key, value in metrics_from_sums(totals, loss).items():
            if key != "tokens":
                averaged[key] = averaged.get(key, 0.0) + value / len(plans)
    moved = sum(float((_local(p).detach() - b).pow(2).sum()) for p, b in zip(params, before))
    averaged["update_norm"] = math.sqrt(reducer.sums({"moved": moved})["moved"])
    averaged["grad_norm"] = max(grad_norms)
    averaged["micro_batches"] = float(sum(len(plan) for plan in plans))  # per rank
    if device.type == "cuda":
        averaged["gpu_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    return averaged


def batch_metrics(groups: Sequence[Sequence[PackedSequence]], trainer_version: int) -> dict[str, float]:
    """Figures of the batch itself: reward, response lengths, token staleness, response tokens."""
    seqs = [s for group in groups for s in group]
    lengths = [len(s.versions) for s in seqs]
    staleness = [trainer_version - v for s in seqs for v in s.versions]
    return {
        "tokens": float(sum(lengths)),
        "reward_mean": sum(s.reward for s in seqs) / len(seqs),
        "response_len_mean": sum(lengths) / len(lengths),
        "response_len_max": float(max(lengths)),
        "token_staleness_mean": sum(staleness) / len(staleness),
        "token_staleness_max": float(max(staleness)),
        "packed_tokens": float(sum(len(s) for s in seqs)),
    }

"""Checksums of weights, comparable across processes: what a tensor-parallel rank computes with its
shard of the weights, summarised in three numbers, and the same from the trainer's full tensors.

A rank reports, per layer, a *layout* (which rows, ``rows``, or input columns, ``cols``, of which
checkpoint tensors it holds; ``param`` for a tensor checked by value) with a checksum of the layer's
response ``y = W_rank @ x`` to a seeded probe ``x`` (:func:`probe`): two projections of ``y`` on
seeded unit vectors and its norm (:func:`checksum`). :func:`expected_checksums` computes the same from
the checkpoint tensors, cast to the rank's dtype, so only layouts and three numbers per layer cross
processes. Reading layouts and responses off an engine is the engine binding's part
(:mod:`staleflow.adapters.vllm.weight_checksum`).

What a check can tell apart: the probe response moves by ``(W_new - W_old) @ x``; in float32 that is
far above the tolerance for any update, in bfloat16 only for updates above about 1% of the weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from staleflow.runtime.interfaces import InstanceLostError

#: Relative tolerance of a checksum, by the engine's dtype (float32: GEMM accumulation order only;
#: 16-bit: the kernel's rounding of its output).
RTOL = {"torch.float32": 1e-4, "torch.bfloat16": 2e-2, "torch.float16": 5e-3}

class WeightChecksumMismatch(InstanceLostError):
    """A rank's weights differ from the trainer's for the version it loaded: the instance cannot serve
    that version, and is treated as lost (its requests recovered elsewhere)."""


def _generator(seed: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + salt) % 2**63)


def probe(seed: int, size: int) -> torch.Tensor:
    """The seeded probe input of a layer whose checkpoint input size is ``size`` (float32, CPU)."""
    return torch.randn(size, generator=_generator(seed, size))


def checksum(values: torch.Tensor, seed: int) -> list[float]:
    """Two projections of ``values`` (flattened) on seeded unit vectors, and its norm."""
    flat = values.detach().reshape(-1).to(device="cpu", dtype=torch.float64)
    out = []
    for salt in (1, 2):
        direction = torch.randn(flat.numel(), generator=_generator(seed, salt * 2**40 + flat.numel()), dtype=torch.float64)
        out.append(float(flat @ (direction / direction.norm().clamp_min(1e-30))))
    return [*out, float(flat.norm())]


def layer_probe(layout: Mapping[str, Any], seed: int) -> torch.Tensor:
    """The probe a layer of ``layout`` receives on its rank: the whole probe, or its share of the
    input columns for a ``cols`` (row-parallel) layer."""
    x = probe(seed, layout["in"])
    if layout["kind"] == "cols":
        _, start, size = layout["parts"][0]
        x = x[start:start + size]
    return x


def _checkpoint_tensor(weights: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name in weights:
        return weights[name]
    if name.endswith("lm_head.weight") and "model.embed_tokens.weight" in weights:  # tied embeddings
        return weights["model.embed_tokens.weight"]
    raise KeyError(f"the trainer's weights hold no tensor {name!r} (a rank's layout names it)")


def expected_checksums(weights: Mapping[str, torch.Tensor], rank: Mapping[str, Any], seed: int) -> list[list[float]]:
    """The checksums each entry of ``rank`` (from :func:`rank_checksums`) should have, computed from
    the checkpoint tensors ``weights`` cast to the rank's dtype."""
    dtype = getattr(torch, rank["dtype"].removeprefix("torch."))
    expected = []
    for entry in rank["entries"]:
        slices = [_checkpoint_tensor(weights, part)[start:start + size] if entry["kind"] != "cols"
                  else _checkpoint_tensor(weights, part)[:, start:start + size] for part, start, size in entry["parts"]]
        values = torch.cat([s.detach().to("cpu").to(dtype).float() for s in slices])
        if entry["kind"] != "param":
            values = values @ layer_probe(entry, seed).to(dtype).float()
        expected.append(checksum(values, seed))
    return expected


def mismatches(weights: Mapping[str, torch.Tensor], ranks: Sequence[Mapping[str, Any]], seed: int) -> list[str]:
    """Each entry of each rank whose checksum differs from the trainer's ``weights`` beyond the
    dtype's tolerance, as ``rank R: NAME ...``; empty when every rank holds its shard of ``weights``."""
    found = []
    for rank in ranks:
        rtol = RTOL.get(rank["dtype"], 2e-2)
        for entry, want in zip(rank["entries"], expected_checksums(weights, rank, seed), strict=True):
            scale = max(want[2], 1e-12)
            if any(abs(got - exp) > rtol * scale for got, exp in zip(entry["checksum"], want, strict=True)):
                found.append(f"rank {rank['rank']}: {entry['name']} checksum {entry['checksum']} != trainer's {want}")
    return found

"""Per-rank weight checks of a vLLM engine: each layer's response to a seeded probe, row by row (the
engine's side of :mod:`staleflow.adapters.rlkit.weight_checksum`).

After a weight sync every tensor-parallel rank must hold *its shard* of the new version: a rank left on
the old weights, or one that loaded the right tensor into the wrong rows, shifts every logit of every
request the instance serves. A rank's linear layers cannot be read back everywhere (vLLM-CPU repacks
each linear weight into a oneDNN handle after loading and empties the parameter), so a layer is
checked by what it computes: its response to the seeded probe through the layer's own
``quant_method.apply`` (the very kernel that serves requests), computed on the rank's device, every
output row reported. On a GPU the probe runs with PyTorch's reduced-precision reductions and TF32
switched off (restored after), so a bfloat16 GEMM accumulates in float32 as the tolerance assumes.
The layout is read from the layer: vLLM's fused ``qkv_proj`` and ``gate_up_proj``, column- and
row-parallel splits, the vocabulary shard. Parameters outside the linear layers (norms, biases) are
checked by value.

Covered: vLLM's unquantized ``QKVParallelLinear``, ``MergedColumnParallelLinear``,
``ColumnParallelLinear``, ``RowParallelLinear``, ``ReplicatedLinear`` and ``VocabParallelEmbedding``
(``ParallelLMHead`` included), in models whose vLLM names are their checkpoint names with the fused
layers of ``packed_modules_mapping`` (the Llama, Qwen2 and Qwen3 dense families). A checkpoint tensor
a layout names but the trainer does not hold is an error naming it, never a pass.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from staleflow.adapters.rlkit.weight_checksum import WeightChecksumMismatch, layer_probe, mismatches, reported
from staleflow.adapters.rlkit.weight_sender import TransferWeights

LOG = logging.getLogger("staleflow.adapters.vllm.engine")  # the engine's verdicts, in its log


def _packed_parts(model: torch.nn.Module, name: str) -> list[str]:
    """The checkpoint weights of the layers fused into vLLM's layer ``name`` (its own when not fused)."""
    prefix, _, leaf = name.rpartition(".")
    mapping = getattr(model, "packed_modules_mapping", {}) or {}
    return [f"{prefix}.{part}.weight" if prefix else f"{part}.weight" for part in mapping.get(leaf, [leaf])]


def _layer_layout(model: torch.nn.Module, name: str, layer: torch.nn.Module) -> dict[str, Any] | None:
    """Which rows (``rows``) or input columns (``cols``) of which checkpoint layers ``layer`` holds on
    this rank, and its checkpoint input size; None for a module that is not a covered layer."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    parts = _packed_parts(model, name)
    if isinstance(layer, QKVParallelLinear):
        q, k, v = parts
        kv_shard = layer.tp_rank // layer.num_kv_head_replicas
        rows = [(q, layer.tp_rank * layer.num_heads * layer.head_size, layer.num_heads * layer.head_size),
                (k, kv_shard * layer.num_kv_heads * layer.head_size, layer.num_kv_heads * layer.head_size),
                (v, kv_shard * layer.num_kv_heads * layer.v_head_size, layer.num_kv_heads * layer.v_head_size)]
        return {"kind": "rows", "parts": rows, "in": layer.input_size}
    if isinstance(layer, MergedColumnParallelLinear):
        share = layer.tp_rank, layer.tp_size
        rows = [(part, share[0] * size // share[1], size // share[1]) for part, size in zip(parts, layer.output_sizes, strict=True)]
        return {"kind": "rows", "parts": rows, "in": layer.input_size}
    if isinstance(layer, ColumnParallelLinear):
        size = layer.output_size_per_partition
        return {"kind": "rows", "parts": [(parts[0], layer.tp_rank * size, size)], "in": layer.input_size}
    if isinstance(layer, RowParallelLinear):
        size = layer.input_size_per_partition
        return {"kind": "cols", "parts": [(parts[0], layer.tp_rank * size, size)], "in": layer.input_size}
    if isinstance(layer, ReplicatedLinear):
        return {"kind": "rows", "parts": [(parts[0], 0, layer.output_size)], "in": layer.input_size}
    if isinstance(layer, VocabParallelEmbedding):
        shard = layer.shard_indices
        start, end = shard.org_vocab_start_index, shard.org_vocab_end_index
        return {"kind": "rows", "parts": [(parts[0], start, end - start)], "in": layer.embedding_dim}
    return None


def _response(layer: torch.nn.Module, layout: Mapping[str, Any], seed: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The rank's layer applied to its share of the probe (no bias), the vocabulary padding cut off."""
    x = layer_probe(layout, seed)
    kernel: Any = layer.quant_method
    with torch.inference_mode():
        y: torch.Tensor = kernel.apply(layer, x.to(device=device, dtype=dtype).unsqueeze(0))
    rows = sum(size for _, _, size in layout["parts"]) if layout["kind"] == "rows" else y.shape[-1]
    return y[0, :rows]


@contextmanager
def _float32_reductions() -> Iterator[None]:
    """PyTorch's CUDA matmul flags set so that every GEMM accumulates in float32 (no reduced-precision
    reduction of a 16-bit one, no TF32 for a float32 one), restored after."""
    matmul = torch.backends.cuda.matmul
    flags = ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction", "allow_tf32")
    saved = {flag: getattr(matmul, flag) for flag in flags}
    try:
        for flag in flags:
            setattr(matmul, flag, False)
        yield
    finally:
        for flag, value in saved.items():
            setattr(matmul, flag, value)


def rank_checksums(model: torch.nn.Module, seed: int, tp_rank: int) -> dict[str, Any]:
    """This rank's layouts and responses (run inside a vLLM worker, e.g. through ``collective_rpc``)."""
    with _float32_reductions():
        return _rank_report(model, seed, tp_rank)


def _rank_report(model: torch.nn.Module, seed: int, tp_rank: int) -> dict[str, Any]:
    entries: list[dict[str, Any]] = []
    covered: set[str] = set()
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    device = next(model.parameters()).device
    for name, layer in model.named_modules():
        layout = _layer_layout(model, name, layer)
        if layout is None:
            continue
        entries.append({"name": name, **layout, "response": reported(_response(layer, layout, seed, dtype, device))})
        covered.add(f"{name}.weight")
        bias = getattr(layer, "bias", None)
        if isinstance(bias, torch.nn.Parameter) and layout["kind"] == "rows":  # sharded as the rows
            parts = [(part.removesuffix(".weight") + ".bias", start, size) for part, start, size in layout["parts"]]
            rows = sum(size for _, _, size in parts)
            entries.append({"name": f"{name}.bias", "kind": "param", "parts": parts, "response": reported(bias[:rows])})
            covered.add(f"{name}.bias")
    for name, param in model.named_parameters():
        if name not in covered and param.numel():
            rows = param.shape[0] if param.dim() else 1
            entries.append({"name": name, "kind": "param", "parts": [(name, 0, rows)], "response": reported(param)})
    return {"rank": tp_rank, "dtype": str(dtype), "entries": entries}




def engine_checksums(llm_engine: Any, seed: int) -> list[dict[str, Any]]:
    """Every rank's :func:`rank_checksums` (through the worker extension's ``collective_rpc``)."""
    return llm_engine.collective_rpc("staleflow_weight_checksums", args=(seed,))  # type: ignore[no-any-return]


def verify_loaded(llm_engine: Any, instance_id: str, version: int, source: Path | TransferWeights) -> None:
    """Check every rank's weights against ``version`` as loaded from ``source`` (a safetensors file,
    or a transfer: the parameter server judges), the version the probe's seed; logs the verdict.
    Raises :class:`~staleflow.adapters.rlkit.weight_checksum.WeightChecksumMismatch` naming the first
    layers that differ."""
    ranks = engine_checksums(llm_engine, version)
    if isinstance(source, TransferWeights):
        problems = source.mismatches(ranks, seed=version)
    else:
        from safetensors.torch import load_file

        problems = mismatches(load_file(str(source)), ranks, seed=version)
    if problems is None:
        LOG.info("%s: version %d left the parameter server before its check: not verified", instance_id, version)
        return
    if problems:
        raise WeightChecksumMismatch(f"{instance_id}: after loading version {version}, {len(problems)} weight checksums "
                                     f"differ from the trainer's ({'; '.join(problems[:3])})")
    LOG.info("%s: weights verified: version %d, %d ranks x %d layers' responses equal the trainer's",
             instance_id, version, len(ranks), len(ranks[0]["entries"]))

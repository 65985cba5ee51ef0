"""The tensor-parallel weight check's layouts at two ranks, without a TP-2 engine: vLLM's own layers
(``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``RowParallelLinear``,
``VocabParallelEmbedding``, ``ParallelLMHead``) built at rank 0 and at rank 1 of 2, each loading the
full checkpoint tensors through its own ``weight_loader`` (vLLM's shard selection), then
``rank_checksums`` (``adapters/vllm/weight_checksum.py``) on each rank.

Each rank must name the rows (or input columns) it holds, so that together the two ranks cover every
checkpoint tensor once, and its checksums must equal the trainer's for exactly those rows. A layout
that named shard 0 on every rank passed every TP-1 test (every rank is rank 0 there); the whole TP-2
run is ``tests/test_train_tensor_parallel.py``, in the nightly tier. The tensor-parallel group is the
one thing stood in: vLLM reads a layer's rank from ``parallel_state``'s group, here a record of the
rank and the world size (no process group is started).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
from skips import needs

pytestmark = [pytest.mark.vllm, needs("vllm", "cpu-infer")]

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, SEED = 16, 4, 2, 4, 32, 64, 7
LAYER = "model.layers.0."


@contextmanager
def _tensor_parallel_rank(rank: int, world_size: int) -> Iterator[None]:
    """vLLM's tensor-parallel group as its layers read it (``get_tensor_model_parallel_rank`` and ``_world_size``)."""
    from vllm.distributed import parallel_state

    with mock.patch.object(parallel_state, "_TP", SimpleNamespace(rank_in_group=rank, world_size=world_size)):
        yield


def _checkpoint() -> dict[str, torch.Tensor]:
    """The trainer's full tensors of a one-layer Qwen2-shaped model (grouped-query attention with q/k/v biases)."""
    g = torch.Generator().manual_seed(0)
    shapes = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN), "lm_head.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
        f"{LAYER}self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN), f"{LAYER}self_attn.q_proj.bias": (HEADS * HEAD_DIM,),
        f"{LAYER}self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN), f"{LAYER}self_attn.k_proj.bias": (KV_HEADS * HEAD_DIM,),
        f"{LAYER}self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN), f"{LAYER}self_attn.v_proj.bias": (KV_HEADS * HEAD_DIM,),
        f"{LAYER}self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
        f"{LAYER}mlp.gate_proj.weight": (INTER, HIDDEN), f"{LAYER}mlp.up_proj.weight": (INTER, HIDDEN),
        f"{LAYER}mlp.down_proj.weight": (HIDDEN, INTER),
    }
    return {name: torch.randn(*shape, generator=g) for name, shape in shapes.items()}


def _rank_model(rank: int, world_size: int, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """vLLM's layers of the model at ``rank`` of ``world_size``, named as vLLM's Qwen2 names them,
    each loaded from ``weights`` by its own weight loader and prepared for serving."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    with _tensor_parallel_rank(rank, world_size):
        root, model, layer, attn, mlp = (torch.nn.Module() for _ in range(5))
        model.embed_tokens = VocabParallelEmbedding(VOCAB, HIDDEN)
        attn.qkv_proj = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=True)
        attn.o_proj = RowParallelLinear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        mlp.gate_up_proj = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], bias=False)
        mlp.down_proj = RowParallelLinear(INTER, HIDDEN, bias=False)
        layer.self_attn, layer.mlp = attn, mlp
        model.layers = torch.nn.ModuleList([layer])
        model.norm = torch.nn.Module()
        model.norm.weight = torch.nn.Parameter(torch.empty(HIDDEN))
        root.model, root.lm_head = model, ParallelLMHead(VOCAB, HIDDEN)
        root.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
        params: dict[str, Any] = dict(root.named_parameters())
        for name in ("model.embed_tokens.weight", "lm_head.weight", f"{LAYER}self_attn.o_proj.weight", f"{LAYER}mlp.down_proj.weight"):
            params[name].weight_loader(params[name], weights[name])
        for kind in ("weight", "bias"):
            qkv = params[f"{LAYER}self_attn.qkv_proj.{kind}"]
            for shard in "qkv":
                qkv.weight_loader(qkv, weights[f"{LAYER}self_attn.{shard}_proj.{kind}"], shard)
        gate_up = params[f"{LAYER}mlp.gate_up_proj.weight"]
        for index, part in enumerate(("gate_proj", "up_proj")):
            gate_up.weight_loader(gate_up, weights[f"{LAYER}mlp.{part}.weight"], index)
        params["model.norm.weight"].data.copy_(weights["model.norm.weight"])
        for module in root.modules():
            if getattr(module, "quant_method", None) is not None:
                module.quant_method.process_weights_after_loading(module)
    return root


def _covered(ranks: list[dict[str, Any]], weights: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    """For each checkpoint tensor a rank's layout names, how many ranks name each of its rows (or, for
    a row-parallel layer, its input columns): 1 everywhere when the ranks split it exactly."""
    counts: dict[str, list[int]] = {}
    for rank in ranks:
        for entry in rank["entries"]:
            for name, start, size in entry["parts"]:
                full = weights[name].shape[1] if entry["kind"] == "cols" else weights[name].shape[0] if weights[name].dim() else 1
                row_counts = counts.setdefault(name, [0] * full)
                for row in range(start, start + size):
                    row_counts[row] += 1
    return counts


def test_two_tensor_parallel_ranks_each_name_their_own_shard_and_hold_what_they_name() -> None:
    from staleflow.adapters.rlkit.weight_checksum import mismatches
    from staleflow.adapters.vllm.weight_checksum import rank_checksums

    weights = _checkpoint()
    ranks = [rank_checksums(_rank_model(rank, 2, weights), SEED, rank) for rank in (0, 1)]
    layouts = [{e["name"]: e["parts"] for e in rank["entries"]} for rank in ranks]
    assert layouts[0][f"{LAYER}self_attn.qkv_proj"] == [
        (f"{LAYER}self_attn.q_proj.weight", 0, 8), (f"{LAYER}self_attn.k_proj.weight", 0, 4), (f"{LAYER}self_attn.v_proj.weight", 0, 4)]
    assert layouts[1][f"{LAYER}self_attn.qkv_proj"] == [
        (f"{LAYER}self_attn.q_proj.weight", 8, 8), (f"{LAYER}self_attn.k_proj.weight", 4, 4), (f"{LAYER}self_attn.v_proj.weight", 4, 4)]
    # the two ranks split every sharded tensor exactly; replicated ones (the norm) are named by both
    replicated = {"model.norm.weight"}
    counts = _covered(ranks, weights)
    assert set(counts) == set(weights)
    assert {name: set(c) for name, c in counts.items()} == {name: {2} if name in replicated else {1} for name in weights}
    # and each rank's checksums are the trainer's for the rows it names
    assert mismatches(weights, ranks, SEED) == []

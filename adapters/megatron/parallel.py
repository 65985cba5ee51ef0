"""Tensor, pipeline and data parallel layout of the Megatron trainer: who holds which slice of a weight.

Megatron-core splits a ``GPTModel`` over ``tensor_parallel x pipeline_parallel`` ranks and repeats
that split ``data_parallel`` times. :func:`shard_for_rank` cuts the full (TP = PP = 1) state dict of
:func:`~staleflow.adapters.megatron.convert.hf_to_megatron` into one rank's local state dict, and
:func:`unshard` joins the local state dicts of one model replica back, so that checkpoints and
published weights never depend on the layout. The split of each weight follows Megatron's layers:

- column parallel (output rows split, ``partition_dim`` 0): the vocabulary-parallel embedding and
  output layer, ``linear_qkv`` (its rows are grouped by key/value head, so a contiguous split gives
  each rank whole query groups);
- gated column parallel: ``linear_fc1`` holds gate then up; each rank holds its slice of the gate
  followed by its slice of the up projection;
- row parallel (input columns split, ``partition_dim`` 1): ``linear_proj`` and ``linear_fc2``;
- replicated: every norm (Qwen3's ``q_layernorm``/``k_layernorm`` included).

Pipeline stage ``s`` holds decoder layers ``[s * L / pp, (s + 1) * L / pp)`` under local numbers
from 0, the first stage the embedding, the last the final norm and the output layer (with tied
embeddings and more than one stage, the last stage keeps its own copy of the embedding as the output
layer, which Megatron keeps equal to the first stage's). A weight no rule covers is an error.
``tests/test_megatron_parallel.py`` checks the rules against Megatron's own parameter attributes
and a TP = 2 and a PP = 2 model's log-probs against the Hugging Face model's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

Split = Literal["column", "gated", "row", "replicated"]

#: a decoder layer's Megatron weight: its layer number, and its name within the layer
MEGATRON_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_SPLITS: dict[str, Split] = {
    "embedding.word_embeddings.weight": "column",
    "output_layer.weight": "column",
    "self_attention.linear_qkv.weight": "column",
    "self_attention.linear_qkv.bias": "column",
    "mlp.linear_fc1.weight": "gated",
    "self_attention.linear_proj.weight": "row",
    "mlp.linear_fc2.weight": "row",
}
_NORMS = ("layernorm.weight",)  # input_, pre_mlp_, final_, q_, k_layernorm


def split_of(name: str) -> Split:
    """How tensor parallelism splits the full Megatron weight ``name`` (a local or full name)."""
    match = MEGATRON_LAYER.match(name)
    suffix = match.group(2) if match else name
    if suffix in _SPLITS:
        return _SPLITS[suffix]
    if suffix.endswith(_NORMS):
        return "replicated"
    raise ValueError(f"the Megatron layout has no tensor-parallel rule for the weight {name!r}")


@dataclass(frozen=True)
class MegatronLayout:
    """``world_size`` ranks as ``tensor_parallel x pipeline_parallel x data_parallel``.

    Rank numbering is Megatron-core's default order (``tp-cp-ep-dp-pp``): the tensor-parallel rank
    varies fastest, then the data-parallel rank, then the pipeline stage.
    """

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1 or self.pipeline_parallel < 1:
            raise ValueError(f"tensor_parallel and pipeline_parallel must be >= 1, got {self.tensor_parallel} and {self.pipeline_parallel}")
        if self.world_size % (self.tensor_parallel * self.pipeline_parallel):
            raise ValueError(
                f"train.world_size={self.world_size} is not a multiple of tensor_parallel x pipeline_parallel = "
                f"{self.tensor_parallel} x {self.pipeline_parallel}"
            )

    @property
    def data_parallel(self) -> int:
        return self.world_size // (self.tensor_parallel * self.pipeline_parallel)

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(tp_rank, pp_rank, dp_rank)`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size}")
        tp_rank = rank % self.tensor_parallel
        dp_rank = (rank // self.tensor_parallel) % self.data_parallel
        pp_rank = rank // (self.tensor_parallel * self.data_parallel)
        return tp_rank, pp_rank, dp_rank

    def check_model(self, hf_config: Any) -> None:
        """Refuse a model this layout cannot split evenly, naming every size that does not divide."""
        tp, pp = self.tensor_parallel, self.pipeline_parallel
        sizes = {
            "num_attention_heads": (hf_config.num_attention_heads, tp),
            "num_key_value_heads": (hf_config.num_key_value_heads, tp),
            "vocab_size": (hf_config.vocab_size, tp),
            "intermediate_size": (hf_config.intermediate_size, tp),
            "num_hidden_layers": (hf_config.num_hidden_layers, pp),
        }
        bad = [f"{name}={size} by {parts}" for name, (size, parts) in sizes.items() if size % parts]
        if bad:
            raise ValueError(
                f"the model cannot be split with tensor_parallel={tp}, pipeline_parallel={pp}: {', '.join(bad)} does not divide"
            )

    def stage_layers(self, pp_rank: int, num_layers: int) -> range:
        """The (global) decoder layers of pipeline stage ``pp_rank``."""
        per_stage = num_layers // self.pipeline_parallel
        return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)

    def stage(self, pp_rank: int, num_layers: int) -> Stage:
        """What pipeline stage ``pp_rank`` holds."""
        return Stage(self.stage_layers(pp_rank, num_layers), first=pp_rank == 0, last=pp_rank == self.pipeline_parallel - 1)


@dataclass(frozen=True)
class Stage:
    """The part of the model one pipeline stage holds: decoder layers ``layers`` (global numbers),
    the embedding on the ``first`` stage, the final norm and the output layer on the ``last``."""

    layers: range
    first: bool = True
    last: bool = True


def _cut(tensor: torch.Tensor, split: Split, parts: int, index: int) -> torch.Tensor:
    if split == "replicated" or parts == 1:
        return tensor
    if split == "gated":
        gate, up = torch.chunk(tensor, 2, dim=0)
        return torch.cat([torch.chunk(gate, parts, dim=0)[index], torch.chunk(up, parts, dim=0)[index]], dim=0)
    return torch.chunk(tensor, parts, dim=0 if split == "column" else 1)[index].contiguous()


def join_shards(shards: list[torch.Tensor], split: Split) -> torch.Tensor:
    if split == "replicated" or len(shards) == 1:
        return shards[0]
    if split == "gated":
        halves = [torch.chunk(shard, 2, dim=0) for shard in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=0 if split == "column" else 1)


def shard_for_rank(full: Mapping[str, torch.Tensor], layout: MegatronLayout, tp_rank: int, pp_rank: int, num_layers: int,
                   tied: bool) -> dict[str, torch.Tensor]:
    """The local state dict of the rank at ``(tp_rank, pp_rank)`` (any data-parallel rank)."""
    layers = layout.stage_layers(pp_rank, num_layers)
    first, last = pp_rank == 0, pp_rank == layout.pipeline_parallel - 1
    local: dict[str, torch.Tensor] = {}
    for name, tensor in full.items():
        match = MEGATRON_LAYER.match(name)
        if match:
            index = int(match.group(1))
            if index not in layers:
                continue
            local_name = f"decoder.layers.{index - layers.start}.{match.group(2)}"
        elif name == "embedding.word_embeddings.weight":
            if not first:
                continue
            local_name = name
        elif name in ("decoder.final_layernorm.weight", "output_layer.weight"):
            if not last:
                continue
            local_name = name
        else:
            raise ValueError(f"the Megatron layout has no stage rule for the weight {name!r}")
        local[local_name] = _cut(tensor, split_of(name), layout.tensor_parallel, tp_rank)
    if tied and last and not first:  # the last stage's own copy of the shared embedding
        local["output_layer.weight"] = _cut(full["embedding.word_embeddings.weight"], "column", layout.tensor_parallel, tp_rank)
    return local


def unshard(locals_by_rank: Mapping[tuple[int, int], Mapping[str, torch.Tensor]], layout: MegatronLayout, num_layers: int,
            tied: bool) -> dict[str, torch.Tensor]:
    """The full (TP = PP = 1) state dict from the local state dicts of one replica, keyed ``(tp_rank, pp_rank)``."""
    expected = {(t, p) for t in range(layout.tensor_parallel) for p in range(layout.pipeline_parallel)}
    if set(locals_by_rank) != expected:
        raise ValueError(f"unshard needs the weights of ranks {sorted(expected)}, got {sorted(locals_by_rank)}")
    full: dict[str, torch.Tensor] = {}
    for pp_rank in range(layout.pipeline_parallel):
        start = layout.stage_layers(pp_rank, num_layers).start
        last = pp_rank == layout.pipeline_parallel - 1
        for name in locals_by_rank[(0, pp_rank)]:
            if tied and last and pp_rank > 0 and name == "output_layer.weight":
                continue  # the copy of the embedding (shard_for_rank's counterpart)
            shards = [locals_by_rank[(t, pp_rank)][name] for t in range(layout.tensor_parallel)]
            match = MEGATRON_LAYER.match(name)
            full_name = f"decoder.layers.{int(match.group(1)) + start}.{match.group(2)}" if match else name
            full[full_name] = join_shards(shards, split_of(name))
    return full

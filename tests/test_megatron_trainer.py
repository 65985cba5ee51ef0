"""Megatron-core trainer on CPU: install/import, model build and weight conversion (GPU-only training).

Megatron's optimizer and DDP need CUDA, so :class:`MegatronTrainer` is not trained here. The build
test runs Megatron's forward pass on CPU with the two monkeypatches of
``shared/reference/environment.md`` section 4 (only in this test), to check that the converted
weights give the Hugging Face model's log-probs and that the conversion round-trips exactly.
"""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

import pytest
import torch

megatron = pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra) is not installed")

from staleflow.adapters.megatron.trainer import (
    MegatronTrainer,
    build_gpt_model,
    hf_to_megatron,
    load_hf_into_megatron,
    megatron_logprobs,
    megatron_to_hf,
    transformer_config_from_hf,
)
from staleflow.adapters.torch.algorithms import token_logprobs
from staleflow.adapters.torch.trainer import load_causal_lm
from staleflow.cli.tiny_model import ensure_tiny_model


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return load_causal_lm(ensure_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


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
def test_trainer_refuses_to_start_without_cuda(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        MegatronTrainer(tmp_path)

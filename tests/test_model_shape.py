"""A model's shape from its ``config.json``: the parameters a token goes through and every parameter
stored, for dense models and mixtures of experts, checked against the models transformers builds
and against Qwen3-30B-A3B's published sizes."""

from __future__ import annotations

import json

import pytest
from staleflow.runtime.settings.cost_prior import ModelShape

#: Qwen3-30B-A3B's config.json (https://huggingface.co/Qwen/Qwen3-30B-A3B), the fields the shape reads
QWEN3_30B_A3B = {
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936, "tie_word_embeddings": False,
}


def test_qwen3_30b_a3b_stores_30_5b_parameters_and_a_token_goes_through_3_3b():
    """Issue 45's Qwen3-30B-A3B example sends 61 GB a version in bf16; the shape took the dense
    ``intermediate_size`` for every layer's MLP and counted 3.3B parameters, 6.7 GB a version, so the
    adaptive sync's transfer costs (and an instance's weight memory) were a ninth of the truth. The
    model card: 30.5B parameters in total, 3.3B activated."""
    shape = ModelShape.from_hf_config(QWEN3_30B_A3B)
    assert shape.stored_params == pytest.approx(30.5e9, rel=0.01)
    assert shape.params == pytest.approx(3.3e9, rel=0.02)
    assert shape.weights_gb == pytest.approx(61.0, rel=0.01)


def test_a_jobs_wire_bytes_of_a_mixture_of_experts_count_every_expert(tmp_path):
    from staleflow.app.job_parts import wire_weights_gb
    from staleflow.runtime.settings.config import load_config

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    config = load_config(None, [])  # servers.wire_dtype: bfloat16
    assert wire_weights_gb(config, tmp_path) == pytest.approx(61.0, rel=0.01)


def _matrices(model) -> int:
    """The parameters of a model's matrices (the shape leaves out norms and biases)."""
    return sum(p.numel() for p in model.parameters() if p.dim() >= 2)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_moe_dense_layer", "qwen2_moe_shared_expert", "mixtral", "qwen2_dense"])
def test_the_stored_parameters_are_those_of_the_model_transformers_builds(family):
    """Every matrix of the model transformers builds from the config is counted once, and a token
    goes through ``num_experts_per_tok`` experts' of them (a dense model: all)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    common = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "tie_word_embeddings": False}
    moe = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    kind, extra = {
        "qwen3_moe": ("qwen3_moe", {**moe, "head_dim": 16}),
        "qwen3_moe_dense_layer": ("qwen3_moe", {**moe, "head_dim": 16, "mlp_only_layers": [1], "decoder_sparse_step": 1}),
        "qwen2_moe_shared_expert": ("qwen2_moe", {**moe, "shared_expert_intermediate_size": 48, "decoder_sparse_step": 2}),
        "mixtral": ("mixtral", {"num_local_experts": 8, "num_experts_per_tok": 2}),
        "qwen2_dense": ("qwen2", {"tie_word_embeddings": True}),
    }[family]
    config = AutoConfig.for_model(kind, **{**common, **extra})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shape = ModelShape.from_hf_config(config.to_dict())
    assert shape.stored_params == _matrices(model)
    experts = extra.get("num_experts") or extra.get("num_local_experts")
    if experts is None:
        assert shape.params == shape.stored_params
        return
    expert_matrices = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n and p.dim() >= 2)
    assert shape.params == _matrices(model) - expert_matrices + expert_matrices * 2 // experts

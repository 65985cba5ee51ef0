"""A 2-layer random Qwen3-MoE model (transformers' ``Qwen3MoeConfig``, tiny sizes, built in code) with
the built-in tiny model's byte tokenizer, saved as a Hugging Face folder (shared by the MoE tests)."""

from __future__ import annotations

from pathlib import Path

EXPERTS = 4


def build_tiny_qwen3_moe(target: Path, seed: int = 0) -> Path:
    """Save a random 2-layer Qwen3-MoE (4 experts, 2 per token, both layers sparse; head_dim 32, which
    vLLM-CPU's attention supports) to ``target``."""
    import torch
    from staleflow.app.tiny_model import BOS_ID, EOS_ID, PAD_ID, build_tokenizer
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=EXPERTS, num_experts_per_tok=2,
        decoder_sparse_step=1, norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).float()
    with torch.no_grad():  # random weights large enough that the router and every expert matter
        for name, parameter in model.named_parameters():
            if not name.endswith("norm.weight"):
                parameter.normal_(0.0, 0.08)
    model.save_pretrained(str(target), safe_serialization=True)
    build_tokenizer().save_pretrained(str(target))
    return target

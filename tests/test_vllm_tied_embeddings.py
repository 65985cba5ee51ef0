"""A model with tied input and output embeddings reloads correctly in vLLM-CPU, by file and through
vLLM's weight-transfer API: vLLM-CPU prepares its logits GEMM from the output layer once, and with tied embeddings
a reload left it stale (log-probs off by up to 3.9 nats before the binding refreshed it).

Its own module: one in-process vLLM engine at a time.
"""

from __future__ import annotations

import pytest
from engine_waits import wait_finished
from skips import needs

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    needs("vllm", "cpu-infer"),
]

PROMPT = [4 + b for b in b"a*13="]


def _generate(engine, request_id, version):
    from staleflow.runtime.types import RolloutRequest

    engine.submit([RolloutRequest(request_id, "g0", PROMPT, 24, version)])
    return wait_finished(engine, [request_id])[request_id]


def _torch_logprobs(model_dir, state_dict, output):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(state_dict, strict=False)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + output])).logits[0]
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[len(PROMPT) - 1 + i, token].item() for i, token in enumerate(output)]


def test_tied_embeddings_reload_by_file_and_by_weight_transfer(tmp_path):
    import torch
    from safetensors.torch import load_file
    from staleflow.adapters.rlkit.weight_sender import TransferParameterServer, TransferWeights
    from staleflow.adapters.vllm.engine import SamplingConfig, VLLMEngine
    from staleflow.app.tiny_model import TinyModelSpec, ensure_tiny_model

    model_dir = ensure_tiny_model(tmp_path / "tied", TinyModelSpec(tie_word_embeddings=True))
    files = load_file(str(model_dir / "model.safetensors"))
    embed = files["model.embed_tokens.weight"]
    server = TransferParameterServer(transfer={"wire_dtype": "float32"})
    with VLLMEngine("tied", model_dir, sampling=SamplingConfig(temperature=0.0)) as engine:
        for version, seed in ((1, 3), (2, 4)):
            generator = torch.Generator().manual_seed(seed)
            perturbed = {**files, "model.embed_tokens.weight": embed + 0.05 * torch.randn(embed.shape, generator=generator)}
            if version == 1:
                engine.load_weights(version, perturbed)  # by file
            else:
                server.push(version, perturbed)
                engine.load_weights(version, TransferWeights(server, version))
            out = _generate(engine, f"v{version}", version)
            ref = _torch_logprobs(model_dir, perturbed, out.output_ids)
            assert max(abs(a - b) for a, b in zip(ref, out.logprobs)) < 1e-3, f"version {version}"

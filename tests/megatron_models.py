"""Tiny random Qwen2 and Qwen3 models for the Megatron layout and publication tests (built in code),
and the spawned ranks those tests run."""

from __future__ import annotations

import multiprocessing
import socket
from collections.abc import Callable
from typing import Any


def tiny_qwen(kind: str) -> Any:
    """A tiny Qwen2 (qkv bias, untied) or Qwen3 (q/k norms, head_dim 48, tied): every rule of the
    Megatron layout is used. 4 layers, hidden 128, 4 heads / 2 KV heads, FFN 256, vocabulary 320."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(7)
    shape = dict(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=False))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=48, tie_word_embeddings=True))
    with torch.no_grad():  # norms away from 1, so a misplaced norm shows in the log-probs
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn_like(p))
    return model.eval()


def spawn_ranks(target: Callable[..., None], world: int, *args: Any) -> dict[int, Any]:
    """Run ``target(rank, world, port, *args, answers)`` in ``world`` spawned processes (``port``: a
    free loopback port for their rendezvous); each puts ``(rank, answer)`` on ``answers``. The
    answers by rank; the processes are joined, or killed if they do not end."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    answers = context.Queue()
    procs = [context.Process(target=target, args=(rank, world, port, *args, answers)) for rank in range(world)]
    for proc in procs:
        proc.start()
    try:
        return dict(answers.get(timeout=300) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()

"""Short supervised warm-up: teach a fresh model the answer format so RL rewards vary from step one.

A randomly initialised tiny model never produces a correct answer, so every group's rewards are
equal and GRPO's advantages are zero. A few dozen supervised steps on ``prompt -> answer <eos>``
(loss on the answer tokens only) bring the sampled reward to about 0.25-0.3 with 15-20% exact
answers: enough variance inside groups to learn from.

:func:`warm_up` writes the warmed model (and the tokenizer) to a new folder, which becomes model
version 0 for both the rollout instances and the trainer.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from staleflow.adapters.rlkit.algorithms import token_logprobs
from staleflow.adapters.rlkit.causal_lm import load_causal_lm
from staleflow.runtime.tasks import Prompt


@dataclass(frozen=True)
class WarmupResult:
    """Where the warmed model went, its loss per step and how long it took."""

    path: Path
    losses: list[float]
    seconds: float


def warm_up(
    model_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    prompts: Iterator[Prompt],
    *,
    encode: Callable[[str], Sequence[int]],
    eos_id: int,
    pad_id: int,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int = 0,
) -> WarmupResult:
    """Train ``steps`` supervised steps (AdamW, ``lr``) on ``batch_size`` prompts each; save to ``out_dir``.

    The tokenizer files of ``model_path`` are copied along so ``out_dir`` is a complete model folder.
    """
    if steps < 0 or batch_size < 1:
        raise ValueError(f"steps must be >= 0 and batch_size >= 1, got {steps} and {batch_size}")
    started = time.perf_counter()
    torch.manual_seed(seed)
    model = load_causal_lm(model_path)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98))
    losses: list[float] = []
    for _ in range(steps):
        rows = [next(prompts) for _ in range(batch_size)]
        input_ids, attention, mask = _supervised_batch(rows, encode, eos_id, pad_id)
        logits = model(input_ids=input_ids, attention_mask=attention).logits
        logp = token_logprobs(logits, input_ids)
        loss = -(logp * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.item()))
    target = Path(out_dir)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    _copy_tokenizer(Path(model_path), target)
    return WarmupResult(path=target, losses=losses, seconds=time.perf_counter() - started)


def _supervised_batch(
    rows: Sequence[Prompt], encode: Callable[[str], Sequence[int]], eos_id: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``prompt + answer + eos``, its attention mask, and the target mask of the answer
    and eos tokens (aligned with the targets, one shorter)."""
    sequences = []
    for row in rows:
        prompt = list(encode(row.text))
        answer = list(encode(row.answer)) + [eos_id]
        sequences.append((prompt, answer))
    width = max(len(p) + len(a) for p, a in sequences)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width - 1))
    for i, (prompt, answer) in enumerate(sequences):
        input_ids[i, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        attention[i, : len(prompt) + len(answer)] = 1
        mask[i, len(prompt) - 1 : len(prompt) - 1 + len(answer)] = 1.0
    return input_ids, attention, mask


def _copy_tokenizer(source: Path, target: Path) -> None:
    import shutil

    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)

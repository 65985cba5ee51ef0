"""The sibling proposer's cost (``runtime/drafts.py``): host memory per indexed token, CPU per engine step.

Two figures, from the proposer alone (no engine):

- ``memory``: bytes a :class:`~staleflow.runtime.drafts.SuffixIndex` holds per token (``tracemalloc``,
  what is still allocated once it is built, and the peak while building), for ``--tokens`` random
  tokens of a vocabulary of 50 and of 32,000, indexed at once (a prompt) and a token at a time (a
  response as it is decoded);
- ``step``: process CPU time (``time.process_time``) of :meth:`~staleflow.runtime.drafts.SiblingDrafts.propose`
  per engine step for ``--rows`` rows in groups of ``--group`` samples of one ``--prompt``-token prompt
  each, every row one token longer each step. Each group's samples follow a common random text,
  each token the group's with probability ``--agree`` and a random one otherwise (a vocabulary of
  ``--vocab``). ``record``: a step with no drafts (``k`` 0, the rows only recorded); ``draft``: a
  step with ``--drafts`` tokens for each row less ``record`` (the same seed run again). Both are the
  mean over the steps after ``--warmup`` steps (each step's rows built, and the garbage collected,
  before it is timed); ``prompts``: the CPU time of the first step, which indexes every prompt.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

from staleflow.runtime.drafts import SiblingDrafts, SuffixIndex


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=20_000, help="memory: tokens indexed (default: 20,000)")
    parser.add_argument("--rows", type=int, default=256, help="step: rows in the batch (default: 256)")
    parser.add_argument("--group", type=int, default=8, help="step: samples per prompt (default: 8)")
    parser.add_argument("--prompt", type=int, default=1000, help="step: prompt tokens (default: 1,000)")
    parser.add_argument("--vocab", type=int, default=32_000, help="step: vocabulary (default: 32,000)")
    parser.add_argument("--agree", type=float, default=0.5, help="step: how often a sample's token is its group's (default: 0.5)")
    parser.add_argument("--warmup", type=int, default=50, help="step: steps before the ones timed (default: 50)")
    parser.add_argument("--steps", type=int, default=50, help="step: steps timed (default: 50)")
    parser.add_argument("--drafts", type=int, default=4, help="step: draft tokens per row (default: 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON only")


def run(args: argparse.Namespace) -> int:
    figures: dict[str, Any] = {
        "memory": [memory(args.tokens, vocab, grown, args.seed) for vocab in (50, 32_000) for grown in (False, True)],
        "step": step_cpu(args.rows, args.group, args.prompt, args.vocab, args.agree, args.warmup, args.steps, args.drafts, args.seed),
        "command": "staleflow bench draft-index " + " ".join(sys.argv[3:] if sys.argv[1:3] == ["bench", "draft-index"] else []),
    }
    figures["command"] = figures["command"].strip()
    if args.json:
        print(json.dumps(figures, indent=1))
        return 0
    for row in figures["memory"]:
        how = "a token at a time" if row["grown"] else "at once"
        print(f"memory: {row['tokens']:,} tokens of a vocabulary of {row['vocab']:,} indexed {how}: "
              f"{row['bytes_per_token']:,.1f} bytes a token held, {row['peak_bytes_per_token']:,.1f} at the peak")
    step = figures["step"]
    print(f"step: {args.rows} rows ({args.group} per {args.prompt:,}-token prompt, vocabulary {args.vocab:,}, agreement "
          f"{args.agree}): {step['record_ms']:.2f} ms CPU a step to record, {step['draft_ms']:.2f} ms more to draft "
          f"{args.drafts} tokens for each row; {step['prompts_ms']:.0f} ms to index the prompts")
    print(f"reproduce: {figures['command']}")
    return 0


def memory(tokens: int, vocab: int, grown: bool, seed: int) -> dict[str, Any]:
    """Bytes per token an index of ``tokens`` random tokens holds once built, and at the peak."""
    rng = random.Random(seed)
    text = [rng.randrange(vocab) for _ in range(tokens)]
    tracemalloc.start()
    try:
        if grown:
            index = SuffixIndex()
            for token in text:
                index.extend([token])
        else:
            index = SuffixIndex(text)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del index
    return {"tokens": tokens, "vocab": vocab, "grown": grown, "bytes_per_token": held / tokens, "peak_bytes_per_token": peak / tokens}


def _steps(rows: int, group: int, prompt: int, vocab: int, agree: float, steps: int, seed: int) -> Iterator[list[list[int]]]:
    """Every step's rows (module docstring), one step at a time."""
    rng = random.Random(seed)
    groups = (rows + group - 1) // group
    prompts = [[rng.randrange(vocab) for _ in range(prompt)] for _ in range(groups)]
    common = [[rng.randrange(vocab) for _ in range(steps)] for _ in range(groups)]
    responses = [[c if rng.random() < agree else rng.randrange(vocab) for c in common[i // group]] for i in range(rows)]
    for t in range(steps):
        yield [prompts[i // group] + responses[i][: t + 1] for i in range(rows)]


def step_cpu(rows: int, group: int, prompt: int, vocab: int, agree: float, warmup: int, steps: int, drafts: int,
             seed: int) -> dict[str, float]:
    """Process CPU time per step to record the rows, and to draft for them (module docstring). Each
    step's rows are built, and the garbage collected, before the step is timed."""
    spent: dict[int, list[float]] = {}
    for k in (0, drafts):
        proposer = SiblingDrafts(lookback=2 * (drafts + 1), capacity=4 * rows)
        spent[k] = []
        for batch in _steps(rows, group, prompt, vocab, agree, warmup + steps, seed):
            gc.collect()
            started = time.process_time()
            proposer.propose(batch, k)
            spent[k].append(time.process_time() - started)
    record = sum(spent[0][warmup:]) / steps
    return {"record_ms": 1e3 * record, "draft_ms": 1e3 * (sum(spent[drafts][warmup:]) / steps - record),
            "prompts_ms": 1e3 * spent[0][0]}

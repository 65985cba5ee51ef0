"""Draft acceptance measured by replaying sampled groups: tau(k) per draft source (``app/draft_replay.py``).

``--samples FILE``: a JSONL file of sampled responses, one per line, ``{"group": id, "tokens": [ids]}``
(several samples per prompt, tokenized with the model's own tokenizer, drawn at the training
temperature); ``--replayed all`` replays every response, not only each group's longest.
``--builtin arithmetic``: the second built-in CPU job's groups, made here: its tiny
model warmed up as the job does (``runtime/settings/configs/arithmetic.yaml``'s warm-up), then
``--samples-per-prompt`` responses per prompt sampled at temperature 1.0 with transformers. Prints
tau(k) for k = 1..``--max-drafts`` for each source, the fitted acceptance by position bucket
(``--positions``) and by response-length quartile, and the command that reproduces it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from staleflow.app.draft_replay import POSITION_EDGES, REPLAYED, SOURCES, Bucket, DraftAcceptance, measure


def add_arguments(parser: argparse.ArgumentParser) -> None:
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument("--samples", type=Path, help='JSONL of sampled responses, one per line: {"group": id, "tokens": [ids]}')
    given.add_argument("--builtin", choices=["arithmetic"], help="sample the built-in arithmetic job's groups here (tiny model)")
    parser.add_argument("--prompts", type=int, default=100, help="--builtin: prompts (default: 100)")
    parser.add_argument("--samples-per-prompt", type=int, default=8, help="--builtin: responses per prompt (default: 8)")
    parser.add_argument("--max-drafts", type=int, default=8, help="the largest k measured (default: 8)")
    parser.add_argument("--max-match", type=int, default=8, help="the longest context suffix the proposer matches (default: 8)")
    parser.add_argument("--sources", choices=SOURCES, nargs="+", default=list(SOURCES), help="the draft sources measured (default: all)")
    parser.add_argument("--replayed", choices=REPLAYED, default="longest",
                        help="replay each group's longest response, or every response against the rest of its group (default: longest)")
    parser.add_argument("--positions", type=int, nargs="+", default=list(POSITION_EDGES), metavar="START",
                        help=f"where the position buckets start, from 0 (default: {' '.join(map(str, POSITION_EDGES))})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def read_samples(path: Path) -> dict[str, list[list[int]]]:
    """The groups of a samples file (module docstring); a bad line is an error naming it."""
    groups: dict[str, list[list[int]]] = defaultdict(list)
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            tokens = [int(t) for t in row["tokens"]]
            groups[str(row["group"])].append(tokens)
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: expected {{\"group\": id, \"tokens\": [ids]}}, got {line[:80]!r} ({exc})") from exc
    return dict(groups)


def builtin_arithmetic(prompts: int, per_prompt: int, seed: int) -> dict[str, list[list[int]]]:
    """Groups of the built-in arithmetic job's tiny model after its warm-up, sampled at temperature 1.0."""
    import random
    import tempfile

    import torch
    from staleflow.app.tiny_model import EOS_ID, PAD_ID, ensure_tiny_model
    from staleflow.app.warmup import warm_up
    from staleflow.runtime.settings.config import load_config
    from staleflow.runtime.tasks import Prompt
    from staleflow.runtime.tasks.builtin import arithmetic_problem
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = load_config(Path(__file__).resolve().parents[1] / "runtime/settings/configs/arithmetic.yaml")
    rng = random.Random(seed)

    def problems() -> Any:
        while True:
            question, solution, _ = arithmetic_problem(rng)
            yield Prompt(text=question, answer=solution)  # the job warms up on the worked solution (task.solution_key)

    stream = problems()
    with tempfile.TemporaryDirectory() as tmp:
        base = ensure_tiny_model(Path(tmp) / "tiny")
        tokenizer = AutoTokenizer.from_pretrained(base)

        def encode(text: str) -> list[int]:
            return list(tokenizer.encode(text, add_special_tokens=False))

        warmed = warm_up(base, Path(tmp) / "warm", stream, encode=encode, eos_id=EOS_ID, pad_id=PAD_ID,
                         steps=config.warmup.steps, batch_size=config.warmup.batch_size, lr=config.warmup.lr, seed=seed)
        model = AutoModelForCausalLM.from_pretrained(warmed.path, dtype=torch.float32).eval()
        torch.manual_seed(seed)
        groups = {}
        for index in range(prompts):
            prompt = torch.tensor([encode(next(stream).text)])
            with torch.no_grad():
                out = model.generate(prompt, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                     max_new_tokens=config.rollout.max_new_tokens, num_return_sequences=per_prompt,
                                     eos_token_id=EOS_ID, pad_token_id=PAD_ID)
            responses = []
            for row in out[:, prompt.shape[1]:].tolist():
                responses.append(row[: row.index(EOS_ID) + 1] if EOS_ID in row else row)
            groups[f"p{index}"] = responses
    return groups


def _bucket(bucket: Bucket) -> dict[str, Any]:
    return {"label": bucket.label, "tokens": bucket.tokens, "tau": bucket.tau, "acceptance": {s: bucket.acceptance(s) for s in bucket.tau}}


def report(result: DraftAcceptance, command: str) -> dict[str, Any]:
    return {"tau": result.tau, "acceptance": {s: result.acceptance(s) for s in result.tau},
            "residual": {s: result.residual(s) for s in result.tau}, "groups": result.groups, "tokens": result.tokens,
            "by_position": [_bucket(b) for b in result.by_position], "by_length": [_bucket(b) for b in result.by_length],
            "command": command}


def _print_buckets(title: str, buckets: list[Bucket], max_drafts: int) -> None:
    print(f"{title}: a (geometric fit) per source; tau(1) / tau({max_drafts})")
    print(f"{'bucket':<12} {'tokens':>8} " + " ".join(f"{s:<22}" for s in buckets[0].tau))
    for b in buckets:
        print(f"{b.label:<12} {b.tokens:>8,} " + " ".join(f"{b.acceptance(s):.3f} {b.tau[s][0]:.3f}/{b.tau[s][-1]:<7.3f}" for s in b.tau))


def run(args: argparse.Namespace) -> int:
    try:
        groups = read_samples(args.samples) if args.samples else builtin_arithmetic(args.prompts, args.samples_per_prompt, args.seed)
        result = measure(groups, max_drafts=args.max_drafts, max_match=args.max_match, position_edges=args.positions,
                         replayed=args.replayed, sources=args.sources)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    command = "staleflow bench draft-acceptance " + " ".join(sys.argv[3:] if sys.argv[1:3] == ["bench", "draft-acceptance"] else [])
    figures = report(result, command.strip())
    if args.json:
        print(json.dumps(figures, indent=1))
        return 0
    which = "their longest responses" if args.replayed == "longest" else "every response"
    print(f"{result.groups} groups, {which} replayed ({result.tokens:,} tokens); tau(k), tokens per verification step:")
    print("source    " + " ".join(f"k={k:<5d}" for k in range(1, args.max_drafts + 1)) + " a (geometric fit) rms residual")
    for source in result.tau:
        print(f"{source:<9} " + " ".join(f"{tau:<7.3f}" for tau in result.tau[source])
              + f" {result.acceptance(source):<17.3f} {result.residual(source):.3f}")
    _print_buckets("by position in the response (where a step starts)", result.by_position, args.max_drafts)
    _print_buckets("by the response's length (quartiles of the replayed ones)", result.by_length, args.max_drafts)
    print(f"reproduce: {figures['command']}")
    return 0

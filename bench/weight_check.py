"""The weight check's false alarms and detection rates in bfloat16, on simulated tensor-parallel ranks.

A rank's layer is PyTorch's CPU bfloat16 kernel (``F.linear``, oneDNN) applied to the seeded probe;
the trainer's side is :class:`~staleflow.adapters.rlkit.weight_checksum.ExpectedResponses`. Weights
are random normal rows (deviation 0.02) in bfloat16. Four figures:

- ``false_alarms``: rows of correct loads flagged (must be 0), and the largest ``|error| / tolerance``;
- ``wrong_rows``: by input width ``K``, the share of rows holding another row's weights (a swapped or
  shifted shard's rows) that pass, and the probability that a shard of 10 such rows passes;
- ``lm_head``: a 151,936-row ``lm_head`` split over two ranks; per probe seed, the two shards swapped
  and shifted by 1 to ``--shifts`` rows either way, each a trial: trials detected, and correct loads
  flagged; and the time to compute the expected responses, in nanoseconds a weight;
- ``versions``: by relative update ``delta`` (each weight moved by ``delta`` times the weights'
  deviation, in float32, then cast to bfloat16), the share of rows that pass, and the probability
  that a 1,536-row layer, and a whole Qwen2.5-1.5B load (about 900,000 rows), pass.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any

# torch (and the checksum module built on it) is imported where a figure is computed: the command
# line that lists this benchmark among others (every ``staleflow`` command) does not load it
if TYPE_CHECKING:
    import torch

SCALE = 0.02  # the weights' deviation
LM_HEAD_ROWS = 151_936  # Qwen2.5's vocabulary
QWEN_ROWS = 900_000  # rows of every layer of Qwen2.5-1.5B (embedding, 28 x (q, k, v, o, gate, up, down))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", type=int, default=10, help="probe seeds (versions) per figure (default: 10)")
    parser.add_argument("--hidden", type=int, default=1536, help="lm_head's input width (default: 1536, Qwen2.5-1.5B's)")
    parser.add_argument("--shifts", type=int, default=100, help="shard shifts tried each way per seed (default: 100)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON only")


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    figures = measure(args.seeds, args.hidden, args.shifts)
    figures["seconds"] = round(time.perf_counter() - started, 1)
    figures["command"] = "staleflow bench weight-check " + " ".join(sys.argv[3:])
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    alarms, head = figures["false_alarms"], figures["lm_head"]
    print(f"false alarms: {alarms['flagged']} of {alarms['rows']:,} rows of correct loads "
          f"(largest error/tolerance {alarms['worst_ratio']:.3f})")
    for row in figures["wrong_rows"]:
        print(f"wrong rows at K={row['K']}: {row['passing']:.4f} pass; "
              f"a shard of 10 such rows passes with probability {row['shard_of_10']:.1e}")
    print(f"lm_head {LM_HEAD_ROWS:,} x {args.hidden}, 2 ranks: {head['detected']} of {head['trials']} swapped or shifted shards "
          f"detected; {head['flagged']} of {head['correct']} correct loads flagged; expected responses computed in "
          f"{head['expected_ns_per_weight']} ns a weight")
    for row in figures["versions"]:
        print(f"update delta={row['delta']:.3f}: {row['passing']:.5f} of rows pass; a 1,536-row layer passes with probability "
              f"{row['layer']:.2e}, a whole load {row['load']:.2e}")
    print(f"({figures['seconds']} s; {figures['command']})")
    return 0


def measure(seeds: int, hidden: int, shifts: int) -> dict[str, Any]:
    """The four figures of the module's docstring."""
    return {
        "false_alarms": false_alarms([(4096, 256), (2048, 1536), (512, 8960)], seeds),
        "wrong_rows": [{"K": k, **wrong_rows(rows, k, seeds)} for rows, k in ((4096, 256), (2048, 1536), (512, 8960))],
        "lm_head": lm_head_shards(hidden, seeds, shifts),
        "versions": [{"delta": d, **version_rows(2048, 1536, d, seeds)} for d in (0.01, 0.02, 0.05, 0.1)],
    }


def random_rows(rows: int, width: int, seed: int) -> torch.Tensor:
    """Normal weights of deviation :data:`SCALE`, in float32 (cast to bfloat16 to serve them)."""
    import torch

    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)) * SCALE


def served(matrix: torch.Tensor, seed: int) -> torch.Tensor:
    """What a rank's kernel computes of ``matrix`` (bfloat16) on the probe of ``seed``."""
    import torch
    from staleflow.adapters.rlkit.weight_checksum import layer_probe

    x = layer_probe({"kind": "rows", "in": matrix.shape[1], "parts": []}, seed).to(torch.bfloat16)
    return torch.nn.functional.linear(x.unsqueeze(0), matrix)[0].to(torch.float64)


def expected(matrix: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's responses of ``matrix``'s rows to the probe of ``seed``, and their tolerances."""
    import torch
    from staleflow.adapters.rlkit.weight_checksum import ExpectedResponses, Needs

    reference = ExpectedResponses.compute([("w", matrix)], seed, torch.bfloat16, Needs(rows=frozenset({"w"})))
    return reference.reference({"kind": "rows", "parts": [("w", 0, matrix.shape[0])]})


def false_alarms(shapes: list[tuple[int, int]], seeds: int) -> dict[str, Any]:
    """Correct loads of each ``(rows, K)`` shape, probed with each seed: rows flagged, largest error/tolerance."""
    import torch

    flagged = rows = 0
    worst = 0.0
    for rows_, width in shapes:
        matrix = random_rows(rows_, width, width).to(torch.bfloat16)
        for seed in range(seeds):
            want, tol = expected(matrix, seed)
            ratio = (served(matrix, seed) - want).abs() / tol
            flagged += int((ratio > 1).sum())
            rows += rows_
            worst = max(worst, float(ratio.max()))
    return {"flagged": flagged, "rows": rows, "worst_ratio": worst}


def wrong_rows(rows: int, width: int, seeds: int) -> dict[str, float]:
    """The share of rows that pass when a rank holds other rows (unrelated, of the same deviation)."""
    import torch

    right, wrong = random_rows(rows, width, 1).to(torch.bfloat16), random_rows(rows, width, 2).to(torch.bfloat16)
    passing = 0
    for seed in range(seeds):
        want, tol = expected(right, seed)
        passing += int(((served(wrong, seed) - want).abs() <= tol).sum())
    share = passing / (rows * seeds)
    return {"passing": share, "shard_of_10": share**10}


def lm_head_shards(hidden: int, seeds: int, shifts: int) -> dict[str, Any]:
    """A ``lm_head`` split over two ranks by rows; per seed, the correct load (two checks, one a
    rank), the swapped shards and the shards shifted by 1..``shifts`` rows either way (a trial
    each, detected when some row of either rank fails). A shifted rank's kernel output is the
    correct output shifted: each output row is one row's dot product with the probe."""
    import torch

    matrix = random_rows(LM_HEAD_ROWS, hidden, 3).to(torch.bfloat16)
    half = LM_HEAD_ROWS // 2
    trials = detected = flagged = correct = 0
    computing = 0.0
    for seed in range(seeds):
        started = time.perf_counter()
        want, tol = expected(matrix, seed)
        computing += time.perf_counter() - started
        got = served(matrix, seed)

        def fails(rows_held: torch.Tensor, want: torch.Tensor = want, tol: torch.Tensor = tol, got: torch.Tensor = got) -> bool:
            """Whether the check fails a layout whose ranks hold rows ``rows_held`` (in order): some
            row off (the first 1,024 rows looked at first, the rest only if they all pass)."""
            first = slice(0, 1024)
            if bool(((got[rows_held[first]] - want[first]).abs() > tol[first]).any()):
                return True
            return bool(((got[rows_held] - want).abs() > tol).any())

        every = torch.arange(LM_HEAD_ROWS)
        flagged += int(fails(every))
        correct += 1
        faults = [torch.cat([every[half:], every[:half]])]  # each rank holds the other's shard
        faults += [torch.roll(every, k) for k in range(-shifts, shifts + 1) if k]
        for rows_held in faults:
            trials += 1
            detected += int(fails(rows_held))
    return {"trials": trials, "detected": detected, "correct": correct, "flagged": flagged,
            "expected_ns_per_weight": round(computing / seeds / matrix.numel() * 1e9, 2)}


def version_rows(rows: int, width: int, delta: float, seeds: int) -> dict[str, float]:
    """The share of rows that pass when a rank holds another version: every weight moved by
    ``delta`` times the weights' deviation (in float32, then cast to bfloat16)."""
    import torch

    master = random_rows(rows, width, 4)
    update = torch.randn(rows, width, generator=torch.Generator().manual_seed(5)) * SCALE * delta
    right, other = master.to(torch.bfloat16), (master + update).to(torch.bfloat16)
    passing = 0
    for seed in range(seeds):
        want, tol = expected(right, seed)
        passing += int(((served(other, seed) - want).abs() <= tol).sum())
    share = passing / (rows * seeds)
    return {"passing": share, "layer": share**1536, "load": share**QWEN_ROWS}

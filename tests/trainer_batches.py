"""Training batches for the trainer tests: groups of very different lengths, stale tokens."""

from __future__ import annotations

import torch
from staleflow.runtime.types import TrainingBatch, Trajectory


def make_batch(version: int = 0, groups: int = 3, size: int = 4, seed: int = 0) -> TrainingBatch:
    """Groups of responses of very different lengths, rewards varying inside each group, stale tokens."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for g in range(groups):
        prompt = torch.randint(4, 260, (3 + g,), generator=gen).tolist()
        trajs = []
        for i in range(size):
            n = int(torch.randint(1, 30, (1,), generator=gen))
            trajs.append(
                Trajectory(
                    request_id=f"g{g}-{i}", group_id=f"g{g}", prompt_ids=prompt,
                    output_ids=torch.randint(4, 260, (n,), generator=gen).tolist(),
                    logprobs=(-torch.rand(n, generator=gen) * 9).tolist(),
                    versions=[max(version - (j % 2), 0) for j in range(n)],
                    finish_reason="stop", reward=float(i == g % size) + 0.1 * i,
                )
            )
        out[f"g{g}"] = trajs
    return TrainingBatch(version=version, groups=out)

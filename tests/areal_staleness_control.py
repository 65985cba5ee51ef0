"""Control run (not collected by pytest): AReaL's own staleness control vs the protocol binding.

Same fake engine, workflow (AReaL's RLVRWorkflow), filter and trainer as tests/test_areal_adapter.py;
``areal`` mode is AReaL 1.0.4 unchanged (its StalenessManager, max_head_offpolicyness = eta, and its
FIFO ``prepare_batch``), ``protocol`` mode is staleflow.adapters.areal. Prints, per seed, how many
trained samples had each staleness (batch version - version of the first generated token).

    PYTHONPATH=.typecheck .venv/bin/python tests/areal_staleness_control.py [SEEDS]
"""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_areal_adapter as t
from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
from areal.infra.workflow_executor import WorkflowExecutor
from areal.workflow.rlvr import RLVRWorkflow
from staleflow.adapters.areal import ProtocolBatches, ProtocolStalenessManager
from staleflow.protocol import LockedStalenessManager
from torchdata.stateful_dataloader import StatefulDataLoader


def run(mode: str, seed: int, steps: int = 12, eta: int = 1, batch_size: int = 4) -> tuple[collections.Counter[int], float]:
    policy = torch.zeros(len(t.VOCAB), requires_grad=True)
    optimizer = torch.optim.SGD([policy], lr=0.5)
    engine = t.FakeEngine(policy, seed=seed)
    config = InferenceEngineConfig(consumer_batch_size=batch_size, max_head_offpolicyness=eta,
                                   max_concurrent_rollouts=16)
    workflow = RLVRWorkflow(reward_fn=t.reward_fn, gconfig=GenerationHyperparameters(max_new_tokens=8),
                            tokenizer=t._tokenizer())
    if mode == "protocol":
        protocol = LockedStalenessManager.create(eta, batch_size, redundancy=1)
        staleness = ProtocolStalenessManager(protocol, engine, max_concurrent_rollouts=16)
        executor = WorkflowExecutor(config, engine, staleness_manager=staleness)
        executor.initialize(train_data_parallel_size=1)
        batches = ProtocolBatches(executor, staleness, workflow, t._prompts(), should_accept_fn=t._accept)

        def next_batch() -> list[dict[str, Any]]:
            return batches.prepare_batch(timeout=120).trajectories
    else:
        executor = WorkflowExecutor(config, engine)
        executor.initialize(train_data_parallel_size=1)
        prompts = t._prompts()
        loader = StatefulDataLoader([next(prompts) for _ in range(1000)], batch_size=batch_size,
                                    collate_fn=lambda rows: rows)

        def next_batch() -> list[dict[str, Any]]:
            return executor.prepare_batch(loader, workflow, should_accept_fn=t._accept)
    staleness_count: collections.Counter[int] = collections.Counter()
    started = time.perf_counter()
    try:
        for step in range(steps):
            trajectories = next_batch()
            loss = torch.zeros(())
            for traj in trajectories:
                mask = traj["loss_mask"][0].bool()
                staleness_count[step - int(traj["versions"][0][mask].min())] += 1
                out = traj["input_ids"][0][mask]
                loss = loss - (float(traj["rewards"][0]) - 0.2) * torch.log_softmax(policy, 0)[out].sum()
            optimizer.zero_grad()
            (loss / batch_size).backward()
            optimizer.step()
            executor.pause()
            engine.sync(policy, step + 1)
            executor.resume()
    finally:
        executor.destroy()
    return staleness_count, time.perf_counter() - started


if __name__ == "__main__":
    seeds = [int(s) for s in sys.argv[1:]] or [0, 1, 2]
    for mode in ("areal", "protocol"):
        for seed in seeds:
            counts, seconds = run(mode, seed)
            over = sum(n for s, n in counts.items() if s > 1)
            print(f"{mode:8s} seed {seed}: staleness -> samples {dict(sorted(counts.items()))}; "
                  f"over eta=1: {over}; {seconds:.1f} s for 12 steps")

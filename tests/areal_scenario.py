"""AReaL (areal 1.0.4) runs for tests/test_areal_adapter.py, in a process of their own.

Importing areal imports flask, whose request proxies make vLLM's CPU kernel registration fail in the
same process ("Working outside of application context"), so the pytest process never imports it:
each test runs ``python tests/areal_scenario.py MODE OUT_DIR [SEED...]``, which writes
``OUT_DIR/result.json`` (and the protocol trace) or exits with 3 when areal is not importable.

Modes (``tests`` runs ``binding`` and ``engine-ahead`` in one process):

- ``binding``: AReaL's own WorkflowExecutor and RLVRWorkflow with staleflow.adapters.areal, a CPU
  fake engine and a tiny torch policy trained on exactly the consumed batches;
- ``engine-ahead``: an engine stamped with a version the protocol has not reached;
- ``control``: AReaL unchanged (its StalenessManager, max_head_offpolicyness = eta, FIFO
  prepare_batch) and the binding on the same setup, per seed; prints how many trained samples had
  each staleness (batch version - version of the first generated token). Not run by the tests:
  ``PYTHONPATH=.typecheck .venv/bin/python tests/areal_scenario.py control /tmp/out 0 1 2``.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

try:
    import torch
    from areal.api import ModelResponse
    from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
    from areal.infra import workflow_context
    from areal.infra.workflow_executor import WorkflowExecutor
    from areal.workflow.rlvr import RLVRWorkflow
    from torchdata.stateful_dataloader import StatefulDataLoader
except ImportError as missing:
    print(f"areal is not importable: {missing}", file=sys.stderr)
    sys.exit(3)

from staleflow.adapters.areal import ProtocolBatches, ProtocolStalenessManager
from staleflow.protocol import LockedStalenessManager

VOCAB = [f"t{i}" for i in range(12)] + ["<eos>", "<pad>"]
TARGET = VOCAB.index("t7")
EOS = VOCAB.index("<eos>")


def tokenizer() -> Any:
    """A local word-level tokenizer with a chat template (no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<eos>", pad_token="<pad>",
        chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}",
    )


def reward_fn(prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **data: Any) -> float:
    """Share of generated tokens that are the target token (module level: AReaL pickles it)."""
    body = [t for t in completion_ids if t != EOS]
    return sum(t == TARGET for t in body) / max(1, len(body))


class FakeEngine:
    """AReaL's InferenceEngine surface that RLVRWorkflow and WorkflowExecutor use, on CPU.

    It samples tokens from the policy weights it was last synced with, one token at a time with a
    short sleep (so episodes overlap training), and records each token's model version as AReaL's
    interruptible generation does: a trajectory may span a weight update. It also records, per AReaL
    task id, what it generated, so the test can tell which task a trained trajectory came from.
    """

    def __init__(self, logits: torch.Tensor, seed: int) -> None:
        self._version = 0
        self._weights = logits.detach().clone()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.generated: dict[int, list[int]] = {}

    def get_version(self) -> int:
        return self._version

    def sync(self, logits: torch.Tensor, version: int) -> None:
        with self._lock:
            self._weights = logits.detach().clone()
            self._version = version

    async def agenerate(self, req: Any) -> ModelResponse:
        tokens: list[int] = []
        versions: list[int] = []
        for _ in range(self._rng.randint(2, 6)):
            await asyncio.sleep(self._rng.uniform(0.001, 0.01))
            with self._lock:
                probs = torch.softmax(self._weights, dim=0).tolist()
                version = self._version
            tokens.append(self._rng.choices(range(EOS), weights=probs[:EOS])[0])
            versions.append(version)
        tokens.append(EOS)
        versions.append(self._version)
        task_id = workflow_context.get().task_id
        assert task_id is not None
        self.generated[task_id] = tokens
        return ModelResponse(input_tokens=list(req.input_ids), output_tokens=tokens,
                             output_logprobs=[-1.0] * len(tokens), output_versions=versions,
                             stop_reason="stop", tokenizer=req.tokenizer)


def prompts() -> Any:
    rng = random.Random(5)
    for _ in itertools.count():
        words = " ".join(rng.choice(VOCAB[:12]) for _ in range(rng.randint(1, 4)))
        yield {"messages": [{"role": "user", "content": words}]}


def accept(trajectory: dict[str, Any]) -> bool:
    """A host-side filter (AReaL's should_accept_fn): drop every sequence of length divisible by 4."""
    return int(trajectory["input_ids"].shape[1]) % 4 != 0


def _workflow() -> RLVRWorkflow:
    return RLVRWorkflow(reward_fn=reward_fn, gconfig=GenerationHyperparameters(max_new_tokens=8), tokenizer=tokenizer())


def _config(batch_size: int, eta: int) -> InferenceEngineConfig:
    return InferenceEngineConfig(consumer_batch_size=batch_size, max_head_offpolicyness=eta, max_concurrent_rollouts=16)


def _train_step(policy: torch.Tensor, optimizer: torch.optim.Optimizer, trajectories: list[dict[str, Any]],
                batch_size: int) -> list[tuple[int, list[int], float]]:
    """REINFORCE on the tiny policy; returns (first-token version, generated tokens, reward) per row."""
    rows = []
    loss = torch.zeros(())
    for traj in trajectories:
        mask = traj["loss_mask"][0].bool()
        out = traj["input_ids"][0][mask]
        reward = float(traj["rewards"][0])
        rows.append((int(traj["versions"][0][mask].min()), out.tolist(), reward))
        loss = loss - (reward - 0.2) * torch.log_softmax(policy, 0)[out].sum()
    optimizer.zero_grad()
    (loss / batch_size).backward()
    optimizer.step()
    return rows


def binding(out: Path, steps: int = 12, eta: int = 1, batch_size: int = 4, redundancy: int = 1,
            seed: int = 1) -> dict[str, Any]:
    protocol = LockedStalenessManager.create(eta, batch_size, redundancy)
    writer = protocol.attach_trace(out / "areal-trace.jsonl")
    policy = torch.zeros(len(VOCAB), requires_grad=True)
    optimizer = torch.optim.SGD([policy], lr=0.5)
    engine = FakeEngine(policy, seed=seed)
    staleness = ProtocolStalenessManager(protocol, engine, max_concurrent_rollouts=16)
    executor = WorkflowExecutor(_config(batch_size, eta), engine, staleness_manager=staleness)
    executor.initialize(train_data_parallel_size=1)
    batches = ProtocolBatches(executor, staleness, _workflow(), prompts(), should_accept_fn=accept)
    trained = []
    started = time.perf_counter()
    try:
        for _ in range(steps):
            got = batches.prepare_batch(timeout=120)
            rows = _train_step(policy, optimizer, got.trajectories, batch_size)
            trained.append({"version": got.batch.version, "group_versions": list(got.batch.group_versions),
                            "tasks": [int(g) for g in got.batch.group_ids],
                            "dropped": [int(g) for g in got.batch.dropped],
                            "heads": [r[0] for r in rows], "tokens": [r[1] for r in rows],
                            "rewards": [r[2] for r in rows]})
            executor.pause()  # AReaL's weight-update sequence: pause, push weights + version, resume
            engine.sync(policy, protocol.version)
            executor.resume()
    finally:
        executor.destroy()
        writer.close()
    stats = staleness.get_stats()
    return {"trained": trained, "generated": {str(k): v for k, v in engine.generated.items()},
            "accepted": stats.accepted, "rejected": stats.rejected, "seconds": time.perf_counter() - started}


def engine_ahead(out: Path) -> dict[str, Any]:
    protocol = LockedStalenessManager.create(eta=1, batch_size=2)
    policy = torch.zeros(len(VOCAB))
    engine = FakeEngine(policy, seed=0)
    engine.sync(policy, 3)  # e.g. stamped with optimizer steps instead of weight versions
    staleness = ProtocolStalenessManager(protocol, engine)
    executor = WorkflowExecutor(_config(2, 1), engine, staleness_manager=staleness)
    executor.initialize(train_data_parallel_size=1)
    batches = ProtocolBatches(executor, staleness, _workflow(), prompts())
    result: dict[str, Any] = {}
    try:
        batches.prepare_batch(timeout=60)
    except RuntimeError as error:
        result["error"] = str(error)
    finally:
        executor.destroy()
    try:
        staleness.on_version_recovered(3)
    except ValueError as error:
        result["recovered_error"] = str(error)
    result.update(active=len(protocol), version=protocol.version)
    return result


def areal_default(steps: int = 12, eta: int = 1, batch_size: int = 4, seed: int = 1) -> list[list[int]]:
    """AReaL 1.0.4 unchanged: first-token versions of each trained batch."""
    policy = torch.zeros(len(VOCAB), requires_grad=True)
    optimizer = torch.optim.SGD([policy], lr=0.5)
    engine = FakeEngine(policy, seed=seed)
    executor = WorkflowExecutor(_config(batch_size, eta), engine)
    executor.initialize(train_data_parallel_size=1)
    feed = prompts()
    loader = StatefulDataLoader([next(feed) for _ in range(1000)], batch_size=batch_size, collate_fn=lambda rows: rows)
    heads = []
    try:
        for step in range(steps):
            rows = _train_step(policy, optimizer, executor.prepare_batch(loader, _workflow(), should_accept_fn=accept),
                               batch_size)
            heads.append([r[0] for r in rows])
            executor.pause()
            engine.sync(policy, step + 1)
            executor.resume()
    finally:
        executor.destroy()
    return heads


def control(out: Path, seeds: list[int]) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for seed in seeds:
        runs = {
            "areal": areal_default(seed=seed),
            "protocol": [b["heads"] for b in binding(out, seed=seed)["trained"]],
        }
        for mode, heads in runs.items():
            counts = collections.Counter(step - h for step, batch in enumerate(heads) for h in batch)
            over = sum(n for s, n in counts.items() if s > 1)
            report[f"{mode} seed {seed}"] = dict(sorted(counts.items()))
            print(f"{mode:8s} seed {seed}: staleness -> samples {dict(sorted(counts.items()))}; over eta=1: {over}")
    return report


def main(argv: list[str]) -> int:
    mode, out = argv[0], Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in argv[2:]]
    if mode == "binding":
        result = binding(out, seed=seeds[0] if seeds else 1)
    elif mode == "tests":  # what tests/test_areal_adapter.py checks, with one import of areal
        result = {"binding": binding(out), "engine_ahead": engine_ahead(out)}
    elif mode == "engine-ahead":
        result = engine_ahead(out)
    elif mode == "control":
        result = control(out, seeds or [0, 1, 2])
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    (out / "result.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""AReaL (areal 1.0.4) with StaleFlow's protocol: AReaL's own WorkflowExecutor, RLVRWorkflow and
wait_for_task, a CPU fake inference engine, a tiny torch policy trained on exactly the consumed
batches; the protocol trace is checked with the standard-library checker."""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

try:
    import areal.infra.workflow_executor  # noqa: F401
except ImportError as missing:
    # scripts/setup.sh installs the pinned `areal` extra (--no-deps) unless STALEFLOW_EXTRAS leaves it out
    if os.environ.get("CI") and "areal" in os.environ.get("STALEFLOW_EXTRAS", "areal"):
        pytest.fail(f"areal is not importable although setup.sh installs it: {missing}", pytrace=False)
    pytest.skip(f"needs the areal extra (scripts/setup.sh installs it with --no-deps): {missing}",
                allow_module_level=True)

import torch
from areal.api import ModelResponse
from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
from areal.infra import workflow_context
from areal.infra.workflow_executor import WorkflowExecutor
from areal.workflow.rlvr import RLVRWorkflow
from staleflow.adapters.areal import ProtocolBatches, ProtocolStalenessManager
from staleflow.protocol import LockedStalenessManager
from staleflow.protocol.trace import read_trace

VOCAB = [f"t{i}" for i in range(12)] + ["<eos>", "<pad>"]
TARGET = VOCAB.index("t7")
EOS = VOCAB.index("<eos>")


def _tokenizer() -> Any:
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
        length = self._rng.randint(2, 6)
        for _ in range(length):
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


def _prompts() -> Any:
    rng = random.Random(5)
    for _ in itertools.count():
        words = " ".join(rng.choice(VOCAB[:12]) for _ in range(rng.randint(1, 4)))
        yield {"messages": [{"role": "user", "content": words}]}


def _accept(trajectory: dict[str, Any]) -> bool:
    """A host-side filter (AReaL's should_accept_fn): drop every sequence of length divisible by 4."""
    return int(trajectory["input_ids"].shape[1]) % 4 != 0


@pytest.mark.slow
def test_areal_trains_exactly_the_protocol_batches_and_the_trace_checks(tmp_path: Path) -> None:
    eta, batch_size, redundancy, steps = 1, 4, 1, 12
    protocol = LockedStalenessManager.create(eta, batch_size, redundancy)
    trace = tmp_path / "areal-trace.jsonl"
    writer = protocol.attach_trace(trace)

    policy = torch.zeros(len(VOCAB), requires_grad=True)
    optimizer = torch.optim.SGD([policy], lr=0.5)
    engine = FakeEngine(policy, seed=1)
    staleness = ProtocolStalenessManager(protocol, engine, max_concurrent_rollouts=16)
    config = InferenceEngineConfig(consumer_batch_size=batch_size, max_head_offpolicyness=eta,
                                   max_concurrent_rollouts=16)
    executor = WorkflowExecutor(config, engine, staleness_manager=staleness)
    executor.initialize(train_data_parallel_size=1)
    workflow = RLVRWorkflow(reward_fn=reward_fn, gconfig=GenerationHyperparameters(max_new_tokens=8),
                            tokenizer=_tokenizer())
    batches = ProtocolBatches(executor, staleness, workflow, _prompts(), should_accept_fn=_accept)
    trained: list[tuple[int, list[int], list[tuple[int, int, list[int]]]]] = []
    rewards: list[float] = []
    try:
        for _ in range(steps):
            got = batches.prepare_batch(timeout=120)
            rows = []
            loss = torch.zeros(())
            for task_id, traj in zip(got.batch.group_ids, got.trajectories):
                mask = traj["loss_mask"][0].bool()
                out = traj["input_ids"][0][mask].tolist()
                head = int(traj["versions"][0][mask].min())
                rows.append((int(task_id), head, out))
                reward = float(traj["rewards"][0])
                rewards.append(reward)
                loss = loss - (reward - 0.2) * torch.log_softmax(policy, 0)[torch.tensor(out)].sum()
            optimizer.zero_grad()
            (loss / batch_size).backward()
            optimizer.step()
            trained.append((got.batch.version, list(got.batch.group_versions), rows))
            executor.pause()  # AReaL's weight-update sequence: pause, push weights + version, resume
            engine.sync(policy, protocol.version)
            executor.resume()
    finally:
        executor.destroy()
        writer.close()

    # the trainer got exactly the consumed tasks, in order, each one's own trajectory
    assert [b for b, _, _ in trained] == list(range(steps))
    ids = [task for _, _, rows in trained for task, _, _ in rows]
    assert len(ids) == len(set(ids)) == steps * batch_size
    for _, _, rows in trained:
        for task_id, _, out in rows:
            assert out == engine.generated[task_id]
    # the bound, measured on AReaL's own per-token versions (independent of the protocol's books)
    for version, group_versions, rows in trained:
        for reserved_at, (_, head, _) in zip(group_versions, rows):
            assert reserved_at <= head <= version and version - head <= eta
    assert any(version - head == eta for version, _, rows in trained for _, head, _ in rows)  # stale ones too
    # the trace: AReaL's callbacks drove every operation, rejections and drops included
    events = [e for s in read_trace(trace) for e in s.events]
    ops = {op: sum(e.op == op for e in events) for op in ("reserve", "occupy", "abort", "consume")}
    assert ops["consume"] == steps and ops["abort"] > 0 and ops["occupy"] >= steps * batch_size
    stats = staleness.get_stats()
    assert stats.accepted >= ops["occupy"] and stats.rejected >= ops["abort"]  # > when a dropped task finishes
    checked = subprocess.run([sys.executable, "-m", "staleflow.protocol.check", str(trace)],
                             capture_output=True, text=True, check=False, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"accepted ({len(events)} events" in checked.stdout


def test_an_engine_ahead_of_the_trainer_stops_the_trainer_with_the_protocol_error() -> None:
    """A host that stamps its engine with a version the protocol has not reached (e.g. optimizer steps
    instead of weight versions) gets the InvalidVersionError in prepare_batch, not a silent rejection."""
    protocol = LockedStalenessManager.create(eta=1, batch_size=2)
    policy = torch.zeros(len(VOCAB))
    engine = FakeEngine(policy, seed=0)
    engine.sync(policy, 3)
    staleness = ProtocolStalenessManager(protocol, engine)
    config = InferenceEngineConfig(consumer_batch_size=2, max_head_offpolicyness=1, max_concurrent_rollouts=4)
    executor = WorkflowExecutor(config, engine, staleness_manager=staleness)
    executor.initialize(train_data_parallel_size=1)
    workflow = RLVRWorkflow(reward_fn=reward_fn, gconfig=GenerationHyperparameters(max_new_tokens=8),
                            tokenizer=_tokenizer())
    batches = ProtocolBatches(executor, staleness, workflow, _prompts())
    try:
        with pytest.raises(RuntimeError, match="ahead of the trainer"):
            batches.prepare_batch(timeout=60)
    finally:
        executor.destroy()
    assert len(protocol) == 0 and protocol.version == 0
    with pytest.raises(ValueError, match="restore the protocol snapshot"):
        staleness.on_version_recovered(3)

"""AReaL 1.0.4 with ``staleflow_protocol.bindings.areal``, run INSIDE AReaL's own venv (tests/test_areal_dropin.py
builds it: areal, its light dependencies, CPU torch and the light ``staleflow-protocol`` package,
never ``staleflow``).

``python areal_dropin_run.py OUT [STEPS] [RECOVER_AT]`` starts two data-parallel ranks (processes,
gloo all-reduce of the policy gradient), each with AReaL's own ``WorkflowExecutor`` machinery (its
dispatcher threads and async task runner) as :class:`ProtocolWorkflowExecutor`, a CPU fake engine
and a tiny torch policy trained on exactly the consumed batches. At step RECOVER_AT the ranks dump
AReaL's ``RecoverInfo`` (the protocol travels in the dataloader state through ``RecoverableLoader``)
and die with tasks in flight; two new ranks load it and run to STEPS. The parent checks the bound on
every trained sample (per-token versions recorded by the engine), that each batch trained exactly
its consumed ids, that no prompt was lost, and the traces (``python -m staleflow_protocol.check``);
it prints one JSON line and exits 0, or raises.

``python areal_dropin_run.py --trainer-paths OUT``: AReaL's default path (``ProtocolRolloutController``
over the in-process :class:`InProcessScheduler`, 8 steps; built directly, and built by PPOTrainer's own
single-controller ``_init_rollout`` under ``ProtocolTrainerHooks``) and RLTrainer's recover through AReaL's
``RecoverHandler`` (``ProtocolTrainerHooks`` on a stand-in for ``PPOTrainer.__init__``, dump after step 3,
a second life loads it); prints one JSON line (test_areal_dropin.py says what is real and what is faked).

``python areal_dropin_run.py --control OUT [STEPS]``: the same job on AReaL's own staleness manager
and FIFO ``prepare_batch`` (one rank); prints how many trained samples were past eta.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from areal.api import RolloutWorkflow, Scheduler, StepInfo, Worker
from areal.api.cli_args import InferenceEngineConfig, RecoverConfig
from areal.api.io_struct import FinetuneSpec
from areal.infra import workflow_context
from areal.infra.workflow_context import WorkflowContext
from areal.infra.workflow_executor import WorkflowExecutor
from areal.utils.dynamic_import import import_from_string
from areal.utils.recover import RecoverHandler, RecoverInfo
from staleflow_protocol import LockedStalenessManager
from staleflow_protocol.bindings.areal import (
    FIRST_TASK_ID,
    ProtocolBatches,
    ProtocolRolloutController,
    ProtocolStalenessManager,
    ProtocolWorkflowExecutor,
    RecoverableLoader,
)
from staleflow_protocol.bindings.areal_trainer import ProtocolTrainerHooks
from staleflow_protocol.trace import read_trace
from torchdata.stateful_dataloader import StatefulDataLoader

ETA, BATCH, REDUNDANCY, WORLD = 1, 2, 1, 2  # BATCH groups per rank and step (4 per step in all)
VOCAB, TARGET = 12, 7


class FakeEngine:
    """The inference-engine surface AReaL's executor uses (``get_version``), on CPU: samples tokens
    from the policy it was last synced with, one at a time, recording each token's model version (a
    trajectory may span a weight update, as with AReaL's interruptible generation)."""

    def __init__(self, policy: torch.Tensor, seed: int) -> None:
        self.config = None
        self._version = 0
        self._weights = policy.detach().clone()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def get_version(self) -> int:
        return self._version

    def sync(self, policy: torch.Tensor, version: int) -> None:
        with self._lock:
            self._weights, self._version = policy.detach().clone(), version

    async def generate(self) -> tuple[list[int], list[int]]:
        tokens, versions = [], []
        for _ in range(self._rng.randint(2, 6)):
            await asyncio.sleep(self._rng.uniform(0.001, 0.008))
            with self._lock:
                probs, version = torch.softmax(self._weights, 0).tolist(), self._version
            tokens.append(self._rng.choices(range(VOCAB), weights=probs)[0])
            versions.append(version)
        return tokens, versions


class TargetWorkflow(RolloutWorkflow):  # the host's workflow: reward = share of target tokens
    async def arun_episode(self, engine: FakeEngine, data: dict[str, Any]) -> dict[str, Any]:
        tokens, versions = await engine.generate()
        return {"input_ids": torch.tensor([tokens]), "versions": torch.tensor([versions]),
                "rewards": torch.tensor([sum(t == TARGET for t in tokens) / len(tokens)]),
                "prompt": torch.tensor([data["prompt"]])}


FILTERED: list[int] = []  # prompts the host filter threw away (AReaL's semantics: spent)


def keep(trajectory: dict[str, Any]) -> bool:
    """AReaL's should_accept_fn: a host filter dropping every trajectory of length 4."""
    if int(trajectory["input_ids"].shape[1]) == 4:
        FILTERED.append(int(trajectory["prompt"][0]))
        return False
    return True


def config() -> InferenceEngineConfig:
    # both are the trainer's, over its WORLD ranks: each rank's executor takes its share (consumer_batch_size // dp,
    # max_concurrent_rollouts // dp: 8, above the protocol's limit of 5 per rank, so it never binds here)
    return InferenceEngineConfig(consumer_batch_size=BATCH * WORLD, max_head_offpolicyness=ETA, max_concurrent_rollouts=8 * WORLD)


def loader(rank: int) -> StatefulDataLoader:
    prompts = [{"prompt": rank * 100_000 + i} for i in range(100_000)]
    return StatefulDataLoader(prompts, batch_size=BATCH, collate_fn=list)


def train_step(policy: torch.Tensor, optimizer: torch.optim.Optimizer, trajectories: list[dict[str, Any]]) -> None:
    loss = torch.zeros(())
    for traj in trajectories:
        out = traj["input_ids"][0]
        loss = loss - (float(traj["rewards"][0]) - 0.2) * torch.log_softmax(policy, 0)[out].sum()
    optimizer.zero_grad()
    (loss / len(trajectories)).backward()
    if dist.is_initialized():
        dist.all_reduce(policy.grad)
        policy.grad /= dist.get_world_size()
    optimizer.step()


def rank_main(out: Path, rank: int, steps: int, recover_at: int, resume: bool) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['PORT']}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    policy = torch.zeros(VOCAB, requires_grad=True)
    optimizer = torch.optim.SGD([policy], lr=0.5)
    engine = FakeEngine(policy, seed=rank + 10 * resume)
    protocol = LockedStalenessManager.create(ETA, BATCH, REDUNDANCY)
    executor = ProtocolWorkflowExecutor(config(), engine, protocol, trace_path=out / f"trace-{rank}.jsonl")
    executor.initialize(train_data_parallel_size=WORLD)
    data = RecoverableLoader(loader(rank), executor.batches)
    start = 0
    if resume:  # what RecoverHandler.load and RLTrainer do, minus a real TrainEngine
        info = RecoverInfo.load(str(out / "recover_info"))
        data.load_state_dict(info.dataloader_info)
        with torch.no_grad():
            policy.copy_(torch.load(out / "policy.pt"))
        start = info.last_step_info.global_step + 1
        engine.sync(policy, start)
        executor.staleness.on_version_recovered(start)
    log = (out / f"trained-{rank}.jsonl").open("a")
    for step in range(start, steps):
        trajectories = executor.prepare_batch(data, TargetWorkflow(), should_accept_fn=keep)
        got = executor.batches.last
        assert got is not None and got.batch.version == step
        train_step(policy, optimizer, trajectories)
        log.write(json.dumps({"step": step, "ids": [int(g) for g in got.batch.group_ids],
                              "reserved": list(got.batch.group_versions), "dropped": [int(g) for g in got.batch.dropped],
                              "dropped_prompts": [p["prompt"] for p in got.dropped_prompts],
                              "prompts": [int(t["prompt"][0]) for t in trajectories],
                              "heads": [int(t["versions"][0].min()) for t in trajectories]}) + "\n")
        log.flush()
        executor.pause()  # AReaL's weight update: pause, push weights and version, resume
        engine.sync(policy, executor.batches.protocol.version)
        executor.resume()
        if step == recover_at and not resume:  # RecoverHandler.dump: checkpoint, then die mid-flight
            if rank == 0:
                torch.save(policy.detach(), out / "policy.pt")
            RecoverInfo(last_step_info=StepInfo(epoch=0, epoch_step=step, global_step=step, steps_per_epoch=10**6),
                        saver_info={}, evaluator_info={}, stats_logger_info={}, dataloader_info=data.state_dict(),
                        checkpoint_info={}).dump(str(out / "recover_info"))
            (out / f"filtered-{rank}-0.json").write_text(json.dumps(FILTERED))
            dist.barrier()
            executor.batches.close()
            os._exit(0)  # a crash: AReaL's threads and the episodes in flight die with the process
    (out / f"filtered-{rank}-1.json").write_text(json.dumps(FILTERED))
    final = executor.batches.state_dict()
    (out / f"final-{rank}.json").write_text(json.dumps({
        "pending": [p["prompt"] for p in final["prompts"]], "drawn": data.loader.state_dict(),
        "refused": executor.batches.protocol.stats().refused}))
    dist.barrier()
    executor.destroy()


def spawn(out: Path, steps: int, recover_at: int, resume: bool) -> None:
    env = {**os.environ, "PORT": str(29500 + random.Random().randint(0, 2000)), "OMP_NUM_THREADS": "1"}
    args = [str(out), "RANK", str(steps), str(recover_at), str(int(resume))]
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", *(str(rank) if a == "RANK" else a for a in args)], env=env)
             for rank in range(WORLD)]
    codes = [p.wait(timeout=600) for p in procs]
    assert codes == [0] * WORLD, codes


def check(out: Path, steps: int, recover_at: int) -> dict[str, Any]:
    result: dict[str, Any] = {"steps": steps, "recover_at": recover_at, "ranks": {}}
    for rank in range(WORLD):
        rows = [json.loads(line) for line in (out / f"trained-{rank}.jsonl").read_text().splitlines()]
        # the rows of the steps after the checkpoint, from the first life, were redone by the second
        by_step = {row["step"]: row for row in rows}
        assert sorted(by_step) == list(range(steps)), sorted(by_step)
        trained = [by_step[s] for s in range(steps)]
        ids = [i for row in trained for i in row["ids"]]
        assert len(ids) == len(set(ids)) == steps * BATCH, "each consumed id is trained exactly once"
        past = 0
        for row in trained:
            assert len(row["prompts"]) == len(row["ids"]) == BATCH
            for reserved, head in zip(row["reserved"], row["heads"]):
                assert reserved <= head <= row["step"] <= reserved + ETA, (row, reserved, head)
                past += row["step"] - reserved > ETA
        prompts = [p for row in trained for p in row["prompts"]]
        assert len(prompts) == len(set(prompts)), "no prompt trained twice"
        final = json.loads((out / f"final-{rank}.json").read_text())
        # nothing lost: every prompt the loader's own state says it handed out (both lives: the second
        # resumed the first's loader state) is trained, still pending, filtered by the host, or spent
        drawn = set(range(rank * 100_000, rank * 100_000 + final["drawn"]["_sampler_iter_state"]["samples_yielded"]))
        filtered = {p for life in (0, 1) for p in json.loads((out / f"filtered-{rank}-{life}.json").read_text())}
        seen = set(prompts) | set(final["pending"])
        assert seen | filtered <= drawn, sorted((seen | filtered) - drawn)  # nothing trained the loader never gave
        dropped = sum(len(row["dropped"]) for row in trained)
        spent = {p for row in trained for p in row["dropped_prompts"]}
        lost = unaccounted(drawn, seen, filtered, spent)
        assert not lost, (sorted(lost), dropped)
        # the check's teeth: the newest prompt the loader handed out, were it lost, is reported
        newest = max(drawn)
        assert unaccounted(drawn, seen - {newest}, filtered - {newest}, spent - {newest}) == {newest}
        verdict = trace_check(out / f"trace-{rank}.jsonl", steps)
        stale = sum(row["step"] - v == ETA for row in trained for v in row["reserved"])
        result["ranks"][rank] = {"trained": len(ids), "past_eta": past, "stale": stale, "pending_at_end": len(final["pending"]),
                                 "refused": final["refused"], "filtered": len(filtered), "dropped": dropped, "drawn": len(drawn),
                                 "unaccounted": len(lost), "trace": verdict}
    return result


def unaccounted(drawn: set[int], seen: set[int], filtered: set[int], spent: set[int]) -> set[int]:
    """Prompts the loader handed out that are neither trained nor pending (``seen``), nor filtered by
    the host, nor spent (the prompt of a group the protocol dropped once its deadline passed, unless a
    checkpoint saved it before it was collected)."""
    return drawn - seen - filtered - spent


def refusal_check() -> dict[str, Any]:
    """A task refused at episode start keeps its prompt: AReaL's callbacks played by hand (task 1 is
    refused because another group holds the room), then the prompt is submitted again as task 2
    (task numbers counted from the protocol's first task id, which is returned).
    The loader's one batch has three prompts; the third, drawn but never submitted, is in the saved
    state with the retried one (the loader's own state counts it as handed out)."""
    protocol = LockedStalenessManager.create(eta=1, batch_size=1)
    protocol.reserve("other", 0)
    staleness = ProtocolStalenessManager(FakeEngine(torch.zeros(VOCAB), 0), 8, 1, 1, protocol=protocol)
    submitted: list[list[int]] = []
    batches = ProtocolBatches(staleness, lambda task_id, timeout, raise_timeout=True: {"task": task_id}, lambda: None)

    def submit(data: dict[str, Any], task_id: int) -> None:
        submitted.append([task_id - FIRST_TASK_ID, data["prompt"]])
        staleness.on_rollout_enqueued()
        staleness.on_rollout_submitted()

    got: list[Any] = []
    trainer = threading.Thread(target=lambda: got.extend(batches.prepare([[{"prompt": 10}, {"prompt": 11}, {"prompt": 12}]], submit, 30)))
    trainer.start()
    while len(submitted) < 2:
        time.sleep(0.01)
    for task_id, accepted in ((FIRST_TASK_ID, True), (FIRST_TASK_ID + 1, False)):
        workflow_context.set(WorkflowContext(task_id=task_id))
        assert staleness.admit(task_id, 0) is accepted
        (staleness.on_rollout_accepted if accepted else staleness.on_rollout_rejected)()
    trainer.join(30)
    assert got == [{"task": FIRST_TASK_ID}], got
    return {"first_task_id": FIRST_TASK_ID, "submissions": submitted, "saved": sorted(p["prompt"] for p in batches.state_dict()["prompts"])}


def control(out: Path, steps: int) -> dict[str, Any]:
    """AReaL unchanged: its StalenessManager (max_head_offpolicyness = eta) and FIFO prepare_batch."""
    policy = torch.zeros(VOCAB, requires_grad=True)
    optimizer = torch.optim.SGD([policy], lr=0.5)
    engine = FakeEngine(policy, seed=0)
    executor = WorkflowExecutor(InferenceEngineConfig(consumer_batch_size=BATCH * WORLD, max_head_offpolicyness=ETA,
                                                      max_concurrent_rollouts=8), engine)
    executor.initialize(train_data_parallel_size=1)
    data = StatefulDataLoader([{"prompt": i} for i in range(100_000)], batch_size=BATCH * WORLD, collate_fn=list)
    staleness: dict[int, int] = {}
    try:
        for step in range(steps):
            trajectories = executor.prepare_batch(data, TargetWorkflow(), should_accept_fn=keep)
            train_step(policy, optimizer, trajectories)
            for t in trajectories:
                lag = step - int(t["versions"][0].min())
                staleness[lag] = staleness.get(lag, 0) + 1
            executor.pause()
            engine.sync(policy, step + 1)
            executor.resume()
    finally:
        executor.destroy()
    return {"samples": sum(staleness.values()), "past_eta": sum(n for lag, n in staleness.items() if lag > ETA),
            "staleness": dict(sorted(staleness.items()))}


class InProcessScheduler(Scheduler):
    """AReaL's ``Scheduler`` interface with its workers in this process: the seam that replaces
    LocalScheduler's RPC-server processes and the SGLang/vLLM server each one launches (GPU-only).
    An engine call reaches a :class:`FakeEngine`; ``submit`` runs the host's workflow, resolved from
    the import path the controller sends (as a worker does), and when it is done POSTs the
    controller's real callback server, as AReaL's worker-side engine does; ``wait_for_task`` hands
    the trajectory back once."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.workers: list[Worker] = []
        self.produced: dict[int, Any] = {}  # task id -> the trajectory its episode returned
        self.callbacks = 0  # callbacks the controller's HTTP server answered
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def n_gpus_per_node(self) -> int:
        return 0

    def create_workers(self, job: Any, *args: Any, **kwargs: Any) -> list[str]:
        self.workers = [Worker(id=f"{job.role}/{i}", ip="127.0.0.1") for i in range(job.replicas)]
        return [w.id for w in self.workers]

    def get_workers(self, role: str, timeout: Any = None) -> list[Worker]:
        return [w for w in self.workers if w.id.startswith(role + "/")]

    def delete_workers(self, role: Any = None, reverse_order: bool = False) -> None:
        self.workers = []

    def fork_workers(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("no proxy workers in this test")

    async def create_engine(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def set_worker_env(self, worker_id: str, env: dict[str, str]) -> None:
        return None

    def call_engine(self, worker_id: str, method: str, engine_name: Any = None, *args: Any, **kwargs: Any) -> Any:
        return asyncio.run(self.async_call_engine(worker_id, method, engine_name, *args, **kwargs))

    async def async_call_engine(self, worker_id: str, method: str, engine_name: Any = None, *args: Any,
                                rpc_meta: Any = None, **kwargs: Any) -> Any:
        if method == "submit":
            task = asyncio.ensure_future(self._episode(kwargs))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return kwargs["task_id"]
        if method == "wait_for_task":
            return self.produced.get(kwargs["task_id"])
        return None  # launch_server, initialize, set_version, pause, resume, destroy: nothing to do here

    async def _episode(self, call: dict[str, Any]) -> None:
        workflow = import_from_string(call["workflow"])(**call["workflow_kwargs"])
        trajectory = await workflow.arun_episode(self.engine, call["data"])
        self.produced[call["task_id"]] = trajectory
        request = urllib.request.Request(call["callback_addr"], data=json.dumps({"task_id": call["task_id"]}).encode(),
                                         headers={"Content-Type": "application/json"})
        with await asyncio.to_thread(urllib.request.urlopen, request, timeout=30) as answer:
            assert answer.status == 200
        self.callbacks += 1


def check_row(step: int, got: Any, trajectories: list[Any]) -> int:
    """The bound on every trained sample; returns how many were reserved ETA versions back."""
    assert got is not None and got.batch.version == step and len(trajectories) == BATCH
    for reserved, traj in zip(got.batch.group_versions, trajectories):
        assert reserved <= int(traj["versions"][0].min()) <= step <= reserved + ETA, (step, reserved)
    return sum(step - v == ETA for v in got.batch.group_versions)


def trace_check(path: Path, steps: int) -> str:
    """The checker's verdict on a trace, which must also be the whole run's: its consumes, over all
    its segments, are batches ``0..steps-1`` (a recovered life appends its segment to the trace of
    the life before; it does not start the file again)."""
    checked = subprocess.run([sys.executable, "-m", "staleflow_protocol.check", str(path)], capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    consumed = sorted({event.batch.version for segment in read_trace(path) for event in segment.events if event.batch is not None})
    assert consumed == list(range(steps)), f"{path}: the trace has the consumes of batches {consumed}, not of 0..{steps - 1}"
    return checked.stdout.strip()


def single_controller_trainer(scheduler: Scheduler, rollout_config: InferenceEngineConfig, protocol: LockedStalenessManager,
                              trace_path: Path) -> Any:
    """``ProtocolTrainerHooks`` on AReaL's real ``PPOTrainer``, single-controller mode (AReaL's default:
    ``AREAL_SPMD_MODE`` unset), built as far as the rollout: the train dataloader, then AReaL's own
    ``_init_rollout`` (the backend's engine class builds the controller with ``as_controller`` and
    initializes it over ``scheduler``). The rest of ``PPOTrainer.__init__`` (tokenizer, scheduler start,
    the actor's controller) is left out."""
    from areal.api.alloc_mode import ModelAllocation
    from areal.api.cli_args import vLLMConfig
    from areal.trainer.rl_trainer import PPOTrainer
    from areal.utils.environ import is_single_controller

    assert is_single_controller()

    class RolloutOrder(PPOTrainer):
        def __init__(self) -> None:  # PPOTrainer.__init__'s attributes that _init_rollout reads, in its order
            self.config = SimpleNamespace(rollout=rollout_config, vllm=vLLMConfig(), train_dataset=SimpleNamespace(batch_size=BATCH))
            self.scheduler = scheduler
            self.rollout_alloc = ModelAllocation.from_str(rollout_config.backend, name="rollout")
            self.train_dataloader = self._create_dataloader(None, dataset_config=self.config.train_dataset, rank=0, world_size=1)
            self.rollout = self._init_rollout(rollout_config)

        def _create_dataloader(self, dataset: Any, dataset_config: Any, rank: int, world_size: int) -> Any:
            return loader(rank)  # the rank's prompts, BATCH per draw

    class HookedRolloutOrder(ProtocolTrainerHooks, RolloutOrder):
        pass

    return HookedRolloutOrder(protocol=protocol, trace_path=trace_path)


def controller_run(out: Path, steps: int, built_by_trainer: bool) -> dict[str, Any]:
    """AReaL's default path: ProtocolRolloutController (its dispatcher, async runner and Flask callback
    server all real) over two rollout workers of :class:`InProcessScheduler`; trains ``steps`` batches.
    The controller is built directly, or (``built_by_trainer``) by PPOTrainer's own ``_init_rollout``
    under ``ProtocolTrainerHooks`` (:func:`single_controller_trainer`)."""
    out.mkdir(parents=True, exist_ok=True)
    policy = torch.zeros(VOCAB, requires_grad=True)
    optimizer = torch.optim.SGD([policy], lr=0.5)
    engine = FakeEngine(policy, seed=3)
    scheduler = InProcessScheduler(engine)
    protocol = LockedStalenessManager.create(ETA, BATCH, REDUNDANCY)
    cfg = InferenceEngineConfig(backend="vllm:d2", consumer_batch_size=BATCH, max_head_offpolicyness=ETA, max_concurrent_rollouts=8)
    trace = out / "controller-trace.jsonl"
    if built_by_trainer:
        from areal.engine import RemotevLLMEngine

        factory = RemotevLLMEngine.__dict__["as_controller"]
        trainer = single_controller_trainer(scheduler, cfg, protocol, trace)
        controller, data = trainer.rollout, trainer.train_dataloader
        assert data.batches is controller.batches  # the hooks bound the loader: the protocol rides in recover
        assert RemotevLLMEngine.__dict__["as_controller"] is factory  # AReaL's own factory is back
    else:
        controller = ProtocolRolloutController(FakeEngine, cfg, scheduler, protocol=protocol, trace_path=trace)
        controller.initialize(role="rollout", server_args={})
        data = loader(0)
    exact, stale, workers, consumed = True, 0, len(scheduler.workers), []
    try:
        for step in range(steps):
            trajectories = controller.prepare_batch(data, TargetWorkflow, group_size=1)
            got = controller.batches.last
            stale += check_row(step, got, trajectories)
            consumed.extend(int(g) for g in got.batch.group_ids)
            exact &= all(t is scheduler.produced[int(g)] for t, g in zip(trajectories, got.batch.group_ids))
            train_step(policy, optimizer, trajectories)
            controller.pause()  # RLTrainer's weight update on this path: pause, push, set_version, resume
            engine.sync(policy, protocol.version)
            controller.set_version(protocol.version)
            controller.resume()
        bypasses = refusals(controller)
        # the protocol's ids and AReaL's own (its TaskIdGenerator, which a direct submit would draw from)
        id_spaces = {"protocol_from": min(consumed), "areal_next": controller._task_id_generator.next()}
    finally:
        controller.batches.close()
        controller.destroy()
    return {"steps": steps, "workers": workers, "exact_ids": exact, "stale": stale, "refused": protocol.stats().refused,
            "callbacks": scheduler.callbacks, "version": controller.get_version(), "trace": trace_check(trace, steps),
            "built": [type(controller).__name__, controller.inf_engine.__name__], "bypasses": bypasses, "id_spaces": id_spaces,
            "first_task_id": FIRST_TASK_ID}


def controller_recover_run(out: Path, steps: int, recover_at: int) -> dict[str, Any]:
    """AReaL's default mode through a recover: two lives of PPOTrainer's single-controller
    ``_init_rollout`` under the hooks (:func:`single_controller_trainer`, over ``InProcessScheduler``).
    Life 0 trains to ``recover_at`` and its ``RecoverInfo`` is dumped (the loader's state, the protocol
    in it) with episodes in flight; life 1 is built again and does what ``PPOTrainer.__init__`` does
    after its ``RecoverHandler.load`` in this mode: the loader state restored, the controller's version
    set, ``rollout.staleness_manager.on_version_recovered``; then it trains to ``steps``."""
    out.mkdir(parents=True, exist_ok=True)
    trace, info_dir, rows = out / "trace.jsonl", str(out / "recover_info"), []
    cfg = InferenceEngineConfig(backend="vllm:d2", consumer_batch_size=BATCH, max_head_offpolicyness=ETA, max_concurrent_rollouts=8)
    saved_policy = torch.zeros(VOCAB)
    for life in (0, 1):
        policy = saved_policy.clone().requires_grad_(True)
        optimizer = torch.optim.SGD([policy], lr=0.5)
        engine = FakeEngine(policy, seed=20 + life)
        protocol = LockedStalenessManager.create(ETA, BATCH, REDUNDANCY)
        trainer = single_controller_trainer(InProcessScheduler(engine), cfg, protocol, trace)
        controller, data, start = trainer.rollout, trainer.train_dataloader, 0
        if life == 1:
            data.load_state_dict(RecoverInfo.load(info_dir).dataloader_info)
            start = recover_at + 1
            engine.sync(policy, start)
            controller.set_version(start)
            controller.staleness_manager.on_version_recovered(start)
            resumed = {"protocol_version": controller.batches.protocol.version, "retry": len(controller.batches.state_dict()["prompts"])}
        try:
            for step in range(start, steps if life else recover_at + 1):
                trajectories = controller.prepare_batch(data, TargetWorkflow, group_size=1)
                check_row(step, controller.batches.last, trajectories)
                rows.append([step, [int(g) for g in controller.batches.last.batch.group_ids], [int(t["prompt"][0]) for t in trajectories]])
                train_step(policy, optimizer, trajectories)
                controller.pause()
                engine.sync(policy, controller.batches.protocol.version)
                controller.set_version(controller.batches.protocol.version)
                controller.resume()
            if life == 0:
                in_flight, saved_policy = controller.batches.outstanding, policy.detach().clone()
                RecoverInfo(last_step_info=StepInfo(epoch=0, epoch_step=recover_at, global_step=recover_at, steps_per_epoch=10**6),
                            saver_info={}, evaluator_info={}, stats_logger_info={}, dataloader_info=data.state_dict(),
                            checkpoint_info={}).dump(info_dir)
        finally:
            controller.batches.close()
            controller.destroy()
    ids = [i for _, group, _ in rows for i in group]
    prompts = [p for _, _, group in rows for p in group]
    return {"steps": [s for s, _, _ in rows], "in_flight_at_dump": in_flight, "resumed": resumed,
            "unique_ids": len(ids) == len(set(ids)), "unique_prompts": len(prompts) == len(set(prompts)),
            "trace": trace_check(trace, steps)}


def refused(call: Any) -> str:
    """The message of the RuntimeError or ValueError ``call()`` raises (it must raise one)."""
    try:
        call()
    except (RuntimeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    raise AssertionError(f"{call} was not refused")


def refusals(rollout: Any) -> list[str]:
    """What a protocol-owned training rollout says to a direct submit, wait and rollout_batch."""
    workflow = TargetWorkflow if isinstance(rollout, ProtocolRolloutController) else TargetWorkflow()
    return [refused(lambda: rollout.submit({"prompt": -1}, workflow)), refused(lambda: rollout.wait(1, timeout=1)),
            refused(lambda: rollout.rollout_batch([{"prompt": -1}], workflow))]


class TrainEngineCheckpoint:
    """The train-engine surface RecoverHandler uses (``save`` / ``load`` of its recover checkpoint),
    and the hooks (``is_data_parallel_head``: False for a tensor-, context- or pipeline-parallel rank)."""

    def __init__(self, policy: torch.Tensor, head: bool = True) -> None:
        self.policy = policy
        self.head = head

    def is_data_parallel_head(self) -> bool:
        return self.head

    def save(self, meta: Any) -> None:
        os.makedirs(meta.path, exist_ok=True)
        torch.save(self.policy.detach(), os.path.join(meta.path, "policy.pt"))

    def load(self, meta: Any) -> None:
        with torch.no_grad():
            self.policy.copy_(torch.load(os.path.join(meta.path, "policy.pt")))


class NoState:  # the saver, evaluator and stats logger RecoverHandler dumps and loads (no state here)
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class ExecutorEngine(FakeEngine):
    """A RemoteInfEngine's surface for use_protocol: ``config`` (the trainer's, over one data-parallel
    rank) and the ``workflow_executor`` it builds; every one built is in ``built``."""

    built: list[ExecutorEngine] = []

    def __init__(self, policy: torch.Tensor, seed: int) -> None:
        super().__init__(policy, seed)
        self.built.append(self)
        self.config = InferenceEngineConfig(consumer_batch_size=BATCH, max_head_offpolicyness=ETA, max_concurrent_rollouts=8)
        self.workflow_executor = WorkflowExecutor(self.config, self)
        self.workflow_executor.initialize(train_data_parallel_size=1)


class PPOTrainerOrder:
    """PPOTrainer.__init__ reduced to what the hooks see, in its order: train dataloader, rollout,
    RecoverHandler.load(..., train_dataloader, ...), on_version_recovered, without the real one's
    tokenizer, model and FSDP actor (``areal_ppo_trainer_run.py`` runs the real one). ``load`` gets
    no inference engine: its weight push needs a train engine connected to the rollout."""

    def __init__(self, out: Path, policy: torch.Tensor, seed: int, head: bool = True) -> None:
        recover = RecoverConfig(experiment_name="x", trial_name="t", fileroot=str(out), mode="on", freq_steps=1)
        self.config = SimpleNamespace(train_dataset=SimpleNamespace(batch_size=BATCH), rollout=None, recover=recover)
        self.actor_alloc = SimpleNamespace(parallel=SimpleNamespace(dp_size=1))
        self.actor = TrainEngineCheckpoint(policy, head)
        self.seed = seed
        self.train_dataloader = self._create_dataloader([{"prompt": i} for i in range(100_000)], dataset_config=self.config.train_dataset,
                                                        rank=0, world_size=1)
        self.rollout = self._init_rollout(self.config.rollout)
        spec = FinetuneSpec(total_train_epochs=1, dataset_size=200_000, train_batch_size=BATCH)
        self.recover_handler = RecoverHandler(self.config.recover, spec)
        self.recover_info = self.recover_handler.load(self.actor, NoState(), NoState(), NoState(), self.train_dataloader)
        if self.recover_info is not None:
            version = self.recover_info.last_step_info.global_step + 1
            self.rollout.sync(policy, version)
            self.rollout.workflow_executor.staleness_manager.on_version_recovered(version)

    def _create_dataloader(self, dataset: Any, dataset_config: Any, rank: int, world_size: int) -> Any:
        return StatefulDataLoader(dataset, batch_size=dataset_config.batch_size, collate_fn=list)

    def _init_rollout(self, rollout_config: Any, is_eval: bool = False, lora_path: Any = None) -> Any:
        return ExecutorEngine(self.actor.policy, self.seed)


class HookedTrainer(ProtocolTrainerHooks, PPOTrainerOrder):
    pass


def recover_handler_run(out: Path, steps: int, recover_at: int) -> dict[str, Any]:
    """Two lives of HookedTrainer: the first trains to ``recover_at``, dumps with RecoverHandler.dump
    and dies with tasks in flight; the second is built again (RecoverHandler.load in its __init__)
    and trains to ``steps``."""
    out.mkdir(parents=True, exist_ok=True)
    trace, rows, spent = out / "trainer-trace.jsonl", [], set()
    for life in (0, 1):
        policy = torch.zeros(VOCAB, requires_grad=True)
        optimizer = torch.optim.SGD([policy], lr=0.5)
        trainer = HookedTrainer(out, policy, life, protocol=LockedStalenessManager.create(ETA, BATCH, REDUNDANCY), trace_path=trace)
        executor = trainer.rollout.workflow_executor
        start = 0 if trainer.recover_info is None else trainer.recover_info.last_step_info.global_step + 1
        for step in range(start, steps if life else recover_at + 1):
            trajectories = executor.prepare_batch(trainer.train_dataloader, TargetWorkflow())
            check_row(step, executor.batches.last, trajectories)
            rows.append([step, [int(g) for g in executor.batches.last.batch.group_ids], [int(t["prompt"][0]) for t in trajectories]])
            spent.update(p["prompt"] for p in executor.batches.last.dropped_prompts)  # the protocol dropped their groups
            train_step(policy, optimizer, trajectories)
            executor.pause()
            trainer.rollout.sync(policy, executor.batches.protocol.version)
            executor.resume()
        if life == 0:
            step_info = StepInfo(epoch=0, epoch_step=recover_at, global_step=recover_at, steps_per_epoch=10**6)
            trainer.recover_handler.dump(trainer.actor, step_info, NoState(), NoState(), NoState(), trainer.train_dataloader)
            in_flight = executor.batches.outstanding
            saved = [p["prompt"] for p in trainer.train_dataloader.state_dict()["staleflow_protocol"]["prompts"]]
        else:
            restored, pending = start, [p["prompt"] for p in executor.batches.state_dict()["prompts"]]
        executor.destroy()
    ids = [i for _, group, _ in rows for i in group]
    prompts = [p for _, _, group in rows for p in group]
    return {"steps": [s for s, _, _ in rows], "restored_at": restored, "in_flight_at_dump": in_flight,
            "unique_ids": len(ids) == len(set(ids)), "unique_prompts": len(prompts) == len(set(prompts)),
            "saved_prompts_kept": set(saved) <= set(prompts) | set(pending) | spent, "trace": trace_check(trace, steps)}


def main(argv: list[str]) -> None:
    if argv[0] == "--rank":
        rank_main(Path(argv[1]), int(argv[2]), int(argv[3]), int(argv[4]), bool(int(argv[5])))
        return
    if argv[0] == "--trainer-paths":  # AReaL's default controller path, and RLTrainer's recover through RecoverHandler
        print(json.dumps({"controller": controller_run(Path(argv[1]) / "controller", 8, built_by_trainer=False),
                          "trainer_controller": controller_run(Path(argv[1]) / "trainer-controller", 8, built_by_trainer=True),
                          "controller_recover": controller_recover_run(Path(argv[1]) / "controller-recover", 8, 3),
                          "recover_handler": recover_handler_run(Path(argv[1]) / "recover", 8, 3)}))
        return
    if argv[0] == "--control":
        print(json.dumps(control(Path(argv[1]), int(argv[2]) if len(argv) > 2 else 50)))
        return
    out = Path(argv[0])
    steps = int(argv[1]) if len(argv) > 1 else 50
    recover_at = int(argv[2]) if len(argv) > 2 else steps // 2
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    refused = refusal_check()
    spawn(out, steps, recover_at, resume=False)
    spawn(out, steps, recover_at, resume=True)
    result = check(out, steps, recover_at)
    result["refusal_submissions"] = refused
    result["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])

"""verl 0.9's own rollouter and trainer code (``FullyAsyncRollouter._processor_worker`` and
``reset_staleness``, ``FullyAsyncTrainer._get_samples_from_queue``) with a fake engine, run in one of
three modes: ``protocol`` (``staleflow_protocol.bindings.verl.ProtocolMessageQueue`` as the message-queue
client), ``verl`` (verl's own ``MessageQueue``, ``_process_single_sample_streaming`` and
``_should_pause_generation``: its count-based staleness control) or ``dropin`` (the drop-in's own
classes from ``staleflow_protocol.bindings.verl_dropin``: see :func:`run_dropin`). Run with a Python
that has verl 0.9.1 (installed --no-deps, see docs/integrating.md) and the light package:
``python tests/verl_real_scenario.py MODE[,MODE...] OUT SEED``; writes OUT/MODE/result.json (and
OUT/MODE/trace.jsonl but in verl mode), one mode after the other in one process (verl's import is most
of the time). Exit 3 when verl is not importable.

The objects are made with ``__new__`` and given the attributes these two methods read (their
constructors need verl's dataset, tokenizer and Ray worker groups); the rollouter subclass overrides
``_process_single_sample_streaming`` (reserve before generating, ``put_sample`` with the sample id)
``_should_pause_generation`` (the protocol decides admission) and ``reset_staleness`` (no count to
reset, and its lock would deadlock: see the method); the trainer's
``assemble_batch_from_rollout_samples`` (tensor padding) is replaced by a list of the samples.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import json
import os
import random
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

try:
    import ray
    from verl.experimental.fully_async_policy import fully_async_trainer
    from verl.experimental.fully_async_policy.detach_utils import RolloutSample
    from verl.experimental.fully_async_policy.fully_async_rollouter import FullyAsyncRollouter
    from verl.experimental.fully_async_policy.fully_async_trainer import FullyAsyncTrainer
    from verl.experimental.fully_async_policy.message_queue import MessageQueue
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path
except ImportError as error:
    print(f"verl is not importable: {error}", file=sys.stderr)
    sys.exit(3)

def plain_class(actor_class: Any) -> Any:
    """The class under verl's ``@ray.remote`` (Ray refuses subclasses of an actor class)."""
    return actor_class.__ray_metadata__.modified_class if hasattr(actor_class, "__ray_metadata__") else actor_class


from omegaconf import OmegaConf
from staleflow_protocol.bindings.verl import Admission, ProtocolMessageQueue, protocol_settings
from staleflow_protocol.bindings.verl_dropin import (
    ProtocolQueue,
    ProtocolQueueClient,
    ProtocolRollouterMixin,
    ProtocolTrainerMixin,
    current_reservation,
)
from staleflow_protocol.trace import JsonlTraceWriter

ETA, REQUIRED, STEPS = 1, 4, 50
#: Seconds the drop-in mode's weight push takes (verl's checkpoint engine broadcasting): generations
#: started meanwhile run on the previous weights.
PUSH_S = 0.005
#: Seconds a step of the drop-in mode may take before the run is reported stalled (a step takes
#: milliseconds; verl's rollouter lock held while every slot waits to be admitted never ends).
STALL_S = 60.0


class ProtocolRollouter(plain_class(FullyAsyncRollouter)):  # type: ignore[misc]
    """verl's rollouter with admission by the protocol before each generation."""

    async def _should_pause_generation(self) -> bool:
        return False  # no sample count: the protocol admits each sample in reserve

    async def reset_staleness(self) -> dict[str, Any]:
        """verl resets its sample count here under the rollouter's lock. The protocol has no count,
        and must not take that lock: ``_processor_worker`` holds it while it waits for a free slot,
        and every slot may be a sample waiting in ``reserve`` for the consume that this sync
        follows (verl's own method deadlocked here after 31 steps)."""
        self.paused = False
        self._resume_event.set()
        return {}

    async def _process_single_sample_streaming(self, rollout_sample: RolloutSample) -> None:
        sample_id = rollout_sample.sample_id
        while await self.message_queue_client.try_reserve(sample_id, self.engine.version) is not Admission.ADMITTED:
            await asyncio.sleep(0)  # no room, or too old for the protocol: ask again next turn
        generated = await self.async_rollout_manager.generate_sequences_single(rollout_sample.full_batch)
        if generated.filtered:
            await self.message_queue_client.abort(sample_id)
            return
        rollout_sample.full_batch = generated
        if await self.message_queue_client.put_sample(ray.cloudpickle.dumps(rollout_sample), sample_id=sample_id):
            self.total_generated_samples += 1
        else:
            self.dropped_stale_samples += 1


class FakeBatch:
    """What verl's streaming code touches of a one-prompt ``DataProto``: ``len`` and ``non_tensor_batch``."""

    def __init__(self, version: int = -1, filtered: bool = False) -> None:
        self.non_tensor_batch: dict[str, Any] = {}
        self.version, self.filtered = version, filtered
        self.reserved = -1  # the version the sample was reserved under (the drop-in's mode records it)

    def __len__(self) -> int:
        return 1


class FakeEngine:
    """verl's ``async_rollout_manager``: generations of seeded random length (event-loop turns) with a
    long tail, stamped with the parameter version the replicas ran when the sample started; about 1
    in 10 is filtered (a host filter; verl's own mode trains it: it has no filter there). One in ten
    takes ``slow_turns``."""

    def __init__(self, seed: int, slow_turns: int = 120) -> None:
        self.rng = random.Random(seed)
        self.version = 0
        self.slow_turns = slow_turns

    async def generate_sequences_single(self, prompts: FakeBatch) -> FakeBatch:
        started = self.version
        filtered = self.rng.random() < 0.1
        turns = self.rng.choice((1, 2, 3, 4, 6, 40)) if self.rng.random() < 0.9 else self.slow_turns
        for _ in range(turns):
            await asyncio.sleep(0)
        return FakeBatch(started, filtered)


def make_rollouter(rollouter_class: Any, queue: Any, engine: FakeEngine) -> Any:
    r = rollouter_class.__new__(rollouter_class)
    r._init_async_objects()
    r.paused, r.running = False, True
    r.pending_queue = asyncio.Queue(maxsize=128)
    r.active_tasks = set()
    r.staleness_samples = 0
    r.max_concurrent_samples = 12
    r.required_samples, r.staleness_threshold = REQUIRED, ETA
    r.max_required_samples = r.max_queue_size = REQUIRED * (ETA + 1)  # set_max_required_samples, sync step 1
    r._active_count_history = [(time.time(), 0, 12)]
    r.message_queue_client = queue
    r.async_rollout_manager = r.engine = engine
    r.total_generated_samples = r.dropped_stale_samples = r.processed_sample_count = 0
    r.idle_start_time = r.step_start_time = time.time()
    r._step_generated_samples, r._completed_steps = 0, 1
    r._STEP_HISTORY_SIZE = 10
    r._step_samples_history = collections.deque(maxlen=10)
    return r


def make_trainer(queue: Any, trainer_class: Any = None) -> Any:
    trainer_class = trainer_class or plain_class(FullyAsyncTrainer)
    t = trainer_class.__new__(trainer_class)
    t.required_samples = REQUIRED
    t.dynamic_schedule_enabled = False
    t.message_queue_client = queue
    t.config = SimpleNamespace(trainer=SimpleNamespace(balance_batch=False))
    t.tokenizer = None
    t._step_wait_times, t._step_wait_samples = [], []
    return t


def assemble_batches_as_lists() -> None:
    """The trainer's ``assemble_batch_from_rollout_samples`` (tensor padding) replaced by the list of samples."""
    fully_async_trainer.assemble_batch_from_rollout_samples = (
        lambda samples, tokenizer, config, balance: SimpleNamespace(samples=samples, meta_info={}))


async def feed(rollouter: Any, epoch: int) -> None:
    """verl's ``_feed_samples`` without the dataloader: samples ``sample_EPOCH_N`` into the pending queue."""
    for n in range(10**6):
        await rollouter.pending_queue.put(RolloutSample(full_batch=FakeBatch(), sample_id=f"sample_{epoch}_{n}", epoch=epoch,
                                                        rollout_status={}))


async def run(mode: str, out: Path, seed: int) -> dict[str, Any]:
    assemble_batches_as_lists()
    engine = FakeEngine(seed)
    writer = None
    if mode == "protocol":
        queue: Any = ProtocolMessageQueue(*protocol_settings(REQUIRED, 1, 1, staleness_threshold=ETA))
        writer = JsonlTraceWriter.attach(queue.manager, out / "trace.jsonl", refusals=True)
        rollouter = make_rollouter(ProtocolRollouter, queue, engine)
    else:
        queue = plain_class(MessageQueue)(config=None, max_queue_size=10**6)
        rollouter = make_rollouter(plain_class(FullyAsyncRollouter), queue, engine)
    trainer = make_trainer(queue)

    feeder = asyncio.ensure_future(feed(rollouter, epoch=0))
    processor = asyncio.ensure_future(rollouter._processor_worker())
    trained: list[dict[str, Any]] = []
    for step in range(STEPS):
        _, batch = await trainer._get_samples_from_queue()
        trained.append({"version": step, "samples": [[s.sample_id, s.full_batch.version] for s in batch.samples]})
        engine.version = step + 1  # _fit_update_weights: the replicas get the new parameters ...
        if mode == "protocol":
            for sample_id in await queue.param_synced(step + 1):
                raise AssertionError(f"dropped {sample_id} without redundancy")
        await rollouter.reset_staleness()  # ... and verl's rollouter resumes
    for task in (feeder, processor, *rollouter.active_tasks):
        task.cancel()
    await asyncio.gather(feeder, processor, *rollouter.active_tasks, return_exceptions=True)
    if writer is not None:
        writer.close()
    return {"trained": trained, "stats": await queue.get_statistics()}


class ActorStandIn:
    """A Ray actor handle's calling convention, ``handle.method.remote(*args).future()``, over an object
    whose methods (coroutines or not) run on ``loop``, as a Ray async actor runs its methods on its own
    event loop: the drop-in's client and trainer call the queue and the rollouter through this."""

    def __init__(self, target: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._target, self._loop = target, loop

    def __getattr__(self, name: str) -> Any:
        method, loop = getattr(self._target, name), self._loop

        def remote(*args: Any) -> Any:
            async def call() -> Any:
                result = method(*args)
                return await result if inspect.isawaitable(result) else result

            future = asyncio.run_coroutine_threadsafe(call(), loop)
            return SimpleNamespace(future=lambda: future)

        return SimpleNamespace(remote=remote)


def actor_loop() -> asyncio.AbstractEventLoop:
    """An event loop on a thread of its own: the queue actor's."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return loop


class ReplicaPush:
    """verl's ``CheckpointEngineManager`` on the fake engine: ``update_weights`` takes :data:`PUSH_S`
    (the event loop runs on: generations start on the old weights meanwhile), then loads the version."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine

    async def update_weights(self, global_steps: int) -> None:
        await asyncio.sleep(PUSH_S)
        self.engine.version = global_steps


class ReservingEngine(FakeEngine):
    """The fake engine under the drop-in: each generation also records the version its sample was
    reserved under (``current_reservation``), to compare with the weights it ran on."""

    async def generate_sequences_single(self, prompts: FakeBatch) -> FakeBatch:
        reservation = current_reservation()
        assert reservation is not None, "a generation started without a reservation"
        reserved = reservation.version
        generated = await super().generate_sequences_single(prompts)
        generated.reserved = reserved
        return generated


class VerlTrainerStandIn(plain_class(FullyAsyncTrainer)):  # type: ignore[misc]
    """verl's trainer with the three methods the drop-in wraps reduced to what they do for it (verl's
    own call its worker groups): ``set_rollouter`` keeps the rollouter and builds the checkpoint
    manager; ``_save_checkpoint`` writes ``global_step_N/actor`` and then, last, verl's tracker file;
    ``load_checkpoint`` finds the folder as verl does (``resume_mode`` auto) and returns its version."""

    engine: FakeEngine

    async def set_rollouter(self, rollouter: Any) -> None:
        self.rollouter = rollouter
        self.checkpoint_manager = ReplicaPush(self.engine)

    def _save_checkpoint(self) -> None:
        root = self.config.trainer.default_local_dir
        os.makedirs(os.path.join(root, f"global_step_{self.current_param_version}", "actor"), exist_ok=True)
        Path(root, "latest_checkpointed_iteration.txt").write_text(str(self.current_param_version))

    async def load_checkpoint(self) -> int:
        folder = find_latest_ckpt_path(self.config.trainer.default_local_dir)
        self.current_param_version = 0 if folder is None else int(folder.split("global_step_")[-1])
        return self.current_param_version


class DropinRollouter(ProtocolRollouterMixin, plain_class(FullyAsyncRollouter)):  # type: ignore[misc]
    """The drop-in's rollouter class as ``verl_dropin`` builds it, over verl's own; it records the ids
    each push reported dropped, how many of them were still generating, and how many of those the
    mixin's ``weights_loaded`` cancelled."""

    dropped_ids: list[str]
    generating: list[int]  # [still generating (not done) when dropped, of which cancelled]

    async def weights_loaded(self, version: int, dropped: list[str]) -> None:
        self.dropped_ids += dropped
        generations = self._staleflow_generations()  # a finished one may stay listed until its caller resumes
        tasks = [generations[i] for i in dropped if i in generations and not generations[i].done()]
        await super().weights_loaded(version, dropped)
        self.generating[0] += len(tasks)
        self.generating[1] += sum(task.cancelled() or task.cancelling() > 0 for task in tasks)


class DropinTrainer(ProtocolTrainerMixin, VerlTrainerStandIn):  # type: ignore[misc]
    """The drop-in's trainer mixin over the stand-in."""


async def train_and_push(trainer: Any, rollouter: Any, step: int) -> dict[str, Any]:
    """One step of the drop-in mode: the batch, the push of the next version, verl's reset; the
    batch's record (each sample's id, the version of its weights, the version it was reserved under)."""
    _, batch = await trainer._get_samples_from_queue()
    samples = [ray.cloudpickle.loads(s) if isinstance(s, bytes) else s for s in batch.samples]
    rows = [[s.sample_id, s.full_batch.version, s.full_batch.reserved] for s in samples]
    ahead = [row for row in rows if row[2] > row[1]]
    if ahead:  # stop at once: the test finds it in the result too, but a run gone wrong may also stall
        raise AssertionError(f"step {step}: [sample, weights, reserved] {ahead}: reserved under a newer version than its weights")
    trainer.current_param_version = step + 1
    await trainer.checkpoint_manager.update_weights(global_steps=step + 1)
    await rollouter.reset_staleness()
    return {"version": step, "samples": rows}


async def run_dropin(out: Path, seed: int, steps: int = 25) -> dict[str, Any]:
    """The drop-in's classes on verl's own ``_processor_worker``, ``_process_single_sample_streaming``,
    ``reset_staleness`` and ``_get_samples_from_queue``: ``ProtocolQueue`` built from a verl config
    (redundancy 1, a trace) on a loop of its own, reached through ``ProtocolQueueClient``; each step the
    trainer pushes through the checkpoint manager the mixin wraps (``param_synced``, then
    ``weights_loaded`` on the rollouter, which cancels dropped generations) and verl resets the
    rollouter's staleness. After ``steps`` steps the trainer checkpoints (the queue first), the run
    stops, and a new queue, rollouter and trainer resume from verl's latest folder for ``steps`` more."""
    assemble_batches_as_lists()
    # a tail long enough that dropped samples are still generating when dropped (2,000 turns: as few as 0 of
    # the 48 dropped under load, a flaky test; 8,000: 16 in every run measured, the run no longer)
    engine = ReservingEngine(seed, slow_turns=8000)
    config = OmegaConf.create({
        "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": REQUIRED}},
        "async_training": {"require_batches": 1, "trigger_parameter_sync_step": 1, "staleness_threshold": ETA,
                           "staleflow_redundancy": 1, "staleflow_trace_path": str(out / "trace.jsonl")},
        "trainer": {"default_local_dir": str(out / "checkpoints"), "resume_mode": "auto", "balance_batch": False},
    })
    trained: list[dict[str, Any]] = []
    stats: list[dict[str, Any]] = []
    dropped: list[str] = []
    generating = [0, 0]
    for run_index in range(2):
        queue_loop = actor_loop()
        queue = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(asyncio.sleep(0, ProtocolQueue(config)), queue_loop))
        client = ProtocolQueueClient(ActorStandIn(queue, queue_loop))
        rollouter = make_rollouter(DropinRollouter, client, engine)
        rollouter.dropped_ids, rollouter.generating = dropped, generating
        trainer = make_trainer(client, DropinTrainer)
        trainer.config, trainer.engine = config, engine
        start = await trainer.load_checkpoint()
        await trainer.set_rollouter(ActorStandIn(rollouter, asyncio.get_running_loop()))
        await trainer.checkpoint_manager.update_weights(global_steps=start)  # fully_async_main pushes before fit

        feeder = asyncio.ensure_future(feed(rollouter, epoch=run_index))
        processor = asyncio.ensure_future(rollouter._processor_worker())
        for step in range(start, start + steps):
            try:
                trained.append(await asyncio.wait_for(train_and_push(trainer, rollouter, step), STALL_S))
            except TimeoutError:
                raise RuntimeError(f"the drop-in run stalled at step {step}: no batch trained and pushed in {STALL_S:.0f} s") from None
        if run_index == 0:
            trainer._save_checkpoint()
        for task in (feeder, processor, *rollouter.active_tasks):
            task.cancel()
        await asyncio.gather(feeder, processor, *rollouter.active_tasks, return_exceptions=True)
        stats.append(await client.get_statistics())
        await client.shutdown()
        queue_loop.call_soon_threadsafe(queue_loop.stop)
    return {"trained": trained, "stats": stats, "dropped": dropped, "generating": generating,
            "checkpoint": sorted(str(p.relative_to(out / "checkpoints")) for p in (out / "checkpoints").rglob("*"))}


if __name__ == "__main__":
    modes, out, seed = sys.argv[1].split(","), Path(sys.argv[2]), int(sys.argv[3])
    for mode in modes:
        (out / mode).mkdir(parents=True, exist_ok=True)
        result = asyncio.run(run_dropin(out / mode, seed) if mode == "dropin" else run(mode, out / mode, seed))
        (out / mode / "result.json").write_text(json.dumps(result))
        past = sum(b["version"] - v > ETA for b in result["trained"] for _, v, *_ in b["samples"])
        print(f"{mode}: trained {sum(len(b['samples']) for b in result['trained'])} samples in {len(result['trained'])} steps, "
              f"{past} past eta")

"""verl 0.9's own rollouter and trainer code (``FullyAsyncRollouter._processor_worker`` and
``reset_staleness``, ``FullyAsyncTrainer._get_samples_from_queue``) with a fake engine, run in one of
two modes: ``protocol`` (``staleflow_protocol.bindings.verl.ProtocolMessageQueue`` as the message-queue
client) or ``verl`` (verl's own ``MessageQueue``, ``_process_single_sample_streaming`` and
``_should_pause_generation``: its count-based staleness control). Run with a Python that has verl
0.9.1 (installed --no-deps, see docs/integrating.md) and the light package:
``python tests/verl_real_scenario.py MODE OUT SEED``; writes OUT/result.json (and OUT/trace.jsonl in
protocol mode). Exit 3 when verl is not importable.

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
import json
import random
import sys
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
except ImportError as error:
    print(f"verl is not importable: {error}", file=sys.stderr)
    sys.exit(3)

def plain_class(actor_class: Any) -> Any:
    """The class under verl's ``@ray.remote`` (Ray refuses subclasses of an actor class)."""
    return actor_class.__ray_metadata__.modified_class if hasattr(actor_class, "__ray_metadata__") else actor_class


from staleflow_protocol.bindings.verl import Admission, ProtocolMessageQueue, protocol_settings
from staleflow_protocol.trace import JsonlTraceWriter

ETA, REQUIRED, STEPS = 1, 4, 50


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

    def __len__(self) -> int:
        return 1


class FakeEngine:
    """verl's ``async_rollout_manager``: generations of seeded random length (event-loop turns) with a
    long tail, stamped with the parameter version the replicas ran when the sample started; about 1
    in 10 is filtered (a host filter; verl's own mode trains it: it has no filter there)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.version = 0

    async def generate_sequences_single(self, prompts: FakeBatch) -> FakeBatch:
        started = self.version
        filtered = self.rng.random() < 0.1
        turns = self.rng.choice((1, 2, 3, 4, 6, 40)) if self.rng.random() < 0.9 else 120
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


def make_trainer(queue: ProtocolMessageQueue) -> Any:
    trainer_class = plain_class(FullyAsyncTrainer)
    t = trainer_class.__new__(trainer_class)
    t.required_samples = REQUIRED
    t.dynamic_schedule_enabled = False
    t.message_queue_client = queue
    t.config = SimpleNamespace(trainer=SimpleNamespace(balance_batch=False))
    t.tokenizer = None
    t._step_wait_times, t._step_wait_samples = [], []
    return t


async def run(mode: str, out: Path, seed: int) -> dict[str, Any]:
    fully_async_trainer.assemble_batch_from_rollout_samples = (
        lambda samples, tokenizer, config, balance: SimpleNamespace(samples=samples, meta_info={}))
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

    async def feed() -> None:  # _feed_samples, without the dataloader
        for n in range(10**6):
            await rollouter.pending_queue.put(RolloutSample(full_batch=FakeBatch(), sample_id=f"sample_0_{n}",
                                                            epoch=0, rollout_status={}))

    feeder = asyncio.ensure_future(feed())
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


if __name__ == "__main__":
    mode, out, seed = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(run(mode, out, seed))
    (out / "result.json").write_text(json.dumps(result))
    past = sum(b["version"] - v > ETA for b in result["trained"] for _, v in b["samples"])
    print(f"trained {sum(len(b['samples']) for b in result['trained'])} samples in {len(result['trained'])} steps, "
          f"{past} past eta")

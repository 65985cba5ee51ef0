"""A fully asynchronous rollouter / message queue / parameter-sync loop shaped like verl 0.9's
``verl/experimental/fully_async_policy`` (verl-project/verl), with a fake engine, run either with
verl's own staleness control or with ``staleflow_protocol.bindings.verl.ProtocolMessageQueue``.

What it copies of verl's mechanism (no code): a feed of ``sample_{epoch}_{n}`` ids
(``FullyAsyncRollouter._feed_samples``), a processor that starts one generation task per sample with
at most ``max_concurrent`` in flight (``_processor_worker``), generations that run on across a
parameter sync and keep the version they started on (partial rollouts), a trainer that takes
``batch_size`` samples per parameter version (``FullyAsyncTrainer._get_samples_from_queue``, with
``trigger_parameter_sync_step`` folded into ``batch_size``) and then syncs, and verl's count rule
(:class:`VerlCountControl`). The engine is fake: each generation takes a seeded random number of
event-loop turns with a long tail, so slow samples overtake nothing and fast ones overtake them,
as long responses do on a real engine. Deterministic for a seed (asyncio runs ready callbacks in
order). Everything is driven through ``await``: no threads, no clocks.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from staleflow.protocol.bindings.verl import Admission


@dataclass
class Sample:
    """What the fake engine returns: the id and the parameter version its first token came from."""

    sample_id: str
    version: int


@dataclass
class RunResult:
    trained: list[tuple[int, list[Sample]]] = field(default_factory=list)  # (batch version, samples)
    cancelled: int = 0

    def past(self, eta: int) -> int:
        """Trained samples with batch version - first-token version > eta."""
        return sum(b - s.version > eta for b, samples in self.trained for s in samples)

    def staleness(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for b, samples in self.trained:
            for s in samples:
                counts[b - s.version] = counts.get(b - s.version, 0) + 1
        return dict(sorted(counts.items()))


class VerlCountControl:
    """verl's own control, as ``fully_async_rollouter.py`` and ``message_queue.py`` do it: a FIFO
    queue; the rollouter pauses while ``staleness_samples >= max_required_samples`` (= batch_size *
    (staleness_threshold + 1)), counts one per started sample, and at each sync resets the count to
    the samples in flight plus those queued (``reset_staleness``)."""

    def __init__(self, batch_size: int, staleness_threshold: int) -> None:
        self.batch_size = batch_size
        self.max_required_samples = batch_size * (staleness_threshold + 1)
        self.staleness_samples = 0
        self.queue: deque[Sample] = deque()
        self.changed = asyncio.Condition()
        self.version = 0
        self.in_flight = 0

    async def reserve(self, sample_id: str, version: int) -> bool:
        async with self.changed:
            await self.changed.wait_for(lambda: self.staleness_samples < self.max_required_samples)
            self.staleness_samples += 1
            self.in_flight += 1
            return True

    async def put_sample(self, sample: Sample, sample_id: str) -> bool:
        async with self.changed:
            self.in_flight -= 1
            self.queue.append(sample)
            self.changed.notify_all()
            return True

    async def abort(self, sample_id: str) -> bool:
        async with self.changed:
            self.in_flight -= 1
            return True

    async def get_batch(self) -> tuple[int, list[Sample]]:
        async with self.changed:
            await self.changed.wait_for(lambda: len(self.queue) >= self.batch_size)
            samples = [self.queue.popleft() for _ in range(self.batch_size)]
            self.version += 1
            return self.version - 1, samples

    async def param_synced(self, version: int) -> list[str]:
        async with self.changed:
            self.staleness_samples = self.in_flight + len(self.queue)
            self.changed.notify_all()
            return []


class FakeEngine:
    """Generations of seeded random length (event-loop turns), long tail; stamped with the version
    the replicas ran when the sample started (verl keeps a partial rollout's first version)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.version = 0

    async def generate(self, sample_id: str) -> Sample | None:
        """The sample, or None when the reward filter drops it (about 1 in 10: all rewards equal)."""
        started = self.version
        filtered = self.rng.random() < 0.1
        turns = self.rng.choice((1, 2, 3, 4, 6, 40)) if self.rng.random() < 0.9 else 120
        for _ in range(turns):
            await asyncio.sleep(0)
        return None if filtered else Sample(sample_id, started)


async def admitted(queue: Any, sample_id: str, version: int) -> bool:
    """One ask: the protocol queue's non-blocking ``try_reserve``, or verl's count (it waits)."""
    if isinstance(queue, VerlCountControl):
        return await queue.reserve(sample_id, version)
    return await queue.try_reserve(sample_id, version) is Admission.ADMITTED


async def run_loop(queue: Any, engine: FakeEngine, steps: int, *, max_concurrent: int, start_step: int = 0,
                   epoch: int = 0, train_turns: int = 8, on_step: Any = None) -> RunResult:
    """Run ``steps`` trainer steps; ``queue`` is a ProtocolMessageQueue (its get_batch gives a
    TrainBatch) or a VerlCountControl. ``on_step(step)`` runs after each sync (e.g. a checkpoint)."""
    result = RunResult()
    tasks: dict[str, asyncio.Task[None]] = {}
    slots = asyncio.Semaphore(max_concurrent)

    async def generate(sample_id: str) -> None:
        try:
            sample = await engine.generate(sample_id)
            if sample is None:
                await queue.abort(sample_id)
            else:
                await queue.put_sample(sample, sample_id=sample_id)
        finally:
            tasks.pop(sample_id, None)
            slots.release()

    async def processor() -> None:  # _feed_samples + _processor_worker
        n = 0
        while True:
            sample_id = f"sample_{epoch}_{n}"
            n += 1
            await slots.acquire()
            while not await admitted(queue, sample_id, engine.version):
                await asyncio.sleep(0)  # no room, or the replicas are too old: ask again next turn
            tasks[sample_id] = asyncio.ensure_future(generate(sample_id))

    feeder = asyncio.ensure_future(processor())
    try:
        for step in range(start_step, start_step + steps):
            got = await queue.get_batch()
            version, samples = (got.batch.version, got.samples) if hasattr(got, "batch") else got
            assert version == step, (version, step)
            result.trained.append((version, samples))
            for _ in range(train_turns):  # the training step; generation goes on meanwhile
                await asyncio.sleep(0)
            engine.version = step + 1  # _fit_update_weights: the replicas get the new parameters
            for sample_id in await queue.param_synced(step + 1):
                task = tasks.get(sample_id)
                if task is not None:  # dropped by the protocol: abort the partial generation
                    task.cancel()
                    result.cancelled += 1
            if on_step is not None:
                await on_step(step + 1)
    finally:
        feeder.cancel()
        running = list(tasks.values())
        for task in running:
            task.cancel()
        await asyncio.gather(feeder, *running, return_exceptions=True)
    return result

"""The protocol in verl's fully asynchronous trainer (verl 0.9, ``verl/experimental/fully_async_policy``).

verl's fully async trainer has three parts (files of the verl repository, ``verl-project/verl``):

- the rollouter (``fully_async_rollouter.py``, ``FullyAsyncRollouter``): ``_feed_samples`` turns
  each prompt into a ``RolloutSample`` with a ``sample_id``; ``_processor_worker`` starts one
  generation task per sample unless ``_should_pause_generation`` says to pause, which compares a
  sample *count* (``staleness_samples``, reset at each parameter sync to the samples in flight plus
  those queued) with ``max_required_samples = required_samples * (staleness_threshold + 1) *
  trigger_parameter_sync_step``; ``_process_single_sample_streaming`` generates and calls
  ``put_sample``;
- the message queue (``message_queue.py``, ``MessageQueue``, a Ray actor with asyncio methods): a
  FIFO ``deque``; the trainer's ``_get_samples_from_queue`` (``fully_async_trainer.py``) pops
  ``required_samples`` samples per local step, oldest first;
- the parameter sync (``FullyAsyncTrainer._fit_update_weights``): every
  ``trigger_parameter_sync_step`` local steps ``current_param_version`` grows by one, the weights
  go to the rollout replicas and the rollouter's ``reset_staleness`` resumes generation.

The count bounds how many samples are *started* per parameter version, not when each is
*trained*: the FIFO queue hands the trainer whatever arrived first, so a sample that generated
slowly (a long response, a partial rollout resumed across syncs) is trained later than
``staleness_threshold`` versions after it started.

:class:`ProtocolMessageQueue` replaces the queue with one that keeps the protocol's strict bound:
a sample started on parameter version ``v`` is trained in the batch of version ``b`` only if
``v <= b <= v + eta``. It has the queue's methods (``put_sample``, ``get_sample``,
``get_queue_size``, ``get_statistics``, ``clear_queue``, ``shutdown``, ``put_validate``,
``get_validate``) and three more for the rollouter and the trainer:

- ``try_reserve(sample_id, version)`` before the rollouter starts a generation: it never waits
  (``Admission.ADMITTED``, ``WAIT`` or ``STALE``: the version is too old, sync first); the caller
  waits with :func:`wait_admitted` (the drop-in's client does), so a waiting rollouter holds none of
  the actor's ``max_concurrency`` slots and ``put_sample`` / ``get_sample`` always get one;
- ``put_sample(sample, sample_id=...)`` stores the finished sample under its id (False, like
  verl's "dropped", when the protocol had dropped it: its deadline passed), ``abort(sample_id)``
  for a failed or filtered generation;
- ``get_sample()`` hands out the samples of the protocol's next batch, exactly its ids, in batch
  order (a batch is ``required_samples * trigger_parameter_sync_step`` samples: one parameter
  version), ``get_batch()`` the whole batch at once;
- ``param_synced(version)`` after a parameter sync: the ids dropped since the last sync, whose
  partial generations the rollouter should abort (a partial sample that is still admitted keeps
  its first version and simply resumes);
- ``state_dict()`` / ``load_state_dict(state)`` and ``save_checkpoint(folder)`` /
  ``load_checkpoint(folder)`` (a JSON file beside verl's ``data.pt`` in its ``global_step_N``
  folder).

Host it as verl hosts its queue: ``ray.remote(num_cpus=1, max_concurrency=20)(ProtocolMessageQueue)``
(all its methods are ``async``, so Ray runs them on one event loop and the plain, single-threaded
:class:`~..manager.StalenessManager` is safe; only the trainer's ``get_sample`` waits inside the
actor), or call it directly from one asyncio loop. :func:`protocol_settings` turns verl's
``async_training`` numbers into ``eta`` and ``batch_size``; ``.verl_dropin`` (it imports verl) plugs
all of this into verl's own ``fully_async_main``.
This module needs nothing but the standard library; it imports nothing from verl.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
from collections import deque
from enum import Enum
from typing import Any, Awaitable, Callable, Deque, Dict, List, NamedTuple, Optional, Tuple, Union

from ..errors import InvalidGroupIdError, InvalidParameterError, InvalidVersionError, SnapshotError
from ..events import ConsumedBatch, GroupId
from ..manager import StalenessManager
from ..trace_file import TraceFile
from ..waiting import AsyncWaiter

__all__ = ["CHECKPOINT_FILE", "Admission", "ProtocolMessageQueue", "ProtocolSettings", "TrainBatch", "protocol_settings", "wait_admitted"]

#: The protocol snapshot's file name in verl's ``global_step_N`` checkpoint folder.
CHECKPOINT_FILE = "staleflow_protocol.json"


class ProtocolSettings(NamedTuple):
    """The protocol's parameters for a verl run."""

    eta: int
    batch_size: int


def protocol_settings(ppo_mini_batch_size: int, require_batches: int, trigger_parameter_sync_step: int,
                      staleness_threshold: float) -> ProtocolSettings:
    """``eta`` and ``batch_size`` from verl's ``actor.ppo_mini_batch_size`` and ``async_training``
    settings. One protocol batch is one parameter version: ``required_samples *
    trigger_parameter_sync_step`` samples (verl's ``required_samples = ppo_mini_batch_size *
    require_batches``). verl lets ``(staleness_threshold + 1)`` versions' worth of samples start per
    version; the protocol's ``eta = ceil(staleness_threshold)`` bounds each sample instead."""
    if staleness_threshold < 0:
        raise InvalidParameterError(f"staleness_threshold must be >= 0, got {staleness_threshold}")
    return ProtocolSettings(math.ceil(staleness_threshold), ppo_mini_batch_size * require_batches * trigger_parameter_sync_step)


class Admission(str, Enum):
    """The answer of :meth:`ProtocolMessageQueue.try_reserve`."""

    ADMITTED = "admitted"
    WAIT = "wait"
    STALE = "stale"


#: ``try_reserve(sample_id, version)``: the queue's method, a Ray actor's ``try_reserve.remote`` or a client's.
TryReserve = Callable[[GroupId, int], Awaitable[Admission]]


async def wait_admitted(try_reserve: TryReserve, sample_id: GroupId, version: Union[int, Callable[[], int]],
                        timeout: Optional[float] = None, max_backoff: float = 0.05) -> bool:
    """Reserve on the caller's side: ask ``try_reserve`` until the sample is admitted (True) or
    ``timeout`` seconds passed (False), sleeping between asks from 1 ms, doubling up to
    ``max_backoff`` seconds, with jitter (callers refused together do not ask again together).

    ``version``: the parameter version the sample's generation will start on; a fixed number (False
    once it is stale: sync first) or a function read at every ask, such as the version of the
    weights the rollouter has loaded (a stale answer then waits for the sync that raises it)."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    delay = 0.001
    while True:
        answer = await try_reserve(sample_id, version() if callable(version) else version)
        if answer is Admission.ADMITTED:
            return True
        if (answer is Admission.STALE and not callable(version)) or (deadline is not None and loop.time() >= deadline):
            return False
        pause = delay * random.uniform(0.5, 1.0)
        await asyncio.sleep(pause if deadline is None else max(0.0, min(pause, deadline - loop.time())))
        delay = min(2 * delay, max_backoff)


class TrainBatch(NamedTuple):
    """One protocol batch: the consumed ids and their samples, in the same order."""

    batch: ConsumedBatch
    samples: List[Any]


class ProtocolMessageQueue:
    """verl's ``MessageQueue`` with the protocol deciding admission and what each batch trains.

    Args:
        eta, batch_size: see :func:`protocol_settings`.
        redundancy: extra samples admitted beyond what the batches can take; surplus samples whose
            deadline passes are dropped (reported by :meth:`param_synced`).
        manager: a manager to use instead (a restored one); ``eta``/``batch_size`` are then ignored.
        trace_path: a JSONL protocol trace (``python -m staleflow_protocol.check`` checks it), opened
            by the first ``reserve`` (a new file) or by :meth:`load_state_dict` (a segment appended:
            a resumed run continues the trace of the run before); written at each batch, every 256
            events and at :meth:`shutdown`.

    Call its methods from one event loop (its waits are made on the first call, in that loop), so
    it may be built anywhere, as Ray builds an actor.
    """

    def __init__(self, eta: int = 1, batch_size: int = 1, redundancy: int = 0,
                 manager: Optional[StalenessManager] = None, trace_path: Optional[str] = None) -> None:
        self.manager = manager if manager is not None else StalenessManager(eta, batch_size, redundancy)
        self.trace = TraceFile(trace_path)
        self._waiter_or_none: Optional[AsyncWaiter] = None  # built on first use, inside the event loop
        self._samples: Dict[GroupId, Any] = {}  # finished samples not yet handed to the trainer
        self._handing: Deque[Any] = deque()  # the rest of the batch get_sample is handing out
        self._dropped: List[GroupId] = []  # dropped since the last param_synced
        self._validation: Deque[Any] = deque()
        self.running = True
        self._stopped_or_none: Optional[asyncio.Event] = None
        self.total_produced = 0
        self.total_consumed = 0
        self.dropped_samples = 0
        self.refused_late = 0  # finished samples whose group had been dropped or aborted

    @property
    def _waiter(self) -> AsyncWaiter:
        if self._waiter_or_none is None:
            self._waiter_or_none = AsyncWaiter(self.manager)
        return self._waiter_or_none

    @property
    def _stopped(self) -> asyncio.Event:
        if self._stopped_or_none is None:
            self._stopped_or_none = asyncio.Event()
            if not self.running:
                self._stopped_or_none.set()
        return self._stopped_or_none

    # ----------------------------------------------------------------- rollouter side
    async def try_reserve(self, sample_id: GroupId, version: int) -> Admission:
        """Admit ``sample_id`` before its generation starts on parameter ``version``, without waiting:
        ``ADMITTED``, ``WAIT`` (no room now: ask again later) or ``STALE`` (``version`` can never be
        admitted again: sync the replicas first). The waiting is the caller's (:func:`wait_admitted`),
        so no number of rollouter callers can fill the actor's ``max_concurrency`` slots."""
        self.trace.start(self.manager)
        if version + self.manager.eta < self.manager.version:
            return Admission.STALE
        if self.manager.reserve_slack(version) > 0 and self.manager.reserve(sample_id, version):
            return Admission.ADMITTED
        return Admission.WAIT

    async def put_sample(self, sample: Any, sample_id: Optional[GroupId] = None) -> bool:
        """Store a finished sample under its id; False if the protocol dropped it meanwhile (throw it
        away, as verl counts ``dropped_stale_samples``). ``None`` is verl's end signal."""
        if sample is None:
            await self.shutdown()
            return True
        if sample_id is None:
            raise InvalidGroupIdError("put_sample needs the sample_id the rollouter reserved")
        if sample_id not in self.manager:
            self.refused_late += 1
            return False
        self._samples[sample_id] = sample
        self.manager.occupy(sample_id)
        self.total_produced += 1
        return True

    async def abort(self, sample_id: GroupId) -> bool:
        """A generation failed or was filtered: free its place. False if it was no longer active."""
        if sample_id not in self.manager:
            return False
        self._samples.pop(sample_id, None)
        self.manager.abort(sample_id)
        return True

    # ----------------------------------------------------------------- trainer side
    async def get_batch(self, timeout: Optional[float] = None) -> Optional[TrainBatch]:
        """The protocol's next batch and its samples; None if shut down with no batch ready, or on timeout."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        # a loop, not one wait: a reserve from an engine still on the previous version may land in
        # the head buffer between the wake-up and this task running, and disable consume again
        while not self.manager.can_consume():
            left = None if deadline is None else deadline - loop.time()
            if not self.running or (left is not None and left <= 0):
                return None
            consumable = asyncio.ensure_future(self._waiter.wait_consumable(left))
            stopped = asyncio.ensure_future(self._stopped.wait())
            await asyncio.wait({consumable, stopped}, return_when=asyncio.FIRST_COMPLETED)
            for waiting in (consumable, stopped):
                waiting.cancel()
            await asyncio.gather(stopped, return_exceptions=True)
            if consumable.done() and not consumable.cancelled():
                consumable.result()  # a failed wait raises here, not as "no batch"
            else:
                await asyncio.gather(consumable, return_exceptions=True)
        batch = self.manager.consume()
        samples = [self._samples.pop(sample_id) for sample_id in batch.group_ids]
        for sample_id in batch.dropped:
            self._samples.pop(sample_id, None)
        self._dropped.extend(batch.dropped)
        self.dropped_samples += len(batch.dropped)
        self.total_consumed += len(samples)
        return TrainBatch(batch, samples)

    async def get_sample(self) -> Optional[Tuple[Any, int]]:
        """verl's ``get_sample``: ``(sample, samples still queued)``, one at a time, the samples of the
        protocol's batches in order; None once shut down with no batch ready."""
        if not self._handing:
            got = await self.get_batch()
            if got is None:
                return None
            self._handing.extend(got.samples)
        return self._handing.popleft(), len(self._handing) + len(self._samples)

    async def param_synced(self, version: int) -> List[GroupId]:
        """After the trainer pushed parameter ``version`` to the replicas: the ids dropped since the
        last call (abort their generations if any still run). ``version`` must be the protocol's."""
        if version != self.manager.version:
            raise InvalidVersionError(f"parameter version {version} is not the protocol's {self.manager.version}: "
                             "one protocol batch must be one parameter version")
        dropped, self._dropped = self._dropped, []
        return dropped

    # ----------------------------------------------------------------- verl's queue API
    async def get_queue_size(self) -> int:
        return len(self._samples) + len(self._handing)

    async def get_statistics(self) -> Dict[str, Any]:
        stats = self.manager.stats()
        return {
            "queue_size": await self.get_queue_size(),
            "total_produced": self.total_produced,
            "total_consumed": self.total_consumed,
            "dropped_samples": self.dropped_samples,
            "refused_late": self.refused_late,
            "param_version": self.manager.version,
            "active": len(self.manager),
            "staleness": list(stats.staleness),
        }

    async def clear_queue(self) -> None:
        """Abort every finished sample not yet handed out (verl's ``clear_queue``)."""
        for sample_id in list(self._samples):
            await self.abort(sample_id)

    async def shutdown(self) -> None:
        """verl's end signal: ``get_batch`` and ``get_sample`` return None once no batch is ready; the
        trace is written out (it stays open: later aborts are traced too)."""
        self.running = False
        self.trace.flush()
        if self._stopped_or_none is not None:
            self._stopped_or_none.set()

    async def put_validate(self, data: Any) -> None:
        self._validation.append(data)

    async def get_validate(self) -> Any:
        return self._validation.popleft() if self._validation else None

    # ----------------------------------------------------------------- checkpoints
    async def state_dict(self) -> Dict[str, Any]:
        """The protocol snapshot (JSON-serialisable); the samples themselves are not saved."""
        return self.manager.snapshot()

    async def load_state_dict(self, state: Dict[str, Any], param_version: Optional[int] = None) -> List[GroupId]:
        """Restore the protocol, abort every sample that was in flight or queued at the checkpoint
        (verl's checkpoint keeps neither generations nor the queue; its dataloader resumes after
        them) and return their ids. ``param_version``: the trainer's restored
        ``current_param_version``, checked against the snapshot."""
        restored = StalenessManager.restore(state)
        if param_version is not None and param_version != restored.version:
            raise SnapshotError(f"checkpoint mismatch: verl resumes at parameter version {param_version}, "
                             f"the protocol snapshot at {restored.version}")
        self.trace.resume(restored)
        lost = [record.group_id for record in restored.groups()]
        for sample_id in lost:
            restored.abort(sample_id)
        if self._waiter_or_none is not None:
            self._waiter_or_none.close()
            self._waiter_or_none = None
        self.manager = restored
        self._samples.clear()
        self._handing.clear()
        self._dropped = []
        return lost

    async def save_checkpoint(self, global_step_folder: str) -> str:
        """Write the snapshot into verl's ``global_step_N`` folder (beside the rollouter's ``data.pt``)."""
        os.makedirs(global_step_folder, exist_ok=True)
        path = os.path.join(global_step_folder, CHECKPOINT_FILE)
        with open(path + ".tmp", "w") as out:
            json.dump(await self.state_dict(), out)
        os.replace(path + ".tmp", path)
        return path

    async def load_checkpoint(self, global_step_folder: str, param_version: Optional[int] = None) -> List[GroupId]:
        """:meth:`load_state_dict` from the file :meth:`save_checkpoint` wrote."""
        with open(os.path.join(global_step_folder, CHECKPOINT_FILE)) as source:
            state = json.load(source)
        return await self.load_state_dict(state, param_version)

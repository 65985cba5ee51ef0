"""The batch source of ``staleflow_protocol.bindings.areal`` (:class:`ProtocolBatches`: AReaL task ids are
the protocol's group ids, in a space of their own) and its checkpoint through AReaL's recover
machinery (:class:`RecoverableLoader`)."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

from areal.utils.data import cycle_dataloader

from ..events import ConsumedBatch
from ..locked import LockedStalenessManager
from ..trace_file import TraceFile
from .areal_staleness import ProtocolStalenessManager

TracePath = Union[str, Path]
#: ``submit(data, task_id)``: hand one prompt to AReaL under the given task id.
Submit = Callable[[Any, int], Any]
#: The protocol's task ids (its group ids) count from here: AReaL's own ``TaskIdGenerator`` counts from
#: 0 on the same dispatcher, so the two id spaces never meet (below 2**53: exact in JSON).
FIRST_TASK_ID = 1 << 48


@dataclass(frozen=True)
class TrainBatch:
    """One consumed batch: ``trajectories[i]`` is task ``batch.group_ids[i]``'s. ``dropped_prompts``
    are the prompts of the tasks ``batch.dropped`` names: the protocol dropped them (``redundancy``
    surplus whose deadline passed), so they are spent, as a prompt ``should_accept_fn`` filters is."""

    batch: ConsumedBatch
    trajectories: list[Any]
    dropped_prompts: list[Any]


class ProtocolBatches:
    """Train exactly what the protocol consumes (AReaL's own consumer takes the oldest finished).

    Keeps up to ``get_pending_limit()`` tasks submitted under its own task ids (a counter from
    :data:`FIRST_TASK_ID`: the group ids), waits until ``consume()`` is enabled, then fetches each consumed task with AReaL's
    ``wait_for_task``. Dropped and rejected tasks are collected and thrown away; the prompt of a task
    refused at episode start is submitted again before any new prompt. ``trace_path``: a JSONL
    protocol trace, opened by the first :meth:`prepare` (a new file) or by :meth:`load_state_dict`
    (a new segment appended): a recovered life continues the trace its predecessor wrote.
    """

    def __init__(self, staleness: ProtocolStalenessManager, wait_for_task: Callable[..., Any], wake: Callable[[], None],
                 trace_path: Optional[TracePath] = None) -> None:
        self.staleness = staleness
        self.wait_for_task = wait_for_task
        self.wake = wake
        self.trace = TraceFile(trace_path)
        self.next_task_id = FIRST_TASK_ID
        self.last: Optional[TrainBatch] = None
        self._prompts: dict[int, Any] = {}  # submitted, result not collected: task id -> prompt
        self._retry: collections.deque[Any] = collections.deque()  # prompts to submit before new ones
        self._discard: set[int] = set()  # results to collect and throw away
        self._loader_batches: Optional[Iterator[Any]] = None  # the dataloader's batches, cycled
        # prompts of the loader batch last drawn, not submitted yet: the loader's own state counts them
        # as handed out, so a checkpoint must carry them (state_dict) or they would be lost
        self._drawn: collections.deque[Any] = collections.deque()

    @property
    def protocol(self) -> LockedStalenessManager:
        return self.staleness.protocol

    def prepare(self, dataloader: Any, submit: Submit, timeout: float = 300.0) -> list[Any]:
        """The next consumed batch's trajectories (also ``self.last``), prompts drawn from ``dataloader``
        (cycled, cached on the first call as AReaL's ``prepare_batch`` does)."""
        if not self.staleness.consumes:
            raise RuntimeError("prepare_batch on a rank that never consumes (not a data-parallel head): "
                               "AReaL's DistRolloutCoordinator draws batches on the heads only")
        if self._loader_batches is None:
            self._loader_batches = iter(cycle_dataloader(dataloader))
            self.trace.start(self.protocol)
        deadline = time.monotonic() + timeout
        while True:
            self.staleness.raise_errors()
            self._collect_discarded()
            self._top_up(submit)
            batch = self.protocol.try_consume()
            if batch is not None:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"no batch after {timeout} s; protocol counts {self.protocol.counts()}")
            self.staleness.wait_for_change(0.05)
        self.wake()  # capacity grew: AReaL's producer thread sleeps until its queue changes
        trajectories = []
        for group_id in batch.group_ids:
            task_id = int(group_id)
            trajectory = self.wait_for_task(task_id, timeout=max(1.0, deadline - time.monotonic()))
            if trajectory is None:
                raise RuntimeError(f"task {task_id} was consumed by the protocol but AReaL has no trajectory")
            trajectories.append(trajectory)
            del self._prompts[task_id]
            self.staleness.forget(task_id)
        dropped = [int(group_id) for group_id in batch.dropped]
        self._discard.update(dropped)
        self.last = TrainBatch(batch, trajectories, [self._prompts[task_id] for task_id in dropped])
        return trajectories

    def _top_up(self, submit: Submit) -> None:
        while len(self._prompts) < self.staleness.get_pending_limit():
            data = self._retry.popleft() if self._retry else self._next_prompt()
            task_id, self.next_task_id = self.next_task_id, self.next_task_id + 1
            self._prompts[task_id] = data
            submit(data, task_id)

    def _next_prompt(self) -> Any:
        assert self._loader_batches is not None
        while not self._drawn:
            self._drawn.extend(next(self._loader_batches))
        return self._drawn.popleft()

    def _collect_discarded(self) -> None:
        for task_id, refused in self.staleness.take_rejected():
            self._discard.add(task_id)
            if refused:  # never burn a prompt on a refusal: it is tried again
                self._retry.append(self._prompts[task_id])
        for task_id in list(self._discard):
            if self.staleness.is_finished(task_id):
                self.wait_for_task(task_id, timeout=30.0, raise_timeout=False)
                self._discard.discard(task_id)
                self._prompts.pop(task_id, None)
                self.staleness.forget(task_id)

    @property
    def outstanding(self) -> int:
        return len(self._prompts)

    # ------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The protocol snapshot and every prompt not yet trained (to retry, in flight, drawn from the
        loader and not submitted yet)."""
        return {"protocol": self.protocol.snapshot(), "next_task_id": self.next_task_id,
                "prompts": [*self._retry, *self._prompts.values(), *self._drawn]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore before any task is submitted: the protocol from its snapshot; its unconsumed groups
        died with the old process, so each is aborted (traced) and its prompt submitted again."""
        if self._prompts or self._loader_batches is not None:
            raise RuntimeError("load_state_dict must come before the first prepare_batch")
        protocol = LockedStalenessManager.restore(state["protocol"])
        self.staleness.protocol = protocol
        self.trace.resume(protocol)
        for group in protocol.groups():
            protocol.abort(group.group_id)
        self.next_task_id = int(state["next_task_id"])
        self._retry.extend(state["prompts"])

    def close(self) -> None:
        self.trace.close()


class RecoverableLoader:
    """The train dataloader as AReaL's recover machinery sees it: ``RecoverHandler.dump`` saves
    ``dataloader.state_dict()`` per data-parallel rank, ``load`` restores it; this wrapper adds the
    protocol's state (:meth:`ProtocolBatches.state_dict`). Everything else goes to the loader.

    ``batches`` may be bound later (:meth:`bind`): RLTrainer builds its dataloader before its rollout;
    a protocol state loaded before then is applied when the batches are bound."""

    def __init__(self, loader: Any, batches: Optional[ProtocolBatches] = None) -> None:
        self.loader = loader
        self.batches = batches
        self._pending: Optional[dict[str, Any]] = None  # protocol state loaded before bind

    def bind(self, batches: ProtocolBatches) -> None:
        self.batches = batches
        if self._pending is not None:
            state, self._pending = self._pending, None
            batches.load_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        if self.batches is None:
            raise RuntimeError("RecoverableLoader has no ProtocolBatches bound: nothing to save the protocol from")
        return {"loader": self.loader.state_dict(), "staleflow_protocol": self.batches.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state["loader"])
        if self.batches is None:
            self._pending = state["staleflow_protocol"]
        else:
            self.batches.load_state_dict(state["staleflow_protocol"])

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

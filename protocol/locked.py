"""A thread-safe wrapper of :class:`StalenessManager`: one re-entrant lock around every call.

:class:`StalenessManager` itself is not thread-safe (``reserve`` checks the slack and then inserts;
``consume`` plans and then takes), as a host whose rollout workers, reward threads and trainer call
it concurrently would need. :class:`LockedStalenessManager` serialises every operation and query on
one ``threading.RLock``, so each call is atomic and the calls form one sequence (the event hooks run
inside the lock, so a trace lists events in ``seq`` order). The lock is re-entrant: a hook may read
the manager. Compound decisions take the lock explicitly::

    with locked.locked():
        if locked.can_consume():
            batch = locked.consume()

or use the atomic helpers :meth:`LockedStalenessManager.try_consume` and
:meth:`LockedStalenessManager.attach_trace` (snapshot and hook registration in one step, so no event
is missed). ``staleflow bench protocol`` reports what the lock costs per operation.

Blocking waits for threads (a trainer thread, a Ray actor's threads): :meth:`~LockedStalenessManager.wait_consumable`,
:meth:`~LockedStalenessManager.wait_admissible` and :meth:`~LockedStalenessManager.consume_when_ready`
sleep on a ``threading.Condition`` over the same lock, woken by the wrapper's own operations that
can make them true (``events.CONSUMABLE_AFTER``, ``events.ADMISSIBLE_AFTER``) and when a
:meth:`~LockedStalenessManager.locked` block ends. With a ``timeout`` (seconds) they return
``False`` (or ``None``) when it passes; ``wait_admissible`` raises
:class:`~.errors.StaleVersionError` once the version can never be admitted again.
Operations are atomic as :class:`StalenessManager`'s are (see :mod:`.errors`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from .events import BufferView, ConsumedBatch, CounterState, EventHook, GroupId, GroupRecord
from .manager import StalenessManager
from .stats import ProtocolStats
from .waiting import admissible_now

if TYPE_CHECKING:
    from pathlib import Path

    from .trace import JsonlTraceWriter


class LockedStalenessManager:
    """:class:`StalenessManager`'s API, every call under one re-entrant lock.

    Either wrap an existing manager (``LockedStalenessManager(manager)``: do not use the inner one
    directly afterwards) or build one: ``LockedStalenessManager.create(eta=2, batch_size=8)``.
    Lists (``groups()``) are copied under the lock, so iterating them is safe while other threads
    change the manager.
    """

    def __init__(self, manager: StalenessManager) -> None:
        self._manager = manager
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._waiting = 0  # threads inside a wait: notify only when someone listens

    @classmethod
    def create(
        cls, eta: int, batch_size: int, redundancy: int = 0, on_event: EventHook | None = None,
        hooks: Iterable[EventHook] = (),
    ) -> LockedStalenessManager:
        return cls(StalenessManager(eta, batch_size, redundancy, on_event, hooks))

    @classmethod
    def restore(
        cls, snapshot: Mapping[str, Any], on_event: EventHook | None = None, hooks: Iterable[EventHook] = ()
    ) -> LockedStalenessManager:
        return cls(StalenessManager.restore(snapshot, on_event, hooks))

    @contextmanager
    def locked(self) -> Iterator[StalenessManager]:
        """Hold the lock for a compound decision; yields the inner manager (use it only inside).
        Waiting threads are woken when the block ends (it may have changed anything)."""
        with self._lock:
            try:
                yield self._manager
            finally:
                self._notify()

    def _notify(self) -> None:
        if self._waiting:
            self._changed.notify_all()

    # ----------------------------------------------------------------- blocking waits
    def wait_consumable(self, timeout: float | None = None) -> bool:
        """Block until ``can_consume()`` (True), or ``timeout`` seconds pass (False)."""
        with self._lock:
            return self._wait(self._manager.can_consume, timeout)

    def wait_admissible(self, version: int, timeout: float | None = None) -> bool:
        """Block until a group generated from ``version`` would be admitted now (True), or ``timeout``
        seconds pass (False). Raises :class:`~.errors.StaleVersionError` once ``version`` is past
        every deadline (``version + eta < self.version``): waiting longer would never succeed.
        Another thread may take the room first: ``reserve`` still decides."""
        with self._lock:
            return self._wait(admissible_now(self._manager, version), timeout)

    def consume_when_ready(self, timeout: float | None = None) -> ConsumedBatch | None:
        """Wait until a batch can be taken and take it (one step under the lock); None on timeout."""
        with self._lock:
            if not self._wait(self._manager.can_consume, timeout):
                return None
            return self.consume()

    def _wait(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        self._waiting += 1
        try:
            return self._changed.wait_for(ready, timeout)
        finally:
            self._waiting -= 1

    # ----------------------------------------------------------------- parameters and queries
    @property
    def eta(self) -> int:
        return self._manager.eta

    @property
    def batch_size(self) -> int:
        return self._manager.batch_size

    @property
    def redundancy(self) -> int:
        return self._manager.redundancy

    @property
    def version(self) -> int:
        with self._lock:
            return self._manager.version

    def __len__(self) -> int:
        with self._lock:
            return len(self._manager)

    def __contains__(self, group_id: object) -> bool:
        with self._lock:
            return group_id in self._manager

    def group(self, group_id: GroupId) -> GroupRecord:
        with self._lock:
            return self._manager.group(group_id)

    def groups(self) -> list[GroupRecord]:
        """Every active group (a list copied under the lock, in :meth:`StalenessManager.groups` order)."""
        with self._lock:
            return list(self._manager.groups())

    def capacity(self, offset: int) -> int:
        return self._manager.capacity(offset)

    def start_capacity(self, version: int, max_in_flight: int) -> int:
        with self._lock:
            return self._manager.start_capacity(version, max_in_flight)

    def blocking_groups(self) -> tuple[GroupId, ...]:
        with self._lock:
            return self._manager.blocking_groups()

    def stats(self) -> ProtocolStats:
        with self._lock:
            return self._manager.stats()

    def interrupted_groups(self) -> tuple[GroupId, ...]:
        with self._lock:
            return self._manager.interrupted_groups()

    def counts(self) -> CounterState:
        with self._lock:
            return self._manager.counts()

    def flat_counts(self) -> tuple[int, ...]:
        with self._lock:
            return self._manager.flat_counts()

    def reserve_slack(self, version: int) -> int:
        with self._lock:
            return self._manager.reserve_slack(version)

    def can_reserve(self, version: int) -> bool:
        with self._lock:
            return self._manager.can_reserve(version)

    def oldest_admissible_version(self) -> int | None:
        with self._lock:
            return self._manager.oldest_admissible_version()

    def buffers(self) -> tuple[BufferView, ...]:
        with self._lock:
            return self._manager.buffers()

    def can_consume(self) -> bool:
        with self._lock:
            return self._manager.can_consume()

    # ----------------------------------------------------------------- operations
    # A reserve never makes a wait succeed (events.CONSUMABLE_AFTER, ADMISSIBLE_AFTER): it notifies
    # nobody. The others notify in ``finally``: an operation whose hook failed was still applied.
    def reserve(self, group_id: GroupId, version: int) -> bool:
        with self._lock:
            return self._manager.reserve(group_id, version)

    def occupy(self, group_id: GroupId) -> None:
        with self._lock:
            try:
                self._manager.occupy(group_id)
            finally:
                self._notify()

    def abort(self, group_id: GroupId) -> None:
        with self._lock:
            try:
                self._manager.abort(group_id)
            finally:
                self._notify()

    def abort_if_active(self, group_id: GroupId) -> bool:
        """Abort ``group_id`` if it is active (atomically); False if it was not."""
        with self._lock:
            if group_id not in self._manager:
                return False
            self.abort(group_id)
            return True

    def consume(self) -> ConsumedBatch:
        with self._lock:
            try:
                return self._manager.consume()
            finally:
                self._notify()

    def try_consume(self) -> ConsumedBatch | None:
        """The next batch if consume is enabled now, else None (check and take in one step)."""
        with self._lock:
            return self.consume() if self._manager.can_consume() else None

    # ----------------------------------------------------------------- hooks, checkpoints, traces
    def add_event_hook(self, hook: EventHook) -> None:
        with self._lock:
            self._manager.add_event_hook(hook)

    def remove_event_hook(self, hook: EventHook) -> None:
        with self._lock:
            self._manager.remove_event_hook(hook)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return self._manager.snapshot()

    def attach_trace(self, path: str | Path, mode: str = "w", refusals: bool = False) -> JsonlTraceWriter:
        """Start a JSONL trace of this manager; the snapshot and the hook are taken atomically
        (``refusals``: see :meth:`~.trace.JsonlTraceWriter.attach`)."""
        from .trace import JsonlTraceWriter

        with self._lock:
            return JsonlTraceWriter.attach(self, path, mode, refusals)

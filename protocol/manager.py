"""The staleness manager: exact admission and eager consumption under a strict staleness bound.

State (design section 2): the head buffer ``c`` (``version``), and for each active group its
version ``v`` and status. A group's deadline is ``v + eta``: the last buffer it may be trained in.
Groups are kept in ``eta + 1`` buckets by deadline offset ``v + eta - c``, next to one flat list of
their running and done counts that every operation keeps up to date, so every decision reads
``2 * (eta + 1)`` counters and never scans the groups.
Operations are atomic: see :mod:`.errors` for the contract.

Invariant (Inv), for ``cap(k) = (k + 1) * batch_size + redundancy``:
every active group has ``c <= deadline <= c + eta``, and for each ``k`` in ``0..eta`` at most
``cap(k)`` groups have a deadline offset ``<= k``. With ``redundancy == 0`` this is Hall's condition
for nested intervals: the groups can be placed in buffers ``c..deadline`` with at most
``batch_size`` per buffer. Virtual buffers are the earliest-deadline-first placement; nothing moves.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterable, Iterator, Mapping

from .errors import (
    ConsumeNotReadyError,
    DuplicateGroupError,
    InvalidGroupIdError,
    InvalidParameterError,
    InvalidTransitionError,
    InvalidVersionError,
    SnapshotError,
    UnknownGroupError,
)
from .events import (
    BufferView,
    ConsumedBatch,
    CounterState,
    EventHook,
    GroupId,
    GroupRecord,
    GroupStatus,
)
from .hooks import EventEmitter
from .inputs import as_int
from .inputs import check_int as _check_int
from .stats import FULL, STALE, OperationTally, ProtocolStats

SNAPSHOT_FORMAT = "staleflow.protocol/1"


class _Bucket:
    """The active groups that share one deadline; dicts keep insertion (FIFO) order."""

    __slots__ = ("running", "done")

    def __init__(self) -> None:
        self.running: dict[GroupId, None] = {}
        self.done: dict[GroupId, None] = {}

    def __len__(self) -> int:
        return len(self.running) + len(self.done)


class StalenessManager(EventEmitter):
    """Admission and consumption of prompt groups so that every trained group is at most ``eta`` stale.

    A group generated from model ``v`` and trained in batch ``b`` always has ``v <= b <= v + eta``.

    Args:
        eta: staleness bound, ``>= 0`` (0 is fully on-policy).
        batch_size: groups per training batch, ``>= 1``.
        redundancy: extra groups that may be admitted beyond what the batches can take; surplus
            groups whose deadline passes are dropped at consume time and reported in
            ``ConsumedBatch.dropped`` (at most ``redundancy`` per batch).
        on_event, hooks: hooks called after every operation with a :class:`ProtocolEvent`, in order.
    """

    def __init__(self, eta: int, batch_size: int, redundancy: int = 0, on_event: EventHook | None = None,
                 hooks: Iterable[EventHook] = ()) -> None:
        self._eta = _check_int("eta", eta, 0)
        self._batch_size = _check_int("batch_size", batch_size, 1)
        self._redundancy = _check_int("redundancy", redundancy, 0)
        self._version = 0
        self._buckets: deque[_Bucket] = deque(_Bucket() for _ in range(self._eta + 1))
        # group id -> version; the status is which dict of its bucket holds the id. Plain ints keep
        # this dict out of the garbage collector's way, so per-operation cost stays flat at 100k groups.
        self._versions: dict[GroupId, int] = {}
        # running counts of offsets 0..eta, then done counts (the bucket sizes), then the version: kept
        # by every operation, and a copy of it is the flat state events carry
        self._counts = [0] * (2 * self._eta + 2) + [self._version]
        self._init_hooks(([] if on_event is None else [on_event]) + list(hooks))
        self._interrupted: dict[GroupId, None] = {}  # running groups of the snapshot restored from
        self._tally = OperationTally(self._eta)  # for stats(), since this object was built or restored

    # ----------------------------------------------------------------- parameters and queries
    @property
    def eta(self) -> int:
        return self._eta

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def redundancy(self) -> int:
        return self._redundancy

    @property
    def version(self) -> int:
        """Index of the next buffer to consume; the trainer's next step turns it into ``version + 1``."""
        return self._version

    def __len__(self) -> int:
        return len(self._versions)

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._versions

    def group(self, group_id: GroupId) -> GroupRecord:
        """The record of an active group; :class:`UnknownGroupError` if it is not active."""
        version = self._version_of(group_id)
        running = group_id in self._bucket_at(version).running
        return GroupRecord(group_id, version, GroupStatus.RUNNING if running else GroupStatus.DONE)

    def groups(self) -> Iterator[GroupRecord]:
        """Every active group, by deadline, running before done, in arrival order."""
        for bucket in self._buckets:
            for group_id in bucket.running:
                yield GroupRecord(group_id, self._versions[group_id], GroupStatus.RUNNING)
            for group_id in bucket.done:
                yield GroupRecord(group_id, self._versions[group_id], GroupStatus.DONE)

    def capacity(self, offset: int) -> int:
        """How many groups may have a deadline offset ``<= offset`` (``cap(k)`` of the invariant)."""
        return (offset + 1) * self._batch_size + self._redundancy

    def counts(self) -> CounterState:
        """Running and done counts per deadline offset ``0..eta``: the state the spec tracks."""
        return CounterState.from_flat(self.flat_counts())

    def flat_counts(self) -> tuple[int, ...]:
        """:meth:`counts` as one flat tuple ``(*running, *done, version)`` (cheaper: what event
        recorders receive, see :class:`~.events.EventRecorder`)."""
        return tuple(self._counts)

    def reserve_slack(self, version: int) -> int:
        """How many more groups generated from ``version`` would be admitted right now (0: none)."""
        version = self._check_version(version)
        return self._slack_at(version + self._eta - self._version)

    def can_reserve(self, version: int) -> bool:
        """Whether ``reserve(new_id, version)`` would admit the group now."""
        return self.reserve_slack(version) > 0

    def oldest_admissible_version(self) -> int | None:
        """The oldest version that can still reserve (every newer one can too), or None.

        Slack never decreases with the version, so the admissible versions are a suffix of
        ``max(0, version - eta) .. version``; an instance older than this one must sync first.
        """
        for version in range(max(0, self._version - self._eta), self._version + 1):
            if self.reserve_slack(version) > 0:
                return version
        return None

    def start_capacity(self, version: int, max_in_flight: int) -> int:
        """Groups that may start now at ``version`` with at most ``max_in_flight`` running (AReaL's
        ``get_capacity``): the reserve slack, capped by ``max_in_flight`` minus the running groups."""
        slack = self.reserve_slack(version)
        limit = _check_int("max_in_flight", max_in_flight, 0)
        running = sum(self._counts[: self._eta + 1])
        return max(0, min(slack, limit - running))

    def blocking_groups(self) -> tuple[GroupId, ...]:
        """The fewest running groups whose finishing enables ``consume`` (earliest deadlines first, which
        is optimal); every running group if fewer than ``batch_size`` are active; () if consumable."""
        done = self._done_counts()
        if self._plan(done) is not None:
            return ()
        waiting: list[GroupId] = []
        for offset, bucket in enumerate(self._buckets):
            for group_id in bucket.running:
                waiting.append(group_id)
                done[offset] += 1
                if self._plan(done) is not None:
                    return tuple(waiting)
        return tuple(waiting)

    def stats(self) -> ProtocolStats:
        """Counts by deadline, operation counters, refusals, drops, staleness, blocking groups."""
        return self._tally.report(self.counts(), self.can_consume(), self.blocking_groups(),
                                  max(0, self._batch_size - len(self._versions)))

    def interrupted_groups(self) -> tuple[GroupId, ...]:
        """Groups running in the snapshot restored from, still running: their generation died in the
        crash; resume (same id and version) or abort each. Empty for a manager not restored."""
        self._interrupted = {g: None for g in self._interrupted if g in self._versions
                             and g in self._bucket_at(self._versions[g]).running}
        return tuple(self._interrupted)

    def buffers(self) -> tuple[BufferView, ...]:
        """The earliest-deadline-first placement of active groups into buffers ``version..version+eta``.

        The head buffer holds ``batch_size + redundancy`` groups, the others ``batch_size``. Each
        group sits at or before its deadline (that is what the invariant guarantees).
        """
        views = [
            BufferView(self._version + i, self.capacity(0) if i == 0 else self._batch_size, 0, 0)
            for i in range(self._eta + 1)
        ]
        slot = 0
        for bucket in self._buckets:
            for field, count in (("done", len(bucket.done)), ("running", len(bucket.running))):
                while count:
                    view = views[slot]
                    placed = min(count, view.free)
                    setattr(view, field, getattr(view, field) + placed)
                    count -= placed
                    if view.free == 0 and slot < self._eta:
                        slot += 1
        return tuple(views)

    # ----------------------------------------------------------------- operations
    def reserve(self, group_id: GroupId, version: int) -> bool:
        """Admit a group generated from model ``version``, or refuse it (returns False).

        Admission is exact: a group is refused only if no placement of all active groups plus this
        one keeps every group within its bound. Raises ``InvalidVersionError`` (version not an int,
        negative or above :attr:`version`), ``DuplicateGroupError`` (active id), ``InvalidGroupIdError``.
        The id of a group that left may be reserved again: refusing it would need unbounded memory.
        """
        if isinstance(group_id, bool) or not isinstance(group_id, (str, int)):
            raise InvalidGroupIdError(f"group_id must be a str or int, got {type(group_id).__name__}")
        version = self._check_version(version)
        if group_id in self._versions:
            raise DuplicateGroupError(f"group {group_id!r} is already active")
        offset = version + self._eta - self._version
        accepted = self._slack_at(offset) > 0
        if accepted:
            self._buckets[offset].running[group_id] = None
            self._counts[offset] += 1
            self._versions[group_id] = version
            self._tally.reserved += 1
        else:
            self._tally.refused[STALE if version + self._eta < self._version else FULL] += 1
        if self._hooks:
            self._emit("reserve", group_id, version, accepted, None)
        return accepted

    def occupy(self, group_id: GroupId) -> None:
        """Mark a running group finished (its rewards are in); it may now be consumed."""
        version = self._version_of(group_id)
        offset = version + self._eta - self._version
        bucket = self._buckets[offset]
        if group_id not in bucket.running:
            raise InvalidTransitionError(f"cannot occupy group {group_id!r}: it is already done")
        del bucket.running[group_id]
        bucket.done[group_id] = None
        counts = self._counts
        counts[offset] -= 1
        counts[offset + self._eta + 1] += 1
        self._tally.occupied += 1
        if self._hooks:
            self._emit("occupy", group_id, version, None, None)

    def abort(self, group_id: GroupId) -> None:
        """Remove a running or finished, unconsumed group (failed instance, filter, cancellation)."""
        version = self._version_of(group_id)
        offset = version + self._eta - self._version
        bucket = self._buckets[offset]
        self._tally.aborted += 1
        if bucket.running.pop(group_id, bucket) is bucket:
            del bucket.done[group_id]
            offset += self._eta + 1
        self._counts[offset] -= 1
        del self._versions[group_id]
        if self._hooks:
            self._emit("abort", group_id, version, None, None)

    def can_consume(self) -> bool:
        """Whether a batch can be taken now (eager: whenever any choice of done groups keeps Inv)."""
        return self._consume_plan() is not None

    def consume(self) -> ConsumedBatch:
        """Take the next batch: the ``batch_size`` finished groups with the earliest deadlines.

        Groups whose deadline is the head buffer and that are not taken are dropped (redundancy
        waste, at most ``redundancy``). Raises ``ConsumeNotReadyError`` when ``can_consume()`` is
        false.
        """
        plan = self._consume_plan()
        if plan is None:
            raise ConsumeNotReadyError(self._not_ready_reason())
        taken: list[GroupId] = []
        for bucket, count in zip(self._buckets, plan):
            if count:
                # One pass over the bucket's first ``count`` done groups, then delete them: taking
                # them one at a time with ``next(iter(...))`` rescans the deleted slots (quadratic in B).
                oldest = iter(bucket.done)
                first = [next(oldest) for _ in range(count)]
                for group_id in first:
                    del bucket.done[group_id]
                taken.extend(first)
        head = self._buckets.popleft()
        dropped = (*head.running, *head.done)
        self._buckets.append(_Bucket())
        versions = tuple(self._versions.pop(group_id) for group_id in taken)
        for group_id in dropped:
            del self._versions[group_id]
        batch = ConsumedBatch(self._version, tuple(taken), versions, dropped)
        self._tally.count_batch(self._version, versions, len(dropped))
        self._version += 1
        self._recount()
        if self._hooks:
            self._emit("consume", None, batch.version, None, batch)
        return batch

    # ----------------------------------------------------------------- hooks and checkpoints
    def snapshot(self) -> dict[str, Any]:
        """The whole state as JSON-serialisable data; :meth:`restore` rebuilds an equal manager."""
        return {
            "format": SNAPSHOT_FORMAT,
            "eta": self._eta,
            "batch_size": self._batch_size,
            "redundancy": self._redundancy,
            "version": self._version,
            "groups": [[g.group_id, g.version, g.status.value] for g in self.groups()],
        }

    @classmethod
    def restore(
        cls, snapshot: Mapping[str, Any], on_event: EventHook | None = None, hooks: Iterable[EventHook] = ()
    ) -> StalenessManager:
        """Rebuild a manager from :meth:`snapshot` data, checking every field (a ``SnapshotError`` names
        it) and the invariant; hooks as in the constructor; see :meth:`interrupted_groups`."""
        if not isinstance(snapshot, Mapping) or snapshot.get("format") != SNAPSHOT_FORMAT:
            raise SnapshotError(f"not a staleness-manager snapshot (expected format {SNAPSHOT_FORMAT!r})")
        missing = [name for name in ("eta", "batch_size", "redundancy", "version", "groups") if name not in snapshot]
        if missing:
            raise SnapshotError(f"invalid snapshot: missing field(s) {', '.join(map(repr, missing))}")
        try:
            manager = cls(snapshot["eta"], snapshot["batch_size"], snapshot["redundancy"])
            manager._version = _check_int("version", snapshot["version"], 0)
        except InvalidParameterError as error:
            raise SnapshotError(f"invalid snapshot field: {error}") from None
        groups = snapshot["groups"]
        if not isinstance(groups, list):
            raise SnapshotError("invalid snapshot field: 'groups' must be a list")
        for entry in groups:
            manager._restore_group(entry)
        manager._recount()
        manager._check_invariant()
        manager._interrupted = {g: None for bucket in manager._buckets for g in bucket.running}
        manager._set_hooks(([] if on_event is None else [on_event]) + list(hooks))
        return manager

    # ----------------------------------------------------------------- internals
    def _check_version(self, version: int) -> int:
        """``version`` as a plain int, or :class:`InvalidVersionError` (not an integer, negative, ahead)."""
        version = as_int("version", version, InvalidVersionError)
        if version < 0:
            raise InvalidVersionError(f"version must be >= 0, got {version}")
        if version > self._version:
            raise InvalidVersionError(
                f"version {version} is ahead of the trainer: the newest model is {self._version}"
            )
        return version

    def _slack_at(self, offset: int) -> int:
        """min over k >= offset of cap(k) - #{groups with deadline offset <= k}; 0 if offset < 0."""
        if offset < 0:
            return 0
        slack = self.capacity(self._eta)
        prefix = 0
        capacity = self._redundancy
        counts = self._counts
        done = self._eta + 1
        for k in range(done):
            prefix += counts[k] + counts[done + k]
            capacity += self._batch_size
            if k >= offset and capacity - prefix < slack:
                slack = capacity - prefix
        return slack

    def _version_of(self, group_id: GroupId) -> int:
        try:
            return self._versions[group_id]
        except (KeyError, TypeError):
            raise UnknownGroupError(f"group {group_id!r} is not active") from None

    def _bucket_at(self, version: int) -> _Bucket:
        """The bucket of groups reserved with ``version`` (their deadline is ``version + eta``)."""
        return self._buckets[version + self._eta - self._version]

    def _consume_plan(self) -> list[int] | None:
        """How many done groups to take per deadline offset, or None when consume is not enabled."""
        return self._plan(self._done_counts())

    def _done_counts(self) -> list[int]:
        """The done counts by deadline offset (a copy: callers may change it)."""
        offsets = self._eta + 1
        return self._counts[offsets : 2 * offsets]

    def _plan(self, done: list[int]) -> list[int] | None:
        """The consume plan if ``done[k]`` groups due at offset ``k`` were finished, else None. Taking
        done groups earliest-deadline-first is optimal for every constraint at once: it takes the most
        head-buffer groups (fewest drops) and lowers every prefix count the most."""
        need = self._batch_size
        plan: list[int] = []
        for finished in done:
            take = min(need, finished)
            plan.append(take)
            need -= take
        if need:
            return None
        counts = self._counts
        offsets = self._eta + 1
        if counts[0] + counts[offsets] - plan[0] > self._redundancy:
            return None
        prefix = 0
        for k in range(1, offsets):
            prefix += counts[k] + counts[offsets + k] - plan[k]
            if prefix > self.capacity(k - 1):
                return None
        return plan

    def _not_ready_reason(self) -> str:
        done = sum(self._done_counts())
        if done < self._batch_size:
            return f"cannot consume buffer {self._version}: {done} finished groups, {self._batch_size} needed"
        return (
            f"cannot consume buffer {self._version}: groups due in it are still running and "
            f"dropping them would exceed the redundancy of {self._redundancy} or leave too many "
            "groups due in the next buffers"
        )

    def _restore_group(self, entry: Any) -> None:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 3):
            raise SnapshotError(f"invalid snapshot group entry {entry!r}: expected [id, version, status]")
        group_id, version, status = entry
        if isinstance(group_id, bool) or not isinstance(group_id, (str, int)):
            raise SnapshotError(f"invalid snapshot group id {group_id!r}")
        if group_id in self._versions:
            raise SnapshotError(f"invalid snapshot: group {group_id!r} appears twice")
        try:
            version = self._check_version(version)
            record = GroupRecord(group_id, version, GroupStatus(status))
        except ValueError as error:
            raise SnapshotError(f"invalid snapshot group {group_id!r}: {error}") from None
        offset = version + self._eta - self._version
        if not 0 <= offset <= self._eta:  # never let a negative offset index the deque from the end
            raise SnapshotError(f"invalid snapshot: group {group_id!r} is past its deadline")
        bucket = self._buckets[offset]
        (bucket.running if record.status is GroupStatus.RUNNING else bucket.done)[group_id] = None
        self._versions[group_id] = version

    def _check_invariant(self) -> None:
        prefix = 0
        for k, bucket in enumerate(self._buckets):
            prefix += len(bucket)
            if prefix > self.capacity(k):
                raise SnapshotError(
                    f"invalid snapshot: {prefix} groups due by buffer {self._version + k}, "
                    f"at most {self.capacity(k)} allowed"
                )

    def _recount(self) -> None:
        """Set the counts from the buckets (after a consume moved every deadline on, and at restore)."""
        buckets = self._buckets
        self._counts = [len(b.running) for b in buckets] + [len(b.done) for b in buckets] + [self._version]

"""The staleness manager: exact admission and eager consumption under a strict staleness bound.

State (design section 2): the head buffer ``c`` (``version``), and for each active group its
version ``v`` and status. A group's deadline is ``v + eta``: the last buffer it may be trained in.
Groups are kept in ``eta + 1`` buckets by deadline offset ``v + eta - c``, so every decision reads
``eta + 1`` counters and never scans the groups.

Invariant (Inv), for ``cap(k) = (k + 1) * batch_size + redundancy``:
every active group has ``c <= deadline <= c + eta``, and for each ``k`` in ``0..eta`` at most
``cap(k)`` groups have a deadline offset ``<= k``. With ``redundancy == 0`` this is Hall's condition
for nested intervals: the groups can be placed in buffers ``c..deadline`` with at most
``batch_size`` per buffer. Virtual buffers are the earliest-deadline-first placement; nothing moves.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterator, Mapping

from .errors import (
    ConsumeNotReadyError,
    DuplicateGroupError,
    InvalidTransitionError,
    InvalidVersionError,
    SnapshotError,
    UnknownGroupError,
)
from .events import (
    ConsumedBatch,
    CounterState,
    EventHook,
    GroupId,
    GroupRecord,
    GroupStatus,
    ProtocolEvent,
)

SNAPSHOT_FORMAT = "staleflow.protocol/1"


class _Bucket:
    """The active groups that share one deadline; dicts keep insertion (FIFO) order."""

    __slots__ = ("running", "done")

    def __init__(self) -> None:
        self.running: dict[GroupId, None] = {}
        self.done: dict[GroupId, None] = {}

    def __len__(self) -> int:
        return len(self.running) + len(self.done)


class BufferView:
    """One virtual buffer of the earliest-deadline-first placement, for display."""

    __slots__ = ("index", "capacity", "running", "done")

    def __init__(self, index: int, capacity: int, running: int, done: int) -> None:
        self.index = index
        self.capacity = capacity
        self.running = running
        self.done = done

    @property
    def free(self) -> int:
        return self.capacity - self.running - self.done

    def __repr__(self) -> str:
        return (
            f"BufferView(index={self.index}, capacity={self.capacity}, "
            f"running={self.running}, done={self.done})"
        )


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class StalenessManager:
    """Admission and consumption of prompt groups so that every trained group is at most ``eta`` stale.

    A group generated from model ``v`` and trained in batch ``b`` always has ``v <= b <= v + eta``.

    Args:
        eta: staleness bound, ``>= 0`` (0 is fully on-policy).
        batch_size: groups per training batch, ``>= 1``.
        redundancy: extra groups that may be admitted beyond what the batches can take; surplus
            groups whose deadline passes are dropped at consume time and reported in
            ``ConsumedBatch.dropped`` (at most ``redundancy`` per batch).
        on_event: optional hook called after every operation with a :class:`ProtocolEvent`.
    """

    def __init__(
        self,
        eta: int,
        batch_size: int,
        redundancy: int = 0,
        on_event: EventHook | None = None,
    ) -> None:
        self._eta = _check_int("eta", eta, 0)
        self._batch_size = _check_int("batch_size", batch_size, 1)
        self._redundancy = _check_int("redundancy", redundancy, 0)
        self._version = 0
        self._buckets: deque[_Bucket] = deque(_Bucket() for _ in range(self._eta + 1))
        # group id -> version; the status is which dict of its bucket holds the id. Plain ints keep
        # this dict out of the garbage collector's way, so per-operation cost stays flat at 100k groups.
        self._versions: dict[GroupId, int] = {}
        self._hooks: list[EventHook] = [] if on_event is None else [on_event]
        self._seq = 0

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
        return CounterState(
            version=self._version,
            running=tuple(len(b.running) for b in self._buckets),
            done=tuple(len(b.done) for b in self._buckets),
        )

    def reserve_slack(self, version: int) -> int:
        """How many more groups generated from ``version`` would be admitted right now (0: none)."""
        self._check_version(version)
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
        one keeps every group within its bound. Raises ``InvalidVersionError`` for a negative
        version or one above :attr:`version`, ``DuplicateGroupError`` for an active id.
        """
        if isinstance(group_id, bool) or not isinstance(group_id, (str, int)):
            raise TypeError(f"group_id must be a str or int, got {type(group_id).__name__}")
        self._check_version(version)
        if group_id in self._versions:
            raise DuplicateGroupError(f"group {group_id!r} is already active")
        before = self.counts() if self._hooks else None
        accepted = self._slack_at(version + self._eta - self._version) > 0
        if accepted:
            self._bucket_at(version).running[group_id] = None
            self._versions[group_id] = version
        if before is not None:
            self._emit("reserve", group_id, version, accepted, None, before)
        return accepted

    def occupy(self, group_id: GroupId) -> None:
        """Mark a running group finished (its rewards are in); it may now be consumed."""
        version = self._version_of(group_id)
        bucket = self._bucket_at(version)
        if group_id not in bucket.running:
            raise InvalidTransitionError(f"cannot occupy group {group_id!r}: it is already done")
        before = self.counts() if self._hooks else None
        del bucket.running[group_id]
        bucket.done[group_id] = None
        if before is not None:
            self._emit("occupy", group_id, version, None, None, before)

    def abort(self, group_id: GroupId) -> None:
        """Remove a running or finished, unconsumed group (failed instance, filter, cancellation)."""
        version = self._version_of(group_id)
        before = self.counts() if self._hooks else None
        bucket = self._bucket_at(version)
        if bucket.running.pop(group_id, bucket) is bucket:
            del bucket.done[group_id]
        del self._versions[group_id]
        if before is not None:
            self._emit("abort", group_id, version, None, None, before)

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
        before = self.counts() if self._hooks else None
        taken: list[GroupId] = []
        for bucket, count in zip(self._buckets, plan):
            for _ in range(count):
                group_id = next(iter(bucket.done))
                del bucket.done[group_id]
                taken.append(group_id)
        head = self._buckets.popleft()
        dropped = (*head.running, *head.done)
        self._buckets.append(_Bucket())
        versions = tuple(self._versions.pop(group_id) for group_id in taken)
        for group_id in dropped:
            del self._versions[group_id]
        batch = ConsumedBatch(self._version, tuple(taken), versions, dropped)
        self._version += 1
        if before is not None:
            self._emit("consume", None, batch.version, None, batch, before)
        return batch

    # ----------------------------------------------------------------- hooks and checkpoints
    def add_event_hook(self, hook: EventHook) -> None:
        """Call ``hook`` after every operation (for traces, metrics and trace validation)."""
        self._hooks.append(hook)

    def remove_event_hook(self, hook: EventHook) -> None:
        self._hooks.remove(hook)

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
        cls, snapshot: Mapping[str, Any], on_event: EventHook | None = None
    ) -> StalenessManager:
        """Rebuild a manager from :meth:`snapshot` data, checking every field and the invariant."""
        if not isinstance(snapshot, Mapping) or snapshot.get("format") != SNAPSHOT_FORMAT:
            raise SnapshotError(f"not a staleness-manager snapshot (expected format {SNAPSHOT_FORMAT!r})")
        try:
            manager = cls(snapshot["eta"], snapshot["batch_size"], snapshot["redundancy"])
            manager._version = _check_int("version", snapshot["version"], 0)
            groups = snapshot["groups"]
        except (KeyError, ValueError) as error:
            raise SnapshotError(f"invalid snapshot: {error}") from None
        if not isinstance(groups, list):
            raise SnapshotError("invalid snapshot: 'groups' must be a list")
        for entry in groups:
            manager._restore_group(entry)
        manager._check_invariant()
        manager._hooks = [] if on_event is None else [on_event]
        return manager

    # ----------------------------------------------------------------- internals
    def _check_version(self, version: int) -> None:
        if isinstance(version, bool) or not isinstance(version, int):
            raise InvalidVersionError(f"version must be an int, got {version!r}")
        if version < 0:
            raise InvalidVersionError(f"version must be >= 0, got {version}")
        if version > self._version:
            raise InvalidVersionError(
                f"version {version} is ahead of the trainer: the newest model is {self._version}"
            )

    def _slack_at(self, offset: int) -> int:
        """min over k >= offset of cap(k) - #{groups with deadline offset <= k}; 0 if offset < 0."""
        if offset < 0:
            return 0
        slack = self.capacity(self._eta)
        prefix = 0
        capacity = self._redundancy
        for k, bucket in enumerate(self._buckets):
            prefix += len(bucket)
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
        """How many done groups to take per deadline offset, or None when consume is not enabled.

        Taking done groups earliest-deadline-first is optimal for every constraint at once: it
        takes the most head-buffer groups (fewest drops) and lowers every prefix count the most.
        """
        need = self._batch_size
        plan: list[int] = []
        for bucket in self._buckets:
            take = min(need, len(bucket.done))
            plan.append(take)
            need -= take
        if need:
            return None
        if len(self._buckets[0]) - plan[0] > self._redundancy:
            return None
        prefix = 0
        for k in range(1, self._eta + 1):
            prefix += len(self._buckets[k]) - plan[k]
            if prefix > self.capacity(k - 1):
                return None
        return plan

    def _not_ready_reason(self) -> str:
        done = sum(len(b.done) for b in self._buckets)
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
            self._check_version(version)
            record = GroupRecord(group_id, version, GroupStatus(status))
        except ValueError as error:
            raise SnapshotError(f"invalid snapshot group {group_id!r}: {error}") from None
        offset = version + self._eta - self._version
        if offset < 0:
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

    def _emit(
        self,
        op: str,
        group_id: GroupId | None,
        version: int | None,
        accepted: bool | None,
        batch: ConsumedBatch | None,
        before: CounterState,
    ) -> None:
        event = ProtocolEvent(self._seq, op, group_id, version, accepted, batch, before, self.counts())
        self._seq += 1
        for hook in self._hooks:
            hook(event)

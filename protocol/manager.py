"""The staleness manager: exact admission and eager consumption under a strict staleness bound.

State (design section 2): the head buffer ``c`` (``version``), and for each active group its
version ``v`` and status. A group's deadline is ``v + eta``: the last buffer it may be trained in.
Groups are kept in ``eta + 1`` buckets by deadline offset ``v + eta - c``, so every decision reads
``eta + 1`` counters and never scans the groups.

Operations are atomic (see :mod:`.errors`): each either raises a :class:`~.errors.ProtocolError`
before changing anything, or is fully applied; then every event hook runs, and if any raised, the
operation raises :class:`~.errors.HookError` (it was applied: do not retry it). Versions are
accepted through ``operator.index`` (numpy or torch integer scalars work; ``bool`` does not) and
stored as plain ints.

Group ids are not remembered once a group leaves (consumed, dropped or aborted): an id may be
reserved again as a new group, as the spec allows (``Reserve`` needs only that the id is not
active). Refusing a consumed id would need memory that grows with every group a run ever trains;
hosts that key groups by prompt reuse ids across epochs. A host that needs unique ids should
draw them from a counter.

Invariant (Inv), for ``cap(k) = (k + 1) * batch_size + redundancy``:
every active group has ``c <= deadline <= c + eta``, and for each ``k`` in ``0..eta`` at most
``cap(k)`` groups have a deadline offset ``<= k``. With ``redundancy == 0`` this is Hall's condition
for nested intervals: the groups can be placed in buffers ``c..deadline`` with at most
``batch_size`` per buffer. Virtual buffers are the earliest-deadline-first placement; nothing moves.
"""

from __future__ import annotations

import operator
from collections import deque
from typing import Any, Iterable, Iterator, Mapping

from .errors import (
    ConsumeNotReadyError,
    DuplicateGroupError,
    HookError,
    InvalidGroupIdError,
    InvalidParameterError,
    InvalidTransitionError,
    InvalidVersionError,
    ProtocolError,
    SnapshotError,
    UnknownGroupError,
    UnknownHookError,
)
from .events import (
    ConsumedBatch,
    CounterState,
    EventHook,
    GroupId,
    GroupRecord,
    GroupStatus,
    ProtocolEvent,
    ProtocolStats,
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


def as_int(name: str, value: object, error: type[ProtocolError] = InvalidParameterError) -> int:
    """``value`` as a plain int through ``operator.index`` (numpy/torch integer scalars pass; ``bool``,
    floats and strings raise ``error``)."""
    if type(value) is int:
        return value
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise error(f"{name} must be an int, got {value!r} ({type(value).__name__})") from None


def _check_int(name: str, value: object, minimum: int) -> int:
    number = as_int(name, value)
    if number < minimum:
        raise InvalidParameterError(f"{name} must be >= {minimum}, got {number}")
    return number


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
        hooks: more hooks, called after ``on_event`` in this order.

    Raises :class:`~.errors.InvalidParameterError` (a ``ValueError``) for a parameter out of range.
    """

    def __init__(
        self,
        eta: int,
        batch_size: int,
        redundancy: int = 0,
        on_event: EventHook | None = None,
        hooks: Iterable[EventHook] = (),
    ) -> None:
        self._eta = _check_int("eta", eta, 0)
        self._batch_size = _check_int("batch_size", batch_size, 1)
        self._redundancy = _check_int("redundancy", redundancy, 0)
        self._version = 0
        self._buckets: deque[_Bucket] = deque(_Bucket() for _ in range(self._eta + 1))
        # group id -> version; the status is which dict of its bucket holds the id. Plain ints keep
        # this dict out of the garbage collector's way, so per-operation cost stays flat at 100k groups.
        self._versions: dict[GroupId, int] = {}
        self._hooks: list[EventHook] = ([] if on_event is None else [on_event]) + list(hooks)
        self._seq = 0
        self._last_counts: CounterState | None = None  # the last event's after-state: the next one's before
        self._interrupted: dict[GroupId, None] = {}  # running groups of the snapshot restored from
        # counters for stats(), since this object was built or restored
        self._reserved = self._refused_stale = self._refused_full = 0
        self._occupied = self._aborted = self._batches = self._consumed = self._dropped = 0
        self._staleness = [0] * (self._eta + 1)

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
        buckets = self._buckets
        return CounterState(
            self._version, tuple([len(b.running) for b in buckets]), tuple([len(b.done) for b in buckets])
        )

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
        """How many more groups may start generating now on an engine at ``version``, with at most
        ``max_in_flight`` groups running at once (AReaL's ``get_capacity``): the reserve slack at
        ``version``, capped by ``max_in_flight`` minus the running groups; never negative."""
        slack = self.reserve_slack(version)
        limit = _check_int("max_in_flight", max_in_flight, 0)
        running = sum(len(bucket.running) for bucket in self._buckets)
        return max(0, min(slack, limit - running))

    def blocking_groups(self) -> tuple[GroupId, ...]:
        """The running groups the next batch waits for: empty when ``can_consume()``; else the fewest
        running groups which, once finished, enable ``consume``: those with the earliest deadlines
        (earliest-deadline-first finishing is optimal), in deadline then arrival order. When fewer
        than ``batch_size`` groups are active, every running group (and more reserves are needed)."""
        done = [len(bucket.done) for bucket in self._buckets]
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
        """Counts by deadline, operation counters, refusals by reason, drops, the staleness histogram
        of consumed groups and the groups blocking the next batch (see :class:`ProtocolStats`)."""
        counts = self.counts()
        blocking = self.blocking_groups()
        return ProtocolStats(
            version=self._version,
            deadlines=tuple(range(self._version, self._version + self._eta + 1)),
            running=counts.running,
            done=counts.done,
            reserved=self._reserved,
            refused={"stale": self._refused_stale, "full": self._refused_full},
            occupied=self._occupied,
            aborted=self._aborted,
            batches=self._batches,
            consumed=self._consumed,
            dropped=self._dropped,
            staleness=tuple(self._staleness),
            can_consume=self.can_consume(),
            blocking=blocking,
            missing=max(0, self._batch_size - len(self._versions)),
        )

    def interrupted_groups(self) -> tuple[GroupId, ...]:
        """The groups that were running in the snapshot this manager was restored from and are still
        running: their generation died with the process that took the snapshot. Resume each (keep
        its id: its version is the oldest token's, unchanged) or ``abort`` it; until then it holds
        its place and may block the batch it is due in. Empty for a manager that was not restored."""
        self._interrupted = {
            group_id: None
            for group_id in self._interrupted
            if group_id in self._versions and group_id in self._bucket_at(self._versions[group_id]).running
        }
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
        one keeps every group within its bound. Raises ``InvalidVersionError`` for a version that is
        not an integer, negative or above :attr:`version`, ``DuplicateGroupError`` for an active id,
        ``InvalidGroupIdError`` for an id that is not a str or int. An id that was active before
        (consumed, dropped or aborted) is a new group (see the module docstring).
        """
        if isinstance(group_id, bool) or not isinstance(group_id, (str, int)):
            raise InvalidGroupIdError(f"group_id must be a str or int, got {type(group_id).__name__}")
        version = self._check_version(version)
        if group_id in self._versions:
            raise DuplicateGroupError(f"group {group_id!r} is already active")
        before = self._before() if self._hooks else None
        accepted = self._slack_at(version + self._eta - self._version) > 0
        if accepted:
            self._bucket_at(version).running[group_id] = None
            self._versions[group_id] = version
            self._reserved += 1
        elif version + self._eta < self._version:
            self._refused_stale += 1
        else:
            self._refused_full += 1
        if before is not None:
            self._emit("reserve", group_id, version, accepted, None, before)
        return accepted

    def occupy(self, group_id: GroupId) -> None:
        """Mark a running group finished (its rewards are in); it may now be consumed."""
        version = self._version_of(group_id)
        bucket = self._bucket_at(version)
        if group_id not in bucket.running:
            raise InvalidTransitionError(f"cannot occupy group {group_id!r}: it is already done")
        before = self._before() if self._hooks else None
        del bucket.running[group_id]
        bucket.done[group_id] = None
        self._occupied += 1
        if before is not None:
            self._emit("occupy", group_id, version, None, None, before)

    def abort(self, group_id: GroupId) -> None:
        """Remove a running or finished, unconsumed group (failed instance, filter, cancellation)."""
        version = self._version_of(group_id)
        before = self._before() if self._hooks else None
        bucket = self._bucket_at(version)
        self._aborted += 1
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
        before = self._before() if self._hooks else None
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
        for group_version in versions:
            self._staleness[self._version - group_version] += 1
        self._batches += 1
        self._consumed += len(taken)
        self._dropped += len(dropped)
        self._version += 1
        if before is not None:
            self._emit("consume", None, batch.version, None, batch, before)
        return batch

    # ----------------------------------------------------------------- hooks and checkpoints
    def add_event_hook(self, hook: EventHook) -> None:
        """Call ``hook`` after every operation (for traces, metrics and trace validation).

        Hooks run after the operation is applied, in registration order, every one of them even if
        an earlier one raises; the operation then raises :class:`~.errors.HookError`.
        """
        self._last_counts = None  # operations without hooks did not record their after-state
        self._hooks.append(hook)

    def remove_event_hook(self, hook: EventHook) -> None:
        """Stop calling ``hook``; :class:`~.errors.UnknownHookError` if it is not registered."""
        try:
            self._hooks.remove(hook)
        except ValueError:
            raise UnknownHookError(f"event hook {hook!r} is not registered") from None

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
        """Rebuild a manager from :meth:`snapshot` data, checking every field and the invariant.

        ``on_event`` and ``hooks`` are registered as in the constructor (restoring emits no event).
        A :class:`~.errors.SnapshotError` names the missing or bad field. The groups that were
        running in the snapshot are reported by :meth:`interrupted_groups`: after a crash their
        generation is gone, and the host must resume or abort each one.
        """
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
        manager._check_invariant()
        manager._interrupted = {g: None for bucket in manager._buckets for g in bucket.running}
        manager._hooks = ([] if on_event is None else [on_event]) + list(hooks)
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
        """How many done groups to take per deadline offset, or None when consume is not enabled."""
        return self._plan([len(bucket.done) for bucket in self._buckets])

    def _plan(self, done: list[int]) -> list[int] | None:
        """The consume plan if ``done[k]`` of the groups due at offset ``k`` were finished (the active
        groups per offset unchanged), or None when that state would not enable consume.

        Taking done groups earliest-deadline-first is optimal for every constraint at once: it
        takes the most head-buffer groups (fewest drops) and lowers every prefix count the most.
        """
        need = self._batch_size
        plan: list[int] = []
        for finished in done:
            take = min(need, finished)
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

    def _emit(
        self,
        op: str,
        group_id: GroupId | None,
        version: int | None,
        accepted: bool | None,
        batch: ConsumedBatch | None,
        before: CounterState,
    ) -> None:
        after = self.counts()
        event = ProtocolEvent(self._seq, op, group_id, version, accepted, batch, before, after)
        self._seq += 1
        self._last_counts = after
        failures: list[tuple[EventHook, BaseException]] = []
        for hook in tuple(self._hooks):  # a copy: a hook may remove itself (a trace writer closing)
            try:
                hook(event)
            except Exception as error:  # noqa: BLE001 - the other hooks must still see the event
                failures.append((hook, error))
        if failures:
            raise HookError(event, failures) from failures[0][1]

    def _before(self) -> CounterState:
        """The state before an operation, for its event: the last event's after-state when there is one
        (every state change emits an event while hooks are registered), else counted now."""
        return self.counts() if self._last_counts is None else self._last_counts

"""Values the staleness manager hands out: consumed batches, group records and operation events."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Protocol, Union

#: A prompt group's id. Ints and strings keep snapshots and traces JSON-serialisable.
GroupId = Union[str, int]


class GroupStatus(str, enum.Enum):
    """Where an active group is in its life: generating, or finished and rewarded."""

    RUNNING = "running"
    DONE = "done"


@dataclass(frozen=True)
class GroupRecord:
    """An active group: the oldest model version that generated any of its tokens, and its status."""

    group_id: GroupId
    version: int
    status: GroupStatus


@dataclass(frozen=True)
class ConsumedBatch:
    """One training batch taken out of the protocol.

    ``version`` is the buffer index: training on it turns model version ``version`` into
    ``version + 1``. Every group in ``group_ids`` satisfies
    ``group_version <= version <= group_version + eta``. ``dropped`` lists groups removed as
    redundancy waste (at most ``redundancy`` of them; always empty when ``redundancy == 0``).
    ``group_versions`` maps each consumed group to its version, in the same order as ``group_ids``.
    """

    version: int
    group_ids: tuple[GroupId, ...]
    group_versions: tuple[int, ...]
    dropped: tuple[GroupId, ...]


@dataclass(frozen=True, init=False)
class CounterState:
    """The protocol's abstract state as counters: the head buffer and per-deadline group counts.

    ``running[i]`` and ``done[i]`` count the active groups whose deadline is ``version + i``
    (``0 <= i <= eta``). Together with the group identities this is everything the TLA+ spec tracks.
    """

    version: int
    running: tuple[int, ...]
    done: tuple[int, ...]

    def __init__(self, version: int, running: tuple[int, ...], done: tuple[int, ...]) -> None:
        # The generated frozen __init__ sets each field through object.__setattr__ (about 1 us per
        # event with ProtocolEvent's eight fields); filling __dict__ keeps tracing cheap.
        fields = self.__dict__
        fields["version"] = version
        fields["running"] = running
        fields["done"] = done

    @classmethod
    def from_flat(cls, state: tuple[int, ...]) -> CounterState:
        """The state of a flat tuple ``(*running, *done, version)`` (:meth:`flat`)."""
        offsets = len(state) // 2
        return cls(state[-1], state[:offsets], state[offsets:-1])

    def flat(self) -> tuple[int, ...]:
        """This state as one flat tuple ``(*running, *done, version)`` (the manager's own layout)."""
        return (*self.running, *self.done, self.version)


@dataclass(frozen=True, init=False)
class ProtocolEvent:
    """One operation on the manager, with its outcome and the state before and after it.

    ``op`` is one of ``"reserve"``, ``"occupy"``, ``"abort"``, ``"consume"``. For ``reserve``,
    ``accepted`` tells whether the group was admitted (a refused reserve still emits an event, with
    ``before == after``). For ``consume``, ``batch`` holds the batch. ``seq`` numbers the events
    one manager object emitted, from 0 (a restored manager starts again at 0).
    """

    seq: int
    op: str
    group_id: GroupId | None
    version: int | None
    accepted: bool | None
    batch: ConsumedBatch | None
    before: CounterState
    after: CounterState

    def __init__(
        self,
        seq: int,
        op: str,
        group_id: GroupId | None,
        version: int | None,
        accepted: bool | None,
        batch: ConsumedBatch | None,
        before: CounterState,
        after: CounterState,
    ) -> None:
        fields = self.__dict__  # see CounterState.__init__
        fields["seq"] = seq
        fields["op"] = op
        fields["group_id"] = group_id
        fields["version"] = version
        fields["accepted"] = accepted
        fields["batch"] = batch
        fields["before"] = before
        fields["after"] = after


#: The operations after which ``can_consume()`` may turn true: ``occupy`` (one more finished group),
#: ``abort`` (a running group due soon is gone) and ``consume`` (the next buffer may be ready at
#: once). A ``reserve`` never enables a consume (it only adds a running group), a refused one
#: changes nothing. ``tests/test_protocol_waiting.py`` checks this claim on random runs.
CONSUMABLE_AFTER = frozenset({"occupy", "abort", "consume"})

#: The operations after which the admission room (``reserve_slack(v)``, ``can_reserve(v)``) may grow:
#: ``abort`` (a place is freed) and ``consume`` (every deadline moves one buffer on, and versions up
#: to the new ``manager.version`` become valid). ``occupy`` leaves it unchanged (a finished group keeps
#: its place until consumed); an accepted ``reserve`` only shrinks it.
ADMISSIBLE_AFTER = frozenset({"abort", "consume"})


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


EventHook = Callable[[ProtocolEvent], None]


class EventRecorder(Protocol):
    """An event hook that can also take an operation's fields without a :class:`ProtocolEvent`.

    When such a hook is the manager's **only** hook, the manager calls :meth:`record_event` instead
    of building an event and calling the hook (the trace writer's fast path); with other hooks
    registered, it is called like any hook. The states are flat tuples ``(*running, *done, version)``
    (:meth:`CounterState.flat`); ``before`` is the last event's ``after`` (the same object), and a
    refused reserve passes one object as both. If it raises, the operation raises
    :class:`~.errors.HookError` with the event built from these fields, as for any hook.
    """

    def __call__(self, event: ProtocolEvent) -> None: ...

    def record_event(self, seq: int, op: str, group_id: GroupId | None, version: int, accepted: bool | None,
                     batch: ConsumedBatch | None, before: tuple[int, ...], after: tuple[int, ...]) -> None: ...

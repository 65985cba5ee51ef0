"""Values the staleness manager hands out: consumed batches, group records and operation events."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Union

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


@dataclass(frozen=True)
class CounterState:
    """The protocol's abstract state as counters: the head buffer and per-deadline group counts.

    ``running[i]`` and ``done[i]`` count the active groups whose deadline is ``version + i``
    (``0 <= i <= eta``). Together with the group identities this is everything the TLA+ spec tracks.
    """

    version: int
    running: tuple[int, ...]
    done: tuple[int, ...]


@dataclass(frozen=True)
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


EventHook = Callable[[ProtocolEvent], None]

"""The staleness protocol: a pure, standard-library-only core that other RL systems can vendor.

>>> from staleflow.protocol import StalenessManager
>>> m = StalenessManager(eta=1, batch_size=2)
>>> [m.reserve(g, version=0) for g in ("a", "b", "c", "d", "e")]
[True, True, True, True, False]
>>> for g in ("a", "b"): m.occupy(g)
>>> m.consume().group_ids
('a', 'b')
"""

from staleflow.protocol.errors import (
    ConsumeNotReadyError,
    DuplicateGroupError,
    InvalidTransitionError,
    InvalidVersionError,
    ProtocolError,
    SnapshotError,
    UnknownGroupError,
)
from staleflow.protocol.events import (
    ConsumedBatch,
    CounterState,
    EventHook,
    GroupId,
    GroupRecord,
    GroupStatus,
    ProtocolEvent,
)
from staleflow.protocol.manager import SNAPSHOT_FORMAT, BufferView, StalenessManager

__all__ = [
    "SNAPSHOT_FORMAT",
    "BufferView",
    "ConsumeNotReadyError",
    "ConsumedBatch",
    "CounterState",
    "DuplicateGroupError",
    "EventHook",
    "GroupId",
    "GroupRecord",
    "GroupStatus",
    "InvalidTransitionError",
    "InvalidVersionError",
    "ProtocolError",
    "ProtocolEvent",
    "SnapshotError",
    "StalenessManager",
    "UnknownGroupError",
]

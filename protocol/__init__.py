"""The staleness protocol: a pure, standard-library-only core that other RL systems can vendor.

Inside StaleFlow it is ``staleflow.protocol``; alone it installs as the dependency-free
distribution ``staleflow-protocol`` (``pip install ./protocol``, Python >= 3.9), imported as
``staleflow_protocol``: the same files. ``LockedStalenessManager`` is the thread-safe wrapper;
``python -m staleflow_protocol.check TRACE.jsonl`` checks a trace against the spec's mirror.
See ``docs/integrating.md``.

>>> from staleflow.protocol import StalenessManager
>>> m = StalenessManager(eta=1, batch_size=2)
>>> [m.reserve(g, version=0) for g in ("a", "b", "c", "d", "e")]
[True, True, True, True, False]
>>> for g in ("a", "b"): m.occupy(g)
>>> m.consume().group_ids
('a', 'b')
"""

from .errors import (
    ConsumeNotReadyError,
    DuplicateGroupError,
    InvalidTransitionError,
    InvalidVersionError,
    ProtocolError,
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
from .locked import LockedStalenessManager
from .manager import SNAPSHOT_FORMAT, BufferView, StalenessManager

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
    "LockedStalenessManager",
    "ProtocolError",
    "ProtocolEvent",
    "SnapshotError",
    "StalenessManager",
    "UnknownGroupError",
]

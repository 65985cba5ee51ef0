"""The staleness protocol: a pure, standard-library-only core that other RL systems can vendor.

Inside StaleFlow it is ``staleflow.protocol``; alone it installs as the dependency-free
distribution ``staleflow-protocol`` (``pip install ./protocol``, Python >= 3.9), imported as
``staleflow_protocol``: the same files. ``LockedStalenessManager`` is the thread-safe wrapper;
``python -m staleflow_protocol.check TRACE.jsonl`` checks a trace against the spec's mirror;
``AsyncWaiter`` (module ``waiting``) makes readiness awaitable. Operations are atomic: an error comes
before any state change, or the operation is applied and every hook runs (a failing hook surfaces
as ``HookError``; see ``errors``). ``staleflow_protocol.bindings.areal`` and ``staleflow_protocol.bindings.areal_trainer``
(not imported here; they need ``areal``) are the drop-in for AReaL 1.0.4. See ``docs/integrating.md``.

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
    HookError,
    InvalidGroupIdError,
    InvalidParameterError,
    InvalidTransitionError,
    InvalidVersionError,
    ProtocolError,
    SnapshotError,
    StaleVersionError,
    TraceClosedError,
    UnknownGroupError,
    UnknownHookError,
)
from .events import (
    ADMISSIBLE_AFTER,
    CONSUMABLE_AFTER,
    BufferView,
    ConsumedBatch,
    CounterState,
    EventHook,
    EventRecorder,
    GroupId,
    GroupRecord,
    GroupStatus,
    ProtocolEvent,
)
from .locked import LockedStalenessManager
from .manager import SNAPSHOT_FORMAT, StalenessManager
from .stats import ProtocolStats
from .waiting import AsyncWaiter

__all__ = [
    "ADMISSIBLE_AFTER",
    "CONSUMABLE_AFTER",
    "SNAPSHOT_FORMAT",
    "AsyncWaiter",
    "BufferView",
    "ConsumeNotReadyError",
    "ConsumedBatch",
    "CounterState",
    "DuplicateGroupError",
    "EventHook",
    "EventRecorder",
    "GroupId",
    "GroupRecord",
    "GroupStatus",
    "HookError",
    "InvalidGroupIdError",
    "InvalidParameterError",
    "InvalidTransitionError",
    "InvalidVersionError",
    "LockedStalenessManager",
    "ProtocolError",
    "ProtocolEvent",
    "ProtocolStats",
    "SnapshotError",
    "StaleVersionError",
    "StalenessManager",
    "TraceClosedError",
    "UnknownGroupError",
    "UnknownHookError",
]

"""What :meth:`~.manager.StalenessManager.stats` reports, and the operation counters behind it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .events import CounterState, GroupId

#: Why a reserve was refused: its version's deadline has passed, or there is no room by it.
STALE, FULL = "stale", "full"


@dataclass(frozen=True)
class ProtocolStats:
    """What :meth:`~.manager.StalenessManager.stats` reports: the state by deadline and the counters
    of the operations this manager object performed (a restored manager counts from 0 again).

    ``deadlines[i]`` is buffer ``version + i``; ``running[i]`` and ``done[i]`` count the active groups
    due in it. ``refused`` counts refused reserves by reason: ``"stale"`` (the version's deadline
    has passed: the engine must sync) and ``"full"`` (no room by the group's deadline: wait for a
    consume or an abort). ``staleness[s]`` counts consumed groups trained ``s`` versions after the
    model that generated them (``0 <= s <= eta``). ``blocking`` are the running groups the next
    batch waits for (:meth:`~.manager.StalenessManager.blocking_groups`); ``missing`` how many groups
    must still be reserved before any batch can form (when fewer than ``batch_size`` are active).
    """

    version: int
    deadlines: tuple[int, ...]
    running: tuple[int, ...]
    done: tuple[int, ...]
    reserved: int
    refused: dict[str, int]
    occupied: int
    aborted: int
    batches: int
    consumed: int
    dropped: int
    staleness: tuple[int, ...]
    can_consume: bool
    blocking: tuple[GroupId, ...]
    missing: int


class OperationTally:
    """Counters of one manager object's operations (plain attributes: incremented on the hot path)."""

    __slots__ = ("reserved", "refused", "occupied", "aborted", "batches", "consumed", "dropped", "staleness")

    def __init__(self, eta: int) -> None:
        self.reserved = self.occupied = self.aborted = self.batches = self.consumed = self.dropped = 0
        self.refused = {STALE: 0, FULL: 0}
        self.staleness = [0] * (eta + 1)

    def count_batch(self, version: int, group_versions: Sequence[int], dropped: int) -> None:
        """A consume of buffer ``version`` took groups of ``group_versions`` and dropped ``dropped``."""
        for group_version in group_versions:
            self.staleness[version - group_version] += 1
        self.batches += 1
        self.consumed += len(group_versions)
        self.dropped += dropped

    def report(self, counts: CounterState, can_consume: bool, blocking: tuple[GroupId, ...], missing: int) -> ProtocolStats:
        return ProtocolStats(
            version=counts.version,
            deadlines=tuple(range(counts.version, counts.version + len(counts.running))),
            running=counts.running,
            done=counts.done,
            reserved=self.reserved,
            refused=dict(self.refused),
            occupied=self.occupied,
            aborted=self.aborted,
            batches=self.batches,
            consumed=self.consumed,
            dropped=self.dropped,
            staleness=tuple(self.staleness),
            can_consume=can_consume,
            blocking=blocking,
            missing=missing,
        )

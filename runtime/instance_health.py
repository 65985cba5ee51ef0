"""Failed rollout instances: how the run loop finds out what an instance still holds, and when to
trust it again.

An engine call or weight transfer that raises the failure contract's errors
(:data:`~staleflow.runtime.interfaces.INSTANCE_FAILURES`) marks the instance *down*: its state is
unknown, so the requests the trajectory server places on it go back to the queue from their last
partial. A down instance gets no work; every tick it is *probed*: once it answers and holds nothing
(anything it still held is aborted first, and results it reports late are dropped), it is *up*
again, starting from its empty snapshot. Nothing ever runs twice or is lost.
"""

from __future__ import annotations

from dataclasses import dataclass

from staleflow.runtime.interfaces import INSTANCE_FAILURES, RolloutEngine
from staleflow.runtime.types import InstanceSnapshot


def first_snapshot(engine: RolloutEngine, now: float) -> tuple[InstanceSnapshot, bool]:
    """The engine's snapshot and whether it is up.

    Down (with an empty, loading stand-in snapshot) if it does not answer, or holds requests this
    run did not route or results of such requests not yet collected (left from before a restart:
    the checkpoint re-queued them from their last partial, so such a result would arrive twice;
    chaos seed 200027): it is then probed every tick. Leftover results are discarded here.
    """
    try:
        leftover = engine.collect()
        snapshot = engine.snapshot()
        if not (snapshot.running or snapshot.waiting or leftover):
            return snapshot, True
    except INSTANCE_FAILURES:
        pass
    return InstanceSnapshot(engine.instance_id, 0, (), (), 0, 0, 0.0, now, loading=True), False


@dataclass(frozen=True)
class ProbeResult:
    """A probe that found the instance answering and empty: it is up again.

    ``late``: trajectories it reported that finished while it was down (dropped by the caller).
    """

    snapshot: InstanceSnapshot
    next_event: float | None
    late: int


def probe(engine: RolloutEngine) -> ProbeResult | None:
    """Probe a down instance: None while it fails or still holds requests (which are aborted, so
    that a later probe finds it empty)."""
    try:
        late = engine.collect()
        held = engine.snapshot()
        if held.running or held.waiting:
            engine.abort([*held.running, *held.waiting])
            return None  # taken back on a later probe, once a snapshot shows it empty
        snapshot = engine.snapshot()
        next_event = engine.next_event_time()
    except INSTANCE_FAILURES:
        return None
    if snapshot.running or snapshot.waiting:
        return None
    return ProbeResult(snapshot, next_event, len(late))

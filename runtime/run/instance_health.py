"""Failed rollout instances: how the run loop finds out what an instance still holds, and when to
trust it again.

An engine call or weight transfer that raises the failure contract's errors
(:data:`~staleflow.runtime.interfaces.INSTANCE_FAILURES`) marks the instance *down*: its state is
unknown, so the requests the trajectory server places on it go back to the queue from their last
partial. A down instance gets no work; every tick it is *probed*: every request placed on it when
it failed is aborted there (whatever its snapshots say), results it reports late are dropped, and
once it answers and its snapshot shows nothing held, it is *up* again, starting from that empty
snapshot. Nothing ever runs twice or is lost.

A snapshot alone never proves an instance empty: it may be older than the requests last sent there
(a real engine publishes its state from its own loop; snapshots can arrive late or out of order).
Chaos seeds 300557, 300618 and 301287 brought an instance back on such a snapshot, taken before
the requests that were re-queued when a Pull failed: they ran twice. The abort of every request
placed there when it failed closes that: the snapshot only has to show nothing else.
"""

from __future__ import annotations

from collections.abc import Collection
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


def probe(engine: RolloutEngine, placed: Collection[str]) -> ProbeResult | None:
    """Probe a down instance: abort ``placed`` (the requests placed on it when it failed, re-queued
    since) there, then None while it fails or its snapshot still shows requests (which are aborted
    too, so that a later probe finds it empty)."""
    try:
        late = engine.collect()
        if placed:
            engine.abort(sorted(placed))
        snapshot = engine.snapshot()
        if snapshot.running or snapshot.waiting:
            engine.abort([*snapshot.running, *snapshot.waiting])
            return None  # taken back on a later probe, once a snapshot shows it empty
        next_event = engine.next_event_time()
    except INSTANCE_FAILURES:
        return None
    return ProbeResult(snapshot, next_event, len(late))

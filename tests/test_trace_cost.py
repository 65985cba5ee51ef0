"""The trace writer's cost per admitted group, counted rather than timed (so it is the same on every
machine): on the manager's fast path no event object is built, and the writer's stream calls and
bytes stay within a budget. The timed ratio (goal: a traced group costs at most 3x an untraced
one) is ``staleflow bench trace-cost``; its command is checked in tests/test_bench_commands.py.
"""

from __future__ import annotations

from collections import Counter

import pytest
from staleflow.bench.trace_cost import recorded_ops, trace_footprint
from staleflow.protocol import StalenessManager
from staleflow.protocol.events import CounterState, ProtocolEvent
from staleflow.protocol.trace import JsonlTraceWriter

#: (eta, batch size) -> bytes per admitted group at 20 batches of the bench's sequence (seed 0), about
#: 12% over what format staleflow.trace/2 writes (196 and 230): a before-state on every line, or
#: format /1's objects, goes over
BYTES_PER_GROUP = {(1, 64): 220, (3, 512): 260}


@pytest.fixture
def objects_built(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How many ProtocolEvent and CounterState objects are built from now on (their __init__ counted)."""
    built: Counter[str] = Counter()
    for cls in (ProtocolEvent, CounterState):
        original = cls.__init__

        def counting(self: object, *args: object, _original: object = original, _name: str = cls.__name__) -> None:
            built[_name] += 1
            _original(self, *args)  # type: ignore[operator]

        monkeypatch.setattr(cls, "__init__", counting)
    return built


@pytest.mark.parametrize(("eta", "batch_size"), sorted(BYTES_PER_GROUP))
def test_a_traced_group_builds_no_event_and_stays_within_its_write_budget(
    eta: int, batch_size: int, objects_built: Counter[str]
) -> None:
    ops = recorded_ops(eta, batch_size, batches=20, seed=0)
    manager = StalenessManager(eta, batch_size)
    objects_built.clear()  # the manager's own start-up state is not the trace's doing
    footprint = trace_footprint(manager, ops)
    assert objects_built == Counter(), "the writer, the manager's only hook, must take the fields (EventRecorder)"
    groups, events, consumes = footprint["groups"], footprint["events"], footprint["consumes"]
    assert groups > 1_000 and events >= 2 * groups + consumes  # each group reserved and ended, each batch consumed
    # one write at each consume and one per WRITE_EVERY lines, each followed by a flush (and close's)
    assert footprint["writes"] <= consumes + events // JsonlTraceWriter.WRITE_EVERY + 1
    assert footprint["flushes"] <= footprint["writes"] + 1
    assert footprint["bytes_per_group"] <= BYTES_PER_GROUP[(eta, batch_size)], footprint


def test_the_counted_stream_holds_what_a_file_holds(tmp_path: object) -> None:
    """The footprint counts what the writer writes: the same characters as the trace file's events."""
    from pathlib import Path

    ops = recorded_ops(1, 64, batches=3, seed=0)
    footprint = trace_footprint(StalenessManager(1, 64), ops)
    path = Path(str(tmp_path)) / "trace.jsonl"
    manager = StalenessManager(1, 64)
    with JsonlTraceWriter.attach(manager, path):
        for op, args in ops:
            getattr(manager, op)(*args)
    header, *lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    assert (len(lines), sum(map(len, lines))) == (footprint["events"], footprint["bytes"])

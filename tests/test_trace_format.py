"""Trace format /2 and the writer's field fast path: the counts the manager keeps per operation equal
its buckets, a lone trace writer takes the fields without a ProtocolEvent and writes what it writes
as one hook among others, a failing one raises HookError as any hook, and traces of format /1 (every
before-state logged) still read back and check."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from staleflow.protocol import CounterState, GroupStatus, HookError, ProtocolEvent, StalenessManager, check
from staleflow.protocol.trace import (
    JsonlTraceWriter,
    TraceFormatError,
    TraceHeader,
    read_trace,
)


def _bucket_counts(manager: StalenessManager) -> CounterState:
    """The counts of the groups the manager lists (its buckets), computed here."""
    running, done = [0] * (manager.eta + 1), [0] * (manager.eta + 1)
    for group in manager.groups():
        offset = group.version + manager.eta - manager.version
        (running if group.status is GroupStatus.RUNNING else done)[offset] += 1
    return CounterState(manager.version, tuple(running), tuple(done))


def _random_run(manager: StalenessManager, steps: int, seed: int, hooks: list[Any], after_each: Any) -> None:
    """Random reserves (some refused, some stale), occupies, aborts, consumes and, every so often, a
    snapshot and restore (the restored manager gets ``hooks``); ``after_each(manager)`` after each step."""
    rng = random.Random(seed)
    for step in range(steps):
        active = list(manager.groups())
        running = [g.group_id for g in active if g.status is GroupStatus.RUNNING]
        roll = rng.random()
        if roll < 0.45:
            group_id: int | str = step if step % 2 else f"g{step}"
            manager.reserve(group_id, rng.randint(max(0, manager.version - manager.eta - 1), manager.version))
        elif roll < 0.75 and running:
            manager.occupy(rng.choice(running))
        elif roll < 0.82 and active:
            manager.abort(rng.choice(active).group_id)
        elif roll < 0.98 and manager.can_consume():
            manager.consume()
        elif roll >= 0.98:
            manager = StalenessManager.restore(manager.snapshot(), hooks=hooks)
        after_each(manager)


@pytest.mark.parametrize("eta,batch_size,redundancy", [(0, 1, 0), (1, 3, 1), (3, 2, 2)])
@pytest.mark.parametrize("hooked", [False, True])
def test_the_counts_kept_per_operation_equal_the_buckets(eta: int, batch_size: int, redundancy: int, hooked: bool) -> None:
    """counts() (the counters every operation updates, which admission and consume read) equals the
    counts of the groups in the buckets after every operation, with and without hooks."""
    events: list[ProtocolEvent] = []
    hooks: list[Any] = [events.append] if hooked else []
    manager = StalenessManager(eta, batch_size, redundancy, hooks=hooks)
    checked = [0]

    def same(m: StalenessManager) -> None:
        assert m.counts() == _bucket_counts(m)
        assert m.flat_counts() == m.counts().flat()
        checked[0] += 1

    _random_run(manager, 1500, eta * 10 + batch_size, hooks, same)
    assert checked[0] == 1500
    if hooked:  # every event's after-state is the counted state, and the next event's before-state
        assert all(a.after == b.before for a, b in zip(events, events[1:]) if b.seq == a.seq + 1)
        assert any(e.op == "consume" for e in events) and any(e.accepted is False for e in events)


class Recorder:
    """An EventRecorder that keeps what it is given, by which door."""

    def __init__(self) -> None:
        self.fields: list[tuple[Any, ...]] = []
        self.events: list[ProtocolEvent] = []

    def __call__(self, event: ProtocolEvent) -> None:
        self.events.append(event)

    def record_event(self, *fields: Any) -> None:
        self.fields.append(fields)


def test_a_lone_recorder_takes_the_fields_and_shares_states_as_documented() -> None:
    recorder = Recorder()
    manager = StalenessManager(eta=1, batch_size=1, hooks=[recorder])
    assert manager.reserve("a", 0) and manager.reserve("b", 0) and not manager.reserve("c", 0)
    manager.occupy("a")
    batch = manager.consume()
    assert recorder.events == []  # no ProtocolEvent was built
    assert [f[:6] for f in recorder.fields] == [
        (0, "reserve", "a", 0, True, None), (1, "reserve", "b", 0, True, None),
        (2, "reserve", "c", 0, False, None), (3, "occupy", "a", 0, None, None), (4, "consume", None, 0, None, batch)]
    states = [f[6:] for f in recorder.fields]
    assert all(before is previous[1] for previous, (before, _) in zip(states, states[1:]))  # one object
    assert states[2][0] is states[2][1]  # a refused reserve: before is after
    assert [CounterState.from_flat(after) for _, after in states][-1] == manager.counts()
    other: list[ProtocolEvent] = []
    manager.add_event_hook(other.append)  # two hooks: both get the event
    manager.abort("b")
    assert len(recorder.fields) == 5 and recorder.events == other and other[0].op == "abort"
    manager.remove_event_hook(other.append)  # alone again: the fields
    manager.reserve("d", 1)
    assert len(recorder.fields) == 6 and recorder.fields[-1][0] == 6


def test_an_object_that_makes_up_attributes_stays_a_plain_hook() -> None:
    hook = mock.Mock()  # hook.record_event exists on the instance only: it must not be called
    manager = StalenessManager(eta=1, batch_size=1, on_event=hook)
    manager.reserve("a", 0)
    assert hook.call_count == 1 and isinstance(hook.call_args.args[0], ProtocolEvent)
    assert hook.record_event.call_count == 0


def _traced_run(stream: io.StringIO, with_other_hook: bool) -> list[ProtocolEvent]:
    manager = StalenessManager(eta=2, batch_size=3, redundancy=1)
    writer = JsonlTraceWriter.attach(manager, stream, refusals=True)
    seen: list[ProtocolEvent] = []
    if with_other_hook:
        manager.add_event_hook(seen.append)
    _random_ops(manager, 800, seed=11)
    writer.close()
    return seen


def _random_ops(manager: StalenessManager, steps: int, seed: int) -> None:
    rng = random.Random(seed)
    for step in range(steps):
        running = [g.group_id for g in manager.groups() if g.status is GroupStatus.RUNNING]
        roll = rng.random()
        if roll < 0.5:
            manager.reserve(f'p"{step}\u00e9' if step % 3 == 0 else step, max(0, manager.version - rng.randint(0, 3)))
        elif roll < 0.85 and running:
            (manager.abort if roll > 0.8 else manager.occupy)(rng.choice(running))
        elif manager.can_consume():
            manager.consume()


def test_the_fast_path_writes_what_the_hook_path_writes(tmp_path: Path) -> None:
    """The writer alone (fields) and the writer next to another hook (events) write the same text,
    and that trace reads back as exactly the events the other hook saw and checks."""
    alone, shared = io.StringIO(), io.StringIO()
    _traced_run(alone, with_other_hook=False)
    seen = _traced_run(shared, with_other_hook=True)
    assert alone.getvalue() == shared.getvalue()
    path = tmp_path / "trace.jsonl"
    path.write_text(alone.getvalue())
    [segment] = read_trace(path)
    assert list(segment.events) == seen and len(seen) > 600
    lines = alone.getvalue().splitlines()
    assert '"before":' in lines[1] and not any('"before":' in line for line in lines[2:])
    report = check.check_trace(path)
    assert report.accepted and report.events == len(seen), report


def test_a_failing_recorder_raises_hook_error_with_the_event() -> None:
    class Failing(Recorder):
        def record_event(self, *fields: Any) -> None:
            if fields[0] > 0:  # every event after the first
                raise OSError("disk full")

    failing = Failing()
    manager = StalenessManager(eta=1, batch_size=2, hooks=[failing])
    manager.reserve("a", 0)
    with pytest.raises(HookError) as caught:
        manager.reserve("b", 0)
    error = caught.value
    assert "b" in manager and error.result is True  # applied
    assert [(hook, type(e)) for hook, e in error.failures] == [(failing, OSError)]
    event = error.event
    assert (event.seq, event.op, event.group_id, event.version, event.accepted) == (1, "reserve", "b", 0, True)
    assert event.before == CounterState(0, (0, 1), (0, 0)) and event.after == manager.counts()


def _v1_line(event: ProtocolEvent) -> str:
    """An event as format /1 wrote it (every field, before- and after-states as objects)."""
    def state(s: CounterState) -> dict[str, Any]:
        return {"version": s.version, "running": list(s.running), "done": list(s.done)}

    batch = event.batch
    return json.dumps({
        "type": "event", "seq": event.seq, "op": event.op, "group_id": event.group_id, "version": event.version,
        "accepted": event.accepted,
        "batch": None if batch is None else {"version": batch.version, "group_ids": list(batch.group_ids),
                                             "group_versions": list(batch.group_versions), "dropped": list(batch.dropped)},
        "before": state(event.before), "after": state(event.after)})


def test_a_trace_of_format_1_reads_back_and_checks(tmp_path: Path) -> None:
    manager = StalenessManager(eta=2, batch_size=3, redundancy=1)
    header = {**TraceHeader(2, 3, 1, manager.snapshot(), True).to_json(), "format": "staleflow.trace/1"}
    events: list[ProtocolEvent] = []
    manager.add_event_hook(events.append)
    _random_ops(manager, 600, seed=5)
    path = tmp_path / "v1.jsonl"
    path.write_text("\n".join([json.dumps(header), *map(_v1_line, events)]) + "\n")
    [segment] = read_trace(path)
    assert list(segment.events) == events
    assert check.check_trace(path).accepted
    lines = path.read_text().splitlines()  # a /1 line whose before-state is wrong is still caught
    bad = json.loads(lines[5])
    bad["before"]["version"] += 1
    lines[5] = json.dumps(bad)
    path.write_text("\n".join(lines) + "\n")
    report = check.check_trace(path)
    assert not report.accepted and "before-state" in report.reason and "line 6," in report.offending


def test_a_first_event_without_its_before_state_and_a_bad_state_are_format_errors(tmp_path: Path) -> None:
    manager = StalenessManager(eta=1, batch_size=2)
    path = tmp_path / "t.jsonl"
    with JsonlTraceWriter.attach(manager, path):
        manager.reserve("a", 0)
        manager.reserve("b", 0)
    header, first, second = path.read_text().splitlines()
    assert json.loads(first)["before"] == [0, 0, 0, 0, 0] and "before" not in json.loads(second)
    path.write_text("\n".join([header, second]) + "\n")
    with pytest.raises(TraceFormatError, match=r"t.jsonl:2: missing field 'before'"):
        read_trace(path)
    path.write_text("\n".join([header, first.replace('"after":[0,1,0,0,0]', '"after":[0,1,0,0]')]) + "\n")
    with pytest.raises(TraceFormatError, match=r"t.jsonl:2: a counter state .* odd length"):
        read_trace(path)

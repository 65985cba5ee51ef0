"""The trace file's reading and writing (``protocol/trace.py``) at the points a mutant can move.

Each test pins one thing the writer or the reader promises: the header's JSON both ways, each field
the reader refuses (named), a torn last line ignored and cut before an append (over several read
blocks), a bad line that is not the last one an error, the writer's flush points (every consume,
every ``WRITE_EVERY`` lines, a failed write retried by the next event), an explicit before-state
exactly where the chain of states breaks, and what ``close`` releases. ``staleflow bench mutation
--file protocol/trace.py`` judges the writer's and reader's mutants by this file and the trace tests.
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
from staleflow.protocol import StalenessManager, check
from staleflow.protocol.errors import HookError, TraceClosedError
from staleflow.protocol.events import ConsumedBatch, CounterState, ProtocolEvent
from staleflow.protocol.trace import (
    TRACE_FORMAT,
    JsonlTraceWriter,
    TraceFormatError,
    TraceHeader,
    TraceSegment,
    drop_torn_line,
    event_from_json,
    header_from_json,
    read_trace,
    write_trace,
)

# ----------------------------------------------------------------------------- the header


def test_a_header_and_a_segment_are_immutable_and_traced_refusals_are_the_default() -> None:
    header = TraceHeader(1, 2, 0)
    assert header.refusals is True and header.start is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        header.eta = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        TraceSegment(header, (), 0).first_line = 1  # type: ignore[misc]


@pytest.mark.parametrize("start", [None, {"version": 0, "groups": []}])
@pytest.mark.parametrize("refusals", [True, False])
def test_a_header_goes_to_json_and_back(start: dict[str, Any] | None, refusals: bool) -> None:
    header = TraceHeader(2, 3, 1, start, refusals)
    data = json.loads(json.dumps(header.to_json()))
    assert data == {"type": "header", "format": TRACE_FORMAT, "eta": 2, "batch_size": 3, "redundancy": 1,
                    "start": start, "refusals": refusals}
    assert header_from_json(data) == header


def test_a_header_without_refusals_is_one_that_traced_them() -> None:
    """Traces written before the option traced every refused reserve."""
    data = {"type": "header", "format": TRACE_FORMAT, "eta": 1, "batch_size": 1, "redundancy": 0, "start": None}
    assert header_from_json(data).refusals is True


_HEADER = {"type": "header", "format": TRACE_FORMAT, "eta": 1, "batch_size": 1, "redundancy": 0, "start": None}


@pytest.mark.parametrize(("change", "error"), [
    ({"type": "event"}, "not a trace header"), ({"type": "a"}, "not a trace header"), ({"type": "zzz"}, "not a trace header"),
    ({"format": "staleflow.trace/9"}, "not a trace header"),
    ({"batch_size": 0}, "batch_size must be an int >= 1, got 0"), ({"eta": -1}, "eta must be an int >= 0, got -1"),
    ({"redundancy": True}, "redundancy must be an int >= 0, got True"), ({"eta": "1"}, "eta must be an int >= 0, got '1'"),
    ({"start": []}, "start must be an object"), ({"refusals": 0}, "refusals must be true or false, got 0"),
], ids=str)
def test_a_bad_header_field_is_named(change: dict[str, Any], error: str) -> None:
    with pytest.raises(TraceFormatError, match=f"^here: {error}"):
        header_from_json({**_HEADER, **change}, "here")


def test_a_header_with_batch_size_one_and_zero_eta_is_valid() -> None:
    assert header_from_json({**_HEADER, "eta": 0, "batch_size": 1}) == TraceHeader(0, 1, 0)


# ----------------------------------------------------------------------------- events

_EVENT = {"seq": 0, "op": "reserve", "group_id": "g", "version": 0, "accepted": True, "after": [1, 0, 0, 0, 0]}
_BEFORE = CounterState(0, (0, 0), (0, 0))


@pytest.mark.parametrize(("change", "error"), [
    ({"seq": True}, "seq must be an int >= 0, got True"), ({"seq": "0"}, "seq must be an int >= 0, got '0'"),
    ({"seq": -1}, "seq must be an int >= 0, got -1"), ({"version": -1}, "version must be an int >= 0, got -1"),
    ({"group_id": 1.5}, "group_id must be a str or int group id, got 1.5"),
    ({"group_id": True}, "group_id must be a str or int group id, got True"),
    ({"accepted": None}, "a reserve event needs accepted true or false, got None"),
    ({"after": [1, 0, 0, 0]}, "a counter state [*running, *done, version] has an odd length, got [1, 0, 0, 0]"),
    ({"after": [1, 0, 0, 0, 0, 0]}, "a counter state [*running, *done, version] has an odd length, got [1, 0, 0, 0, 0, 0]"),
], ids=str)
def test_a_bad_event_field_is_named(change: dict[str, Any], error: str) -> None:
    with pytest.raises(TraceFormatError, match=f"^here: {re.escape(error)}"):
        event_from_json(json.loads(json.dumps({**_EVENT, **change})), "here", _BEFORE)


def test_only_a_reserve_needs_its_verdict() -> None:
    for op in ("occupy", "abort"):
        assert event_from_json({**_EVENT, "op": op, "accepted": None}, "here", _BEFORE).accepted is None
    assert event_from_json({**_EVENT, "group_id": 7}, "here", _BEFORE).group_id == 7
    assert event_from_json({**_EVENT, "after": [0]}, "here", _BEFORE).after == CounterState(0, (), ())


# ----------------------------------------------------------------------------- reading a file

def _run(manager: StalenessManager, operations: int, first: int = 0) -> None:
    """Reserve, finish and consume groups (``operations`` reserves)."""
    for i in range(first, first + operations):
        assert manager.reserve(f"g{i}", manager.version)
        manager.occupy(f"g{i}")
        if manager.can_consume():
            manager.consume()


def _traced(tmp_path: Path) -> tuple[Path, StalenessManager]:
    """A trace file of two groups reserved, finished and consumed (6 events), and its manager."""
    path = tmp_path / "t.jsonl"
    manager = StalenessManager(eta=1, batch_size=1)
    with JsonlTraceWriter.attach(manager, path):
        _run(manager, 2)
    return path, manager


def test_blank_lines_are_skipped_and_segments_start_at_their_header_line(tmp_path: Path) -> None:
    path, _ = _traced(tmp_path)
    text = path.read_text()
    path.write_text("\n" + text + "\n" + text)
    first, second = read_trace(path)
    assert (first.first_line, second.first_line) == (2, 3 + len(text.splitlines()))
    assert first.events == second.events and len(first.events) == 6


def test_a_torn_last_line_is_ignored_and_a_bad_line_elsewhere_is_an_error(tmp_path: Path) -> None:
    path, _ = _traced(tmp_path)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines) + lines[-1][:9])  # a writer killed inside its last write
    assert len(read_trace(path)[0].events) == 6
    path.write_text("".join(lines[:2]) + lines[2][:9] + "\n" + "".join(lines[3:]))
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:3: not JSON"):
        read_trace(path)
    path.write_text("\n")
    with pytest.raises(TraceFormatError, match="empty trace"):
        read_trace(path)


def test_drop_torn_line_cuts_only_a_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    assert drop_torn_line(path) == 0 and not path.exists()  # no file
    path.write_bytes(b"")
    assert drop_torn_line(path) == 0 and path.read_bytes() == b""
    path.write_bytes(b'{"a": 1}\n{"b": 2')
    assert drop_torn_line(path) == len(b'{"b": 2') and path.read_bytes() == b'{"a": 1}\n'
    assert drop_torn_line(path) == 0 and path.read_bytes() == b'{"a": 1}\n'  # ends on a newline: kept
    path.write_bytes(b'{"a": 1}\n{"b": 2}')  # whole but unterminated: kept, terminated
    assert drop_torn_line(path) == 0 and path.read_bytes() == b'{"a": 1}\n{"b": 2}\n'
    path.write_bytes(b'{"b": 2}')  # the only line, whole
    assert drop_torn_line(path) == 0 and path.read_bytes() == b'{"b": 2}\n'
    path.write_bytes(b"x" * 100_000)  # one long torn line, longer than a read block
    assert drop_torn_line(path) == 100_000 and path.read_bytes() == b""
    path.write_bytes(b"x" * (65_536 + 1))  # one block and its first byte
    assert drop_torn_line(path) == 65_537 and path.read_bytes() == b""
    whole = b'{"a": 1}\n{"long": "' + b"z" * 100_000 + b'"}'  # a whole last line longer than a block
    path.write_bytes(whole)
    assert drop_torn_line(path) == 0 and path.read_bytes() == whole + b"\n"


def test_drop_torn_line_finds_a_newline_several_blocks_back(tmp_path: Path) -> None:
    """200,000 bytes of whole lines, then a torn line of 150,000 bytes: three 64 KiB blocks back."""
    path = tmp_path / "t.jsonl"
    whole = b"".join(b'{"n": %d}\n' % i for i in range(20_000))[:200_000]
    whole = whole[: whole.rfind(b"\n") + 1]
    path.write_bytes(whole + b'{"torn": "' + b"y" * 149_990)
    assert drop_torn_line(path) == 150_000 and path.read_bytes() == whole


def test_an_append_cuts_the_torn_line_first_and_starts_its_segment_on_a_line_of_its_own(tmp_path: Path) -> None:
    path, manager = _traced(tmp_path)
    whole = path.read_bytes()
    path.write_bytes(whole + whole.splitlines()[-1][:9])
    with JsonlTraceWriter.attach(manager, path, mode="a"):
        _run(manager, 1, first=2)
    assert [len(s.events) for s in read_trace(path)] == [6, 3]
    assert check.check_trace(path).accepted
    with JsonlTraceWriter.attach(manager, path, mode="w"):  # a new file: the old segments are gone
        _run(manager, 1, first=3)
    assert [len(s.events) for s in read_trace(path)] == [3]


def test_write_trace_writes_every_segment_and_event(tmp_path: Path) -> None:
    path, _ = _traced(tmp_path)
    segments = read_trace(path)
    copy = tmp_path / "copy.jsonl"
    write_trace(copy, segments * 2)
    assert [s.events for s in read_trace(copy)] == [segments[0].events] * 2


# ----------------------------------------------------------------------------- the writer's flush points

class Stream(io.StringIO):
    """A text stream that records the lines of each write and fails the writes listed in ``fail``."""

    def __init__(self, fail: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.writes: list[int] = []
        self.fail = fail

    def write(self, text: str) -> int:
        attempt = len(self.writes)
        self.writes.append(text.count("\n"))
        if attempt in self.fail:
            raise OSError("disk full")
        return super().write(text)


def _read(tmp_path: Path, text: str) -> list[TraceSegment]:
    path = tmp_path / "written.jsonl"
    path.write_text(text)
    return read_trace(path)


def _reserve(seq: int, before: tuple[int, ...], after: tuple[int, ...], op: str = "reserve") -> tuple[Any, ...]:
    return (seq, op, f"g{seq}", 0, True if op == "reserve" else None, None, before, after)


def test_usual_lines_are_written_every_write_every_events_and_at_close(tmp_path: Path) -> None:
    """Chained events (the manager's own calls): a first line, then WRITE_EVERY lines per write."""
    stream = Stream()
    writer = JsonlTraceWriter(stream, TraceHeader(0, 10_000, 0))
    state: tuple[int, ...] = (0, 0, 0)
    for seq in range(2 * writer.WRITE_EVERY + 10):
        after = (seq + 1, 0, 0)
        writer.record_event(*_reserve(seq, state, after))
        state = after
    assert stream.writes == [1, writer.WRITE_EVERY, writer.WRITE_EVERY]  # header, then two full runs
    writer.close()
    assert stream.writes[-1] == 10 and writer.closed
    [segment] = _read(tmp_path, stream.getvalue())
    assert len(segment.events) == 2 * writer.WRITE_EVERY + 10 and check.replay_events(segment.header, segment.events) is None


def test_lines_whose_before_state_breaks_the_chain_are_written_every_write_every_and_carry_it() -> None:
    """Equal but new state tuples (not the one the writer wrote last): each line carries its before-state."""
    stream = Stream()
    writer = JsonlTraceWriter(stream, TraceHeader(0, 10_000, 0))
    writer.record_event(*_reserve(0, (1, 0, 0), (0, 0, 0), op="abort"))  # an abort waits like any line but a consume
    assert stream.writes == [1]
    for seq in range(1, writer.WRITE_EVERY + 3):
        writer.record_event(*_reserve(seq, (seq, 0, 0), (seq + 1, 0, 0)))
    assert stream.writes == [1, writer.WRITE_EVERY]
    writer.close()
    lines = [json.loads(line) for line in stream.getvalue().splitlines()[1:]]
    assert stream.writes == [1, writer.WRITE_EVERY, 3] and all("before" in line for line in lines)


@pytest.mark.parametrize("chained", [True, False])
def test_a_failed_write_is_retried_by_the_next_event_and_loses_nothing(chained: bool, tmp_path: Path) -> None:
    stream = Stream(fail=(1,))
    writer = JsonlTraceWriter(stream, TraceHeader(0, 10_000, 0))
    every = writer.WRITE_EVERY
    state: tuple[int, ...] = (0, 0, 0)
    for seq in range(every + 1):
        after = (seq + 1, 0, 0)
        before = state if chained else (seq, 0, 0)
        if seq == every - 1:
            with pytest.raises(OSError):
                writer.record_event(*_reserve(seq, before, after))
        else:
            writer.record_event(*_reserve(seq, before, after))
        state = after
    assert stream.writes == [1, every, every + 1]  # the failed run, then it and the next event
    writer.close()
    assert len(_read(tmp_path, stream.getvalue())[0].events) == every + 1


def test_a_consume_is_written_at_once() -> None:
    stream = Stream()
    manager = StalenessManager(eta=0, batch_size=1)
    writer = JsonlTraceWriter.attach(manager, stream)
    manager.reserve("a", 0)
    manager.occupy("a")
    assert stream.writes == [1]  # the header; the reserve and the occupy wait
    manager.consume()
    assert stream.writes == [1, 3] and json.loads(stream.getvalue().splitlines()[-1])["op"] == "consume"
    writer.close()
    built = "".join(["con", "sume"])  # an op a host built at run time: equal to "consume", not the same object
    stream = Stream()
    writer = JsonlTraceWriter(stream, TraceHeader(0, 1, 0))
    writer.record_event(0, built, None, 0, None, ConsumedBatch(0, (), (), ()), (0, 0, 0), (0, 0, 1))
    assert stream.writes == [1, 1]
    writer.close()


def test_refusals_not_traced_are_counted_and_change_nothing_written() -> None:
    manager = StalenessManager(eta=0, batch_size=1)
    stream = Stream()
    with JsonlTraceWriter.attach(manager, stream) as writer:
        manager.reserve("a", 0)
        assert not manager.reserve("b", 0) and not manager.reserve("c", 0)
        assert writer.refusals_skipped == 2
    assert len(stream.getvalue().splitlines()) == 2


# ----------------------------------------------------------------------------- hooks beside the writer

def test_beside_other_hooks_only_a_break_in_the_chain_writes_a_before_state(tmp_path: Path) -> None:
    """Through ``__call__`` (the path when other hooks are registered): a line carries its before-state
    only where it differs from the line before's after-state, here the first line and the one after
    an event the writer did not see."""
    events: list[ProtocolEvent] = []
    manager = StalenessManager(eta=1, batch_size=1)
    manager.add_event_hook(events.append)
    path = tmp_path / "t.jsonl"
    with JsonlTraceWriter.attach(manager, path, refusals=True):
        _run(manager, 3)
        assert not manager.reserve("stale", 0)
    lines = [json.loads(line) for line in path.read_text().splitlines()[1:]]
    assert len(lines) == 10 and ["before" in line for line in lines] == [True] + [False] * 9
    assert check.check_trace(path).accepted
    gap = tmp_path / "gap.jsonl"
    with JsonlTraceWriter(gap, TraceHeader(1, 1, 0)) as writer:
        for event in events[:3] + events[4:]:  # the writer misses the fourth event
            writer(event)
    [segment] = read_trace(gap)
    assert segment.events[3].before == events[4].before != events[2].after
    copies = tmp_path / "copies.jsonl"  # equal states as new objects (a host's own events): still one chain
    with JsonlTraceWriter(copies, TraceHeader(1, 1, 0)) as writer:
        for event in events:
            writer(dataclasses.replace(event, before=_copy(event.before), after=_copy(event.after)))
    assert ["before" in json.loads(line) for line in copies.read_text().splitlines()[1:]] == [True] + [False] * 9


def _copy(state: CounterState) -> CounterState:
    return CounterState(state.version, state.running, state.done)


# ----------------------------------------------------------------------------- close

def test_close_detaches_the_writer_closes_its_file_and_a_closed_writer_refuses_events(tmp_path: Path) -> None:
    manager = StalenessManager(eta=1, batch_size=1)
    writer = JsonlTraceWriter.attach(manager, tmp_path / "t.jsonl")
    manager.reserve("a", 0)
    file = writer._stream
    assert writer.closed is False
    writer.close()
    assert file is not None and file.closed and writer.closed is True
    manager.reserve("b", 0)  # no hook left: no error
    writer.close()  # twice: harmless
    with pytest.raises(TraceClosedError, match=r"trace .*t\.jsonl is closed"):
        writer.record_event(*_reserve(0, (0, 0, 0, 0, 0), (1, 0, 0, 0, 0)))
    stream = io.StringIO()
    unattached = JsonlTraceWriter(stream, TraceHeader(1, 1, 0))
    unattached.record_event(*_reserve(0, (0, 0, 0, 0, 0), (1, 0, 0, 0, 0)))
    last = unattached._last_after
    unattached.close()
    assert not stream.closed  # a stream given to the writer stays open
    for before in (last, (1, 0, 0, 0, 0)):  # a chained event and one that is not
        with pytest.raises(TraceClosedError, match="trace stream is closed"):
            unattached.record_event(*_reserve(1, before, (2, 0, 0, 0, 0)))  # type: ignore[arg-type]
    with pytest.raises(TraceClosedError, match="trace stream is closed"):
        unattached.record_event(1, "reserve", "x", 0, False, None, (1, 0, 0, 0, 0), (1, 0, 0, 0, 0))
    refusing = JsonlTraceWriter(io.StringIO(), TraceHeader(1, 1, 0, refusals=False))
    refusing.close()
    with pytest.raises(TraceClosedError, match="trace stream is closed"):
        refusing.record_event(0, "reserve", "x", 0, False, None, (0, 0, 0, 0, 0), (0, 0, 0, 0, 0))
    with pytest.raises(HookError):  # a closed writer still attached fails the operation, naming itself
        manager.add_event_hook(writer)
        manager.reserve("c", 0)

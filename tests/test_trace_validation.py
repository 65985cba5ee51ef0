"""Protocol traces: JSONL round trip, and replay against the spec mirror and TLC."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from staleflow.protocol import ProtocolEvent, StalenessManager
from staleflow.protocol.trace import (
    JsonlTraceWriter,
    TraceFormatError,
    read_trace,
    write_trace,
)
from staleflow.verification.proofs import trace_validation as tv


def test_trace_round_trip(tmp_path: Path) -> None:
    manager = StalenessManager(eta=1, batch_size=2, redundancy=1)
    seen: list[ProtocolEvent] = []
    manager.add_event_hook(seen.append)
    path = tmp_path / "trace.jsonl"
    with JsonlTraceWriter.attach(manager, path, refusals=True) as writer:
        assert manager.reserve("a", 0) and manager.reserve(7, 0) and manager.reserve("c", 0)
        manager.occupy("a")
        manager.occupy(7)
        manager.abort("c")
        assert manager.consume().group_ids == ("a", 7)
        assert all(manager.reserve(f"next{i}", 1) for i in range(5))
        assert manager.reserve("refused", 1) is False  # at most 2 * B + X = 5 groups due by buffer 2
    assert writer.closed
    manager.reserve("after-close", 1)  # the writer detached on close
    [segment] = read_trace(path)
    assert (segment.header.eta, segment.header.batch_size, segment.header.redundancy) == (1, 2, 1)
    assert segment.header.start is not None and segment.header.start["groups"] == []
    assert list(segment.events) == seen[:-1]
    copy = tmp_path / "copy.jsonl"
    write_trace(copy, [segment])
    assert copy.read_text() == path.read_text()


def test_trace_errors_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    tv.record_workload_trace(path, eta=1, batch_size=2, redundancy=0, ops=20, seed=1)
    header = read_trace(path)[0].header
    lines = path.read_text().splitlines()
    event = json.loads(lines[2])
    event["op"] = "teleport"
    lines[2] = json.dumps(event)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceFormatError, match=r"bad.jsonl:3: op must be one of"):
        read_trace(path)
    with pytest.raises(ValueError, match="mode must be 'w'"):
        JsonlTraceWriter(tmp_path / "x.jsonl", header, mode="r")


@pytest.mark.java
def test_real_trace_with_resume_is_accepted_by_mirror_and_tlc(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    written = tv.record_workload_trace(path, eta=2, batch_size=3, redundancy=1, ops=1100, seed=7, resume_at=1000)
    assert written == 1100
    segments = read_trace(path)
    assert [len(s.events) for s in segments] == [1000, 100]
    assert segments[1].header.start is not None and segments[1].header.start["version"] > 0
    events = [e for s in segments for e in s.events]
    assert any(e.op == "reserve" and not e.accepted for e in events)
    assert any(e.batch is not None and e.batch.dropped for e in events)
    result = tv.validate_trace(path)
    assert result.result == "pass", result.detail
    assert "TLC replay" in result.method
    assert "segment 1 (line 1) TLC: 1,001 distinct states" in result.detail


@pytest.mark.java
def test_corrupted_trace_is_rejected_at_the_offending_event(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    tv.record_workload_trace(path, eta=2, batch_size=3, redundancy=1, ops=300, seed=3)
    [segment] = read_trace(path)
    bad = next(i for i, e in enumerate(segment.events) if e.op == "reserve" and not e.accepted and i > 50)
    events = list(segment.events)
    events[bad] = dataclasses.replace(events[bad], accepted=True)  # a refused reserve logged as admitted
    corrupted = dataclasses.replace(segment, events=tuple(events))
    write_trace(path, [corrupted])
    by_mirror = tv.validate_trace(path, use_tlc=False)
    assert by_mirror.result == "fail"
    assert f"first offending event #{bad} " in by_mirror.detail and "Reserve is disabled" in by_mirror.detail
    by_tlc = tv.replay_tlc(corrupted)
    assert (by_tlc.accepted, by_tlc.bad_event) == (False, bad)


def test_consume_with_hidden_drop_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    tv.record_workload_trace(path, eta=2, batch_size=3, redundancy=1, ops=300, seed=3)
    [segment] = read_trace(path)
    bad = next(i for i, e in enumerate(segment.events) if e.batch is not None and e.batch.dropped)
    events = list(segment.events)
    assert events[bad].batch is not None
    events[bad] = dataclasses.replace(events[bad], batch=dataclasses.replace(events[bad].batch, dropped=()))
    verdict = tv.replay_mirror(dataclasses.replace(segment, events=tuple(events)))
    assert (verdict.accepted, verdict.bad_event) == (False, bad)
    assert "the spec drops" in verdict.reason

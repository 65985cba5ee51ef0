"""The trace checker (``protocol/check.py``) rule by rule: each way a trace can fail names its rule.

The other checker tests replay whole traces of real runs (tests/test_protocol_contract.py,
tests/test_safety_alarms.py); here every refusal the checker can give is provoked once, at its
boundary, with the message it must print: a start snapshot that disagrees with its header, a bad
group entry, each conjunct of the invariant one group past its limit, each way a logged event can
differ from the spec's step, and the command's output and exit status for several files at once.
``staleflow bench mutation --file protocol/check.py`` judges the checker's mutants by this file.
"""

from __future__ import annotations

import dataclasses
import json
import re
import runpy
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from staleflow.protocol import check, mirror
from staleflow.protocol.events import ConsumedBatch, CounterState, ProtocolEvent
from staleflow.protocol.mirror import DONE, RUNNING, MirrorState, SpecParams
from staleflow.protocol.trace import TraceFormatError, TraceHeader, TraceSegment, write_trace

P = SpecParams(eta=2, batch_size=2, redundancy=1)


def _state(version: int, *groups: tuple[Any, int, str]) -> MirrorState:
    return MirrorState(version, frozenset(groups))


def _header(p: SpecParams = P, start: dict[str, Any] | None = None) -> TraceHeader:
    return TraceHeader(p.eta, p.batch_size, p.redundancy, start)


def _snapshot(version: int, groups: list[Any], **overrides: Any) -> dict[str, Any]:
    return {"eta": P.eta, "batch_size": P.batch_size, "redundancy": P.redundancy, "version": version, "groups": groups, **overrides}


def _event(s: MirrorState, t: MirrorState, op: str, group_id: Any = None, version: int | None = None,
           accepted: bool | None = None, batch: ConsumedBatch | None = None, seq: int = 0, p: SpecParams = P) -> ProtocolEvent:
    return ProtocolEvent(seq, op, group_id, version, accepted, batch, check.counters(p, s), check.counters(p, t))


# ----------------------------------------------------------------------------- the start snapshot

def test_a_segment_without_a_snapshot_starts_from_the_initial_state() -> None:
    assert check.start_state(_header()) == MirrorState(0, frozenset())


def test_a_valid_snapshot_becomes_exactly_its_mirror_state() -> None:
    """Ids of both kinds, a group at the head's own version (the newest a snapshot may hold) and at
    version 0 (the oldest an eta-2 head at 2 keeps), running and done."""
    start = _snapshot(2, [["a", 2, RUNNING], [0, 0, DONE], ["b", 1, DONE]])
    assert check.start_state(_header(start=start)) == _state(2, ("a", 2, RUNNING), (0, 0, DONE), ("b", 1, DONE))
    assert check.start_state(_header(start=_snapshot(0, []))) == MirrorState(0, frozenset())


@pytest.mark.parametrize("delta", [1, -1])
@pytest.mark.parametrize("name", ["eta", "batch_size", "redundancy"])
def test_a_snapshot_that_disagrees_with_its_header_names_the_parameter(name: str, delta: int) -> None:
    start = _snapshot(0, [], **{name: getattr(P, name) + delta})
    with pytest.raises(TraceFormatError, match=f"disagree on {name}$"):
        check.start_state(_header(start=start))


@pytest.mark.parametrize(("version", "groups"), [(True, []), ("1", []), (1.0, []), (-1, []), (None, []), (1, ()), (1, None)])
def test_a_snapshot_needs_an_int_version_and_a_list_of_groups(version: Any, groups: Any) -> None:
    with pytest.raises(TraceFormatError, match="needs an int version >= 0 and a list of groups"):
        check.start_state(_header(start=_snapshot(version, groups)))


@pytest.mark.parametrize("entry", [
    ("a", 0, RUNNING), ["a", 0], ["a", 0, RUNNING, 1], [1.5, 0, RUNNING], [True, 0, RUNNING], [None, 0, RUNNING],
    ["a", "0", RUNNING], ["a", True, RUNNING], ["a", 0.0, RUNNING], ["a", 0, "queued"], ["a", 0, None],
])
def test_a_bad_group_entry_is_named(entry: Any) -> None:
    start = _snapshot(1, [["ok", 1, RUNNING], entry])
    with pytest.raises(TraceFormatError, match=re.escape(f"invalid group entry {entry!r}")):
        check.start_state(_header(start=start))


@pytest.mark.parametrize("groups", [[["a", 0, RUNNING], ["a", 1, DONE]], [["a", 1, RUNNING], ["b", 2, RUNNING]]],
                         ids=["a group twice", "a group ahead of the trainer"])
def test_a_snapshot_with_a_group_twice_or_ahead_is_refused(groups: list[Any]) -> None:
    with pytest.raises(TraceFormatError, match="a group appears twice or is ahead of the trainer"):
        check.start_state(_header(start=_snapshot(1, groups)))


def test_a_snapshot_that_breaks_the_invariant_names_the_conjuncts() -> None:
    """Four groups due at the head: one past cap0's (0+1)*2+1 = 3; one of them also past its deadline."""
    groups = [["a", 3, RUNNING], ["b", 3, DONE], ["c", 3, RUNNING], ["d", 2, RUNNING]]
    with pytest.raises(TraceFormatError, match=r"violates Inv \(deadline, cap0\)$"):
        check.start_state(_header(start=_snapshot(5, groups)))


# ----------------------------------------------------------------------------- the invariant, conjunct by conjunct

def _due(head: int, counts: dict[int, int], p: SpecParams = P) -> MirrorState:
    """``counts[k]`` running groups with deadline ``head + k`` (version ``head + k - eta``); k = -1 is past due."""
    return MirrorState(head, frozenset((f"g{k}.{i}", head + k - p.eta, RUNNING) for k, n in counts.items() for i in range(n)))


@pytest.mark.parametrize(("counts", "failed"), [
    ({0: 3}, []),                                   # cap0 = (0+1)*2+1 = 3: at the limit
    ({0: 4}, ["cap0"]),                             # one over cap0, within cap1 = 5 and cap2 = 7
    ({0: 3, 1: 2}, []),                             # cap1 at its limit
    ({0: 3, 1: 3}, ["cap1"]),                       # one over cap1 only
    ({0: 1, 1: 1, 2: 5}, []),                       # cap2 = 7 at its limit
    ({0: 1, 1: 1, 2: 6}, ["cap2"]),                 # one over cap2 only
    ({-1: 1}, ["deadline"]),                        # a group one buffer past its deadline
    ({-1: 1, 0: 2}, ["deadline"]),                  # past-due groups count towards cap0 too: 3, at the limit
    ({-1: 1, 0: 3}, ["deadline", "cap0"]),
    ({0: 10}, ["cap0", "cap1", "cap2"]),            # over every cap, and over (eta+2)*2+1 = 9: no cap3
], ids=str)
def test_invariant_failures_name_exactly_the_conjuncts_broken(counts: dict[int, int], failed: list[str]) -> None:
    assert check.invariant_failures(P, _due(5, counts)) == failed
    assert mirror.invariant(P, _due(5, counts)) == (failed == [])


@pytest.mark.parametrize(("counts", "failed"), [
    ({0: 2}, []), ({0: 3}, ["cap0"]), ({0: 1, 1: 2}, []), ({0: 1, 1: 3}, ["cap1"]),
], ids=str)
def test_the_caps_add_the_redundancy_to_an_odd_multiple_of_the_batch(counts: dict[int, int], failed: list[str]) -> None:
    """B = 1, X = 1, eta = 1: cap0 = 1 + 1 = 2 and cap1 = 2 + 1 = 3 (B = 2 above hides a `|` for `+`)."""
    p = SpecParams(eta=1, batch_size=1, redundancy=1)
    assert check.invariant_failures(p, _due(4, counts, p)) == failed


@settings(max_examples=300, deadline=None)
@given(eta=st.integers(0, 3), batch_size=st.integers(1, 3), redundancy=st.integers(0, 2), head=st.integers(0, 6),
       offsets=st.lists(st.integers(-2, 3), max_size=14))
def test_invariant_failures_are_empty_exactly_when_the_mirror_invariant_holds(
        eta: int, batch_size: int, redundancy: int, head: int, offsets: list[int]) -> None:
    p = SpecParams(eta, batch_size, redundancy)
    s = MirrorState(head, frozenset((i, head + k - eta, RUNNING) for i, k in enumerate(offsets)))
    failed = check.invariant_failures(p, s)
    assert (failed == []) == mirror.invariant(p, s)
    assert ("deadline" in failed) == any(k < 0 for k in offsets)
    assert set(failed) <= {"deadline", *(f"cap{k}" for k in range(eta + 1))}


# ----------------------------------------------------------------------------- counters

def test_counters_count_running_and_done_groups_by_deadline_offset() -> None:
    s = _state(5, ("a", 3, RUNNING), ("b", 4, DONE), ("c", 5, RUNNING), ("d", 5, RUNNING), ("e", 5, DONE))
    assert check.counters(P, s) == CounterState(5, (1, 0, 2), (0, 1, 1))
    assert check.counters(SpecParams(0, 1), _state(3, ("a", 3, DONE))) == CounterState(3, (0,), (1,))
    assert check.counters(SpecParams(1, 1), _state(3, ("a", 3, DONE), ("b", 2, RUNNING))) == CounterState(3, (1, 0), (0, 1))


@pytest.mark.parametrize(("version", "offset"), [(2, -1), (6, 3)])
def test_counters_refuse_a_group_outside_the_offsets(version: int, offset: int) -> None:
    with pytest.raises(ValueError, match=rf"^group 'x' \(v{version}\) has deadline offset {offset} at head 5: outside 0..2$"):
        check.counters(P, _state(5, ("x", version, RUNNING)))


# ----------------------------------------------------------------------------- one event against the spec's step

S1 = _state(1, ("a", 0, RUNNING), ("b", 1, DONE))


def test_an_accepted_reserve_is_the_spec_step_and_a_refused_one_changes_nothing() -> None:
    grown = _state(1, ("a", 0, RUNNING), ("b", 1, DONE), ("c", 1, RUNNING))
    assert check.mirror_step(P, S1, _event(S1, grown, "reserve", "c", 1, True)) == grown
    full = _due(5, {0: 3})
    assert check.mirror_step(P, full, _event(full, full, "reserve", "x", 3, False)) is full


@pytest.mark.parametrize(("op", "group_id", "version", "accepted", "reason"), [
    ("reserve", "c", 2, True, "reserve('c', v=2) accepted but Reserve is disabled"),        # ahead of the head
    ("reserve", "c", 1, False, "reserve('c', v=1) refused but Reserve is enabled"),
    ("reserve", "a", 1, False, "refused reserve of 'a', which is active"),
    ("occupy", "b", None, None, "occupy('b') is not enabled in the spec"),                 # done already
    ("occupy", "z", None, None, "occupy('z') is not enabled in the spec"),
    ("abort", "z", None, None, "abort('z') is not enabled in the spec"),
])
def test_an_event_the_spec_does_not_allow_is_named(op: str, group_id: str, version: int | None, accepted: bool | None, reason: str) -> None:
    assert check.mirror_step(P, S1, _event(S1, S1, op, group_id, version, accepted)) == reason


@pytest.mark.parametrize(("group_id", "version"), [("c", None), (None, 1)])
def test_a_reserve_without_its_group_or_version_is_refused(group_id: str | None, version: int | None) -> None:
    """A trace line may omit a reserve's version (the reader allows null): a refusal, not a crash."""
    assert check.mirror_step(P, S1, _event(S1, S1, "reserve", group_id, version, True)) == (
        f"reserve needs a group id and a version, got {group_id!r}, v={version}")


def test_occupy_finishes_a_running_group_and_abort_removes_one() -> None:
    assert check.mirror_step(P, S1, _event(S1, S1, "occupy", "a")) == _state(1, ("a", 0, DONE), ("b", 1, DONE))
    assert check.mirror_step(P, S1, _event(S1, S1, "abort", "a")) == _state(1, ("b", 1, DONE))
    assert check.mirror_step(P, S1, _event(S1, S1, "abort", "b")) == _state(1, ("a", 0, RUNNING))


# Head 2, eta 2: "old" (v0) is due now; B = 2 done groups "p", "q" and one more done group "r".
S2 = _state(2, ("old", 0, RUNNING), ("p", 1, DONE), ("q", 2, DONE), ("r", 2, DONE))


def _consume(ids: tuple[Any, ...], versions: tuple[int, ...], dropped: tuple[Any, ...] = (), buffer: int = 2) -> ProtocolEvent:
    return _event(S2, S2, "consume", None, buffer, None, ConsumedBatch(buffer, ids, versions, dropped))


def test_a_consume_that_is_a_spec_successor_takes_its_batch_and_drops() -> None:
    assert check.mirror_step(P, S2, _consume(("p", "q"), (1, 2), ("old",))) == _state(3, ("r", 2, DONE))


@pytest.mark.parametrize(("event", "reason"), [
    (_consume(("p", "q"), (1, 2), ("old",), buffer=1), "consume of buffer 1, but the spec's head is 2"),
    (_consume(("p", "q"), (1, 2), ("old",), buffer=3), "consume of buffer 3, but the spec's head is 2"),
    (_consume(("p", "z"), (1, 2)), "consume takes ['p', 'z']: not distinct active groups"),
    (_consume(("p", "p"), (1, 1)), "consume takes ['p', 'p']: not distinct active groups"),
    (_consume(("p", "q"), (1, 1), ("old",)), "consume logs versions [1, 1], the spec has [1, 2]"),
    (_consume(("p", "q"), (1,), ("old",)), "consume logs versions [1], the spec has [1, 2]"),
    (_consume(("p", "q"), (2, 2), ("old",)), "consume logs versions [2, 2], the spec has [1, 2]"),
    (_consume(("p", "old"), (1, 0)), "consume of ['p', 'old'] is not a Consume successor in the spec"),  # "old" is running
    (_consume(("p", "q"), (1, 2)), "consume drops [], the spec drops ['old']"),
    (_consume(("p", "q"), (1, 2), ("r",)), "consume drops ['r'], the spec drops ['old']"),
    (_consume(("p", "q"), (1, 2), ("old", "old")), "consume drops ['old', 'old'], the spec drops ['old']"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_a_consume_that_differs_from_the_spec_is_named(event: ProtocolEvent, reason: str) -> None:
    assert check.mirror_step(P, S2, event) == reason


def test_a_snapshot_read_from_json_counts_its_running_groups_as_running() -> None:
    """Statuses decoded from JSON are equal to the mirror's constants, not the same objects."""
    start = json.loads(json.dumps(_snapshot(1, [["a", 0, RUNNING], ["b", 1, DONE]])))
    assert check.counters(P, check.start_state(_header(start=start))) == CounterState(1, (0, 1, 0), (0, 0, 1))


def test_values_past_the_small_int_cache_compare_by_value() -> None:
    """B = X = 300 at head 300, read from JSON: 300 finished and 300 running groups due now; a consume
    takes the 300 and drops the 300 (every count and version here is a separate int object)."""
    p = SpecParams(eta=1, batch_size=300, redundancy=300)
    done, running = [f"d{i}" for i in range(300)], [f"r{i}" for i in range(300)]
    groups = [[g, 299, DONE] for g in done] + [[g, 299, RUNNING] for g in running]
    start = json.loads(json.dumps({"eta": 1, "batch_size": 300, "redundancy": 300, "version": 300, "groups": groups}))
    header = TraceHeader(*json.loads("[1, 300, 300]"), start)
    s = check.start_state(header)
    t = MirrorState(301, frozenset())
    batch = ConsumedBatch(json.loads("300"), tuple(done), (299,) * 300, tuple(running))
    assert check.replay_events(header, [_event(s, t, "consume", None, 300, None, batch, p=p)]) is None


# ----------------------------------------------------------------------------- replay and the report

def _trace() -> list[ProtocolEvent]:
    """Reserve a (v0) and b (v0), occupy both, consume them: five spec steps from the empty state
    (an occupy logs its group's version, as the manager does)."""
    steps = [("reserve", "a", 0, True), ("reserve", "b", 0, True), ("occupy", "a", 0, None), ("occupy", "b", 0, None)]
    s, events = MirrorState(0, frozenset()), []
    for seq, (op, g, v, accepted) in enumerate(steps):
        t = mirror.reserve(P, s, g, 0) if op == "reserve" else mirror.occupy(P, s, g)
        assert t is not None
        events.append(_event(s, t, op, g, v, accepted, seq=seq))
        s = t
    t = MirrorState(1, frozenset())
    events.append(_event(s, t, "consume", None, 0, None, ConsumedBatch(0, ("a", "b"), (0, 0), ()), seq=4))
    return events


def test_a_trace_of_spec_steps_replays_without_rejection() -> None:
    assert check.replay_events(_header(), _trace()) is None


def test_a_wrong_before_or_after_state_is_rejected_at_its_event() -> None:
    events = _trace()
    wrong_before = dataclasses.replace(events[2], before=CounterState(0, (0, 0, 1), (0, 0, 1)))
    wrong_after = dataclasses.replace(events[3], after=CounterState(0, (0, 0, 0), (0, 0, 1)))
    assert check.replay_events(_header(), [*events[:2], wrong_before, *events[3:]]) == check.Rejection(
        2, "before-state CounterState(version=0, running=(0, 0, 1), done=(0, 0, 1)) != spec "
           "CounterState(version=0, running=(0, 0, 2), done=(0, 0, 0))")
    assert check.replay_events(_header(), [*events[:3], wrong_after, *events[4:]]) == check.Rejection(
        3, "after-state CounterState(version=0, running=(0, 0, 0), done=(0, 0, 1)) != spec "
           "CounterState(version=0, running=(0, 0, 0), done=(0, 0, 2))")
    assert check.replay_events(_header(), [*events[:4], _event(S1, S1, "abort", "z")]) is not None


def test_verdicts_are_immutable_values() -> None:
    report, rejection = check.TraceReport(True, 5, 1), check.Rejection(0, "why")
    for verdict in (report, rejection):
        with pytest.raises(dataclasses.FrozenInstanceError):
            verdict.reason = "changed"  # type: ignore[misc]
    assert len({report, check.TraceReport(True, 5, 1)}) == 1


def _write(path: Path, *segments: list[ProtocolEvent]) -> Path:
    write_trace(path, [TraceSegment(_header(), tuple(events), 0) for events in segments])
    return path


def test_the_report_names_the_segment_index_line_and_seq_of_the_first_offending_event(tmp_path: Path) -> None:
    """Segment 2's fourth event (index 3 of the segment, #8 over the file) occupies a group twice:
    segment 1 is lines 1-6 (header and five events), segment 2's header is line 7, so line 11."""
    events = _trace()
    again = ProtocolEvent(3, "occupy", "a", 0, None, None, events[2].after, events[2].after)  # "a" is done already
    bad = [*events[:3], again, *events[4:]]
    report = check.check_trace(_write(tmp_path / "t.jsonl", events, bad))
    assert report == check.TraceReport(False, 10, 2, "segment 2: event #8 (line 11, seq 3, occupy('a', v=0))",
                                       "occupy('a') is not enabled in the spec")
    assert check.check_trace(_write(tmp_path / "ok.jsonl", events, events)) == check.TraceReport(True, 10, 2)


def test_a_consume_is_described_by_its_buffer(tmp_path: Path) -> None:
    events = _trace()
    bad = [*events[:4], dataclasses.replace(events[4], batch=ConsumedBatch(0, ("a", "b"), (0, 0), ("a",)))]
    report = check.check_trace(_write(tmp_path / "t.jsonl", bad))
    assert report.offending == "segment 1: event #4 (line 6, seq 4, consume(buffer 0))"
    assert report.reason == "consume drops ['a'], the spec drops []"
    aborted = [*events[:2], ProtocolEvent(2, "abort", "z", 0, None, None, events[1].after, events[1].after)]
    report = check.check_trace(_write(tmp_path / "abort.jsonl", aborted))
    assert report.offending == "segment 1: event #2 (line 4, seq 2, abort('z', v=0))"


# ----------------------------------------------------------------------------- the command

@pytest.fixture
def traces(tmp_path: Path) -> dict[str, Path]:
    events = _trace()
    rejected = [*events[:2], ProtocolEvent(2, "reserve", "b", 0, True, None, events[1].after, events[1].after)]
    unreadable = tmp_path / "unreadable.jsonl"
    unreadable.write_text('{"type": "event"}\n')
    return {"ok": _write(tmp_path / "ok.jsonl", events), "rejected": _write(tmp_path / "rejected.jsonl", rejected),
            "unreadable": unreadable, "missing": tmp_path / "missing.jsonl"}


@pytest.mark.parametrize(("names", "status"), [
    (["ok"], 0), (["ok", "rejected"], 1), (["rejected", "ok"], 1), (["rejected", "unreadable"], 2),
    (["unreadable", "rejected", "ok"], 2), (["missing", "ok"], 2), (["unreadable", "missing"], 2),
])
def test_the_command_checks_every_file_and_exits_with_the_worst_status(
        traces: dict[str, Path], names: list[str], status: int, capsys: pytest.CaptureFixture[str]) -> None:
    assert check.main([str(traces[name]) for name in names]) == status
    out, err = capsys.readouterr()
    expected = {
        "ok": f"{traces['ok']}: accepted (5 events in 1 segment(s))",
        "rejected": f"{traces['rejected']}: REJECTED at segment 1: event #2 (line 4, seq 2, reserve('b', v=0)): "
                    "reserve('b', v=0) accepted but Reserve is disabled",
    }
    assert out.splitlines() == [expected[name] for name in names if name in expected]
    assert [line.split(": ")[0] for line in err.splitlines()] == [str(traces[name]) for name in names if name not in expected]
    assert all(": unreadable trace: " in line for line in err.splitlines())


def test_the_module_runs_as_a_command(traces: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["check", str(traces["rejected"])])
    monkeypatch.delitem(sys.modules, "staleflow.protocol.check")  # run_module warns about a module already imported
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("staleflow.protocol.check", run_name="__main__")
    assert exit_.value.code == 1
    assert "REJECTED at segment 1: event #2" in capsys.readouterr().out

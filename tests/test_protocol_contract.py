"""The protocol's API contract (issue 26): atomic operations with every hook run and HookError,
a trace writer that fails mid-run and resumes with nothing lost, ProtocolError everywhere,
versions through operator.index, snapshot errors naming the field, interrupted groups after a
restore, stats() and start_capacity()."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import pytest
from staleflow.protocol import (
    DuplicateGroupError,
    HookError,
    InvalidGroupIdError,
    InvalidParameterError,
    InvalidVersionError,
    LockedStalenessManager,
    ProtocolError,
    ProtocolEvent,
    SnapshotError,
    StalenessManager,
    UnknownHookError,
    check,
)
from staleflow.protocol.trace import JsonlTraceWriter, TraceFormatError, TraceHeader, read_trace
from staleflow.protocol.trace_lines import event_to_json


class FlakyStream(io.StringIO):
    """A text stream whose writes fail ``failures`` times from the ``fail_at``-th write on (a full disk)."""

    def __init__(self, fail_at: int, failures: int = 1) -> None:
        super().__init__()
        self.writes, self.fail_at, self.failures = 0, fail_at, failures

    def write(self, text: str) -> int:
        self.writes += 1
        if self.writes >= self.fail_at and self.failures:
            self.failures -= 1
            raise OSError(28, "No space left on device")
        return super().write(text)


def _boom(event: ProtocolEvent) -> None:
    raise RuntimeError(f"metrics backend down at seq {event.seq}")


# ----------------------------------------------------------------------------- atomic operations


def test_a_failing_hook_leaves_the_operation_applied_and_every_other_hook_run() -> None:
    seen: list[int] = []
    manager = StalenessManager(eta=1, batch_size=2, hooks=[_boom, lambda e: seen.append(e.seq)])
    with pytest.raises(HookError) as raised:
        manager.reserve("a", 0)
    error = raised.value
    assert isinstance(error, ProtocolError) and error.result is True
    assert "reserve('a') was applied (event seq 0)" in str(error) and "RuntimeError: metrics backend down" in str(error)
    assert [hook for hook, _ in error.failures] == [_boom] and isinstance(error.__cause__, RuntimeError)
    assert "a" in manager and seen == [0]  # applied, and the hook after the failing one ran
    with pytest.raises(DuplicateGroupError):  # a retry is refused: the caller must not retry
        manager.reserve("a", 0)
    assert seen == [0]  # the refused retry changed nothing and emitted nothing
    with pytest.raises(HookError):
        manager.reserve("b", 0)
    for g in ("a", "b"):
        with pytest.raises(HookError):
            manager.occupy(g)
    with pytest.raises(HookError) as consumed:
        manager.consume()
    batch = consumed.value.result
    assert batch is not None and not isinstance(batch, bool) and batch.group_ids == ("a", "b")
    assert manager.version == 1 and len(manager) == 0 and seen == [0, 1, 2, 3, 4]


def test_errors_before_a_change_emit_nothing_and_change_nothing() -> None:
    seen: list[ProtocolEvent] = []
    manager = StalenessManager(eta=1, batch_size=2, on_event=seen.append)
    manager.reserve("a", 0)
    snapshot = manager.snapshot()
    for call in (lambda: manager.reserve("a", 0), lambda: manager.reserve("b", 5), lambda: manager.reserve(["x"], 0),
                 lambda: manager.occupy("zz"), lambda: manager.consume(), lambda: manager.reserve("c", -1)):
        with pytest.raises(ProtocolError):
            call()  # type: ignore[no-untyped-call]
    assert manager.snapshot() == snapshot and len(seen) == 1


def test_a_trace_writer_that_fails_mid_run_resumes_and_loses_nothing(tmp_path: Path) -> None:
    """The writer's stream fails once (disk full) in the middle of a random run; the operation that
    hit it raises HookError (never DuplicateGroupError: nothing is retried), the run goes on, and the
    trace the checker reads holds every event, accepted as a behaviour of the spec."""
    manager = StalenessManager(eta=2, batch_size=3, redundancy=1)
    every: list[ProtocolEvent] = []
    stream = FlakyStream(fail_at=4, failures=2)  # the 4th and 5th writes fail (the header is the 1st)
    writer = JsonlTraceWriter.attach(manager, stream, refusals=True)
    manager.add_event_hook(every.append)  # registered after the writer: must see every event anyway
    rng = random.Random(5)
    hook_errors, next_id = 0, 0
    for _ in range(1500):
        running = [g.group_id for g in manager.groups() if g.status.value == "running"]
        try:
            roll = rng.random()
            if roll < 0.45:
                manager.reserve(f"g{next_id}", max(0, manager.version - rng.randint(0, 3)))
                next_id += 1
            elif roll < 0.8 and running:
                manager.occupy(rng.choice(running))
            elif roll < 0.85 and running:
                manager.abort(rng.choice(running))
            elif manager.can_consume():
                manager.consume()
        except HookError as error:
            hook_errors += 1
            assert [type(e) for _, e in error.failures] == [OSError]
    writer.close()
    assert hook_errors == 2 and stream.failures == 0
    assert "\n\n" not in stream.getvalue()  # a failed write left no blank line behind
    trace = tmp_path / "trace.jsonl"
    trace.write_text(stream.getvalue())
    [segment] = read_trace(trace)
    assert list(segment.events) == every  # nothing lost, nothing twice, in order
    report = check.check_trace(trace)
    assert report.accepted and report.events == len(every) > 1000, report


class CountingStream(io.StringIO):
    """A text stream that records the number of lines each write hands it."""

    def __init__(self) -> None:
        super().__init__()
        self.lines_per_write: list[int] = []

    def write(self, text: str) -> int:
        self.lines_per_write.append(text.count("\n"))
        return super().write(text)


@pytest.mark.parametrize("eta,redundancy,refusals", [(0, 0, True), (1, 1, True), (2, 2, False), (3, 0, False)])
def test_the_trace_writer_writes_each_event_as_json_dumps_would_at_its_flush_points(
        eta: int, redundancy: int, refusals: bool) -> None:
    """The writer's hand-written encoder gives exactly ``json.dumps(event_to_json(event))`` for every
    event (int and str ids with quotes and non-ASCII characters, refusals, drops; the before-state on
    the first line only, format /2), and hands lines to the stream only at a consume, every
    WRITE_EVERY events and at close."""
    manager = StalenessManager(eta=eta, batch_size=4, redundancy=redundancy)
    stream = CountingStream()
    writer = JsonlTraceWriter.attach(manager, stream, refusals=refusals)
    writer.WRITE_EVERY = 3  # small enough that runs of events between consumes reach it
    every: list[ProtocolEvent] = []
    manager.add_event_hook(every.append)
    rng = random.Random(eta)
    running: list[int | str] = []
    for n in range(3000):
        roll = rng.random()
        if roll < 0.5:
            group_id: int | str = f'p"{n}\u00e9\\' if n % 3 == 0 else n
            if manager.reserve(group_id, rng.randint(max(0, manager.version - eta), manager.version)):
                running.append(group_id)
        elif roll < 0.9 and running:
            group_id = running.pop(rng.randrange(len(running)))
            if group_id in manager:
                (manager.abort if roll > 0.85 else manager.occupy)(group_id)
        elif manager.can_consume():
            manager.consume()
    writer.close()
    traced = [e for e in every if refusals or e.accepted is not False]
    lines = stream.getvalue().splitlines()
    assert lines[1:] == [json.dumps(event_to_json(e, with_before=i == 0), separators=(",", ":")) for i, e in enumerate(traced)]
    assert any(e.batch is not None and e.batch.dropped for e in traced) == (redundancy > 0)
    assert any(e.accepted is False for e in traced) == refusals
    assert writer.refusals_skipped == (0 if refusals else sum(e.accepted is False for e in every))
    # one write per flush point: the header, then a consume or WRITE_EVERY events, then close's rest
    flushes, pending = [1], 0
    for event in traced:
        pending += 1
        if event.op == "consume" or pending == writer.WRITE_EVERY:
            flushes.append(pending)
            pending = 0
    assert stream.lines_per_write == flushes + ([pending] if pending else [])
    assert writer.WRITE_EVERY in flushes[1:]


def test_refused_reserves_are_counted_not_traced_unless_asked(tmp_path: Path) -> None:
    manager = StalenessManager(eta=0, batch_size=1)
    with JsonlTraceWriter.attach(manager, tmp_path / "default.jsonl") as quiet, \
            JsonlTraceWriter.attach(manager, tmp_path / "all.jsonl", refusals=True):
        assert manager.reserve("a", 0) and not manager.reserve("b", 0) and not manager.reserve("c", 0)
    [default], [full] = read_trace(tmp_path / "default.jsonl"), read_trace(tmp_path / "all.jsonl")
    assert [e.group_id for e in default.events] == ["a"] and quiet.refusals_skipped == 2
    assert [e.group_id for e in full.events] == ["a", "b", "c"]
    assert (default.header.refusals, full.header.refusals) == (False, True)
    assert manager.stats().refused == {"stale": 0, "full": 2}
    assert all(check.check_trace(tmp_path / name).accepted for name in ("default.jsonl", "all.jsonl"))


def test_restore_takes_hooks_and_reports_interrupted_groups() -> None:
    manager = StalenessManager(eta=1, batch_size=2)
    for g in ("a", "b", "c"):
        manager.reserve(g, 0)
    manager.occupy("b")
    seen: list[str] = []
    restored = StalenessManager.restore(manager.snapshot(), hooks=[lambda e: seen.append(e.op)])
    assert restored.interrupted_groups() == ("a", "c")  # running when the snapshot was taken
    restored.occupy("a")  # resumed and finished
    restored.abort("c")  # or given up
    assert restored.interrupted_groups() == () and seen == ["occupy", "abort"]
    assert StalenessManager(1, 2).interrupted_groups() == ()
    locked = LockedStalenessManager.restore(manager.snapshot(), hooks=[lambda e: seen.append(e.op)])
    assert locked.interrupted_groups() == ("a", "c")


# ----------------------------------------------------------------------------- inputs and errors


class Version:
    """An integer scalar that is not an int (numpy's and torch's work the same way): ``__index__`` only."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def test_versions_and_parameters_are_accepted_through_operator_index() -> None:
    manager = StalenessManager(eta=Version(1), batch_size=Version(2))  # type: ignore[arg-type]
    assert (manager.eta, manager.batch_size) == (1, 2) and type(manager.eta) is int
    assert manager.reserve("a", Version(0)) and manager.reserve_slack(Version(0)) == 3  # type: ignore[arg-type]
    assert type(manager.group("a").version) is int and manager.snapshot()["groups"] == [["a", 0, "running"]]
    for bad in (True, 0.0, "0"):
        with pytest.raises(InvalidVersionError, match="version must be an int"):
            manager.reserve("b", bad)  # type: ignore[arg-type]
    import numpy as np

    assert manager.reserve("n", np.int64(0)) and manager.start_capacity(np.int32(0), np.int64(8)) == 2


@pytest.mark.parametrize("kwargs, base", [
    ({"eta": -1, "batch_size": 1}, ValueError), ({"eta": 1, "batch_size": 0}, ValueError),
    ({"eta": 1, "batch_size": 1, "redundancy": -2}, ValueError), ({"eta": 1.5, "batch_size": 1}, ValueError),
])
def test_bad_parameters_raise_a_protocol_error(kwargs: dict[str, object], base: type[Exception]) -> None:
    with pytest.raises(InvalidParameterError) as raised:
        StalenessManager(**kwargs)  # type: ignore[arg-type]
    assert isinstance(raised.value, ProtocolError) and isinstance(raised.value, base)


def test_every_error_is_a_protocol_error_with_its_old_base(tmp_path: Path) -> None:
    manager = StalenessManager(eta=1, batch_size=1)
    with pytest.raises(InvalidGroupIdError) as raised:
        manager.reserve(None, 0)  # type: ignore[arg-type]
    assert isinstance(raised.value, TypeError)
    with pytest.raises(UnknownHookError):
        manager.remove_event_hook(print)
    with pytest.raises(InvalidParameterError):
        JsonlTraceWriter(tmp_path / "x.jsonl", TraceHeader(1, 1, 0), mode="r")
    with pytest.raises(InvalidParameterError):
        manager.start_capacity(0, -1)
    assert issubclass(TraceFormatError, ProtocolError) and issubclass(TraceFormatError, ValueError)


def test_a_consumed_id_may_be_reserved_again_as_a_new_group(tmp_path: Path) -> None:
    """Decided: not refused (that would need memory growing with every group ever trained, and hosts
    keying groups by prompt reuse ids across epochs); the spec allows it and the checker accepts it."""
    manager = StalenessManager(eta=0, batch_size=1)
    with JsonlTraceWriter.attach(manager, tmp_path / "t.jsonl"):
        manager.reserve("p", 0)
        manager.occupy("p")
        assert manager.consume().group_ids == ("p",)
        assert manager.reserve("p", 1) and manager.group("p").version == 1
    assert check.check_trace(tmp_path / "t.jsonl").accepted


@pytest.mark.parametrize("field", ["eta", "batch_size", "redundancy", "version", "groups"])
def test_snapshot_errors_name_the_missing_field(field: str) -> None:
    data = StalenessManager(1, 2).snapshot()
    del data[field]
    with pytest.raises(SnapshotError, match=f"missing field\\(s\\) '{field}'"):
        StalenessManager.restore(data)


def test_snapshot_errors_name_the_bad_field() -> None:
    data = StalenessManager(1, 2).snapshot()
    data["eta"] = -1
    with pytest.raises(SnapshotError, match="invalid snapshot field: eta must be >= 0, got -1"):
        StalenessManager.restore(data)


# ----------------------------------------------------------------------------- stats and capacity


def test_stats_count_deadlines_refusals_drops_staleness_and_blocking_groups() -> None:
    manager = StalenessManager(eta=1, batch_size=2, redundancy=1)
    for g in ("a", "b", "c", "d", "e"):
        assert manager.reserve(g, 0)
    assert not manager.reserve("f", 0)  # full: cap(1) = 2 * 2 + 1 = 5 groups due by buffer 1
    manager.occupy("a")
    stats = manager.stats()
    assert (stats.version, stats.deadlines, stats.running, stats.done) == (0, (0, 1), (0, 4), (0, 1))
    assert stats.blocking == ("b",) and not stats.can_consume and stats.missing == 0
    manager.occupy("b")
    assert manager.consume().group_ids == ("a", "b")
    assert manager.stats().blocking == ("c", "d")  # two of the three due now; the third may be dropped
    manager.occupy("c")
    assert manager.reserve("new", 1)
    manager.occupy("new")  # done, but c and new leave two head groups running: more than X = 1
    assert manager.stats().blocking == ("d",)
    manager.occupy("d")
    batch = manager.consume()
    assert batch.group_ids == ("c", "d") and batch.dropped == ("e",)
    assert not manager.reserve("stale", 0)  # version 0's deadline (buffer 1) has passed
    stats = manager.stats()
    assert stats.staleness == (2, 2) and (stats.batches, stats.consumed, stats.dropped) == (2, 4, 1)
    assert stats.refused == {"stale": 1, "full": 1} and (stats.reserved, stats.occupied, stats.aborted) == (6, 5, 0)
    assert stats.blocking == () and stats.missing == 1 and not stats.can_consume  # only "new" is active


def test_start_capacity_is_the_slack_capped_by_groups_in_flight() -> None:
    manager = StalenessManager(eta=1, batch_size=4)
    assert manager.start_capacity(0, 16) == 8 and manager.start_capacity(0, 3) == 3
    for g in range(3):
        manager.reserve(g, 0)
    assert manager.start_capacity(0, 4) == 1 and manager.start_capacity(0, 2) == 0  # never negative
    manager.occupy(0)
    assert manager.start_capacity(0, 4) == 2 and manager.start_capacity(0, 100) == manager.reserve_slack(0) == 5


def test_start_capacity_counts_running_groups_only_and_takes_zero_in_flight() -> None:
    """Finished groups hold places in the buffers (the slack) but are not in flight; a limit of 0
    admits nothing, a negative one is an error."""
    manager = StalenessManager(eta=0, batch_size=8)
    for g in range(3):
        manager.reserve(g, 0)
    manager.occupy(0)  # 2 running, 1 done; slack 8 - 3 = 5
    assert manager.start_capacity(0, 4) == 2 and manager.start_capacity(0, 0) == 0
    with pytest.raises(ValueError, match="max_in_flight"):
        manager.start_capacity(0, -1)


def test_a_refused_reserve_counts_as_stale_exactly_when_its_deadline_has_passed() -> None:
    """At head 10 with eta 3 and every buffer full, a reserve of each version 0..10 is refused:
    versions 0-6 (deadline v + 3 < 10) as stale, 7-10 as full."""
    manager = StalenessManager(eta=3, batch_size=1)
    for i in range(10):
        manager.reserve(f"w{i}", manager.version)
        manager.occupy(f"w{i}")
        manager.consume()
    for v in range(7, 11):  # one group due at each of buffers 10..13: every prefix at its capacity
        assert manager.reserve(f"f{v}", v)
    for v in range(11):
        before = manager.stats().refused
        assert not manager.reserve(f"x{v}", v)
        kind = "stale" if v + 3 < 10 else "full"
        assert manager.stats().refused == {**before, kind: before[kind] + 1}, v
    assert manager.stats().refused == {"stale": 7, "full": 4}


def test_stats_count_each_abort_once_and_the_groups_missing_to_a_batch() -> None:
    manager = StalenessManager(eta=1, batch_size=4)
    for g in ("a", "b"):
        manager.reserve(g, 0)
    assert manager.stats().missing == 2
    manager.abort("a")
    stats = manager.stats()
    assert stats.aborted == 1 and stats.missing == 3 and stats.reserved == 2
    manager.abort("b")
    assert manager.stats().aborted == 2 and manager.stats().missing == 4

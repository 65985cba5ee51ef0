"""Check a JSONL protocol trace against the spec's Python mirror, with the standard library only.

A host system that drives the protocol (through :class:`StalenessManager` or its locked wrapper)
and records a trace with :class:`~.trace.JsonlTraceWriter` can validate its own run::

    python -m staleflow_protocol.check run/trace.jsonl      # the light distribution
    python -m staleflow.protocol.check run/trace.jsonl      # inside StaleFlow

Exit status: 0 the trace is a behaviour of the spec; 1 it is not (the first offending event is
printed: its index over the file's events, line, ``seq``, op and why); 2 the file is unreadable or
not a trace. Every event must be an enabled action of the mirror (:mod:`.mirror`, the spec's
actions written naively, checked against TLC's state graph) with the logged outcome: an accepted
reserve an enabled Reserve, a refused one a disabled Reserve; occupy and abort enabled; a consume's
batch, group versions and drops exactly one Consume successor; and the logged before/after counters
equal to the mirror state's. The mirror enumerates nothing here but evaluates the invariant over
all active groups, so the cost per event grows with the number of active groups.

``staleflow verify --trace`` runs this same replay and also replays a prefix of each segment with
TLC through the TLA+ spec itself.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from . import mirror
from .events import CounterState, ProtocolEvent
from .mirror import MirrorState, SpecParams
from .trace import TraceFormatError, TraceHeader, TraceSegment, read_trace

__all__ = [
    "Rejection",
    "TraceReport",
    "check_trace",
    "counters",
    "main",
    "mirror_step",
    "params_of",
    "replay_events",
    "start_state",
]


def params_of(header: TraceHeader) -> SpecParams:
    return SpecParams(header.eta, header.batch_size, header.redundancy)


def start_state(header: TraceHeader) -> MirrorState:
    """The mirror state a segment starts from: its header snapshot, or the initial state.

    Raises :class:`TraceFormatError` if the snapshot is malformed, disagrees with the header's
    parameters or violates the invariant.
    """
    start = header.start
    if start is None:
        return mirror.init()
    for name in ("eta", "batch_size", "redundancy"):
        if start.get(name) != getattr(header, name):
            raise TraceFormatError(f"trace header and its start snapshot disagree on {name}")
    version, entries = start.get("version"), start.get("groups")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0 or not isinstance(entries, list):
        raise TraceFormatError("start snapshot needs an int version >= 0 and a list of groups")
    groups = []
    for entry in entries:
        if not (
            isinstance(entry, list) and len(entry) == 3
            and isinstance(entry[0], (str, int)) and not isinstance(entry[0], bool)
            and isinstance(entry[1], int) and not isinstance(entry[1], bool)
            and entry[2] in (mirror.RUNNING, mirror.DONE)
        ):
            raise TraceFormatError(f"start snapshot: invalid group entry {entry!r}")
        groups.append((entry[0], entry[1], entry[2]))
    state = MirrorState(version, frozenset(groups))
    if len(state.groups) != len(state.ids()) or any(v > version for _, v, _ in groups):
        raise TraceFormatError("start snapshot: a group appears twice or is ahead of the trainer")
    p = params_of(header)
    if not mirror.invariant(p, state):
        raise TraceFormatError(f"start snapshot violates Inv ({', '.join(invariant_failures(p, state))})")
    return state


def invariant_failures(p: SpecParams, s: MirrorState) -> list[str]:
    """The conjuncts of Inv that ``s`` breaks: ``deadline`` (a group past its deadline) and
    ``cap<k>`` (more than ``(k + 1) * B + X`` groups due by buffer ``c + k``)."""
    deadlines = [v + p.eta for _, v, _ in s.groups]
    failed = ["deadline"] if any(d < s.version for d in deadlines) else []
    for k in range(p.eta + 1):
        if sum(1 for d in deadlines if d <= s.version + k) > (k + 1) * p.batch_size + p.redundancy:
            failed.append(f"cap{k}")
    return failed


def counters(p: SpecParams, s: MirrorState) -> CounterState:
    """The counters the implementation logs, computed from a mirror state."""
    running, done = [0] * (p.eta + 1), [0] * (p.eta + 1)
    for g, v, status in s.groups:
        offset = v + p.eta - s.version
        if not 0 <= offset <= p.eta:  # a negative index would wrap into the newest offset
            raise ValueError(f"group {g!r} (v{v}) has deadline offset {offset} at head {s.version}: outside 0..{p.eta}")
        (running if status == mirror.RUNNING else done)[offset] += 1
    return CounterState(s.version, tuple(running), tuple(done))


def mirror_step(p: SpecParams, s: MirrorState, e: ProtocolEvent) -> MirrorState | str:
    """The mirror state after event ``e`` from ``s``, or why ``e`` is not a spec step."""
    if e.op == "reserve":
        if e.group_id is None or e.version is None:
            return f"reserve needs a group id and a version, got {e.group_id!r}, v={e.version}"
        t = mirror.reserve(p, s, e.group_id, e.version)
        if e.accepted:
            return t if t is not None else f"reserve({e.group_id!r}, v={e.version}) accepted but Reserve is disabled"
        if s.find(e.group_id) is not None:
            return f"refused reserve of {e.group_id!r}, which is active"
        return s if t is None else f"reserve({e.group_id!r}, v={e.version}) refused but Reserve is enabled"
    if e.op in ("occupy", "abort"):
        assert e.group_id is not None
        t = (mirror.occupy if e.op == "occupy" else mirror.abort)(p, s, e.group_id)
        return t if t is not None else f"{e.op}({e.group_id!r}) is not enabled in the spec"
    assert e.batch is not None
    b = e.batch
    if b.version != s.version:
        return f"consume of buffer {b.version}, but the spec's head is {s.version}"
    chosen = [s.find(g) for g in b.group_ids]
    if any(g is None for g in chosen) or len(set(b.group_ids)) != len(b.group_ids):
        return f"consume takes {list(b.group_ids)}: not distinct active groups"
    if tuple(g[1] for g in chosen if g is not None) != b.group_versions:
        return f"consume logs versions {list(b.group_versions)}, the spec has {[g[1] for g in chosen if g]}"
    step = mirror.consume_taking(p, s, frozenset(g for g in chosen if g is not None))
    if step is None:
        return f"consume of {list(b.group_ids)} is not a Consume successor in the spec"
    if step.dropped != frozenset(b.dropped) or len(b.dropped) != len(step.dropped):
        return f"consume drops {sorted(map(str, b.dropped))}, the spec drops {sorted(map(str, step.dropped))}"
    return step.state


@dataclass(frozen=True)
class Rejection:
    """Why replay stopped: ``index`` is the 0-based position of the offending event in its segment."""

    index: int
    reason: str


def replay_events(header: TraceHeader, events: Sequence[ProtocolEvent]) -> Rejection | None:
    """Replay one segment on the mirror; None when every event is a spec step with the logged outcome."""
    p = params_of(header)
    s = start_state(header)
    for index, e in enumerate(events):  # every state here satisfies Inv, so counters() never raises
        if e.before != counters(p, s):
            return Rejection(index, f"before-state {e.before} != spec {counters(p, s)}")
        t = mirror_step(p, s, e)
        if isinstance(t, str):
            return Rejection(index, t)
        if e.after != counters(p, t):
            return Rejection(index, f"after-state {e.after} != spec {counters(p, t)}")
        s = t
    return None


@dataclass(frozen=True)
class TraceReport:
    """The verdict on a trace file. On rejection, ``offending`` names the first offending event."""

    accepted: bool
    events: int
    segments: int
    offending: str = ""
    reason: str = ""


def describe(segment: TraceSegment, offset: int, index: int) -> str:
    """``event #N (line L, seq S, op(...))``: an event by its index over the file's events."""
    e = segment.events[index]
    what = f"{e.op}({e.group_id!r}, v={e.version})" if e.op != "consume" else f"consume(buffer {e.version})"
    return f"event #{offset + index} (line {segment.first_line + 1 + index}, seq {e.seq}, {what})"


def check_trace(path: str | Path) -> TraceReport:
    """Replay every segment of a JSONL trace on the mirror; raises TraceFormatError or OSError if unreadable."""
    segments = read_trace(path)
    total = sum(len(segment.events) for segment in segments)
    offset = 0
    for number, segment in enumerate(segments, start=1):
        rejection = replay_events(segment.header, segment.events)
        if rejection is not None:
            at = describe(segment, offset, rejection.index)
            return TraceReport(False, total, len(segments), f"segment {number}: {at}", rejection.reason)
        offset += len(segment.events)
    return TraceReport(True, total, len(segments))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m staleflow_protocol.check",
        description="Check JSONL staleness-protocol traces against the spec's Python mirror.",
    )
    parser.add_argument("traces", nargs="+", type=Path, help="trace files written by JsonlTraceWriter")
    args = parser.parse_args(argv)
    status = 0
    for path in args.traces:
        try:
            report = check_trace(path)
        except (OSError, TraceFormatError) as error:
            print(f"{path}: unreadable trace: {error}", file=sys.stderr)
            status = max(status, 2)
            continue
        if report.accepted:
            print(f"{path}: accepted ({report.events} events in {report.segments} segment(s))")
        else:
            print(f"{path}: REJECTED at {report.offending}: {report.reason}")
            status = max(status, 1)
    return status


if __name__ == "__main__":
    sys.exit(main())

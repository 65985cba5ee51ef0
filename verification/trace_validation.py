"""Trace validation: replay an implementation trace (``staleflow.protocol.trace``) against the spec.

Two replays, same verdict expected:

- **mirror** (any size): every event must be an enabled action of ``spec/mirror.py`` with the logged
  outcome: an accepted reserve is an enabled Reserve, a refused reserve a disabled one; occupy and
  abort are enabled; a consume's batch and drops are exactly one Consume successor (with the
  logged group versions); the logged before/after counters equal the spec state's counters.
- **TLC** (the first :data:`TLC_MAX_EVENTS` events of each segment): the trace becomes a generated
  ``TraceData.tla`` and ``spec/MCTrace.tla`` walks it through the TLA+ actions themselves (the
  etcd-raft / CCF pattern). Trace group ids are renamed to reusable slots ``s1, s2, ...`` (a
  bijection between live ids and slots; the spec is symmetric in group ids) so that the model stays
  small for long traces.

A rejection names the first offending event: its index in the file (0-based, over events), line,
``seq`` and op.
"""

from __future__ import annotations

import dataclasses
import random
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from staleflow.protocol import ProtocolError, StalenessManager
from staleflow.protocol.events import CounterState, GroupId, ProtocolEvent
from staleflow.protocol.trace import (
    JsonlTraceWriter,
    TraceFormatError,
    TraceSegment,
    read_trace,
)
from staleflow.spec import mirror
from staleflow.spec.mirror import MirrorState, SpecParams
from staleflow.verification.checks import CheckResult
from staleflow.verification.tlc import TlcUnavailableError, run_tlc

#: Longest prefix of a segment handed to TLC (a 2,000-event trace takes a few seconds).
TLC_MAX_EVENTS = 2000


@dataclass(frozen=True)
class Verdict:
    """The outcome of one replay. ``bad_event`` is the 0-based index of the first offending event
    within the segment, or None when the segment is accepted."""

    accepted: bool
    events: int
    bad_event: int | None = None
    reason: str = ""
    explored: str = ""


# ----------------------------------------------------------------------------- mirror replay


def params_of(segment: TraceSegment) -> SpecParams:
    h = segment.header
    return SpecParams(h.eta, h.batch_size, h.redundancy)


def start_state(segment: TraceSegment) -> MirrorState:
    """The mirror state a segment starts from: its header snapshot, or the initial state."""
    start = segment.header.start
    if start is None:
        return mirror.init()
    for name in ("eta", "batch_size", "redundancy"):
        if start.get(name) != getattr(segment.header, name):
            raise TraceFormatError(f"trace header and its start snapshot disagree on {name}")
    version, entries = start.get("version"), start.get("groups")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0 or not isinstance(entries, list):
        raise TraceFormatError("the trace's start snapshot has no valid version and group list")
    for entry in entries:
        ok = isinstance(entry, list) and len(entry) == 3
        g, v, status = entry if ok else (None, None, None)
        ok = ok and isinstance(g, (str, int)) and not isinstance(g, bool)
        ok = ok and isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= version
        if not (ok and status in (mirror.RUNNING, mirror.DONE)):
            raise TraceFormatError(f"the trace's start snapshot has an invalid group entry {entry!r}")
    groups = frozenset((g, v, status) for g, v, status in entries)
    state = MirrorState(version, groups)
    p = params_of(segment)
    if len({g for g, _, _ in groups}) != len(entries):
        raise TraceFormatError("the trace's start snapshot lists a group twice")
    if not mirror.invariant(p, state):  # checked by the spec itself, not by restore()
        failed = ", ".join(mirror.invariant_failures(p, state))
        raise TraceFormatError(f"the trace's start state violates Inv ({failed})")
    return state


def counters(p: SpecParams, s: MirrorState) -> CounterState:
    """The counters the implementation logs, computed from a spec state."""
    running, done = [0] * (p.eta + 1), [0] * (p.eta + 1)
    for g, v, status in s.groups:
        offset = v + p.eta - s.version
        if not 0 <= offset <= p.eta:  # a negative index would wrap into the newest offset
            raise ValueError(f"group {g!r} (v{v}) has deadline offset {offset} at head {s.version}: outside 0..{p.eta}")
        (running if status == mirror.RUNNING else done)[offset] += 1
    return CounterState(s.version, tuple(running), tuple(done))


def mirror_step(p: SpecParams, s: MirrorState, e: ProtocolEvent) -> MirrorState | str:
    """The spec state after event ``e`` from ``s``, or why ``e`` is not a spec step."""
    if e.op == "reserve":
        assert e.group_id is not None and e.version is not None
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


def replay_mirror(segment: TraceSegment) -> Verdict:
    p = params_of(segment)
    s = start_state(segment)
    for index, e in enumerate(segment.events):
        try:
            if e.before != counters(p, s):
                return Verdict(False, len(segment.events), index, f"before-state {e.before} != spec {counters(p, s)}")
            t = mirror_step(p, s, e)
            if isinstance(t, str):
                return Verdict(False, len(segment.events), index, t)
            if e.after != counters(p, t):
                return Verdict(False, len(segment.events), index, f"after-state {e.after} != spec {counters(p, t)}")
        except ValueError as error:  # a state outside offsets 0..eta: never a spec state
            return Verdict(False, len(segment.events), index, str(error))
        s = t
    return Verdict(True, len(segment.events), explored=f"{len(segment.events):,} events")


# ----------------------------------------------------------------------------- TLC replay


def _tla(value: Any) -> str:
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return '"' + value + '"'
    if isinstance(value, tuple):
        return "<<" + ", ".join(_tla(v) for v in value) + ">>"
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(_tla(v) for v in value)) + "}"
    if isinstance(value, dict):
        return "[" + ", ".join(f"{k} |-> {_tla(v)}" for k, v in value.items()) + "]"
    raise TypeError(f"no TLA+ form for {value!r}")


def _counters_tla(state: CounterState) -> dict[str, Any]:
    return {"c": state.version, "running": state.running, "done": state.done}


class _Slots:
    """Renames trace group ids to reusable slots: live ids get distinct slots, freed on removal."""

    def __init__(self) -> None:
        self.of: dict[GroupId, str] = {}
        self.free: list[str] = []
        self.count = 0

    def new(self) -> str:
        if self.free:
            return self.free.pop()
        self.count += 1
        return f"s{self.count}"

    def slot(self, group_id: GroupId) -> str:
        """The slot of a live id, or a fresh one (an idle group in the spec) for an unknown id."""
        if group_id not in self.of:
            fresh = self.new()
            self.free.append(fresh)
            return fresh
        return self.of[group_id]

    def bind(self, group_id: GroupId) -> str:
        self.of[group_id] = self.new()
        return self.of[group_id]

    def release(self, group_id: GroupId) -> None:
        if group_id in self.of:
            self.free.append(self.of.pop(group_id))


def trace_module(segment: TraceSegment) -> str:
    """``TraceData.tla`` for a segment: slots, start state and the event log."""
    slots = _Slots()
    start = start_state(segment)
    start_ver = {slots.bind(g): (v, status) for g, v, status in sorted(start.groups, key=repr)}
    records = []
    for e in segment.events:
        rec: dict[str, Any] = {"op": e.op, "g": "none", "v": e.version or 0, "ok": bool(e.accepted), "bv": 0,
                               "taken": frozenset(), "takenv": frozenset(), "dropped": frozenset()}
        if e.op == "reserve":
            assert e.group_id is not None
            rec["g"] = slots.bind(e.group_id) if e.accepted and e.group_id not in slots.of else slots.slot(e.group_id)
        elif e.op in ("occupy", "abort"):
            assert e.group_id is not None
            rec["g"] = slots.slot(e.group_id)
            if e.op == "abort":
                slots.release(e.group_id)
        else:
            assert e.batch is not None
            taken = [slots.slot(g) for g in e.batch.group_ids]
            rec.update(bv=e.batch.version, taken=frozenset(taken),
                       takenv=frozenset(zip(taken, e.batch.group_versions)),
                       dropped=frozenset(slots.slot(g) for g in e.batch.dropped))
            for g in (*e.batch.group_ids, *e.batch.dropped):
                slots.release(g)
        rec["before"], rec["after"] = _counters_tla(e.before), _counters_tla(e.after)
        records.append(_tla(rec))
    names = [f"s{k}" for k in range(1, max(slots.count, 1) + 1)]

    def by_slot(values: dict[str, Any], default: Any) -> str:
        arms = " [] ".join(f'g = "{s}" -> {_tla(v)}' for s, v in values.items())
        return f"[g \\in TraceSlots |-> CASE {arms} [] OTHER -> {_tla(default)}]" if values else \
            f"[g \\in TraceSlots |-> {_tla(default)}]"

    log = ",\n    ".join(records)
    return (
        "---- MODULE TraceData ----\n"
        "EXTENDS Integers, Sequences\n"
        f"TraceSlots == {_tla(frozenset(names))}\n"
        f"TraceStartC == {start.version}\n"
        f"TraceStartVer == {by_slot({s: v for s, (v, _) in start_ver.items()}, 0)}\n"
        f"TraceStartSt == {by_slot({s: st for s, (_, st) in start_ver.items()}, 'idle')}\n"
        f"TraceLog == <<\n    {log}\n>>\n"
        "====\n"
    )


def replay_tlc(segment: TraceSegment) -> Verdict:
    """Replay a segment with TLC through ``MCTrace.tla``."""
    p = params_of(segment)
    cfg = (f"CONSTANTS\n    Eta = {p.eta}\n    B = {p.batch_size}\n    X = {p.redundancy}\n"
           "    Groups <- TraceSlots\nINIT TraceInit\nNEXT TraceNext\nINVARIANTS TypeOK Inv S1 S2\n")
    run = run_tlc("MCTrace", cfg, overrides={"TraceData.tla": trace_module(segment)}, workers=1)
    n = len(segment.events)
    explored = f"{run.distinct:,} distinct states, depth {run.depth}"
    if run.ok and run.distinct == n + 1:
        return Verdict(True, n, explored=explored)
    if run.returncode == 11:  # deadlock: no spec step matches event i
        positions = re.findall(r"/\\ i = (\d+)", run.output)
        bad = int(positions[-1]) - 1 if positions else None
        return Verdict(False, n, bad, "TLC: no spec action matches this event (deadlock)", explored)
    reason = f"TLC rc {run.returncode} ({run.outcome}) {run.violated}; {run.distinct} states for {n} events"
    tail = " | ".join(run.output.strip().splitlines()[-4:])
    return Verdict(False, n, None, f"{reason}: {tail}", explored)


# ----------------------------------------------------------------------------- API


def _describe(segment: TraceSegment, offset: int, index: int) -> str:
    e = segment.events[index]
    what = f"{e.op}({e.group_id!r}, v={e.version})" if e.op != "consume" else f"consume(buffer {e.version})"
    return f"event #{offset + index} (line {segment.first_line + 1 + index}, seq {e.seq}, {what})"


def _tlc_prefix(segment: TraceSegment) -> Verdict:
    """TLC replay of the first :data:`TLC_MAX_EVENTS` events (a prefix of a behaviour is one)."""
    verdict = replay_tlc(dataclasses.replace(segment, events=segment.events[:TLC_MAX_EVENTS]))
    if len(segment.events) > TLC_MAX_EVENTS:
        return dataclasses.replace(verdict, explored=f"first {TLC_MAX_EVENTS:,} of {len(segment.events):,} "
                                                     f"events, {verdict.explored}")
    return verdict


def validate_trace(path: str | Path, use_tlc: bool = True) -> CheckResult:
    """Validate a JSONL trace against the spec mirror (every event) and, with ``use_tlc``, against
    TLC (the first :data:`TLC_MAX_EVENTS` events of each segment).

    ``detail`` names the first offending event (0-based index over the file's events) on failure.
    """
    started = time.perf_counter()
    name, prop = "trace-validation", "implementation trace is a behaviour of the spec"
    try:
        segments = read_trace(path)
    except (OSError, TraceFormatError) as error:
        return CheckResult(name, prop, "replay", str(path), "0 events", "fail", 0.0, f"unreadable trace: {error}")
    total = sum(len(s.events) for s in segments)
    replays: list[tuple[str, Callable[[TraceSegment], Verdict]]] = [("mirror", replay_mirror)]
    if use_tlc:
        replays.append(("TLC", _tlc_prefix))
    methods = " + ".join(["mirror replay"] + (["TLC replay (MCTrace.tla)"] if use_tlc else []))
    bounds = ", ".join(sorted({f"eta={s.header.eta} B={s.header.batch_size} X={s.header.redundancy}" for s in segments}))
    notes: list[str] = []
    offset = 0
    for k, segment in enumerate(segments):
        where = f"segment {k + 1} (line {segment.first_line})"
        for layer, replay in replays:
            try:
                verdict = replay(segment)
            except (TlcUnavailableError, TraceFormatError) as error:
                verdict = Verdict(False, len(segment.events), None, str(error))
            if not verdict.accepted:
                at = _describe(segment, offset, verdict.bad_event) if verdict.bad_event is not None else "?"
                detail = f"{layer} rejects {where}: first offending {at}: {verdict.reason}"
                return CheckResult(name, prop, methods, bounds, f"{total:,} events", "fail",
                                   round(time.perf_counter() - started, 2), detail)
            notes.append(f"{where} {layer}: {verdict.explored}")
        offset += len(segment.events)
    return CheckResult(name, prop, methods, bounds, f"{total:,} events in {len(segments)} segment(s)",
                       "pass", round(time.perf_counter() - started, 2), "accepted; " + "; ".join(notes))


def record_workload_trace(
    path: str | Path, eta: int, batch_size: int, redundancy: int, ops: int, seed: int,
    resume_at: int | None = None,
) -> int:
    """Drive a :class:`StalenessManager` with a seeded random producer/trainer and write its trace.

    Reserves come from instances at versions up to ``eta + 1`` behind the trainer (some are
    refused), groups finish or are aborted, the trainer consumes whenever it can (sometimes it
    waits, so that head groups still running are dropped when ``redundancy > 0``). With
    ``resume_at``, the manager is snapshotted and restored at that operation and the trace continues
    in a second segment. Returns the number of events written.
    """
    rng = random.Random(seed)
    manager = StalenessManager(eta, batch_size, redundancy)
    writer = JsonlTraceWriter.attach(manager, path)
    written, next_id, resumed = 0, 0, False
    try:
        while written < ops:
            if written == resume_at and not resumed:
                resumed = True
                writer.close()
                manager = StalenessManager.restore(manager.snapshot())
                writer = JsonlTraceWriter.attach(manager, path, mode="a")
            groups = list(manager.groups())
            running = [g.group_id for g in groups if g.status.value == "running"]
            roll = rng.random()
            try:
                if roll < 0.40:
                    version = max(0, manager.version - rng.randint(0, eta + 1))
                    manager.reserve(f"p{next_id}", version)
                    next_id += 1
                elif roll < 0.75 and running:
                    manager.occupy(rng.choice(running))
                elif roll < 0.82 and groups:
                    manager.abort(rng.choice(groups).group_id)
                elif manager.can_consume():
                    manager.consume()
                else:
                    continue
            except ProtocolError as error:  # the workload only issues valid calls
                raise AssertionError(f"workload issued an invalid call: {error}") from error
            written += 1
    finally:
        writer.close()
    return written


#: (eta, batch_size, redundancy, ops, seed, resume_at) of the generated implementation traces.
WORKLOADS_QUICK: Sequence[tuple[int, int, int, int, int, int | None]] = [(2, 3, 1, 1200, 7, None)]
WORKLOADS_FULL: Sequence[tuple[int, int, int, int, int, int | None]] = [
    (2, 3, 1, 1500, 7, 700),
    (1, 4, 0, 1200, 11, None),
    (3, 2, 2, 1000, 23, None),
]


def checks(quick: bool) -> list[CheckResult]:
    """Record seeded implementation traces and validate them by mirror and TLC."""
    results = []
    for eta, batch_size, redundancy, ops, seed, resume_at in WORKLOADS_QUICK if quick else WORKLOADS_FULL:
        with tempfile.TemporaryDirectory(prefix="staleflow-trace-") as tmp:
            path = Path(tmp) / "trace.jsonl"
            record_workload_trace(path, eta, batch_size, redundancy, ops, seed, resume_at)
            result = validate_trace(path)
            stats = trace_stats(path)
        results.append(CheckResult(
            f"trace-validation-eta{eta}-B{batch_size}-X{redundancy}", result.property, result.method,
            f"{result.bounds}, seed {seed}" + (f", resumed at op {resume_at}" if resume_at else ""),
            f"{result.explored} ({stats})", result.result, result.seconds, result.detail))
    return results


def trace_stats(path: str | Path) -> str:
    """What a trace exercises: counts per op, refusals, distinct reserve versions, drops."""
    events = [e for segment in read_trace(path) for e in segment.events]
    refused = sum(1 for e in events if e.op == "reserve" and not e.accepted)
    ops_count = {op: sum(1 for e in events if e.op == op) for op in ("reserve", "occupy", "abort", "consume")}
    dropped = sum(len(e.batch.dropped) for e in events if e.batch is not None)
    versions = len({e.version for e in events if e.op == "reserve"})
    return (f"{ops_count['reserve']} reserves ({refused} refused, {versions} versions), {ops_count['occupy']} occupies, "
            f"{ops_count['abort']} aborts, {ops_count['consume']} consumes, {dropped} drops")

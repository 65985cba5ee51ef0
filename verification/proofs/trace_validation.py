"""Trace validation: replay an implementation trace (``staleflow.protocol.trace``) against the spec.

Two replays, same verdict expected:

- **mirror** (any size): every event must be an enabled action of ``spec/mirror.py`` with the logged
  outcome: an accepted reserve is an enabled Reserve, a refused reserve a disabled one; occupy and
  abort are enabled; a consume's batch and drops are exactly one Consume successor (with the
  logged group versions); the logged before/after counters equal the spec state's counters. This
  replay is the light package's standard-library checker (``protocol/check.py``), shared, not copied.
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

from staleflow.protocol import ProtocolError, StalenessManager, check
from staleflow.protocol.events import CounterState, GroupId
from staleflow.protocol.trace import (
    JsonlTraceWriter,
    TraceFormatError,
    TraceSegment,
    read_trace,
)
from staleflow.spec.mirror import MirrorState, SpecParams
from staleflow.verification.checks import CheckResult
from staleflow.verification.proofs.tlc import TlcUnavailableError, run_tlc

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
    return check.params_of(segment.header)


def start_state(segment: TraceSegment) -> MirrorState:
    """The mirror state a segment starts from: its header snapshot, or the initial state."""
    return check.start_state(segment.header)


def replay_mirror(segment: TraceSegment) -> Verdict:
    """The light package's mirror replay (:mod:`staleflow.protocol.check`) as a :class:`Verdict`."""
    rejection = check.replay_events(segment.header, segment.events)
    if rejection is not None:
        return Verdict(False, len(segment.events), rejection.index, rejection.reason)
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
    return check.describe(segment, offset, index)


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
    writer = JsonlTraceWriter.attach(manager, path, refusals=True)  # check every refusal too
    written, next_id, resumed = 0, 0, False
    try:
        while written < ops:
            if written == resume_at and not resumed:
                resumed = True
                writer.close()
                manager = StalenessManager.restore(manager.snapshot())
                writer = JsonlTraceWriter.attach(manager, path, mode="a", refusals=True)
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

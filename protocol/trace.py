"""Protocol traces as JSON lines: one header, then one object per :class:`ProtocolEvent`.

The header holds the protocol parameters and the manager's starting snapshot (so that a trace of a
resumed run can be replayed from where it began)::

    {"type": "header", "format": "staleflow.trace/2", "eta": 2, "batch_size": 4, "redundancy": 0,
     "start": {...StalenessManager.snapshot()...}, "refusals": false}
    {"seq":0,"op":"reserve","group_id":"p0","version":0,"accepted":true,"before":[0,0,0,0,0,0,0],"after":[0,0,1,0,0,0,0]}
    {"seq":1,"op":"occupy","group_id":"p0","version":0,"accepted":null,"after":[0,0,0,0,0,1,0]}

A counter state is the flat array ``[*running, *done, version]`` (:meth:`CounterState.flat`).
Consume events carry ``"batch": {"version", "group_ids", "group_versions", "dropped"}``. An event's
``before`` state is written only where it is not the previous event's ``after`` (the first event of
a segment: a manager's operations follow one another, so the chain never breaks in between);
:func:`read_trace` fills it in, so every :class:`ProtocolEvent` read back has both states, and the
checker still compares every logged after-state with the spec's.

Format ``staleflow.trace/1`` (written by earlier versions, about twice as long) has
``"type": "event"``, ``"batch": null`` and ``before`` on every event line, and counter states as
``{"version", "running", "done"}`` objects; :func:`read_trace` reads both formats.

Refused reserves are not traced one by one unless asked (``refusals=True``; the header's
``"refusals"`` says which): they change no state, so a trace without them is still a behaviour of
the spec, and :meth:`~.manager.StalenessManager.stats` counts them by reason. They can outnumber
every other event when producers poll for room; trace them to check admission exactness.
``staleflow.verification.proofs.trace_validation`` replays such files against the spec.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Protocol, TypeVar, Union

from .errors import InvalidParameterError, ProtocolError, TraceClosedError
from .events import (
    ConsumedBatch,
    CounterState,
    EventHook,
    GroupId,
    ProtocolEvent,
)
from .trace_lines import JSON_FLAGS, fields_line, json_group_id, line_formats

TRACE_FORMAT = "staleflow.trace/2"
#: the formats :func:`read_trace` reads: /1 logs every event's before-state, /2 (written) only where
#: the chain of after-states breaks
TRACE_FORMATS = ("staleflow.trace/1", TRACE_FORMAT)
OPS = ("reserve", "occupy", "abort", "consume")


class Traceable(Protocol):
    """What :meth:`JsonlTraceWriter.attach` needs: a :class:`~.manager.StalenessManager` or a
    :class:`~.locked.LockedStalenessManager`."""

    @property
    def eta(self) -> int: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def redundancy(self) -> int: ...
    def snapshot(self) -> dict[str, Any]: ...
    def add_event_hook(self, hook: EventHook) -> None: ...
    def remove_event_hook(self, hook: EventHook) -> None: ...


class TraceFormatError(ProtocolError, ValueError):
    """A trace line that is not a valid header or event; the message names the line and the field."""


@dataclass(frozen=True)
class TraceHeader:
    """The protocol parameters of a trace and the snapshot of the manager when tracing began.

    ``refusals`` tells whether refused reserves are traced (traces written before the option have them).
    """

    eta: int
    batch_size: int
    redundancy: int
    start: Mapping[str, Any] | None = None
    refusals: bool = True

    def to_json(self) -> dict[str, Any]:
        return {
            "type": "header",
            "format": TRACE_FORMAT,
            "eta": self.eta,
            "batch_size": self.batch_size,
            "redundancy": self.redundancy,
            "start": None if self.start is None else dict(self.start),
            "refusals": self.refusals,
        }


# ----------------------------------------------------------------------------- from JSON


def _field(data: Mapping[str, Any], name: str, where: str) -> Any:
    if name not in data:
        raise TraceFormatError(f"{where}: missing field {name!r}")
    return data[name]


def _int(value: Any, name: str, where: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceFormatError(f"{where}: {name} must be an int >= {minimum}, got {value!r}")
    return value


def _group_id(value: Any, name: str, where: str) -> GroupId:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TraceFormatError(f"{where}: {name} must be a str or int group id, got {value!r}")
    return value


def _int_list(value: Any, name: str, where: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise TraceFormatError(f"{where}: {name} must be a list, got {value!r}")
    return tuple(_int(item, name, where) for item in value)


def _id_list(value: Any, name: str, where: str) -> tuple[GroupId, ...]:
    if not isinstance(value, list):
        raise TraceFormatError(f"{where}: {name} must be a list, got {value!r}")
    return tuple(_group_id(item, name, where) for item in value)


def _mapping(value: Any, name: str, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise TraceFormatError(f"{where}: {name} must be an object, got {value!r}")
    return value


def counters_from_json(data: Any, where: str) -> CounterState:
    """A counter state: a flat array ``[*running, *done, version]`` (format /2) or an object (/1)."""
    if isinstance(data, list):
        if len(data) % 2 == 0:
            raise TraceFormatError(f"{where}: a counter state [*running, *done, version] has an odd length, got {data!r}")
        return CounterState.from_flat(_int_list(data, "counter state", where))
    data = _mapping(data, "counter state", where)
    return CounterState(
        version=_int(_field(data, "version", where), "version", where),
        running=_int_list(_field(data, "running", where), "running", where),
        done=_int_list(_field(data, "done", where), "done", where),
    )


def batch_from_json(data: Any, where: str) -> ConsumedBatch:
    data = _mapping(data, "batch", where)
    return ConsumedBatch(
        version=_int(_field(data, "version", where), "batch version", where),
        group_ids=_id_list(_field(data, "group_ids", where), "group_ids", where),
        group_versions=_int_list(_field(data, "group_versions", where), "group_versions", where),
        dropped=_id_list(_field(data, "dropped", where), "dropped", where),
    )


def event_from_json(data: Any, where: str = "event", before: CounterState | None = None) -> ProtocolEvent:
    """The event of one trace line (already JSON-decoded); ``where`` prefixes error messages.

    ``before`` is the previous event's after-state, the before-state of a line that has none."""
    data = _mapping(data, "event", where)
    op = _field(data, "op", where)
    if op not in OPS:
        raise TraceFormatError(f"{where}: op must be one of {', '.join(OPS)}, got {op!r}")
    group_id = _field(data, "group_id", where)
    version = _field(data, "version", where)
    accepted = _field(data, "accepted", where)
    batch = data.get("batch")
    if op == "consume":
        if batch is None:
            raise TraceFormatError(f"{where}: a consume event needs a batch")
        parsed_batch: ConsumedBatch | None = batch_from_json(batch, where)
        parsed_group: GroupId | None = None
    else:
        parsed_batch = None
        parsed_group = _group_id(group_id, "group_id", where)
    if op == "reserve" and not isinstance(accepted, bool):
        raise TraceFormatError(f"{where}: a reserve event needs accepted true or false, got {accepted!r}")
    return ProtocolEvent(
        seq=_int(_field(data, "seq", where), "seq", where),
        op=op,
        group_id=parsed_group,
        version=None if version is None else _int(version, "version", where),
        accepted=accepted if isinstance(accepted, bool) else None,
        batch=parsed_batch,
        before=before if before is not None and "before" not in data
        else counters_from_json(_field(data, "before", where), where),
        after=counters_from_json(_field(data, "after", where), where),
    )


def header_from_json(data: Any, where: str = "header") -> TraceHeader:
    data = _mapping(data, "header", where)
    if data.get("type") != "header" or data.get("format") not in TRACE_FORMATS:
        raise TraceFormatError(
            f"{where}: not a trace header (expected type 'header', format {' or '.join(map(repr, TRACE_FORMATS))})")
    start, refusals = data.get("start"), data.get("refusals", True)
    if not isinstance(refusals, bool):
        raise TraceFormatError(f"{where}: refusals must be true or false, got {refusals!r}")
    return TraceHeader(
        eta=_int(_field(data, "eta", where), "eta", where),
        batch_size=_int(_field(data, "batch_size", where), "batch_size", where, minimum=1),
        redundancy=_int(_field(data, "redundancy", where), "redundancy", where),
        start=None if start is None else _mapping(start, "start", where),
        refusals=refusals,
    )


@dataclass(frozen=True)
class TraceSegment:
    """One traced run: its header and events. ``first_line`` is the header's line number in the file."""

    header: TraceHeader
    events: tuple[ProtocolEvent, ...]
    first_line: int


def read_trace(path: str | Path) -> list[TraceSegment]:
    """The segments of a JSONL trace file, in order; errors name the line.

    A file usually holds one segment; a writer opened with ``mode="a"`` (a resumed run, or several
    runs in one file) starts a new segment with a new header line. A last line without its newline
    that is not JSON is the event a killed writer was writing (torn): it is ignored, as the writer
    never finished recording it; a bad line anywhere else is an error.
    """
    segments: list[TraceSegment] = []
    header: TraceHeader | None = None
    events: list[ProtocolEvent] = []
    first_line = 0
    with open(path, encoding="utf-8") as stream:
        for number, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                data = json.loads(line)
            except json.JSONDecodeError as error:
                if not line.endswith("\n"):
                    break  # torn: only the last line of a file can lack its newline
                raise TraceFormatError(f"{where}: not JSON ({error.msg})") from None
            if isinstance(data, dict) and data.get("type") == "header":
                if header is not None:
                    segments.append(TraceSegment(header, tuple(events), first_line))
                header, events, first_line = header_from_json(data, where), [], number
            elif header is None:
                raise TraceFormatError(f"{where}: the first line of a trace must be its header")
            else:
                events.append(event_from_json(data, where, events[-1].after if events else None))
    if header is None:
        raise TraceFormatError(f"{path}: empty trace (no header line)")
    segments.append(TraceSegment(header, tuple(events), first_line))
    return segments


def write_trace(path: str | Path, segments: list[TraceSegment]) -> None:
    """Write segments as a JSONL trace file (the inverse of :func:`read_trace`), in the format
    :class:`JsonlTraceWriter` writes."""
    with open(path, "w", encoding="utf-8") as stream:
        for segment in segments:
            with JsonlTraceWriter(stream, segment.header) as writer:
                for event in segment.events:
                    writer(event)


# ----------------------------------------------------------------------------- writer


_Writer = TypeVar("_Writer", bound="JsonlTraceWriter")


def drop_torn_line(path: Path) -> int:
    """End the file at ``path`` on a whole line before a segment is appended to it: a last line
    without its newline is cut off if it is not JSON (torn: a writer killed while writing it), else
    its newline is added. Returns the bytes cut."""
    if not path.is_file():
        return 0
    with open(path, "rb+") as stream:
        size = stream.seek(0, 2)
        tail, start = b"", size
        while start > 0 and b"\n" not in tail:  # the last line, read backwards in blocks
            block = min(start, 1 << 16)
            start -= block
            stream.seek(start)
            tail = stream.read(block) + tail
        last = tail[tail.rfind(b"\n") + 1 :]
        if not last:  # an empty file, or one that ends on a newline
            return 0
        try:
            json.loads(last)
        except ValueError:  # not JSON (a decode error is a ValueError too)
            stream.truncate(size - len(last))
            return len(last)
        stream.seek(0, 2)
        stream.write(b"\n")
    return 0


class JsonlTraceWriter:
    """An event hook that appends every :class:`ProtocolEvent` to a JSONL trace file or stream.

    >>> with JsonlTraceWriter.attach(manager, "run/trace.jsonl"):   # doctest: +SKIP
    ...     manager.reserve("p0", 0)

    The header is written when the file is opened (``mode="a"`` appends a new segment). Use
    :meth:`attach` to take the parameters and starting snapshot from a manager and register the hook
    in one step. ``target`` is a path (the writer opens and closes the file) or an open text stream
    (the writer writes and flushes it but leaves it open).

    Events are encoded in runs (one %-format for the lines since the last write) and handed to the
    file in one write at each consume, every
    :attr:`WRITE_EVERY` events and at :meth:`close` (or :meth:`flush`), then flushed: a run killed
    in between leaves a valid prefix (read_trace ignores a torn last line), and a resumed run
    appends a segment that starts from its snapshot. A write that raises (a full disk, a broken
    stream) fails that event's hook, so the operation raises :class:`~.errors.HookError`; the lines
    not written are kept and written first at the next attempt, so the trace loses nothing once
    the stream works again.
    """

    #: Events encoded but not yet written are handed to the stream at most this many at a time.
    WRITE_EVERY = 256

    def __init__(
        self, target: Union[str, Path, IO[str]], header: TraceHeader, mode: str = "w"
    ) -> None:
        if mode not in ("w", "a"):
            raise InvalidParameterError(f"mode must be 'w' (new file) or 'a' (append a segment), got {mode!r}")
        self.refusals = header.refusals
        #: refused reserves seen but not traced (``refusals=False``)
        self.refusals_skipped = 0
        self._pending: list[str] = []  # encoded lines not yet written
        # the fields of the usual lines after ``_pending``, not yet encoded: one %-format of a whole run
        # of lines (at the next consume, write or other line) costs less than one per line
        self._rows: list[object] = []
        self._last_after: tuple[int, ...] | None = None  # the last traced after-state
        self._last_event_after: CounterState | None = None  # the last after-state __call__ was given
        self._counters_format, self._line_format = line_formats(header.eta + 1)
        self._row_width = 5 + 2 * (header.eta + 1) + 1  # seq, op, group id, version, accepted, after-state
        self._pending_lines = 0  # lines in _pending
        self._rows_limit = 0  # fields in _rows that call for a flush (_set_rows_limit)
        self._manager: Traceable | None = None
        if isinstance(target, (str, Path)):
            self.path: Path | None = Path(target)
            if mode == "a":
                drop_torn_line(self.path)
            # the writer owns the file until close()
            self._stream: IO[str] | None = open(self.path, mode, encoding="utf-8")  # noqa: SIM115
            self._owned = True
        else:
            self.path, self._stream, self._owned = None, target, False
        self._stream.write(json.dumps(header.to_json()) + "\n")
        self._stream.flush()

    @classmethod
    def attach(
        cls, manager: Traceable, target: Union[str, Path, IO[str]], mode: str = "w", refusals: bool = False
    ) -> JsonlTraceWriter:
        """Trace ``manager`` from its current state (its snapshot is the header's ``start``).

        From several threads, use :meth:`~.locked.LockedStalenessManager.attach_trace`, which takes
        the snapshot and registers the hook under the manager's lock.

        ``mode="a"`` appends a new segment to an existing trace (e.g. after resuming a run).
        ``refusals=True`` traces refused reserves too (the trace checker then checks that each
        refusal was right); by default they are only counted (:attr:`refusals_skipped`, and the
        manager's ``stats()``).
        """
        header = TraceHeader(manager.eta, manager.batch_size, manager.redundancy, manager.snapshot(), refusals)
        writer = cls(target, header, mode)
        manager.add_event_hook(writer)
        writer._manager = manager
        return writer

    def __call__(self, event: ProtocolEvent) -> None:
        """Trace ``event`` (how the manager calls the writer when other hooks are registered too)."""
        before, after = event.before, event.after
        # pass the last after-state's tuple again where the chain holds: record_event tests identity
        last = self._last_after
        before_state = last if last is not None and before == self._last_event_after else before.flat()
        after_state = before_state if after == before else after.flat()
        self._last_event_after = after
        self.record_event(event.seq, event.op, event.group_id, event.version, event.accepted, event.batch,
                          before_state, after_state)

    def record_event(self, seq: int, op: str, group_id: GroupId | None, version: int | None, accepted: bool | None,
                     batch: ConsumedBatch | None, before: tuple[int, ...], after: tuple[int, ...]) -> None:
        """Trace one event given by its fields (:class:`~.events.EventRecorder`: the manager calls this
        directly when the writer is its only hook)."""
        if accepted is False and not self.refusals:
            if self._stream is None:
                raise TraceClosedError(f"trace {self.path or 'stream'} is closed")
            self.refusals_skipped += 1
            return
        if before is self._last_after and batch is None and self._stream is not None:
            # the usual event (its before-state is the last line's after-state): its fields wait in _rows
            rows = self._rows
            rows += (seq, op, group_id if type(group_id) is int else json_group_id(group_id), version,
                     JSON_FLAGS[accepted], *after)
            self._last_after = after
            if len(rows) >= self._rows_limit:
                self.flush()
            return
        if self._stream is None:
            raise TraceClosedError(f"trace {self.path or 'stream'} is closed")
        # a consume, or the first event (its before-state is not the last line's after-state)
        self._encode_rows()
        encoded_before = None if before is self._last_after else self._counters_format % before
        self._pending.append(fields_line(seq, op, group_id, version, accepted, batch, encoded_before,
                                         self._counters_format % after))
        self._pending_lines += 1
        self._last_after = after
        if op == "consume" or self._pending_lines >= self.WRITE_EVERY:
            self.flush()
        else:
            self._set_rows_limit()

    def _set_rows_limit(self) -> None:
        """Flush when ``_rows`` holds the lines that make ``WRITE_EVERY`` unwritten with ``_pending``'s."""
        self._rows_limit = (self.WRITE_EVERY - self._pending_lines) * self._row_width

    def _encode_rows(self) -> None:
        """Encode the usual lines waiting in ``_rows`` (one %-format for all of them) into ``_pending``."""
        rows = self._rows
        if rows:
            lines = len(rows) // self._row_width
            self._pending.append("\n".join([self._line_format] * lines) % tuple(rows))
            self._pending_lines += lines
            rows.clear()

    def flush(self) -> None:
        """Write the events not yet written and flush the stream; on an error they stay pending."""
        if self._stream is None:
            return
        self._encode_rows()
        if self._pending:
            try:
                self._stream.write("\n".join(self._pending) + "\n")
                self._pending.clear()
                self._pending_lines = 0
            finally:
                self._set_rows_limit()  # after a failed write the pending lines still count against WRITE_EVERY
        self._stream.flush()

    @property
    def closed(self) -> bool:
        return self._stream is None

    def close(self) -> None:
        """Detach from the manager (if attached), write what is pending and close the file (a stream
        given to the writer is flushed, not closed); closing twice is harmless."""
        if self._manager is not None:
            self._manager.remove_event_hook(self)
            self._manager = None
        if self._stream is not None:
            try:
                self.flush()
            finally:
                if self._owned:
                    self._stream.close()
                self._stream = None

    def __enter__(self: _Writer) -> _Writer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

"""The text of trace lines (format ``staleflow.trace/2``, see :mod:`.trace`): event and counter-state
encoders, written directly with %-templates where it pays, and their ``json.dumps`` equivalents."""

from __future__ import annotations

from json.encoder import encode_basestring_ascii
from typing import Any

from .events import ConsumedBatch, CounterState, GroupId, ProtocolEvent


def counters_to_json(state: CounterState) -> list[int]:
    """A counter state as the flat array of format /2."""
    return list(state.flat())


def batch_to_json(batch: ConsumedBatch) -> dict[str, Any]:
    return {
        "version": batch.version,
        "group_ids": list(batch.group_ids),
        "group_versions": list(batch.group_versions),
        "dropped": list(batch.dropped),
    }


def event_to_json(event: ProtocolEvent, with_before: bool = True) -> dict[str, Any]:
    """The event's trace line as data (format /2: ``json.dumps(data, separators=(",", ":"))`` is the
    line); ``with_before=False`` leaves out its before-state (an event whose before-state is the
    previous event's after-state)."""
    data: dict[str, Any] = {
        "seq": event.seq,
        "op": event.op,
        "group_id": event.group_id,
        "version": event.version,
        "accepted": event.accepted,
    }
    if event.batch is not None:
        data["batch"] = batch_to_json(event.batch)
    if with_before:
        data["before"] = counters_to_json(event.before)
    data["after"] = counters_to_json(event.after)
    return data


def _json_ids(group_ids: tuple[GroupId, ...]) -> str:
    return "[" + ",".join([encode_basestring_ascii(g) if isinstance(g, str) else str(g) for g in group_ids]) + "]"


_FORMATS: dict[int, tuple[str, str]] = {}


def line_formats(offsets: int) -> tuple[str, str]:
    """%-templates for ``offsets`` deadline offsets (one %-format of ints is several times cheaper than
    formatting lists): a counter state, filled by a flat state ``(*running, *done, version)``, and the
    line of a non-consume event whose before-state is the previous event's after-state, filled by seq,
    op, the encoded group id, version and accepted, then the flat after-state."""
    if offsets not in _FORMATS:
        counters = "[" + ",".join(["%d"] * (2 * offsets + 1)) + "]"
        line = '{"seq":%d,"op":"%s","group_id":%s,"version":%d,"accepted":%s,"after":' + counters + "}"
        _FORMATS[offsets] = counters, line
    return _FORMATS[offsets]


def counters_line(state: CounterState) -> str:
    """``json.dumps(counters_to_json(state), separators=(",", ":"))``, written directly."""
    return line_formats(len(state.running))[0] % state.flat()


def json_group_id(group_id: GroupId | None) -> str | GroupId:
    """The JSON text of a group id (an int is left to %-formatting): ``json.dumps``'s own string encoder."""
    if group_id is None:
        return "null"
    return encode_basestring_ascii(group_id) if isinstance(group_id, str) else group_id


JSON_FLAGS = {None: "null", True: "true", False: "false"}


def fields_line(seq: int, op: str, group_id: GroupId | None, version: int | None, accepted: bool | None,
                batch: ConsumedBatch | None, before: str | None, after: str) -> str:
    """The trace line (format /2) of an event given by its fields and its encoded counter states
    (:func:`counters_line`; ``before`` None: left out), written directly."""
    encoded_batch = "" if batch is None else (
        f'"batch":{{"version":{batch.version},"group_ids":{_json_ids(batch.group_ids)},'
        f'"group_versions":[{",".join(map(str, batch.group_versions))}],"dropped":{_json_ids(batch.dropped)}}},')
    encoded_before = "" if before is None else f'"before":{before},'
    encoded_version = "null" if version is None else version
    return (
        f'{{"seq":{seq},"op":"{op}","group_id":{json_group_id(group_id)},'
        f'"version":{encoded_version},"accepted":{JSON_FLAGS[accepted]},'
        f'{encoded_batch}{encoded_before}"after":{after}}}'
    )


def event_line(event: ProtocolEvent, with_before: bool = True) -> str:
    """``json.dumps(event_to_json(event, with_before), separators=(",", ":"))`` (the same text),
    written directly: about twice as fast as building and dumping the dict."""
    before = counters_line(event.before) if with_before else None
    return fields_line(event.seq, event.op, event.group_id, event.version, event.accepted, event.batch,
                       before, counters_line(event.after))

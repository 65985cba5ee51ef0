"""Unit tests of StalenessManager: every public method, every error, snapshots, events, buffers."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest
from staleflow import protocol
from staleflow.protocol import (
    SNAPSHOT_FORMAT,
    ConsumedBatch,
    ConsumeNotReadyError,
    CounterState,
    DuplicateGroupError,
    GroupRecord,
    GroupStatus,
    InvalidTransitionError,
    InvalidVersionError,
    ProtocolError,
    ProtocolEvent,
    SnapshotError,
    StalenessManager,
    UnknownGroupError,
)

RUNNING, DONE = GroupStatus.RUNNING, GroupStatus.DONE


def finished(manager: StalenessManager, *ids: str, version: int = 0) -> None:
    """Reserve and occupy each id at ``version``."""
    for group_id in ids:
        assert manager.reserve(group_id, version)
        manager.occupy(group_id)


# ----------------------------------------------------------------------------- construction


def test_parameters_and_empty_state() -> None:
    m = StalenessManager(eta=2, batch_size=3, redundancy=1)
    assert (m.eta, m.batch_size, m.redundancy, m.version, len(m)) == (2, 3, 1, 0, 0)
    assert m.counts() == CounterState(0, (0, 0, 0), (0, 0, 0))
    assert [m.capacity(k) for k in range(3)] == [4, 7, 10]
    assert list(m.groups()) == []
    assert not m.can_consume()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"eta": -1, "batch_size": 1}, "eta must be >= 0"),
        ({"eta": 0, "batch_size": 0}, "batch_size must be >= 1"),
        ({"eta": 0, "batch_size": 1, "redundancy": -1}, "redundancy must be >= 0"),
        ({"eta": 1.5, "batch_size": 1}, "eta must be an int"),
        ({"eta": True, "batch_size": 1}, "eta must be an int"),
        ({"eta": 0, "batch_size": "2"}, "batch_size must be an int"),
    ],
)
def test_bad_parameters_are_named(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StalenessManager(**kwargs)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- reserve


def test_reserve_admits_up_to_capacity_and_refuses_beyond() -> None:
    m = StalenessManager(eta=1, batch_size=2)
    assert [m.reserve(g, 0) for g in "abcde"] == [True, True, True, True, False]
    assert len(m) == 4 and "e" not in m and "a" in m
    assert m.group("a") == GroupRecord("a", 0, RUNNING)
    assert m.counts() == CounterState(0, (0, 4), (0, 0))


def test_reserve_with_redundancy_admits_the_slack() -> None:
    m = StalenessManager(eta=0, batch_size=2, redundancy=1)
    assert [m.reserve(g, 0) for g in "abcd"] == [True, True, True, False]


def test_reserve_refuses_a_group_past_its_deadline() -> None:
    m = StalenessManager(eta=1, batch_size=1)
    for step in range(2):
        finished(m, f"g{step}", version=step)
        m.consume()
    assert m.version == 2
    assert m.reserve_slack(0) == 0 and not m.can_reserve(0)
    assert m.reserve("old", 0) is False  # deadline 0 + 1 < 2
    assert m.reserve("fresh", 1) is True


def test_reserve_is_exact_with_mixed_deadlines() -> None:
    """Older groups fill the head buffer; a newer group still fits in a later buffer."""
    m = StalenessManager(eta=1, batch_size=1)
    finished(m, "x")
    m.consume()  # version 1: groups at version 0 have deadline 1 (offset 0)
    assert m.reserve("a", 0)
    assert not m.reserve("b", 0)  # two groups due by buffer 1: no placement
    assert m.reserve("c", 1)  # deadline 2: buffer 2 is free
    assert not m.reserve("d", 1)
    assert m.counts() == CounterState(1, (1, 1), (0, 0))


@pytest.mark.parametrize("version, message", [(-1, ">= 0"), (1, "ahead of the trainer"), ("0", "int"), (True, "int")])
def test_reserve_bad_version(version: object, message: str) -> None:
    m = StalenessManager(eta=1, batch_size=1)
    with pytest.raises(InvalidVersionError, match=message):
        m.reserve("a", version)  # type: ignore[arg-type]
    assert len(m) == 0


def test_reserve_duplicate_and_bad_id() -> None:
    m = StalenessManager(eta=1, batch_size=2)
    m.reserve("a", 0)
    with pytest.raises(DuplicateGroupError, match="'a' is already active"):
        m.reserve("a", 0)
    for bad in (1.5, None, True, ("t",)):
        with pytest.raises(TypeError, match="group_id must be a str or int"):
            m.reserve(bad, 0)  # type: ignore[arg-type]
    assert len(m) == 1


def test_ids_may_be_reused_after_they_leave() -> None:
    m = StalenessManager(eta=0, batch_size=1)
    finished(m, "a")
    m.consume()
    assert m.reserve("a", 1)
    m.abort("a")
    assert m.reserve("a", 1)


# ----------------------------------------------------------------------------- occupy and abort


def test_occupy_and_its_errors() -> None:
    m = StalenessManager(eta=1, batch_size=2)
    m.reserve(7, 0)
    m.occupy(7)
    assert m.group(7) == GroupRecord(7, 0, DONE)
    with pytest.raises(InvalidTransitionError, match="already done"):
        m.occupy(7)
    with pytest.raises(UnknownGroupError, match="'nope' is not active"):
        m.occupy("nope")
    assert m.counts() == CounterState(0, (0, 0), (0, 1))


def test_abort_running_and_done_groups() -> None:
    m = StalenessManager(eta=1, batch_size=2)
    m.reserve("r", 0)
    finished(m, "d")
    m.abort("r")
    m.abort("d")
    assert len(m) == 0 and m.counts() == CounterState(0, (0, 0), (0, 0))
    with pytest.raises(UnknownGroupError):
        m.abort("r")
    with pytest.raises(UnknownGroupError):
        m.group("d")
    with pytest.raises(UnknownGroupError):
        m.group(["unhashable"])  # type: ignore[arg-type]


def test_abort_frees_room_for_a_refused_group() -> None:
    m = StalenessManager(eta=0, batch_size=1)
    assert m.reserve("a", 0) and not m.reserve("b", 0)
    m.abort("a")
    assert m.reserve("b", 0)


def test_unknown_group_error_is_a_key_error_with_a_readable_message() -> None:
    error = UnknownGroupError("group 'x' is not active")
    assert isinstance(error, KeyError) and isinstance(error, ProtocolError)
    assert str(error) == "group 'x' is not active"
    assert str(UnknownGroupError()) == "unknown group"


# ----------------------------------------------------------------------------- consume


def test_consume_takes_earliest_deadlines_first_in_arrival_order() -> None:
    m = StalenessManager(eta=1, batch_size=2)
    finished(m, "a", "b")
    m.consume()  # version 1
    finished(m, "new1", version=1)
    finished(m, "old1", "old2", version=0)
    batch = m.consume()
    assert batch == ConsumedBatch(1, ("old1", "old2"), (0, 0), ())
    assert m.version == 2 and [g.group_id for g in m.groups()] == ["new1"]


def test_consume_not_ready_reasons() -> None:
    m = StalenessManager(eta=0, batch_size=2, redundancy=1)
    finished(m, "a")
    with pytest.raises(ConsumeNotReadyError, match="1 finished groups, 2 needed"):
        m.consume()
    m.reserve("b", 0)
    m.reserve("c", 0)  # head: a done, b and c running
    m.occupy("b")
    assert m.can_consume()  # c is dropped: 1 <= redundancy
    m = StalenessManager(eta=1, batch_size=1)
    finished(m, "x")
    m.consume()
    m.reserve("due_now", 0)
    finished(m, "later", version=1)
    with pytest.raises(ConsumeNotReadyError, match="still running"):
        m.consume()  # taking "later" would drop "due_now": more than redundancy 0
    assert m.version == 1 and len(m) == 2


def test_consume_drops_head_leftovers_within_redundancy() -> None:
    m = StalenessManager(eta=0, batch_size=1, redundancy=1)
    finished(m, "a")
    m.reserve("slow", 0)
    batch = m.consume()
    assert batch.group_ids == ("a",) and batch.dropped == ("slow",)
    assert "slow" not in m and len(m) == 0


def test_consume_refuses_when_the_next_buffers_would_overflow() -> None:
    """Taking the done group leaves two running groups due in the next buffer (capacity 1)."""
    m = StalenessManager(eta=2, batch_size=1)
    finished(m, "x")
    m.consume()  # version 1
    m.reserve("r1", 0)
    m.reserve("r2", 0)  # deadline 2 = offset 1
    finished(m, "d", version=1)  # deadline 3 = offset 2
    assert m.counts() == CounterState(1, (0, 2, 0), (0, 0, 1))
    assert not m.can_consume()
    m.occupy("r1")
    assert m.consume().group_ids == ("r1",)


def test_without_redundancy_nothing_is_ever_dropped() -> None:
    m = StalenessManager(eta=1, batch_size=2)
    for step in range(6):
        finished(m, f"a{step}", f"b{step}", version=m.version)
        assert m.consume().dropped == ()


# ----------------------------------------------------------------------------- queries


def test_reserve_slack_and_oldest_admissible_version() -> None:
    m = StalenessManager(eta=2, batch_size=2)
    assert m.reserve_slack(0) == 6 and m.oldest_admissible_version() == 0
    for step in range(3):
        finished(m, f"a{step}", f"b{step}", version=step)
        m.consume()
    assert m.version == 3
    assert [m.reserve_slack(v) for v in range(4)] == [0, 2, 4, 6]
    for g in "pq":
        m.reserve(g, 1)
    assert [m.reserve_slack(v) for v in range(4)] == [0, 0, 2, 4]
    assert m.oldest_admissible_version() == 2
    for g in "rstu":
        m.reserve(g, 3)
    assert m.oldest_admissible_version() is None
    with pytest.raises(InvalidVersionError):
        m.reserve_slack(4)


def test_buffer_view_is_the_edf_placement() -> None:
    m = StalenessManager(eta=2, batch_size=2, redundancy=1)
    finished(m, "d1", "d2")
    for g in "abcd":
        m.reserve(g, 0)
    views = m.buffers()
    assert [(v.index, v.capacity, v.done, v.running, v.free) for v in views] == [
        (0, 3, 2, 1, 0),
        (1, 2, 0, 2, 0),
        (2, 2, 0, 1, 1),
    ]
    assert "BufferView(index=0, capacity=3, running=1, done=2)" == repr(views[0])


def test_groups_order_is_by_deadline_running_then_done() -> None:
    m = StalenessManager(eta=1, batch_size=2)
    finished(m, "x", "y")
    m.consume()
    m.reserve("new", 1)
    finished(m, "old_done", version=0)
    m.reserve("old_run", 0)
    assert [g.group_id for g in m.groups()] == ["old_run", "old_done", "new"]


# ----------------------------------------------------------------------------- events


def test_event_hook_sees_every_operation_with_counters() -> None:
    events: list[ProtocolEvent] = []
    m = StalenessManager(eta=0, batch_size=1, redundancy=1, on_event=events.append)
    m.reserve("a", 0)
    m.reserve("b", 0)
    m.reserve("c", 0)  # refused
    m.occupy("a")
    m.abort("b")
    batch = m.consume()
    assert [(e.seq, e.op, e.group_id, e.version, e.accepted) for e in events] == [
        (0, "reserve", "a", 0, True),
        (1, "reserve", "b", 0, True),
        (2, "reserve", "c", 0, False),
        (3, "occupy", "a", 0, None),
        (4, "abort", "b", 0, None),
        (5, "consume", None, 0, None),
    ]
    assert events[2].before == events[2].after == CounterState(0, (2,), (0,))
    assert events[3].after == CounterState(0, (1,), (1,))
    assert events[5].batch == batch and events[5].after == CounterState(1, (0,), (0,))
    assert all(e.batch is None for e in events[:5])


def test_failed_calls_emit_nothing_and_hooks_can_be_removed() -> None:
    events: list[ProtocolEvent] = []
    m = StalenessManager(eta=0, batch_size=1)
    m.add_event_hook(events.append)
    with pytest.raises(ConsumeNotReadyError):
        m.consume()
    with pytest.raises(UnknownGroupError):
        m.occupy("x")
    assert events == []
    m.reserve("a", 0)
    m.remove_event_hook(events.append)
    m.occupy("a")
    assert [e.op for e in events] == ["reserve"]


# ----------------------------------------------------------------------------- snapshots


def busy_manager() -> StalenessManager:
    m = StalenessManager(eta=2, batch_size=2, redundancy=1)
    finished(m, "a", "b")
    m.consume()
    m.reserve("r0", 0)
    finished(m, "d1", version=1)
    m.reserve(9, 1)
    return m


def test_snapshot_restore_round_trip_through_json() -> None:
    m = busy_manager()
    data = json.loads(json.dumps(m.snapshot()))
    assert data["format"] == SNAPSHOT_FORMAT and data["version"] == 1
    restored = StalenessManager.restore(data)
    assert restored.snapshot() == data
    assert restored.counts() == m.counts() and list(restored.groups()) == list(m.groups())
    # the copy behaves the same from here on
    for manager in (m, restored):
        manager.occupy("r0")
    assert m.consume() == restored.consume()


def test_restore_attaches_the_given_hook_only() -> None:
    events: list[ProtocolEvent] = []
    restored = StalenessManager.restore(busy_manager().snapshot(), on_event=events.append)
    restored.abort("r0")
    assert [e.op for e in events] == ["abort"]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: s.update(format="other/1"), "not a staleness-manager snapshot"),
        (lambda s: s.pop("eta"), "invalid snapshot"),
        (lambda s: s.update(batch_size=0), "batch_size must be >= 1"),
        (lambda s: s.update(version=-1), "version must be >= 0"),
        (lambda s: s.update(groups={}), "'groups' must be a list"),
        (lambda s: s["groups"].append(["x", 0]), "expected \\[id, version, status\\]"),
        (lambda s: s["groups"].append([1.5, 0, "done"]), "invalid snapshot group id"),
        (lambda s: s["groups"].append(["r0", 1, "done"]), "appears twice"),
        (lambda s: s["groups"].append(["x", 1, "finished"]), "invalid snapshot group 'x'"),
        (lambda s: s["groups"].append(["x", 5, "done"]), "ahead of the trainer"),
        (lambda s: s.update(version=4), "past its deadline"),
        (lambda s: s["groups"].extend([[f"x{i}", 1, "done"] for i in range(5)]), "at most"),
    ],
)
def test_restore_rejects_corrupt_snapshots(edit, message: str) -> None:  # type: ignore[no-untyped-def]
    data = busy_manager().snapshot()
    edit(data)
    with pytest.raises(SnapshotError, match=message):
        StalenessManager.restore(data)


def test_restore_rejects_a_non_mapping() -> None:
    with pytest.raises(SnapshotError):
        StalenessManager.restore([1, 2, 3])  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- packaging


#: The peer drop-ins in the light package: each may import its peer system too (only it), and no
#: other module imports them (``import staleflow_protocol`` needs nothing but the standard library);
#: a drop-in may import another drop-in for the same peer.
PEER_DROP_INS = {
    "areal.py": {"areal"}, "areal_batches.py": {"areal"}, "areal_staleness.py": {"areal"}, "areal_trainer.py": {"areal"},
    "verl_dropin.py": {"verl", "ray"},
}


def test_protocol_imports_only_the_standard_library() -> None:
    """The core (protocol/'s top level) imports only the standard library; the drop-ins live in
    ``bindings/`` and each may import its peer system too."""
    folder = Path(protocol.__file__).parent
    assert not set(PEER_DROP_INS) & {p.name for p in folder.glob("*.py")}, "a drop-in outside bindings/"
    for path in sorted(folder.glob("*.py")) + sorted((folder / "bindings").glob("*.py")):
        stdlib = sys.stdlib_module_names | PEER_DROP_INS.get(path.name, set())
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                ok = top in stdlib or name.startswith("staleflow.protocol") or top == "__future__"
                assert ok, f"{path.name} imports {name}"
            if isinstance(node, ast.ImportFrom) and node.level and path.parent == folder:
                assert not (node.module or "").startswith("bindings"), f"the core module {path.name} imports a binding"
            if isinstance(node, ast.ImportFrom) and node.level and f"{node.module}.py" in PEER_DROP_INS:
                assert PEER_DROP_INS.get(path.name) == PEER_DROP_INS[f"{node.module}.py"], f"{path.name} imports the drop-in {node.module}"


def test_doctest_example_in_the_package_docstring() -> None:
    import doctest

    result = doctest.testmod(protocol)
    assert result.attempted >= 5 and result.failed == 0, result  # the example ran, not an empty docstring


# --------------------------------------------------------------- hooks (mutation-testing survivors)
def test_removing_a_hook_that_is_not_registered_is_an_error() -> None:
    from staleflow.protocol.errors import UnknownHookError

    manager = StalenessManager(eta=1, batch_size=1)
    manager.add_event_hook(seen := [].append)
    with pytest.raises(UnknownHookError, match="is not registered"):
        manager.remove_event_hook(print)
    manager.remove_event_hook(seen)
    with pytest.raises(UnknownHookError):
        manager.remove_event_hook(seen)


def test_every_hook_sees_the_event_when_others_fail_and_the_first_failure_is_the_cause() -> None:
    """Two hooks fail and one does not: the operation is applied, each hook got the event, and the
    HookError lists both failures with the first one's error as its cause."""
    from staleflow.protocol.errors import HookError

    first, second = ValueError("first"), KeyError("second")
    seen: list[str] = []

    def failing(error: Exception) -> object:
        def hook(event: object) -> None:
            seen.append(str(error))
            raise error
        return hook

    manager = StalenessManager(eta=1, batch_size=1, hooks=[failing(first), seen.append, failing(second)])
    with pytest.raises(HookError) as raised:
        manager.reserve("a", 0)
    assert "a" in manager and seen[0] == "first" and seen[2] == "'second'" and len(seen) == 3
    assert [error for _, error in raised.value.failures] == [first, second]
    assert raised.value.__cause__ is first

"""The protocol's ops/s goal, checked by something that does not depend on the machine: the Python
function calls each operation makes (profiled with ``sys.setprofile``: every ``call`` and
``c_call`` event), on the steady-state call sequence that ``staleflow bench protocol`` and
``staleflow bench trace-cost`` time (``bench/trace_cost.py::drive_steady_state``).

The timed figure lives in the benchmark (``staleflow bench protocol``: operations per second, with the
command to reproduce it); what the suite can hold without flaking is that an operation's work stays
a small constant: ``reserve``, ``occupy`` and ``abort`` make the same few calls whatever the number of
groups in flight (B 64 or 512, eta 1 or 3), and ``consume`` a few per group it takes. A change that
made an operation walk the groups in flight (O(groups) per call, the way an ops/s figure collapses at
scale) multiplies these counts, which the second test shows on such a manager.

A walk that makes no call (``for _ in self._versions: pass``) adds no call event, so the work is
also counted as *line events* (``sys.settrace``) in the protocol's own code: every turn of a loop is
one or more of them. The same fixed-size sequence makes exactly as many line events per operation
at 1,000 and at 100,000 groups; a walk over the groups in flight makes 100 times more at the larger
size (the last test shows it on such a manager).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from staleflow.bench.protocol import drive_fixed_size
from staleflow.bench.trace_cost import drive_steady_state
from staleflow.protocol import StalenessManager
from staleflow.protocol import manager as manager_module

#: Most calls per operation (measured on Python 3.11: reserve 8, occupy 3, abort 4, consume 3.1 to
#: 3.5 per group plus a constant); the margin is for a different interpreter's C calls.
BUDGET = {"reserve": 10, "occupy": 4, "abort": 6}
CONSUME_PER_GROUP, CONSUME_CONSTANT = 4, 40
#: Most line events per operation in the protocol's code at eta 3 (measured on Python 3.11: reserve
#: 44, its slack a loop over the eta + 1 deadline offsets; occupy 13; abort 12); a walk over 1,000
#: groups makes at least 1,000.
LINE_BUDGET = {"reserve": 60, "occupy": 20, "abort": 20}
#: An operation's line events are counted up to this many, then its tracing stops (a walk over
#: 100,000 groups would otherwise be traced line by line, minutes of the suite).
LINE_CAP = 5_000
PROTOCOL_DIR = str(Path(manager_module.__file__).resolve().parent)


Drive = Callable[[Callable[[str, Callable[[], object]], object]], None]


def _events_per_op(drive: Drive, set_hook: Callable[[Any], object], hook: Any, seen: list[int], own: int) -> dict[str, float]:
    """Mean events per operation of each kind that ``drive(call)`` makes through ``call``: ``hook``
    is installed with ``set_hook`` (``sys.setprofile`` or ``sys.settrace``) around each operation and
    counts its events in ``seen[0]``; ``own``: the events of the driver's own lambda, not counted."""
    events: Counter[str] = Counter()
    ops: Counter[str] = Counter()

    def call(op: str, fn: Callable[[], object]) -> object:
        seen[0] = 0
        set_hook(hook)
        try:
            result = fn()
        finally:
            set_hook(None)
        events[op] += seen[0] - own
        ops[op] += 1
        return result

    drive(call)
    return {op: events[op] / ops[op] for op in ops}


def calls_per_op(drive: Drive) -> dict[str, float]:
    """Mean profiled calls (``call`` and ``c_call`` events) per operation of each kind that
    ``drive(call)`` makes through ``call`` (the driver's own lambda not counted)."""
    seen = [0]

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            seen[0] += 1

    return _events_per_op(drive, sys.setprofile, profile, seen, own=1)


def lines_per_op(drive: Drive, code: tuple[str, ...] = (PROTOCOL_DIR,)) -> dict[str, float]:
    """Mean line events per operation of each kind that ``drive(call)`` makes through ``call``, in
    frames of the files under ``code`` only (the protocol package's; each operation counted up to
    :data:`LINE_CAP`)."""
    seen = [0]

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            seen[0] += 1
            if seen[0] >= LINE_CAP:
                sys.settrace(None)
                return None  # stop tracing this frame too: the count is past any budget already
        return local

    def on_call(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename.startswith(code) else None

    return _events_per_op(drive, sys.settrace, on_call, seen, own=0)


@pytest.mark.parametrize(("eta", "batch_size"), [(1, 64), (3, 64), (1, 512), (3, 512)])
def test_each_protocol_operation_makes_a_few_calls_whatever_the_groups_in_flight(eta: int, batch_size: int) -> None:
    manager = StalenessManager(eta=eta, batch_size=batch_size)
    per_op = calls_per_op(lambda call: drive_steady_state(manager, eta, batch_size, 12, seed=0, call=call))
    assert {op: per_op[op] <= limit for op, limit in BUDGET.items()} == dict.fromkeys(BUDGET, True), per_op
    assert per_op["consume"] <= CONSUME_PER_GROUP * batch_size + CONSUME_CONSTANT, per_op


def test_the_calls_per_operation_are_the_same_with_a_thousand_and_a_hundred_thousand_groups_active() -> None:
    """``staleflow bench protocol`` times reserve/occupy/abort at 1,000 / 10,000 / 100,000 active
    groups and finds them slower at the largest size; the same sequence makes exactly as many calls
    at each size, so that growth is not work the code does (it is the memory the dicts take)."""
    counts = {active: calls_per_op(lambda call, n=active: drive_fixed_size(n, 3, 300, 0, call)) for active in (1_000, 100_000)}
    assert counts[1_000] == counts[100_000], counts
    assert {op: counts[1_000][op] <= limit for op, limit in BUDGET.items()} == dict.fromkeys(BUDGET, True), counts


def test_the_line_events_per_operation_are_the_same_with_a_thousand_and_a_hundred_thousand_groups_active() -> None:
    """Line events see the loops that call counting misses: a ``reserve`` that walks the groups in
    flight without a call makes 100 times more of them at 100,000 groups than at 1,000."""
    counts = {active: lines_per_op(lambda call, n=active: drive_fixed_size(n, 3, 100, 0, call)) for active in (1_000, 100_000)}
    assert counts[1_000] == counts[100_000], counts
    assert {op: counts[100_000][op] <= limit for op, limit in LINE_BUDGET.items()} == dict.fromkeys(LINE_BUDGET, True), counts


class _ScanningManager(StalenessManager):
    """A reserve that looks at every group it knows first (O(groups) per call)."""

    def reserve(self, group_id: Any, version: int) -> bool:
        for known in list(self._versions):
            self._versions.get(known)
        return super().reserve(group_id, version)


def test_the_budget_catches_an_operation_that_walks_the_groups_in_flight() -> None:
    manager = _ScanningManager(eta=1, batch_size=64)
    per_op = calls_per_op(lambda call: drive_steady_state(manager, 1, 64, 12, seed=0, call=call))
    assert per_op["reserve"] > 5 * BUDGET["reserve"], per_op  # about 72 calls (the ~64 groups in flight each looked at)


class _QuietlyWalkingManager(StalenessManager):
    """A reserve that walks the groups in flight without calling anything (no call event per group)."""

    def reserve(self, group_id: Any, version: int) -> bool:
        for _ in self._versions:
            pass
        return super().reserve(group_id, version)


def test_line_events_catch_a_walk_over_the_groups_that_makes_no_call() -> None:
    calls = calls_per_op(lambda call: drive_fixed_size(1_000, 3, 20, 0, call, manager_class=_QuietlyWalkingManager))
    lines = lines_per_op(lambda call: drive_fixed_size(1_000, 3, 20, 0, call, manager_class=_QuietlyWalkingManager),
                         code=(PROTOCOL_DIR, __file__))
    assert calls["reserve"] <= BUDGET["reserve"], calls  # the call budget does not see it
    assert lines["reserve"] > 1_000 > 10 * LINE_BUDGET["reserve"], lines  # one line event per group walked, at least

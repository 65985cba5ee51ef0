"""An executable Python mirror of ``StalenessBuffer.tla``: the same actions, written from the spec.

This module is deliberately naive: guards are the spec's formulas evaluated by brute force over all
groups and all choices, never the implementation's incremental counters. It is the reference that
the implementation (``staleflow.protocol``) is checked against, and it is itself checked against
TLC's state graph at small bounds (``verification/proofs/graph_equivalence.py``).

It lives in the protocol package so that the dependency-free distribution (``protocol/pyproject.toml``)
ships it with the trace checker (``check.py``); ``spec/mirror.py`` re-exports it, and it imports
nothing from the implementation (``manager.py``): only the ``GroupId`` type.

State: ``version`` (the head buffer ``c``) and the set of active groups ``(id, version, status)``
with status ``"running"`` or ``"done"``. A group's deadline is ``version + eta``.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import Iterator

from .events import GroupId

RUNNING = "running"
DONE = "done"

Group = tuple[GroupId, int, str]


@dataclass(frozen=True)
class SpecParams:
    eta: int
    batch_size: int
    redundancy: int = 0


@dataclass(frozen=True)
class MirrorState:
    version: int
    groups: frozenset[Group]

    def ids(self) -> set[GroupId]:
        return {g for g, _, _ in self.groups}

    def find(self, group_id: GroupId) -> Group | None:
        return next((g for g in self.groups if g[0] == group_id), None)


@dataclass(frozen=True)
class ConsumeStep:
    """One successor of Consume: the new state, the batch taken and the groups dropped."""

    state: MirrorState
    batch: frozenset[GroupId]
    dropped: frozenset[GroupId]


def init() -> MirrorState:
    return MirrorState(0, frozenset())


def invariant(p: SpecParams, s: MirrorState) -> bool:
    """Inv: no group past its deadline; for k in 0..eta, #{deadline <= c+k} <= (k+1)*B + X."""
    deadlines = [v + p.eta for _, v, _ in s.groups]
    if any(d < s.version for d in deadlines):
        return False
    return all(
        sum(1 for d in deadlines if d <= s.version + k) <= (k + 1) * p.batch_size + p.redundancy
        for k in range(p.eta + 1)
    )


def reserve(p: SpecParams, s: MirrorState, group_id: GroupId, version: int) -> MirrorState | None:
    """Reserve(g, v): enabled iff g is not active, 0 <= v <= c and Inv holds with g added."""
    if group_id in s.ids() or not 0 <= version <= s.version:
        return None
    t = MirrorState(s.version, s.groups | {(group_id, version, RUNNING)})
    return t if invariant(p, t) else None


def occupy(p: SpecParams, s: MirrorState, group_id: GroupId) -> MirrorState | None:
    """Occupy(g): a running group becomes done."""
    g = s.find(group_id)
    if g is None or g[2] != RUNNING:
        return None
    return MirrorState(s.version, (s.groups - {g}) | {(g[0], g[1], DONE)})


def abort(p: SpecParams, s: MirrorState, group_id: GroupId) -> MirrorState | None:
    """Abort(g): an active (running or done) group is removed."""
    g = s.find(group_id)
    if g is None:
        return None
    return MirrorState(s.version, s.groups - {g})


def consume_taking(p: SpecParams, s: MirrorState, chosen: frozenset[Group]) -> ConsumeStep | None:
    """Consume with batch ``chosen``: enabled iff it is B done groups of ``s``, the groups due at c
    that are not chosen (dropped) number at most X, and Inv holds at c+1 for what remains."""
    if len(chosen) != p.batch_size or not chosen <= s.groups or any(g[2] != DONE for g in chosen):
        return None
    dropped = frozenset(g for g in s.groups - chosen if g[1] + p.eta == s.version)
    if len(dropped) > p.redundancy:
        return None
    t = MirrorState(s.version + 1, s.groups - chosen - dropped)
    if not invariant(p, t):
        return None
    return ConsumeStep(t, frozenset(g[0] for g in chosen), frozenset(g[0] for g in dropped))


def consume(p: SpecParams, s: MirrorState) -> Iterator[ConsumeStep]:
    """Consume: every choice of B done groups that :func:`consume_taking` accepts."""
    done = sorted((g for g in s.groups if g[2] == DONE), key=repr)
    for chosen in combinations(done, p.batch_size):
        step = consume_taking(p, s, frozenset(chosen))
        if step is not None:
            yield step


def can_consume(p: SpecParams, s: MirrorState) -> bool:
    return next(consume(p, s), None) is not None

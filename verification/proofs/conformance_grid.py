"""Exhaustive small-scope conformance: the manager restored into every Inv state of small parameters,
at every head buffer, with groups listed in shuffled arrival order, answers every query as the
spec mirror does, and every action leads to the mirror's successor (the comparisons of
:mod:`staleflow.verification.proofs.conformance_compare`).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from staleflow.protocol import SNAPSHOT_FORMAT, ConsumeNotReadyError, StalenessManager
from staleflow.spec import mirror
from staleflow.spec.mirror import DONE, RUNNING, MirrorState, SpecParams
from staleflow.verification.proofs.conformance_compare import (
    assert_consume_conforms,
    assert_same_queries,
    assert_same_state,
    consume_steps,
)

# --------------------------------------------------------------------------- exhaustive small scope
#: (eta, B, X) of the exhaustive layer: every Inv state of each, at every head buffer 0..eta+1.
#: eta 3 is the least at which a later Consume prefix guard (cap(1) at c + 1) can bind.
EXHAUSTIVE_GRID = (
    *((eta, b, x) for eta in range(3) for b in (1, 2) for x in range(2)),
    (3, 1, 0), (3, 1, 1), (4, 1, 0),
)


EXHAUSTIVE_GRID_FULL = (*EXHAUSTIVE_GRID, (2, 1, 2), (2, 2, 2), (3, 1, 2), (3, 2, 0), (4, 1, 1))


def inv_counter_states(p: SpecParams) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every (running, done) count vector over offsets ``0..eta`` that satisfies Inv."""

    def extend(i: int, prefix: int, running: tuple[int, ...], done: tuple[int, ...]) -> Iterator[Any]:
        if i > p.eta:
            yield running, done
            return
        for size in range((i + 1) * p.batch_size + p.redundancy - prefix + 1):
            for r in range(size + 1):
                yield from extend(i + 1, prefix + size, (*running, r), (*done, size - r))

    yield from extend(0, 0, (), ())


def heads(eta: int) -> range:
    """Head buffers checked: 0 (the oldest offsets would need negative versions, so they are
    empty) up to ``eta + 1`` (version 0 is past its deadline; every later head behaves the same)."""
    return range(eta + 2)


def snapshot_of(
    p: SpecParams, c: int, running: Sequence[int], done: Sequence[int], rng: random.Random | None = None
) -> dict[str, Any] | None:
    """A snapshot with these counters at head ``c``, groups listed in a shuffled arrival order
    when ``rng`` is given (so arrival order is not deadline order); None if an offset that would
    need a negative version is not empty."""
    groups = []
    for i in range(p.eta + 1):
        version = c - p.eta + i
        for status, count in ((RUNNING, running[i]), (DONE, done[i])):
            if count and version < 0:
                return None
            groups += [[f"{status[0]}{i}.{n}", version, status] for n in range(count)]
    if rng is not None:
        rng.shuffle(groups)
    return {"format": SNAPSHOT_FORMAT, "eta": p.eta, "batch_size": p.batch_size,
            "redundancy": p.redundancy, "version": c, "groups": groups}


@dataclass
class Coverage:
    """Which conjuncts of Inv and of the Consume guard were the only reason for a refusal, per
    (eta, B, X); ``missing`` lists the expected ones never seen alone."""

    seen: dict[SpecParams, set[str]] = field(default_factory=dict)

    def add(self, p: SpecParams, state: MirrorState) -> None:
        self.seen.setdefault(p, set()).update(mirror.sole_refusal_reasons(p, state))

    def missing(self) -> dict[SpecParams, list[str]]:
        out = {}
        for p, seen in self.seen.items():
            absent = [r for r in mirror.refusal_reasons(p) if r not in seen]
            if absent:
                out[p] = absent
        return out

    def describe(self) -> str:
        reasons = sum(len(v) for v in self.seen.values())
        return f"{reasons} (config, conjunct) refusal reasons seen alone in {len(self.seen)} configs"


def exhaustive_conformance(
    manager_cls: type[StalenessManager], grid: Sequence[tuple[int, int, int]],
    coverage: Coverage | None = None, seed: int = 0,
) -> int:
    """Check every Inv state of every ``(eta, B, X)`` in ``grid`` at every head ``0..eta+1``: the
    manager restored into it answers every query as the mirror does, and every action (reserve at
    each version, occupy and abort at each offset, consume) leads to the mirror's successor.
    Snapshots list the groups in a seeded shuffled order. Returns the states checked."""
    checked = 0
    for p, where, snapshot in grid_snapshots(grid, seed):
        spec = MirrorState(snapshot["version"], frozenset(tuple(g) for g in snapshot["groups"]))
        try:
            _check_every_action(manager_cls, snapshot, p, spec)
        except AssertionError as error:
            raise AssertionError(f"{where}: {error}") from None
        if coverage is not None:
            coverage.add(p, spec)
        checked += 1
    return checked


def grid_snapshots(grid: Sequence[tuple[int, int, int]], seed: int = 0) -> Iterator[tuple[SpecParams, str, dict[str, Any]]]:
    """``(params, where, snapshot)`` for every Inv state of every ``(eta, B, X)`` in ``grid`` at every
    head ``0..eta+1``, groups in a shuffled order seeded by ``seed``; ``where`` names the state."""
    rng = random.Random(seed)
    for eta, batch_size, redundancy in grid:
        p = SpecParams(eta, batch_size, redundancy)
        for running, done in inv_counter_states(p):
            for c in heads(eta):
                snapshot = snapshot_of(p, c, running, done, rng)
                if snapshot is not None:
                    yield p, f"eta={eta} B={batch_size} X={redundancy} c={c} running={running} done={done}", snapshot


def _check_every_action(
    manager_cls: type[StalenessManager], snapshot: dict[str, Any], p: SpecParams, spec: MirrorState
) -> None:
    impl = manager_cls.restore(snapshot)
    assert_same_state(impl, p, spec)
    assert_same_queries(impl, p, spec)
    for version in range(spec.version + 1):
        impl = manager_cls.restore(snapshot)
        successor = mirror.reserve(p, spec, "new", version)
        accepted = impl.reserve("new", version)
        assert accepted == (successor is not None), f"reserve at v{version} returned {accepted}"
        assert_same_state(impl, p, successor or spec)
    one_per_class = {(v, s): g for g, v, s in sorted(spec.groups, key=repr)}  # same offset+status
    for group_id in one_per_class.values():
        for operation in (mirror.occupy, mirror.abort):
            successor = operation(p, spec, group_id)
            if successor is None:
                continue
            impl = manager_cls.restore(snapshot)
            getattr(impl, operation.__name__)(group_id)
            assert_same_state(impl, p, successor)
    if consume_steps(p, spec):
        impl = manager_cls.restore(snapshot)
        step = assert_consume_conforms(impl.consume(), p, spec)
        assert_same_state(impl, p, step.state)
    else:
        impl = manager_cls.restore(snapshot)
        try:
            impl.consume()
        except ConsumeNotReadyError as error:
            done = sum(1 for g in spec.groups if g[2] == DONE)
            expected = f"{done} finished groups, {p.batch_size} needed" if done < p.batch_size else "still running"
            assert expected in str(error), f"consume refused with {str(error)!r}, expected it to say {expected!r}"
        else:
            raise AssertionError("consume() succeeded where the spec's Consume is disabled")
        assert_same_state(impl, p, spec)

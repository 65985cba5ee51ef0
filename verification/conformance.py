"""Model-based conformance: the implementation and the spec mirror driven side by side.

A Hypothesis ``RuleBasedStateMachine`` applies every operation (valid and invalid) to a
:class:`~staleflow.protocol.StalenessManager` and to ``spec/mirror.py`` at once. Preconditions come
from the mirror, never from the implementation, so an implementation whose own guard is wrong
cannot hide the rules that would expose it. After every step it checks:

- the same groups, versions, statuses and counters (the refinement mapping is the identity on
  groups; ``counts()`` is derived from the mirror's groups);
- exact admission: ``reserve`` accepts iff the mirror's Reserve is enabled, and ``reserve_slack``,
  ``can_reserve`` and ``oldest_admissible_version`` agree with repeated mirror Reserves;
- eager consume: ``can_consume()`` equals the mirror's enabledness of Consume; a consumed batch and
  its drops are one of the mirror's Consume successors; every consumed group satisfies S1;
- errors: each invalid call raises its documented error and changes nothing;
- events: one event per operation, with the right contents and ``before``/``after`` counters;
- snapshot/restore mid-run rebuilds an equal manager.

A second, deterministic check, :func:`exhaustive_conformance`, restores the manager into every
Inv state of small parameters and compares every query and every action's successor with the
mirror (the same comparison functions).

Both take the manager class as a parameter, which is how ``impl_mutants`` runs mutated
implementations through the same checks.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from hypothesis import HealthCheck, Phase, event, settings, target
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from staleflow.protocol import (
    SNAPSHOT_FORMAT,
    ConsumedBatch,
    ConsumeNotReadyError,
    CounterState,
    DuplicateGroupError,
    InvalidTransitionError,
    InvalidVersionError,
    ProtocolEvent,
    StalenessManager,
    UnknownGroupError,
)
from staleflow.spec import mirror
from staleflow.spec.mirror import DONE, RUNNING, ConsumeStep, MirrorState, SpecParams
from staleflow.verification.checks import CheckResult

#: Parameter ranges the machine draws from; small enough for the mirror's brute force.
MAX_ETA = 3
MAX_BATCH_SIZE = 3
MAX_REDUNDANCY = 2
#: Most reserves one burst may make: cap(eta) + 1 = (eta + 1) B + X + 1 at the largest parameters,
#: so that one burst at one version can fill every buffer and be refused.
MAX_BURST = (MAX_ETA + 1) * MAX_BATCH_SIZE + MAX_REDUNDANCY + 1
#: Picks an element of a state-dependent list by index modulo its length (cheaper than st.data()).
PICK = st.integers(0, 1 << 16)
INVALID_CALLS = (
    "reserve-duplicate", "occupy-done", "occupy-inactive", "abort-inactive", "consume-not-ready"
)

_COMMON: dict[str, Any] = {
    "deadline": None, "print_blob": True, "suppress_health_check": [HealthCheck.too_slow]
}
settings.register_profile(
    "ci", max_examples=200, stateful_step_count=50, derandomize=True, database=None, **_COMMON
)
settings.register_profile("nightly", max_examples=3000, stateful_step_count=100, **_COMMON)
#: For mutants: deterministic, no shrinking (a mutant only needs to be caught, not explained).
settings.register_profile(
    "mutant",
    max_examples=200,
    stateful_step_count=50,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    **_COMMON,
)


def load_profile() -> str:
    """Load the profile named by ``HYPOTHESIS_PROFILE`` (default ``ci``) and return its name."""
    name = os.environ.get("HYPOTHESIS_PROFILE", "ci")
    settings.load_profile(name)
    return name


@lru_cache(maxsize=8192)
def consume_steps(params: SpecParams, state: MirrorState) -> tuple[ConsumeStep, ...]:
    """Every Consume successor of a mirror state (memoised: the mirror enumerates all choices)."""
    return tuple(mirror.consume(params, state))


def pick_one(items: Sequence[Any], index: int) -> Any:
    return items[index % len(items)]


def mirror_slack(params: SpecParams, state: MirrorState, version: int) -> int:
    """How many fresh groups at ``version`` the mirror admits one after another."""
    slack = 0
    while (grown := mirror.reserve(params, state, f"slack-probe-{slack}", version)) is not None:
        state, slack = grown, slack + 1
    return slack


def mirror_counts(params: SpecParams, state: MirrorState) -> CounterState:
    running = [0] * (params.eta + 1)
    done = [0] * (params.eta + 1)
    for group_id, version, status in state.groups:
        offset = version + params.eta - state.version
        assert 0 <= offset <= params.eta, f"{group_id!r} (v{version}) is outside offsets 0..eta at {state.version}"
        (running if status == RUNNING else done)[offset] += 1
    return CounterState(state.version, tuple(running), tuple(done))


def assert_same_state(impl: StalenessManager, p: SpecParams, spec: MirrorState) -> None:
    """The refinement mapping: same groups (id, version, status), head buffer and counters."""
    impl_groups = {(g.group_id, g.version, g.status.value) for g in impl.groups()}
    assert impl_groups == set(spec.groups), f"groups differ: impl {impl_groups}, spec {set(spec.groups)}"
    assert len(impl) == len(spec.groups), f"len(impl) = {len(impl)}, spec has {len(spec.groups)}"
    assert impl.version == spec.version, f"impl version {impl.version}, spec {spec.version}"
    assert impl.counts() == mirror_counts(p, spec), f"counts {impl.counts()} != spec {mirror_counts(p, spec)}"
    for group_id, version, status in spec.groups:  # the per-group queries: group() and `in`
        record = impl.group(group_id)
        assert (record.group_id, record.version, record.status.value) == (group_id, version, status), (
            f"group({group_id!r}) = {record}, spec has v{version} {status}")
        assert group_id in impl, f"{group_id!r} in manager is False for an active group"


def assert_same_queries(impl: StalenessManager, p: SpecParams, spec: MirrorState) -> None:
    """Eager consume (``can_consume``) and exact admission (``reserve_slack``, ``can_reserve``,
    ``oldest_admissible_version``) agree with the mirror's enabledness."""
    enabled = bool(consume_steps(p, spec))
    assert impl.can_consume() == enabled, f"can_consume() is {not enabled}, spec Consume enabled: {enabled}"
    admissible = []
    for version in range(max(0, spec.version - p.eta - 1), spec.version + 1):
        slack = mirror_slack(p, spec, version)
        got = impl.reserve_slack(version)
        assert got == slack, f"reserve_slack({version}) = {got}, spec admits {slack}"
        assert impl.can_reserve(version) == (slack > 0), f"can_reserve({version}) != {slack > 0}"
        if slack:
            admissible.append(version)
    oldest = impl.oldest_admissible_version()
    expected = min(admissible, default=None)
    assert oldest == expected, f"oldest_admissible_version() = {oldest}, spec {expected}"


def assert_consume_conforms(batch: ConsumedBatch, p: SpecParams, spec: MirrorState) -> ConsumeStep:
    """S1 and S2 for one batch, and the batch with its drops is a Consume successor of ``spec``."""
    assert batch.version == spec.version, f"batch tagged {batch.version}, head buffer is {spec.version}"
    assert len(batch.group_ids) == p.batch_size == len(set(batch.group_ids)), f"batch size: {batch}"
    for group_id, version in zip(batch.group_ids, batch.group_versions, strict=True):
        assert (group_id, version, DONE) in spec.groups, f"{group_id!r} (v{version}) was not done"
        assert version <= batch.version <= version + p.eta, f"S1 broken by {group_id!r}"
    assert len(batch.dropped) <= p.redundancy, f"{len(batch.dropped)} drops > X: {batch}"
    matches = [
        step
        for step in consume_steps(p, spec)
        if step.batch == frozenset(batch.group_ids) and step.dropped == frozenset(batch.dropped)
    ]
    assert matches, f"batch {batch} is not a Consume successor of the spec"
    return matches[0]


@dataclass
class Stats:
    """What a run explored, summed over its examples."""

    examples: int = 0
    states: int = 0
    max_version: int = 0
    consumes: int = 0
    drops: int = 0
    refusals: int = 0

    def describe(self) -> str:
        return (
            f"{self.examples} examples, {self.states} states checked, {self.consumes} consumes, "
            f"{self.drops} drops, {self.refusals} refusals, max version {self.max_version}"
        )


def conformance_machine(
    manager_cls: type[StalenessManager] = StalenessManager, stats: Stats | None = None
) -> type[RuleBasedStateMachine]:
    """The conformance state machine for ``manager_cls`` (the real manager or a mutant)."""

    class ProtocolConformance(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.events: list[ProtocolEvent] = []
            self.retired: list[Any] = []  # ids consumed, dropped or aborted
            self.next_id = 0
            self.states = 0
            self.consumes = 0
            self.drops = 0
            self.refusals = 0

        # ------------------------------------------------------------ helpers
        def fresh_id(self) -> Any:
            self.next_id += 1
            return self.next_id if self.next_id % 2 else f"g{self.next_id}"

        def ids(self, status: str | None = None) -> list[Any]:
            return sorted(
                (g for g, _, s in self.spec.groups if status is None or s == status), key=repr
            )

        def expect_event(self, op: str, group_id: Any, before: CounterState) -> ProtocolEvent:
            assert len(self.events) == self.seen + 1, f"{op} emitted {len(self.events) - self.seen} events"
            self.seen += 1
            last = self.events[-1]
            assert last.op == op and last.group_id == group_id, last
            assert last.before == before and last.after == self.impl.counts(), last
            return last

        def expect_error(self, error: type[Exception], operation: Any, *args: Any) -> None:
            before = self.impl.counts()
            try:
                operation(*args)
            except error:
                pass
            else:
                raise AssertionError(f"{operation.__name__}{args} did not raise {error.__name__}")
            assert len(self.events) == self.seen, "a rejected call emitted an event"
            assert self.impl.counts() == before

        # ------------------------------------------------------------ rules
        @initialize(
            eta=st.integers(0, MAX_ETA),
            batch_size=st.integers(1, MAX_BATCH_SIZE),
            redundancy=st.integers(0, MAX_REDUNDANCY),
        )
        def setup(self, eta: int, batch_size: int, redundancy: int) -> None:
            self.params = SpecParams(eta, batch_size, redundancy)
            self.impl = manager_cls(eta, batch_size, redundancy, on_event=self.events.append)
            self.spec = mirror.init()
            self.seen = 0
            event(f"eta={eta} B={batch_size} X={redundancy}")

        def reserve_one(self, version: int) -> Any:
            """Reserve a fresh group at ``version`` in both; the id if admitted, else None."""
            group_id = self.fresh_id()
            before = self.impl.counts()
            if not 0 <= version <= self.spec.version:
                self.expect_error(InvalidVersionError, self.impl.reserve, group_id, version)
                return None
            successor = mirror.reserve(self.params, self.spec, group_id, version)
            accepted = self.impl.reserve(group_id, version)
            assert accepted == (successor is not None), (
                f"reserve({group_id!r}, {version}) returned {accepted}, spec enabled: {successor is not None}"
            )
            last = self.expect_event("reserve", group_id, before)
            assert last.accepted == accepted and last.version == version
            if successor is None:
                self.refusals += 1
                assert last.before == last.after
                return None
            self.spec = successor
            return group_id

        def occupy_one(self, group_id: Any) -> None:
            before = self.impl.counts()
            self.impl.occupy(group_id)
            self.expect_event("occupy", group_id, before)
            successor = mirror.occupy(self.params, self.spec, group_id)
            assert successor is not None
            self.spec = successor

        @precondition(lambda self: any(s == RUNNING for _, _, s in self.spec.groups))
        @rule(pick=PICK)
        def occupy(self, pick: int) -> None:
            self.occupy_one(pick_one(self.ids(RUNNING), pick))

        @rule(lag=st.integers(-1, MAX_ETA + 2), count=st.integers(1, MAX_BURST), finish=st.integers(0, 2**MAX_BURST - 1))
        def reserve(self, lag: int, count: int, finish: int) -> None:
            """1 to cap(eta) + 1 = (eta + 1) B + X + 1 reserves at one version; admitted group ``n`` is occupied at once if bit
            ``n`` of ``finish`` is set. The version is ``lag`` behind the trainer: one ahead (invalid),
            up to two past every deadline (refused) or, folded into ``0..eta``, a valid one. Every call
            is checked as a single call; bursts make runs reach full buffers, Consume, drops and mixed
            versions more often."""
            p = self.params
            if lag > p.eta + 2:
                lag %= p.eta + 1
            version = self.spec.version - lag
            for n in range(min(count, (p.eta + 1) * p.batch_size + p.redundancy + 1)):
                group_id = self.reserve_one(version)
                if group_id is None:
                    break
                self.same_state()
                if finish >> n & 1:
                    self.occupy_one(group_id)
                    self.same_state()

        @precondition(lambda self: bool(self.spec.groups))
        @rule(pick=PICK)
        def abort(self, pick: int) -> None:
            group_id = pick_one(self.ids(), pick)
            before = self.impl.counts()
            self.impl.abort(group_id)
            self.expect_event("abort", group_id, before)
            successor = mirror.abort(self.params, self.spec, group_id)
            assert successor is not None
            self.spec = successor
            self.retired.append(group_id)

        @rule(kind=st.sampled_from(INVALID_CALLS), pick=PICK)
        def invalid_call(self, kind: str, pick: int) -> None:
            """A call the spec does not allow: it must raise its documented error and change nothing."""
            if kind == "reserve-duplicate" and self.spec.groups:
                group_id = pick_one(self.ids(), pick)
                self.expect_error(DuplicateGroupError, self.impl.reserve, group_id, self.spec.version)
            elif kind == "occupy-done" and self.ids(DONE):
                self.expect_error(InvalidTransitionError, self.impl.occupy, pick_one(self.ids(DONE), pick))
            elif kind in ("occupy-inactive", "abort-inactive"):
                group_id = pick_one([*self.retired, "never-reserved"], pick)
                operation = self.impl.occupy if kind == "occupy-inactive" else self.impl.abort
                self.expect_error(UnknownGroupError, operation, group_id)
            elif kind == "consume-not-ready" and not consume_steps(self.params, self.spec):
                self.expect_error(ConsumeNotReadyError, self.impl.consume)

        @precondition(lambda self: bool(consume_steps(self.params, self.spec)))
        @rule()
        def consume(self) -> None:
            before = self.impl.counts()
            batch = self.impl.consume()
            last = self.expect_event("consume", None, before)
            assert last.batch == batch
            self.spec = assert_consume_conforms(batch, self.params, self.spec).state
            self.retired += [*batch.group_ids, *batch.dropped]
            self.consumes += 1
            self.drops += len(batch.dropped)
            event(f"reached version {self.spec.version}")
            if batch.dropped:
                event("consume with drops")

        @rule()
        def snapshot_restore(self) -> None:
            data = json.loads(json.dumps(self.impl.snapshot()))
            restored = manager_cls.restore(data, on_event=self.events.append)
            assert restored.snapshot() == data, f"restore(snapshot()).snapshot() differs: {data}"
            assert restored.counts() == self.impl.counts(), "restored counters differ"
            assert list(restored.groups()) == list(self.impl.groups()), "restored groups differ"
            self.impl = restored

        # ------------------------------------------------------------ invariants
        @invariant()
        def same_state(self) -> None:
            self.states += 1
            assert mirror.invariant(self.params, self.spec)
            assert_same_state(self.impl, self.params, self.spec)

        @invariant()
        def same_queries(self) -> None:
            assert_same_queries(self.impl, self.params, self.spec)

        def teardown(self) -> None:
            if not hasattr(self, "params"):
                return
            event(f"consumes: {min(self.consumes, 5)}{'+' if self.consumes >= 5 else ''}")
            target(float(self.spec.version), label="version reached")
            if stats is not None:
                stats.examples += 1
                stats.states += self.states
                stats.max_version = max(stats.max_version, self.spec.version)
                stats.consumes += self.consumes
                stats.drops += self.drops
                stats.refusals += self.refusals

    return ProtocolConformance


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
    rng = random.Random(seed)
    checked = 0
    for eta, batch_size, redundancy in grid:
        p = SpecParams(eta, batch_size, redundancy)
        for running, done in inv_counter_states(p):
            for c in heads(eta):
                snapshot = snapshot_of(p, c, running, done, rng)
                if snapshot is None:
                    continue
                spec = MirrorState(c, frozenset(tuple(g) for g in snapshot["groups"]))
                where = f"eta={eta} B={batch_size} X={redundancy} c={c} running={running} done={done}"
                try:
                    _check_every_action(manager_cls, snapshot, p, spec)
                except AssertionError as error:
                    raise AssertionError(f"{where}: {error}") from None
                if coverage is not None:
                    coverage.add(p, spec)
                checked += 1
    return checked


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


def run_conformance(
    manager_cls: type[StalenessManager] = StalenessManager, profile: str = "ci", quiet: bool = True
) -> Stats:
    """Run the machine under a profile and return what it explored; raises the first failure.
    Hypothesis prints the failing steps (and a ``@reproduce_failure`` blob) unless ``quiet``."""
    stats = Stats()
    with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
        run_state_machine_as_test(
            conformance_machine(manager_cls, stats), settings=settings.get_profile(profile)
        )
    return stats


def checks(quick: bool) -> list[CheckResult]:
    """The conformance rows of ``staleflow verify``: the exhaustive small-scope check, and the
    Hypothesis machine under the profile named by ``HYPOTHESIS_PROFILE`` (``ci`` by default, for
    the quick and the full run alike; ``verify --nightly`` sets ``nightly``)."""
    return [*_exhaustive_rows(quick), _hypothesis_row(os.environ.get("HYPOTHESIS_PROFILE", "ci"))]


def _grid_bounds(grid: Sequence[tuple[int, int, int]]) -> str:
    etas = sorted({eta for eta, _, _ in grid})
    return (f"{len(grid)} (eta, B, X) points: eta {etas[0]}..{etas[-1]}, B <= {max(b for _, b, _ in grid)}, "
            f"X <= {max(x for _, _, x in grid)}; head buffer 0..eta+1; shuffled arrival order")


def _exhaustive_rows(quick: bool) -> list[CheckResult]:
    grid = EXHAUSTIVE_GRID if quick else EXHAUSTIVE_GRID_FULL
    coverage = Coverage()
    started = time.perf_counter()
    try:
        explored = f"{exhaustive_conformance(StalenessManager, grid, coverage):,} states"
        result, detail = "pass", ""
    except Exception as error:  # noqa: BLE001 - a counterexample or a crash is a failed check
        explored, result, detail = "stopped at the first counterexample", "fail", _first_line(error)
    seconds = round(time.perf_counter() - started, 3)
    rows = [CheckResult(
        name="conformance-exhaustive",
        property="impl = spec mirror on every Inv state: queries and every action's successor",
        method="enumeration of all Inv counter states, manager restored into each",
        bounds=_grid_bounds(grid),
        explored=explored,
        result=result,
        seconds=seconds,
        detail=detail,
    )]
    missing = coverage.missing()
    covered = result == "pass" and not missing and len(coverage.seen) == len(grid)
    rows.append(CheckResult(
        name="coverage-refusals",
        property="per (eta, B, X): every conjunct of Inv (Reserve) and of the Consume guard that can "
                 "bind was the only reason for some refusal",
        method="spec/mirror.py refusal reasons on the states of conformance-exhaustive",
        bounds=_grid_bounds(grid),
        explored=coverage.describe(),
        result="pass" if covered else "fail",
        seconds=0.0,
        detail=("every expected conjunct seen alone in every config; never alone by construction: "
                "next-deadline, next-cap(eta-1), next-cap(eta)") if covered else
               "; ".join(f"eta={p.eta} B={p.batch_size} X={p.redundancy}: never alone {r}" for p, r in missing.items())[:500]
               or "the exhaustive check failed",
    ))
    return rows


def _hypothesis_row(profile: str) -> CheckResult:
    chosen = settings.get_profile(profile)
    started = time.perf_counter()
    try:
        stats = run_conformance(profile=profile)
        result, explored, detail = "pass", stats.describe(), ""
    except Exception as error:  # noqa: BLE001 - any failure of the machine is a failed check, reported as such
        result, explored, detail = "fail", "stopped at the first counterexample", _first_line(error)
    return CheckResult(
        name="conformance",
        property="impl = spec mirror: state, exact admission, eager consume, S1, errors, events",
        method=f"Hypothesis RuleBasedStateMachine, profile {profile}",
        bounds=(
            f"eta 0..{MAX_ETA}, B 1..{MAX_BATCH_SIZE}, X 0..{MAX_REDUNDANCY}, "
            f"{chosen.max_examples} examples x <= {chosen.stateful_step_count} steps"
        ),
        explored=explored,
        result=result,
        seconds=round(time.perf_counter() - started, 3),
        detail=detail,
    )


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]

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
import time
from collections.abc import Sequence
from dataclasses import dataclass
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
from staleflow.spec.mirror import DONE, RUNNING, SpecParams
from staleflow.verification.checks import CheckResult
from staleflow.verification.proofs.conformance_compare import (
    assert_consume_conforms,
    assert_same_queries,
    assert_same_state,
    consume_steps,
)
from staleflow.verification.proofs.conformance_grid import (
    EXHAUSTIVE_GRID,
    EXHAUSTIVE_GRID_FULL,
    Coverage,
    exhaustive_conformance,
)

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




def pick_one(items: Sequence[Any], index: int) -> Any:
    return items[index % len(items)]












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
            # seq numbers the events of one manager object (since its construction or restore) from 0
            assert last.seq == self.seen - 1 - self.impl_start, f"event seq {last.seq}, expected {self.seen - 1 - self.impl_start}"
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
            self.impl_start = 0
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
            self.impl_start = self.seen

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

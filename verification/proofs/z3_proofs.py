"""Z3 proofs of the staleness protocol on its counter abstraction, for every ``eta`` up to a bound.

The protocol state is exactly ``CounterState``: the head buffer ``c`` and, for each deadline offset
``i`` in ``0..eta``, the number of running and done groups whose deadline is ``c + i``. Group
identities never enter a decision of :class:`~staleflow.protocol.StalenessManager`, so a proof over
unbounded integer counts covers any number of groups. ``batch_size`` (B >= 1) and ``redundancy``
(X >= 0) stay symbolic; ``eta`` is concrete (one set of queries per ``eta``).

The actions below are written once, generically over numbers: evaluated on Python ints they are an
executable model that the tests compare with the implementation on concrete states
(``tests/test_z3_proofs.py``); evaluated on Z3 terms they are what is proved. They follow
``protocol/manager.py`` line by line: ``reserve_slack`` is its ``reserve_slack`` (a running minimum
over the offsets at or after the group's), and ``consume_plan`` is its ``_consume_plan`` (take
``min(need, done)`` per offset, earliest deadline first, then the drop and prefix guards).

Each obligation is "premises => conclusion", proved by ``unsat`` of ``premises and not conclusion``
(a conjunction may be split into one query per conjunct), with a non-vacuity check (``premises`` is
``sat``). ``unknown`` is a failure.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import z3
from staleflow.verification.checks import CheckResult

Num: TypeAlias = "int | z3.ArithRef"
Cond: TypeAlias = "bool | z3.BoolRef"

#: Per-query solver timeout; a query that hits it answers ``unknown``, which is a failure.
QUERY_TIMEOUT_MS = 20_000
FULL_MAX_ETA = 16
QUICK_MAX_ETA = 6


# --------------------------------------------------------------------------- generic arithmetic
def _symbolic(*values: object) -> bool:
    return any(isinstance(v, z3.ExprRef) for v in values)


def ite(cond: Cond, then: Num, other: Num) -> Num:
    return z3.If(cond, then, other) if _symbolic(cond, then, other) else (then if cond else other)


def minimum(a: Num, b: Num) -> Num:
    return ite(a <= b, a, b)


def maximum(a: Num, b: Num) -> Num:
    return ite(a >= b, a, b)


def all_of(conds: Sequence[Cond]) -> Cond:
    return z3.And(*conds) if _symbolic(*conds) else all(conds)


def any_of(conds: Sequence[Cond]) -> Cond:
    return z3.Or(*conds) if _symbolic(*conds) else any(conds)


def implies(a: Cond, b: Cond) -> Cond:
    return z3.Implies(a, b) if _symbolic(a, b) else (not a) or bool(b)


def total(values: Sequence[Num]) -> Num:
    result: Num = 0
    for v in values:
        result = result + v
    return result


# --------------------------------------------------------------------------- the counter model
@dataclass(frozen=True)
class Params:
    """``eta`` concrete; ``batch_size`` and ``redundancy`` ints or Z3 terms."""

    eta: int
    batch_size: Num
    redundancy: Num

    def cap(self, k: int) -> Num:
        """How many groups may have a deadline offset ``<= k`` (the manager's ``capacity(k)``)."""
        return (k + 1) * self.batch_size + self.redundancy

    def buffer_capacity(self, k: int) -> Num:
        """The head buffer takes ``B + X`` groups (X of them are dropped), every later one ``B``."""
        return self.batch_size + self.redundancy if k == 0 else self.batch_size

    def valid(self) -> Cond:
        return all_of([self.batch_size >= 1, self.redundancy >= 0])


@dataclass(frozen=True)
class Counters:
    """Running and done counts per deadline offset ``0..eta`` (``CounterState`` without ``c``)."""

    running: tuple[Num, ...]
    done: tuple[Num, ...]

    def size(self, i: int) -> Num:
        return self.running[i] + self.done[i]

    def prefix(self, k: int) -> Num:
        """Groups with a deadline offset ``<= k``."""
        return total([self.size(i) for i in range(k + 1)])

    def active(self) -> Num:
        return self.prefix(len(self.running) - 1)


def symbolic_counters(eta: int, tag: str) -> Counters:
    return Counters(
        tuple(z3.Int(f"{tag}_run{i}") for i in range(eta + 1)),
        tuple(z3.Int(f"{tag}_done{i}") for i in range(eta + 1)),
    )


def init(p: Params) -> Counters:
    return Counters((0,) * (p.eta + 1), (0,) * (p.eta + 1))


def invariant(p: Params, s: Counters) -> Cond:
    """Inv: counts are non-negative and for each k at most ``cap(k)`` groups are due by ``c + k``.

    "No group is past its deadline" is structural: a state has no slot for a negative offset.
    """
    return all_of(
        [n >= 0 for n in s.running + s.done] + [s.prefix(k) <= p.cap(k) for k in range(p.eta + 1)]
    )


def reserve_slack(p: Params, s: Counters, offset: Num) -> Num:
    """The manager's ``_slack_at(offset)``: the least ``cap(k) - prefix(k)`` over ``k >= offset``,
    kept as a running minimum as the code does; 0 for a negative offset (deadline passed)."""
    slack = p.cap(p.eta)
    prefix: Num = 0
    capacity = p.redundancy
    for k in range(p.eta + 1):
        prefix = prefix + s.size(k)
        capacity = capacity + p.batch_size
        slack = ite(all_of([k >= offset, capacity - prefix < slack]), capacity - prefix, slack)
    return ite(offset < 0, 0, slack)


def _with(values: tuple[Num, ...], offset: Num, delta: Num) -> tuple[Num, ...]:
    return tuple(v + ite(i == offset, delta, 0) for i, v in enumerate(values))


def reserve(s: Counters, offset: Num, count: Num = 1) -> Counters:
    """``count`` new running groups at deadline offset ``offset``."""
    return Counters(_with(s.running, offset, count), s.done)


def occupy(s: Counters, offset: Num) -> Counters:
    return Counters(_with(s.running, offset, -1), _with(s.done, offset, 1))


def abort_running(s: Counters, offset: Num) -> Counters:
    return Counters(_with(s.running, offset, -1), s.done)


def abort_done(s: Counters, offset: Num) -> Counters:
    return Counters(s.running, _with(s.done, offset, -1))


def finish_all(s: Counters) -> Counters:
    """Every running group occupied."""
    zero: tuple[Num, ...] = tuple(0 for _ in s.running)
    return Counters(zero, tuple(r + d for r, d in zip(s.running, s.done)))


def consume_guard(p: Params, s: Counters, take: Sequence[Num]) -> Cond:
    """The Consume guard for a choice of ``take[i]`` done groups per offset (``sum == B``):
    at most X groups due at the head are left (dropped), and Inv holds at ``c + 1``."""
    eta = p.eta
    remaining = [s.size(i) - take[i] for i in range(eta + 1)]
    return all_of(
        [total(take) == p.batch_size, remaining[0] <= p.redundancy]
        + [total(remaining[1 : k + 1]) <= p.cap(k - 1) for k in range(1, eta + 1)]
    )


def consume_plan(p: Params, s: Counters) -> tuple[tuple[Num, ...], Cond]:
    """The manager's ``_consume_plan``: done groups taken per offset, earliest deadline first, and
    whether Consume is enabled with that plan."""
    need: Num = p.batch_size
    plan: list[Num] = []
    for i in range(p.eta + 1):
        take = minimum(need, s.done[i])
        plan.append(take)
        need = need - take
    eta = p.eta
    prefix: Num = 0
    guards: list[Cond] = [need == 0, s.size(0) - plan[0] <= p.redundancy]
    for k in range(1, eta + 1):
        prefix = prefix + s.size(k) - plan[k]
        guards.append(prefix <= p.cap(k - 1))
    return tuple(plan), all_of(guards)


def consume(p: Params, s: Counters, plan: Sequence[Num]) -> tuple[Counters, Num]:
    """Take ``plan``, drop what is left at the head, shift every offset down by one.
    Returns the new counters and the number of dropped groups."""
    eta = p.eta
    running = tuple(s.running[i + 1] for i in range(eta)) + (0,)
    done = tuple(s.done[i + 1] - plan[i + 1] for i in range(eta)) + (0,)
    return Counters(running, done), s.size(0) - plan[0]


def buffer_start(p: Params, k: int) -> Num:
    """The first EDF position of buffer ``k``: 0 for the head (which holds ``B + X``), else ``k*B + X``."""
    return 0 if k == 0 else k * p.batch_size + p.redundancy


def filled(p: Params, k: int, n: Num) -> Num:
    """How many of the first ``n`` EDF positions fall in buffer ``k``."""
    return minimum(maximum(n, buffer_start(p, k)), buffer_start(p, k + 1)) - buffer_start(p, k)


def edf_placement(p: Params, s: Counters) -> dict[tuple[int, int], Num]:
    """The earliest-deadline-first placement: ``a[i, k]`` groups of offset ``i`` in buffer ``c + k``.

    Groups sorted by deadline fill positions ``0, 1, ...``; buffer ``k`` holds positions
    ``[buffer_start(k), buffer_start(k + 1))`` and offset ``i`` the positions
    ``[prefix(i-1), prefix(i))``, so ``a[i, k]`` is the size of the overlap. This is the manager's
    ``buffers()`` view.
    """
    return {
        (i, k): filled(p, k, s.prefix(i)) - filled(p, k, s.prefix(i - 1) if i else 0)
        for i in range(p.eta + 1)
        for k in range(p.eta + 1)
    }


def placement_conditions(p: Params, s: Counters, a: dict[tuple[int, int], Num]) -> list[Cond]:
    """What makes ``a`` a placement: every active group is in one buffer between the head and its
    deadline, and no buffer holds more than its capacity. (Separate conditions, so that a proof of
    a concrete placement can be split into small queries.)"""
    eta = p.eta
    offsets = range(eta + 1)
    return (
        [all_of([a[i, k] >= 0 for k in offsets]) for i in offsets]
        + [all_of([a[i, k] == 0 for k in range(i + 1, eta + 1)]) for i in range(eta)]
        + [total([a[i, k] for k in range(eta + 1)]) == s.size(i) for i in range(eta + 1)]
        + [total([a[i, k] for i in range(eta + 1)]) <= p.buffer_capacity(k) for k in range(eta + 1)]
    )


def is_placement(p: Params, s: Counters, a: dict[tuple[int, int], Num]) -> Cond:
    return all_of(placement_conditions(p, s, a))


def symbolic_placement(eta: int, tag: str) -> dict[tuple[int, int], Num]:
    """A free assignment: ``a[i, k]`` for ``k <= i`` (a group is never placed after its deadline)."""
    return {
        (i, k): z3.Int(f"{tag}_a{i}_{k}") if k <= i else 0
        for i in range(eta + 1)
        for k in range(eta + 1)
    }


# --------------------------------------------------------------------------- the queries
@dataclass(frozen=True)
class Query:
    """``premises => every conclusion`` for one ``eta``; ``row`` names the check it counts towards.
    Each conclusion is its own unsat query (a large conjunction split into small queries)."""

    row: str
    premises: tuple[Cond, ...]
    conclusions: tuple[Cond, ...]


def _query(row: str, premises: tuple[Cond, ...], *conclusions: Cond) -> Query:
    return Query(row, premises, conclusions)


@dataclass(frozen=True)
class Row:
    name: str
    property: str


ROWS: tuple[Row, ...] = (
    Row("init", "Init => Inv"),
    Row("reserve", "Inv inductive: Reserve at any deadline offset"),
    Row("occupy", "Inv inductive: Occupy"),
    Row("abort-running", "Inv inductive: Abort of a running group"),
    Row("abort-done", "Inv inductive: Abort of a done group"),
    Row("consume", "Inv inductive: Consume (EDF plan with drops)"),
    Row("s1-bound", "S1: every group in batch c (the head buffer) has version v with 0 <= v <= c <= v + eta; "
                    "only done groups"),
    Row("s2-accounting", "S2 (counts): batch of exactly B; drops = head leftovers, <= X, 0 when X = 0; "
                         "active after = active before - B - drops (no group lost or made up)"),
    Row("l1-deadlock-free", "L1: Inv and >= B active => Consume enabled once all running finish"),
    Row("l1-ranking", "L1: V = #running drops by Occupy; Consume or Occupy enabled with >= B active"),
    Row("l1-stable", "L1: Occupy never disables an enabled Consume"),
    Row("l1-progress", "L1 with Reserve: (cap(eta) - active, #running) >= 0 falls lexicographically at every "
                       "Reserve and Occupy; with no running group and Reserve refused at the newest version, "
                       "Consume is enabled"),
    Row("p1-refuse", "P1: slack+1 more groups at the offset admit no placement (refusals exact)"),
    Row("p1-admit", "P1: admitting slack more groups at the offset keeps Inv"),
    Row("placement", "P1/Hall: Inv => the EDF placement (buffers()) is a valid placement"),
    Row("p2-eager", "P2: any choice of B done groups meeting the guard => EDF plan enabled"),
    Row("p2-fewest-drops", "P2: the EDF plan drops no more than any valid choice"),
)


def queries(eta: int) -> list[Query]:
    """Every proof obligation for one ``eta``."""
    B, X = z3.Int("B"), z3.Int("X")
    p = Params(eta, B, X)
    s = symbolic_counters(eta, "s")
    j = z3.Int("j")
    c = z3.Int("c")  # the head buffer (absolute), for S1 stated with versions
    in_range = z3.And(0 <= j, j <= eta)
    base = (p.valid(), invariant(p, s))
    plan, enabled = consume_plan(p, s)
    after_consume, drops = consume(p, s, plan)
    slack = reserve_slack(p, s, j)
    out: list[Query] = [
        _query("init", (p.valid(),), invariant(p, init(p))),
        _query("reserve", (*base, in_range, slack > 0), invariant(p, reserve(s, j))),
        _query("occupy", (*base, in_range, _at(s.running, j) >= 1), invariant(p, occupy(s, j))),
        _query(
            "abort-running",
            (*base, in_range, _at(s.running, j) >= 1),
            invariant(p, abort_running(s, j)),
        ),
        _query("abort-done", (*base, in_range, _at(s.done, j) >= 1), invariant(p, abort_done(s, j))),
        _query("consume", (*base, enabled), invariant(p, after_consume)),
        _query(
            "s1-bound",
            # head buffer c; a state holds no group at an offset whose version c + i - eta is negative
            (*base, enabled, c >= 0, *[z3.Implies(c + i - eta < 0, s.size(i) == 0) for i in range(eta + 1)]),
            *[
                z3.And(
                    0 <= plan[i],
                    plan[i] <= s.done[i],
                    z3.Implies(plan[i] >= 1, z3.And(0 <= c + i - eta, c + i - eta <= c, c <= c + i - eta + eta)),
                )
                for i in range(eta + 1)
            ],
        ),
        _query(
            "s2-accounting",
            (*base, enabled),
            z3.And(
                total(plan) == B,
                drops == s.size(0) - plan[0],
                0 <= drops,
                drops <= X,
                z3.Implies(X == 0, drops == 0),
                after_consume.active() == s.active() - B - drops,
            ),
        ),
        _query(
            "l1-deadlock-free",
            (*base, s.active() >= B),
            consume_plan(p, finish_all(s))[1],
        ),
        _query(
            "l1-ranking",
            (*base, s.active() >= B),
            z3.Or(enabled, *[r >= 1 for r in s.running]),
        ),
        _query(
            "l1-ranking",
            (*base, in_range, _at(s.running, j) >= 1),
            z3.And(
                0 <= total(occupy(s, j).running),
                total(occupy(s, j).running) < total(s.running),
                occupy(s, j).active() == s.active(),
            ),
        ),
        _query(
            "l1-stable",
            (*base, enabled, in_range, _at(s.running, j) >= 1),
            consume_plan(p, occupy(s, j))[1],
        ),
        _query(
            "l1-progress",
            (*base, in_range, slack > 0),
            z3.And(
                p.cap(eta) - reserve(s, j).active() >= 0,
                p.cap(eta) - reserve(s, j).active() < p.cap(eta) - s.active(),
            ),
        ),
        _query(
            "l1-progress",
            (*base, in_range, _at(s.running, j) >= 1),
            z3.And(
                occupy(s, j).active() == s.active(),
                0 <= total(occupy(s, j).running),
                total(occupy(s, j).running) < total(s.running),
            ),
        ),
        _query(
            "l1-progress",
            (*base, *[r == 0 for r in s.running], reserve_slack(p, s, eta) <= 0),
            enabled,
        ),
        _query(
            "p1-refuse",
            (*base, in_range, slack >= 0),
            z3.Not(is_placement(p, reserve(s, j, slack + 1), symbolic_placement(eta, "a"))),
        ),
        _query("p1-admit", (*base, in_range), invariant(p, reserve(s, j, slack))),
    ]
    edf = edf_placement(p, s)
    out.append(_query("placement", base, *placement_conditions(p, s, edf)))
    take = tuple(z3.Int(f"t{i}") for i in range(eta + 1))
    choice = (
        *base,
        *[z3.And(0 <= take[i], take[i] <= s.done[i]) for i in range(eta + 1)],
        consume_guard(p, s, take),
    )
    out.append(_query("p2-eager", choice, enabled))
    out.append(_query("p2-fewest-drops", choice, drops <= s.size(0) - take[0]))
    return out


def _at(values: tuple[Num, ...], offset: z3.ArithRef) -> Num:
    """``values[offset]`` for a symbolic offset in range."""
    result: Num = values[-1]
    for i in range(len(values) - 2, -1, -1):
        result = z3.If(offset == i, values[i], result)
    return result


# --------------------------------------------------------------------------- running them
@dataclass
class Outcome:
    row: str
    eta: int
    proved: str  # "unsat" for every conclusion is proved; else the first other answer
    premises: str  # "sat" is non-vacuous
    seconds: float
    counterexample: str = ""
    queries: int = 0

    @property
    def ok(self) -> bool:
        return self.proved == "unsat" and self.premises == "sat"


def _check(assertions: Sequence[Cond]) -> tuple[str, z3.ModelRef | None]:
    solver = z3.Solver()
    solver.set("timeout", QUERY_TIMEOUT_MS)
    solver.add(*assertions)
    answer = solver.check()
    return str(answer), solver.model() if answer == z3.sat else None


def prove(query: Query, eta: int) -> Outcome:
    """Every conclusion (unsat of its negation under the premises), then non-vacuity."""
    started = time.perf_counter()
    proved, counterexample = "unsat", ""
    for conclusion in query.conclusions:
        answer, model = _check([*query.premises, z3.Not(conclusion)])
        if answer != "unsat":
            proved = answer
            if model is not None:
                counterexample = ", ".join(
                    f"{d.name()}={model[d]}" for d in sorted(model.decls(), key=lambda d: d.name())
                )
            break
    premises, _ = _check(list(query.premises))
    return Outcome(
        query.row, eta, proved, premises, time.perf_counter() - started, counterexample,
        queries=len(query.conclusions) + 1,
    )


def run_all(max_eta: int, on_outcome: Callable[[Outcome], None] | None = None) -> list[Outcome]:
    outcomes = []
    for eta in range(max_eta + 1):
        for query in queries(eta):
            outcome = prove(query, eta)
            outcomes.append(outcome)
            if on_outcome is not None:
                on_outcome(outcome)
    return outcomes


def checks(quick: bool) -> list[CheckResult]:
    """One row per property, each over every ``eta`` in ``0..max_eta``."""
    max_eta = QUICK_MAX_ETA if quick else FULL_MAX_ETA
    outcomes = run_all(max_eta)
    results = []
    for row in ROWS:
        mine = [o for o in outcomes if o.row == row.name]
        failures = [o for o in mine if not o.ok]
        detail = "; ".join(
            f"eta={o.eta}: negation {o.proved}, premises {o.premises}"
            + (f" (counterexample {o.counterexample})" if o.counterexample else "")
            for o in failures[:3]
        )
        results.append(
            CheckResult(
                name=f"z3 {row.name}",
                property=row.property,
                method="Z3 unsat of the negation on counters + non-vacuity sat",
                bounds=f"eta 0..{max_eta}; B >= 1, X >= 0 and all counts unbounded",
                explored=f"{len(mine)} obligations, {sum(o.queries for o in mine)} queries",
                result="fail" if failures or not mine else "pass",
                seconds=round(sum(o.seconds for o in mine), 3),
                detail=detail,
            )
        )
    return results

"""Inv is inductive for every ``eta``: Z3 proofs by induction over prefix sums.

``z3_proofs.py`` proves every obligation for each ``eta`` up to a bound (one query set per
``eta``). Here ``eta`` is a symbolic integer: the per-offset counts ``R(i)`` (running), ``D(i)``
(done) and every running quantity of the manager's loops are uninterpreted functions of the offset,
tied together by their one-step definitions, which is how the code computes them:

- ``P(i) = P(i-1) + R(i) + D(i)``: the prefix count of groups due by ``c + i`` (``_slack_at``,
  ``_check_invariant``);
- ``SL(i)``: ``_slack_at``'s running minimum, ``SL(-1) = cap(eta)``, ``SL(i) = cap(i) - P(i)`` if
  ``i >= offset`` and that is smaller, else ``SL(i-1)``; Reserve is admitted iff ``SL(eta) > 0``;
- ``N(0) = B``, ``T(i) = min(N(i), D(i))``, ``N(i+1) = N(i) - T(i)``: ``_consume_plan``'s take per
  offset; ``Q(0) = 0``, ``Q(k) = Q(k-1) + R(k) + D(k) - T(k)``: its prefix of remaining groups,
  guarded by ``Q(k) <= cap(k-1)`` for ``k`` in ``1..eta``, ``N(eta+1) = 0`` and
  ``R(0) + D(0) - T(0) <= X``.

Each lemma about these sequences (for example "after Reserve at ``j``, ``P'(k) = P(k) + [k >= j]``")
is proved by induction on the offset: a **base** query and a **step** query (the lemma at ``k - 1``
and the definitions at ``k`` imply the lemma at ``k``, for a symbolic ``k`` in range), each
quantifier-free and checked by ``unsat`` of its negation. The induction principle over the
integers is the meta-argument (applied by hand, as in any inductive proof). The **main** query of
an action then takes Inv and the lemmas at one symbolic offset ``k`` (sound: they hold at every
offset) and shows Inv's conjunct at ``k`` after the action, so Inv holds at every ``k`` for every
``eta``, ``B >= 1``, ``X >= 0`` and all counts.

Proved for all ``eta``: Init, Reserve (with the code's running-minimum slack), Occupy, Abort of a
running or a done group, Consume (with the code's earliest-deadline plan and its guards), and S2's
"exactly B groups, at most X drops" for the plan. Not here (bounded in ``z3_proofs.py``, eta <= 16):
L1, P1 and P2, which quantify over placements or choices.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import z3
from staleflow.verification.checks import CheckResult

Z = z3.IntSort()


@dataclass(frozen=True)
class Step:
    name: str  # e.g. "reserve: lemma P' = P + [k >= j] (step)"
    premises: tuple[z3.BoolRef, ...]
    conclusion: z3.BoolRef


eta, B, X, j, k, i = z3.Ints("eta B X j k i")
R, D, P, SL = (z3.Function(n, Z, Z) for n in ("R", "D", "P", "SL"))
R2, D2, P2 = (z3.Function(n, Z, Z) for n in ("R2", "D2", "P2"))
N, T, Q = (z3.Function(n, Z, Z) for n in ("N", "T", "Q"))
PARAMS = (eta >= 0, B >= 1, X >= 0)


def cap(n: z3.ArithRef) -> z3.ArithRef:
    return (n + 1) * B + X


def in_range(n: z3.ArithRef, lo: z3.ArithRef | int, hi: z3.ArithRef | int) -> z3.BoolRef:
    return z3.And(lo <= n, n <= hi)


def def_p(n: z3.ArithRef) -> z3.BoolRef:
    return P(n) == P(n - 1) + R(n) + D(n)


def def_p2(n: z3.ArithRef) -> z3.BoolRef:
    return P2(n) == P2(n - 1) + R2(n) + D2(n)


def inv_at(n: z3.ArithRef) -> z3.BoolRef:
    """Inv's conjuncts at offset ``n`` (it holds at every offset in 0..eta)."""
    return z3.And(R(n) >= 0, D(n) >= 0, P(n) <= cap(n))


def inv2_at(n: z3.ArithRef) -> z3.BoolRef:
    return z3.And(R2(n) >= 0, D2(n) >= 0, P2(n) <= cap(n))


def induction(name: str, lo: z3.ArithRef | int, hi: z3.ArithRef | int, lemma: Callable[[z3.ArithRef], z3.BoolRef],
              defs: Callable[[z3.ArithRef], Sequence[z3.BoolRef]], context: Sequence[z3.BoolRef]) -> list[Step]:
    """``lemma(n)`` for every ``n`` in ``lo..hi``: base at ``lo``, step ``lo < n <= hi``."""
    base = Step(f"{name} (base)", (*PARAMS, *context, *defs(z3.IntVal(0) + lo)), lemma(z3.IntVal(0) + lo))
    step = Step(f"{name} (step)", (*PARAMS, *context, lo < k, k <= hi, lemma(k - 1), *defs(k)), lemma(k))
    return [base, step]


def reserve_steps() -> list[Step]:
    """Reserve of a running group at offset ``j`` when ``_slack_at(j) = SL(eta) > 0``."""
    ctx = (in_range(j, 0, eta), SL(-1) == cap(eta), P(-1) == 0, P2(-1) == 0)

    def defs(n: z3.ArithRef) -> list[z3.BoolRef]:
        return [def_p(n), def_p2(n), R2(n) == R(n) + z3.If(n == j, 1, 0), D2(n) == D(n),
                SL(n) == z3.If(z3.And(n >= j, cap(n) - P(n) < SL(n - 1)), cap(n) - P(n), SL(n - 1))]

    steps = induction("reserve: P'(n) = P(n) + [n >= j]", -1, eta,
                      lambda n: P2(n) == P(n) + z3.If(n >= j, 1, 0), defs, ctx)
    # SL is non-increasing: SL(n) <= SL(i) for i <= n (induction on n, i fixed)
    steps += induction("reserve: SL(n) <= SL(i) for i <= n", i, eta, lambda n: SL(n) <= SL(i), defs,
                       (*ctx, in_range(i, -1, eta)))
    steps.append(Step("reserve: SL(n) <= cap(n) - P(n) for n >= j",
                      (*PARAMS, *ctx, in_range(k, 0, eta), k >= j, *defs(k)), SL(k) <= cap(k) - P(k)))
    steps.append(Step(
        "reserve: Inv after, at any offset k",
        (*PARAMS, *ctx, SL(eta) > 0, in_range(k, 0, eta), inv_at(k), *defs(k),
         P2(k) == P(k) + z3.If(k >= j, 1, 0), SL(eta) <= SL(k), z3.Implies(k >= j, SL(k) <= cap(k) - P(k))),
        inv2_at(k)))
    return steps


def delta_steps(name: str, dr: z3.ArithRef | int, dd: z3.ArithRef | int, need: z3.BoolRef) -> list[Step]:
    """Occupy/abort at offset ``j``: running changes by ``dr``, done by ``dd`` at ``j`` only."""
    ctx = (in_range(j, 0, eta), P(-1) == 0, P2(-1) == 0, need)

    def defs(n: z3.ArithRef) -> list[z3.BoolRef]:
        return [def_p(n), def_p2(n), R2(n) == R(n) + z3.If(n == j, dr, 0), D2(n) == D(n) + z3.If(n == j, dd, 0)]

    delta = dr + dd
    steps = induction(f"{name}: P'(n) = P(n) + {delta}[n >= j]", -1, eta,
                      lambda n: P2(n) == P(n) + z3.If(n >= j, delta, 0), defs, ctx)
    steps.append(Step(f"{name}: Inv after, at any offset k",
                      (*PARAMS, *ctx, in_range(k, 0, eta), inv_at(k), inv_at(j), *defs(k),
                       P2(k) == P(k) + z3.If(k >= j, delta, 0)), inv2_at(k)))
    return steps


def consume_steps() -> list[Step]:
    """Consume with the manager's plan and guards; shift every offset down by one."""
    ctx = (N(0) == B, Q(0) == 0, P2(-1) == 0, R2(eta) == 0, D2(eta) == 0, N(eta + 1) == 0,
           R(0) + D(0) - T(0) <= X)

    def plan(n: z3.ArithRef) -> list[z3.BoolRef]:
        return [T(n) == z3.If(N(n) <= D(n), N(n), D(n)), N(n + 1) == N(n) - T(n)]

    def defs(n: z3.ArithRef) -> list[z3.BoolRef]:
        # n is an offset of the new state (0..eta-1 take from old offset n + 1)
        return [def_p2(n), R2(n) == R(n + 1), D2(n) == D(n + 1) - T(n + 1),
                Q(n + 1) == Q(n) + R(n + 1) + D(n + 1) - T(n + 1)]

    steps = induction("consume: N(n) >= 0", 0, eta + 1, lambda n: N(n) >= 0, lambda n: plan(n - 1), ctx)
    total = z3.Function("TakenBefore", Z, Z)  # sum of T(0..n-1)
    steps += induction("consume: T(0) + ... + T(n-1) = B - N(n) (a batch of exactly B at n = eta + 1)",
                       0, eta + 1, lambda n: total(n) == B - N(n),
                       lambda n: [*plan(n - 1), total(n) == total(n - 1) + T(n - 1), total(0) == 0], ctx)
    steps += induction("consume: P'(n) = Q(n + 1)", -1, eta - 1, lambda n: P2(n) == Q(n + 1), defs, ctx)
    # The code's last prefix guard (k = eta: Q(eta) <= cap(eta - 1)) never refuses: what remains after
    # taking B is at most cap(eta) - B. Q(n) = P(n) - P(0) - (T(1) + ... + T(n)) by induction, so
    # Q(eta) = P(eta) - B - drops. (This is why a mutant that skips that check is equivalent.)
    steps += induction("consume: Q(n) = P(n) - P(0) - (T(1) + ... + T(n))", 0, eta,
                       lambda n: Q(n) == P(n) - P(0) - (total(n + 1) - T(0)),
                       lambda n: [def_p(n), *defs(n - 1), total(n + 1) == total(n) + T(n), total(1) == T(0)],
                       (*ctx, P(-1) == 0, total(0) == 0))
    steps.append(Step(
        "consume: the last prefix guard Q(eta) <= cap(eta - 1) is implied (never refuses)",
        (*PARAMS, *ctx, eta >= 1, inv_at(eta), inv_at(0), *plan(0), N(0) >= 0, def_p(0), P(-1) == 0,
         total(eta + 1) == B - N(eta + 1), Q(eta) == P(eta) - P(0) - (total(eta + 1) - T(0))),
        Q(eta) <= cap(eta - 1)))
    guard = [in_range(k, 0, eta - 1), Q(k + 1) <= cap(k)]  # the prefix guard at k + 1 in 1..eta
    steps.append(Step(
        "consume: Inv after, at any offset k < eta",
        (*PARAMS, *ctx, *guard, inv_at(k + 1), *plan(k + 1), N(k + 1) >= 0, *defs(k), P2(k) == Q(k + 1)),
        inv2_at(k)))
    steps.append(Step(
        "consume: Inv after, at offset eta",
        (*PARAMS, *ctx, eta >= 1, Q(eta) <= cap(eta - 1), def_p2(eta), P2(eta - 1) == Q(eta)),
        inv2_at(eta)))
    steps.append(Step("consume: Inv after at eta = 0", (*PARAMS, *ctx, eta == 0, def_p2(eta)), inv2_at(eta)))
    steps.append(Step(
        "consume: drops = R(0) + D(0) - T(0) in 0..X (none when X = 0)",
        (*PARAMS, *ctx, inv_at(0), *plan(0), N(0) >= 0),
        z3.And(0 <= R(0) + D(0) - T(0), R(0) + D(0) - T(0) <= X, z3.Implies(X == 0, R(0) + D(0) == T(0)))))
    return steps


def init_steps() -> list[Step]:
    return [Step("init: Inv holds with no group", (*PARAMS, in_range(k, 0, eta), P(-1) == 0, R(k) == 0, D(k) == 0,
                                                    P(k - 1) == 0, def_p(k)), inv_at(k))]


ROWS: tuple[tuple[str, str, Callable[[], list[Step]]], ...] = (
    ("init", "Init => Inv", init_steps),
    ("reserve", "Inv inductive: Reserve with the code's running-minimum slack", reserve_steps),
    ("occupy", "Inv inductive: Occupy", lambda: delta_steps("occupy", -1, 1, R(j) >= 1)),
    ("abort-running", "Inv inductive: Abort of a running group", lambda: delta_steps("abort-running", -1, 0, R(j) >= 1)),
    ("abort-done", "Inv inductive: Abort of a done group", lambda: delta_steps("abort-done", 0, -1, D(j) >= 1)),
    ("consume", "Inv inductive: Consume with the code's EDF plan and guards; batch of B, drops <= X", consume_steps),
)


def prove(step: Step) -> tuple[str, str]:
    """(answer for the negated conclusion, answer for the premises alone): ("unsat", "sat") is proved."""
    answers = []
    for assertions in ((*step.premises, z3.Not(step.conclusion)), step.premises):
        solver = z3.Solver()
        solver.set("timeout", 20_000)
        solver.add(*assertions)
        answers.append(str(solver.check()))
    return answers[0], answers[1]


def checks(quick: bool) -> list[CheckResult]:
    results = []
    for name, prop, build in ROWS:
        started = time.perf_counter()
        steps = build()
        failures = []
        for step in steps:
            proved, premises = prove(step)
            if (proved, premises) != ("unsat", "sat"):
                failures.append(f"{step.name}: negation {proved}, premises {premises}")
        results.append(CheckResult(
            name=f"z3-all-eta {name}",
            property=prop + " (every eta)",
            method="Z3, induction over prefix sums: base + step queries per lemma, then the conjunct at a symbolic offset",
            bounds="eta, B >= 1, X >= 0 and all counts symbolic (unbounded)",
            explored=f"{len(steps)} queries (+ {len(steps)} non-vacuity)",
            result="fail" if failures else "pass",
            seconds=round(time.perf_counter() - started, 3),
            detail="; ".join(failures)[:500],
        ))
    return results

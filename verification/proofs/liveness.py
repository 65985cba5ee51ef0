"""L1 (trainer progress) for arbitrary interleavings, by TLC on the relative (lag) model.

The property, ``TrainerProgress`` in ``spec/MCLag.tla``::

    <>[][~AnyAbort]_vars => []<><<LagConsume>>_vars

checked on ``LagSpec == Init /\\ [][LagNext]_vars /\\ WF(Reserve) /\\ WF(Occupy) /\\ WF(Consume)``,
where each fairness conjunct is weak fairness on a disjunction over groups (and versions): "some
Reserve", "some Occupy", "the Consume". Every behaviour of the spec is explored (Reserve at any
version ``0..c``, Occupy, Abort and Consume interleaved in any order, no CONSTRAINT, no SYMMETRY),
so this is model checking of the temporal property itself, fairness included, at the bounds of
the configurations below; ``docs/verification.md`` ("L1") states what it covers and what not.

Non-vacuity: the ``tlc-liveness-mutant-*`` rows run TLC on variants of the spec at the quick
configuration, checking ``TrainerProgress`` alone (no invariant that could stop TLC first); each
variant must be refuted with a **liveness** violation (TLC exit 13): a Consume guard that is safe
but can block forever, each fairness conjunct dropped in turn, and the property without its
"aborts eventually stop" antecedent.
"""

from __future__ import annotations

import re
import time

from staleflow.verification.checks import CheckResult
from staleflow.verification.proofs.spec_mutants import MUTANTS as SPEC_MUTANTS
from staleflow.verification.proofs.spec_mutants import SB, SpecMutant
from staleflow.verification.proofs.tlc import SPEC_DIR, TlcUnavailableError, config_bounds, model_check, run_tlc

#: The checked-in liveness models (module, config); all on the lag model.
LIVENESS_FULL = ("MCLag", "liveness.cfg")
LIVENESS_QUICK = ("MCLag", "liveness_quick.cfg")
LIVENESS_X0 = ("MCLag", "liveness_x0.cfg")
LIVENESS_ETA3 = ("MCLag", "liveness_eta3.cfg")

FAIRNESS = "WF(some Reserve), WF(some Occupy), WF(Consume)"
PROPERTY = f"L1 trainer progress: <>[]no abort => []<>Consume under {FAIRNESS}; Inv, S1, S2, L1 on the relative model"

LAG = "MCLag.tla"
MUTANTS = (
    SpecMutant("consume-guard-keeps-batch", "Consume",
               "Consume checks Inv at c+1 with the batch still counted: safe, but it can block forever",
               ((SB, r"/\ InvAt(cc + 1, vv, ActiveIn(ss) \ (T \cup DroppedIn(cc, vv, ss, T)))",
                 r"/\ InvAt(cc + 1, vv, ActiveIn(ss) \ DroppedIn(cc, vv, ss, T))"),)),
    SpecMutant("no-producer-fairness", "fairness", "no producer fairness: nothing need ever be reserved",
               ((LAG, r"/\ ProducerFairness /\ RolloutFairness", r"/\ RolloutFairness"),)),
    next(m for m in SPEC_MUTANTS if m.name == "no-rollout-fairness"),  # the spec-mutant row's edit, here at Eta 2
    SpecMutant("no-consume-fairness", "fairness", "no fairness on Consume: the trainer need not consume",
               ((LAG, r"/\ WF_vars(LagConsume)", ""),)),
    SpecMutant("aborts-forever", "property", "the property without its antecedent (aborts may never stop)",
               ((LAG, r"TrainerProgress == <>[][~AnyAbort]_vars => []<><<LagConsume>>_vars",
                 r"TrainerProgress == []<><<LagConsume>>_vars"),)),
)
QUICK_MUTANTS = ("consume-guard-keeps-batch", "aborts-forever")


def check_mutant(mutant: SpecMutant) -> CheckResult:
    """TLC must refute ``TrainerProgress`` on the variant with a liveness violation (exit 13)."""
    module, cfg_name = LIVENESS_QUICK
    # the quick configuration with its INVARIANTS line removed: only TrainerProgress may stop TLC
    cfg = re.sub(r"^INVARIANTS .*\n", "", (SPEC_DIR / cfg_name).read_text(), flags=re.MULTILINE)
    started = time.perf_counter()
    try:
        run = run_tlc(module, cfg, overrides=mutant.apply())
        ok = run.returncode == 13
        detail = f"rc {run.returncode} ({run.outcome}), {run.distinct:,} distinct states" + (
            "" if ok else ": expected a liveness violation (rc 13)")
    except (ValueError, TlcUnavailableError) as error:
        ok, detail = False, str(error)
    return CheckResult(
        name=f"tlc-liveness-mutant-{mutant.name}",
        property=f"non-vacuity of L1: TLC refutes TrainerProgress on a variant ({mutant.action}): {mutant.description}",
        method="TLC 2.15 BFS + liveness on a variant of the spec, TrainerProgress only",
        bounds=config_bounds(cfg),
        explored="liveness violation found" if ok else "not refuted",
        result="pass" if ok else "fail",
        seconds=round(time.perf_counter() - started, 2),
        detail=detail,
    )


def checks(quick: bool) -> list[CheckResult]:
    """TrainerProgress at Eta 2 (quick: X = 0, 4 groups, every capacity conjunct binds; full: also
    X = 1 and Eta 3), then the non-vacuity variants (quick: two of them)."""
    models = [("tlc-liveness", "", LIVENESS_QUICK if quick else LIVENESS_FULL)]
    if not quick:
        models += [("tlc-liveness-x0", ", X = 0", LIVENESS_X0), ("tlc-liveness-eta3", ", Eta = 3", LIVENESS_ETA3)]
    rows = [model_check(name, PROPERTY + suffix, *model, expect_liveness=True) for name, suffix, model in models]
    return rows + [check_mutant(m) for m in MUTANTS if not quick or m.name in QUICK_MUTANTS]

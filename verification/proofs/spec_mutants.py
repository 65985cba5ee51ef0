"""Spec mutants: seeded bugs in the TLA+ spec, each of which some verification layer must catch.

Every mutant is a textual change to ``spec/StalenessBuffer.tla`` or ``spec/MCLag.tla`` (at least one
per action, plus a fairness mutant for the liveness property). The layers whose model reads a
changed file run in order until one catches the mutant:

1. **TLC safety** on a small absolute model (TypeOK, Inv, S1, S2, L1): a violated invariant;
2. **graph equivalence** with ``spec/mirror.py``: a state or successor that differs;
3. **TLC liveness** on the lag model (``TrainerProgress`` under fairness).

A mutant that no layer catches, or whose text no longer occurs in the spec, is a failure.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from staleflow.spec.mirror import SpecParams
from staleflow.verification.checks import CheckResult
from staleflow.verification.proofs.graph_equivalence import compare_graphs
from staleflow.verification.proofs.tlc import SPEC_DIR, TlcUnavailableError, cfg_text, run_tlc

SB = "StalenessBuffer.tla"
Edit = tuple[str, str, str]  # (file, old text, new text)


@dataclass(frozen=True)
class SpecMutant:
    name: str
    action: str
    description: str
    edits: tuple[Edit, ...]

    def apply(self) -> dict[str, str]:
        """The mutated file contents; ValueError if an original text no longer occurs."""
        files: dict[str, str] = {}
        for file, old, new in self.edits:
            text = files.get(file, (SPEC_DIR / file).read_text())
            if old not in text:
                raise ValueError(f"mutant {self.name}: {old!r} no longer occurs in {file}")
            files[file] = text.replace(old, new)
        return files


RESERVE_GUARD = r"/\ InvAt(c, [ver EXCEPT ![g] = v], Active \cup {g})"


def _reserve_up_to(last: int) -> str:
    """Reserve's guard with the capacity conjuncts of Inv only for ``k`` in ``0..last``."""
    return (r"/\ LET vv == [ver EXCEPT ![g] = v] IN (\A h \in Active \cup {g} : vv[h] + Eta >= c) /\ "
            rf"(\A k \in 0..{last} : Cardinality({{h \in Active \cup {{g}} : vv[h] + Eta <= c + k}}) <= (k + 1) * B + X)")


MUTANTS = [
    SpecMutant("reserve-no-guard", "Reserve", "Reserve admits without checking Inv",
               ((SB, RESERVE_GUARD, r"/\ TRUE"),)),
    SpecMutant("reserve-capacity-plus-one", "Reserve", "Reserve checks Inv without the new group (one too many)",
               ((SB, RESERVE_GUARD, r"/\ InvAt(c, [ver EXCEPT ![g] = v], Active)"),)),
    SpecMutant("reserve-checks-head-only", "Reserve", "Reserve checks only the head buffer's constraint (k = 0)",
               ((SB, RESERVE_GUARD, _reserve_up_to(0)),)),
    SpecMutant("reserve-checks-first-two-buffers", "Reserve", "Reserve checks only the constraints of buffers c, c+1",
               ((SB, RESERVE_GUARD, _reserve_up_to(1)),)),
    SpecMutant("reserve-ahead-of-trainer", "Reserve", "Reserve accepts versions up to c+1",
               ((SB, "    /\\ v \\in 0..c\n", "    /\\ v \\in 0..(c + 1)\n"), (SB, "v \\in 0..c :", "v \\in 0..(c + 1) :"))),
    SpecMutant("occupy-done-or-idle", "Occupy", "Occupy of any group (idle or done) marks it done",
               ((SB, "    /\\ st[g] = Running\n    /\\ st' = [st EXCEPT ![g] = Done]",
                 "    /\\ TRUE\n    /\\ st' = [st EXCEPT ![g] = Done]"),)),
    SpecMutant("abort-leaves-group", "Abort", "Abort keeps the group active",
               ((SB, "    /\\ st' = [st EXCEPT ![g] = Idle]\n    /\\ ver' = [ver EXCEPT ![g] = 0]",
                 "    /\\ UNCHANGED <<st, ver>>"),)),
    SpecMutant("consume-ignores-drop-bound", "Consume", "Consume may drop more than X groups",
               ((SB, r"/\ Cardinality(DroppedIn(cc, vv, ss, T)) <= X", r"/\ TRUE"),)),
    SpecMutant("consume-running", "Consume", "Consume may take running groups",
               ((SB, r"/\ T \subseteq DoneIn(ss)", r"/\ T \subseteq ActiveIn(ss)"),
                (SB, r"Consume == \E T \in SUBSET DoneIn(st)", r"Consume == \E T \in SUBSET Active"))),
    SpecMutant("consume-no-inv-guard", "Consume", "Consume does not check Inv at c+1",
               ((SB, r"/\ InvAt(cc + 1, vv, ActiveIn(ss) \ (T \cup DroppedIn(cc, vv, ss, T)))", r"/\ TRUE"),)),
    SpecMutant("consume-needs-extra-group", "Consume", "Consume needs B+1 done groups to take B",
               ((SB, r"/\ Cardinality(T) = B", r"/\ Cardinality(T) = B /\ Cardinality(DoneIn(ss)) > B"),)),
    SpecMutant("no-rollout-fairness", "fairness", "Running groups need not ever finish (liveness non-vacuity)",
               (("MCLag.tla", r"/\ ProducerFairness /\ RolloutFairness", r"/\ ProducerFairness"),)),
]
QUICK_MUTANTS = ("reserve-no-guard", "abort-leaves-group", "no-rollout-fairness")  # one per layer

#: Small models the mutants are checked on (Eta = 2: with Eta = 1 Consume's Inv guard is implied;
#: 4 groups > cap(1) = 2B + X so that every capacity conjunct of Reserve can bind).
MUTANT_PARAMS = SpecParams(eta=2, batch_size=1, redundancy=0)
MUTANT_GROUPS = ("g1", "g2", "g3", "g4")
MUTANT_MAX_VERSION = 2
GRAPH_PARAMS, GRAPH_GROUPS, GRAPH_MAX_VERSION = SpecParams(eta=1, batch_size=1, redundancy=1), 3, 2
LIVENESS_CONSTANTS: dict[str, int | tuple[str, ...]] = {"Eta": 1, "B": 1, "X": 1, "Groups": ("g1", "g2", "g3")}
MUTANT_BOUNDS = "; ".join((
    (f"safety Eta={MUTANT_PARAMS.eta} B={MUTANT_PARAMS.batch_size} X={MUTANT_PARAMS.redundancy} "
     f"|Groups|={len(MUTANT_GROUPS)} MaxVersion={MUTANT_MAX_VERSION}"),
    (f"graph Eta={GRAPH_PARAMS.eta} B={GRAPH_PARAMS.batch_size} X={GRAPH_PARAMS.redundancy} "
     f"|Groups|={GRAPH_GROUPS} MaxVersion={GRAPH_MAX_VERSION}"),
    "liveness " + " ".join(f"{k}={v}" if isinstance(v, int) else f"|{k}|={len(v)}"
                           for k, v in LIVENESS_CONSTANTS.items()),
))


def tlc_safety_layer(files: dict[str, str]) -> str | None:
    p = MUTANT_PARAMS
    cfg = cfg_text({"Eta": p.eta, "B": p.batch_size, "X": p.redundancy, "MaxVersion": MUTANT_MAX_VERSION,
                    "Groups": MUTANT_GROUPS}, "Spec", ("TypeOK", "Inv", "S1", "S2", "L1"), constraint="VersionBound")
    run = run_tlc("MCStalenessBuffer", cfg, overrides=files)
    if run.ok:
        return None
    return f"rc {run.returncode} ({run.outcome}): {run.violated or 'see TLC output'}, {run.distinct:,} states"


def graph_layer(files: dict[str, str]) -> str | None:
    cmp = compare_graphs(GRAPH_PARAMS, GRAPH_GROUPS, GRAPH_MAX_VERSION, overrides=files, max_reported=1)
    if cmp.equal:
        return None
    return f"{len(cmp.mismatches)} mismatch report(s), first: {cmp.mismatches[0][:160]}"


def tlc_liveness_layer(files: dict[str, str]) -> str | None:
    cfg = cfg_text(LIVENESS_CONSTANTS, "LagSpec", ("LagTypeOK", "Inv", "S1", "S2", "L1"), ("TrainerProgress",))
    run = run_tlc("MCLag", cfg, overrides=files)
    if run.ok:
        return None
    return f"rc {run.returncode} ({run.outcome}): {run.violated or 'see TLC output'}"


#: (layer, the spec files its model reads, the check); a layer runs only if the mutant edits one of them.
LAYERS: list[tuple[str, frozenset[str], Callable[[dict[str, str]], str | None]]] = [
    ("TLC safety", frozenset({SB, "MCStalenessBuffer.tla"}), tlc_safety_layer),
    ("graph equivalence", frozenset({SB, "MCStalenessBuffer.tla"}), graph_layer),
    ("TLC liveness", frozenset({SB, "MCLag.tla"}), tlc_liveness_layer),
]


def check_mutant(mutant: SpecMutant) -> CheckResult:
    started = time.perf_counter()
    tried: list[str] = []
    result, detail = "fail", ""
    try:
        files = mutant.apply()
        for layer, reads, run in LAYERS:
            if not reads & files.keys():
                continue
            tried.append(layer)
            caught = run(files)
            if caught is not None:
                result, detail = "pass", f"caught by {layer}: {caught}"
                break
        else:
            detail = "NOT caught by " + ", ".join(tried)
    except (ValueError, TlcUnavailableError) as error:
        detail = str(error)
    return CheckResult(
        name=f"spec-mutant-{mutant.name}",
        property=f"mutant of {mutant.action} is caught: {mutant.description}",
        method=" -> ".join(name for name, _, _ in LAYERS),
        bounds=MUTANT_BOUNDS,
        explored=f"{len(tried)} layer(s) run",
        result=result,
        seconds=round(time.perf_counter() - started, 2),
        detail=detail,
    )


def check_baseline() -> CheckResult:
    """The unmutated spec must pass every layer at the mutants' bounds; else a "catch" proves nothing."""
    started = time.perf_counter()
    rejected: list[str] = []
    try:
        for layer, _, run in LAYERS:
            caught = run({})
            if caught is not None:
                rejected.append(f"{layer}: {caught}")
    except TlcUnavailableError as error:
        rejected.append(str(error))
    return CheckResult(
        name="spec-mutant-baseline",
        property="the unmutated spec passes every mutant layer at the mutants' bounds",
        method=" + ".join(name for name, _, _ in LAYERS),
        bounds=MUTANT_BOUNDS,
        explored=f"{len(LAYERS)} layer(s) run",
        result="fail" if rejected else "pass",
        seconds=round(time.perf_counter() - started, 2),
        detail="; ".join(rejected) if rejected else "passed every layer",
    )


def checks(quick: bool) -> list[CheckResult]:
    """A baseline row, then every spec mutant (quick: one per kind of layer) must be caught by
    some layer."""
    chosen = [m for m in MUTANTS if not quick or m.name in QUICK_MUTANTS]
    return [check_baseline(), *(check_mutant(m) for m in chosen)]

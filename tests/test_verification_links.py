"""Issue 13: restore refuses every invalid snapshot, the mirror replay checks its start state, the
proved model is compared with the code, the exhaustive grid binds at eta >= 3, and refusals cover
every conjunct."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from staleflow.protocol import SNAPSHOT_FORMAT, SnapshotError, StalenessManager, check
from staleflow.protocol.trace import TraceFormatError, read_trace
from staleflow.spec import mirror
from staleflow.spec.mirror import MirrorState, SpecParams
from staleflow.verification.proofs import impl_mutants, model_link, snapshots
from staleflow.verification.proofs import trace_validation as tv
from staleflow.verification.proofs.conformance_grid import Coverage, exhaustive_conformance


def snap(eta: int, b: int, x: int, version: int, groups: list[Any]) -> dict[str, Any]:
    return {"format": SNAPSHOT_FORMAT, "eta": eta, "batch_size": b, "redundancy": x,
            "version": version, "groups": groups}


def mutant(name: str) -> type[StalenessManager]:
    return impl_mutants.mutant_class(next(m for m in impl_mutants.MUTANTS if m.name == name))


# ----------------------------------------------------------------------------- restore


@pytest.mark.parametrize(
    "bad, why",
    [
        (snap(1, 1, 0, 3, [["a", 1, "running"]]), "past its deadline"),  # offset -1 would wrap
        (snap(1, 1, 0, 3, [["a", 0, "done"]]), "past its deadline"),
        (snap(1, 1, 0, 3, [["a", -1, "done"]]), ">= 0"),
        (snap(1, 1, 0, 3, [["a", 4, "done"]]), "ahead of the trainer"),
        (snap(1, 1, 0, 3, [["a", 3, "done"], ["b", 3, "done"], ["c", 3, "running"]]), "at most 2"),
        (snap(1, 1, 0, 3, [["a", 2, "done"], ["b", 2, "done"]]), "at most 1"),
        (snap(1, 1, 0, 3, [["a", 3, "done"], ["a", 3, "running"]]), "twice"),
        (snap(1, 1, 0, 3, [["a", 3, ["done"]]]), "not a valid GroupStatus"),
        (snap(1, 1, 0, 3, [["a", True, "done"]]), "must be an int"),
        (snap(1, 1, 0, 3, [[None, 3, "done"]]), "group id"),
        (snap(1, 0, 0, 3, []), "batch_size"),
        (snap(1, 1, 0, -2, []), "version"),
        ({**snap(1, 1, 0, 3, []), "format": "staleflow.protocol/0"}, "not a staleness-manager snapshot"),
    ],
)
def test_restore_refuses_invalid_snapshots(bad: dict[str, Any], why: str) -> None:
    with pytest.raises(SnapshotError, match=why):
        StalenessManager.restore(bad)


def test_restore_fuzz_passes_and_reaches_every_defect_kind() -> None:
    stats = snapshots.fuzz_restore(StalenessManager, 1500, seed=1)
    assert stats.snapshots == 1500
    assert set(stats.kinds) == set(snapshots.KINDS) and min(stats.kinds.values()) >= 30
    [row] = snapshots.checks(quick=True)
    assert row.result == "pass" and row.explored.startswith("3,000 snapshots")


@pytest.mark.parametrize(
    "name, escape",
    [
        ("restore-skips-invariant", "accepted an invalid snapshot (inv-capacity)"),
        ("restore-wraps-past-deadline", "accepted an invalid snapshot (one-past-deadline)"),
    ],
)
def test_restore_fuzz_catches_restore_bugs(name: str, escape: str) -> None:
    with pytest.raises(AssertionError, match=escape.replace("(", r"\(").replace(")", r"\)")):
        snapshots.fuzz_restore(mutant(name), 3000)


def test_the_oracle_agrees_with_the_mirror_invariant() -> None:
    good = snap(2, 1, 0, 2, [["a", 0, "done"], ["b", 1, "running"], ["c", 2, "done"]])
    assert snapshots.oracle(good) is not None
    too_many = snap(2, 1, 0, 2, [["a", 0, "done"], ["b", 0, "running"]])
    assert snapshots.oracle(too_many) is None
    assert mirror.invariant_failures(SpecParams(2, 1, 0), MirrorState(2, frozenset(
        {("a", 0, "done"), ("b", 0, "running")}))) == ("cap0",)


# ----------------------------------------------------------------------------- mirror replay start state


def _trace_with_start(tmp_path: Path, start_groups: list[Any], version: int) -> Any:
    path = tmp_path / "trace.jsonl"
    tv.record_workload_trace(path, eta=1, batch_size=1, redundancy=0, ops=5, seed=2)
    [segment] = read_trace(path)
    assert segment.header.start is not None
    start = {**segment.header.start, "version": version, "groups": start_groups}
    return dataclasses.replace(segment, header=dataclasses.replace(segment.header, start=start), events=())


def test_mirror_replay_rejects_a_start_state_past_a_deadline(tmp_path: Path) -> None:
    segment = _trace_with_start(tmp_path, [["late", 1, "done"]], version=3)  # deadline 2 < head 3
    with pytest.raises(TraceFormatError, match=r"violates Inv \(deadline\)"):
        tv.replay_mirror(segment)


def test_mirror_replay_rejects_a_start_state_over_capacity(tmp_path: Path) -> None:
    segment = _trace_with_start(tmp_path, [["a", 3, "done"], ["b", 3, "done"], ["c", 3, "done"]], version=3)
    with pytest.raises(TraceFormatError, match=r"violates Inv \(cap1\)"):
        tv.replay_mirror(segment)
    ok = _trace_with_start(tmp_path, [["a", 3, "done"], ["b", 3, "done"]], version=3)
    assert tv.replay_mirror(ok).accepted


def test_counters_never_wrap_a_negative_offset() -> None:
    p = SpecParams(1, 1, 0)
    with pytest.raises(ValueError, match="deadline offset -1"):
        check.counters(p, MirrorState(3, frozenset({("late", 1, "done")})))
    assert check.counters(p, MirrorState(3, frozenset({("ok", 2, "done")}))).done == (1, 0)


# ----------------------------------------------------------------------------- model = code, grid depth


def test_the_proved_model_matches_the_manager_including_buffers() -> None:
    assert model_link.compare_grid(StalenessManager, [(2, 1, 1), (3, 1, 0)]) == 406 + 789


def test_a_consume_guard_bug_needs_eta_3_to_show() -> None:
    cls = mutant("consume-prefix-not-cumulative")
    assert exhaustive_conformance(cls, [(2, 1, 0), (2, 2, 1)]) > 0  # invisible up to eta 2
    with pytest.raises(AssertionError, match=r"eta=3 .*can_consume\(\) is True, spec Consume enabled: False"):
        exhaustive_conformance(cls, [(3, 1, 0)])
    with pytest.raises(AssertionError, match="can_consume"):
        model_link.compare_grid(cls, [(3, 1, 0)])


def test_refusal_coverage_sees_every_binding_conjunct_alone() -> None:
    coverage = Coverage()
    exhaustive_conformance(StalenessManager, [(3, 1, 0), (1, 2, 1)], coverage)
    assert coverage.missing() == {}
    p = SpecParams(3, 1, 0)
    assert coverage.seen[p] == set(mirror.refusal_reasons(p))
    assert "consume:next-cap1" in coverage.seen[p] and "reserve:deadline" in coverage.seen[p]
    # a state where only the later prefix guard of Consume refuses (the eta >= 3 case)
    state = MirrorState(2, frozenset({("r1", 0, "running"), ("r2", 1, "running"), ("r3", 1, "running"),
                                      ("d", 2, "done")}))
    assert mirror.consume_failures(p, state) == ("next-cap1",)


def test_coverage_reports_a_conjunct_never_seen() -> None:
    coverage = Coverage()
    coverage.add(SpecParams(1, 1, 0), MirrorState(0, frozenset()))
    missing = coverage.missing()[SpecParams(1, 1, 0)]
    assert "reserve:deadline" in missing and "consume:drops" in missing


# ----------------------------------------------------------------------------- every eta


def test_inv_is_inductive_for_every_eta() -> None:
    from staleflow.verification.proofs import z3_unbounded as zu

    rows = zu.checks(quick=True)
    assert [r.name for r in rows] == [f"z3-all-eta {name}" for name, _, _ in zu.ROWS]
    assert all(r.result == "pass" for r in rows), [r.detail for r in rows if r.result != "pass"]


def test_the_all_eta_proofs_refute_a_wrong_guard() -> None:
    from staleflow.verification.proofs import z3_unbounded as zu

    main = zu.reserve_steps()[-1]
    at_zero_slack = tuple(zu.SL(zu.eta) >= 0 if p.eq(zu.SL(zu.eta) > 0) else p for p in main.premises)
    assert at_zero_slack != main.premises
    assert zu.prove(dataclasses.replace(main, premises=at_zero_slack))[0] == "sat"
    consume_main = next(s for s in zu.consume_steps() if s.name.startswith("consume: Inv after, at any offset"))
    no_prefix_guard = tuple(p for p in consume_main.premises if not p.eq(zu.Q(zu.k + 1) <= zu.cap(zu.k)))
    assert len(no_prefix_guard) == len(consume_main.premises) - 1
    assert zu.prove(dataclasses.replace(consume_main, premises=no_prefix_guard))[0] == "sat"


# ----------------------------------------------------------------------------- TLA+ configurations bind


def test_checked_in_tlc_configurations_let_later_buffers_bind() -> None:
    from staleflow.verification.proofs import tlc

    safety = tlc.binding_conjuncts((tlc.SPEC_DIR / "safety.cfg").read_text())
    assert safety == "Reserve conjuncts that can bind: deadline, cap0, cap1, cap2, cap3"
    quick = tlc.binding_conjuncts((tlc.SPEC_DIR / "safety_quick.cfg").read_text())
    assert quick == "Reserve conjuncts that can bind: deadline, cap0, cap1, cap2"
    for name in ("liveness.cfg", "liveness_x0.cfg", "liveness_quick.cfg"):
        assert "Eta = 2" in (tlc.SPEC_DIR / name).read_text()
    assert "X = 0" in (tlc.SPEC_DIR / "liveness_x0.cfg").read_text()
    for name in ("liveness_quick.cfg", "liveness_x0.cfg", "liveness_eta3.cfg"):  # X = 0, every cap(k < Eta) binds
        cfg = (tlc.SPEC_DIR / name).read_text()
        assert tlc.binding_conjuncts(cfg).startswith("Reserve conjuncts that can bind: cap0, cap1, cap2"), name
        assert tlc.config_bounds(cfg).endswith("B=1 X=0 |Groups|=4"), name
    assert tlc.config_bounds((tlc.SPEC_DIR / "liveness_eta3.cfg").read_text()).startswith("Eta=3 ")


def test_trainer_progress_is_refuted_when_consume_can_block_forever() -> None:
    """Non-vacuity of the L1 model check: a Consume guard that is safe but can stall the trainer."""
    from staleflow.verification.proofs.liveness import MUTANTS, check_mutant

    row = check_mutant(next(m for m in MUTANTS if m.name == "consume-guard-keeps-batch"))
    assert row.result == "pass" and row.detail.startswith("rc 13 (liveness violation)"), row.detail


def test_a_reserve_checking_only_the_first_two_buffers_is_caught() -> None:
    from staleflow.verification.proofs.spec_mutants import MUTANTS, check_mutant

    row = check_mutant(next(m for m in MUTANTS if m.name == "reserve-checks-first-two-buffers"))
    assert row.result == "pass" and row.detail.startswith("caught by TLC safety: rc 12"), row.detail


def test_graph_coverage_expects_only_what_can_bind() -> None:
    from staleflow.verification.proofs.graph_equivalence import expected_refusals

    p = SpecParams(2, 1, 1)
    assert expected_refusals(p, 4, absolute=True) == [
        "reserve:deadline", "reserve:cap0", "reserve:cap1", "consume:batch", "consume:drops", "consume:next-cap0"]
    assert "reserve:deadline" not in expected_refusals(p, 4, absolute=False)

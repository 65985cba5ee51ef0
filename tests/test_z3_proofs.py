"""The Z3 proofs pass, can fail, and are about the implementation's algorithm.

The link between proof and code: the same model functions that are proved on Z3 terms are
evaluated here on concrete counters and compared with StalenessManager on every Inv state of a
small grid (reserve_slack, the consume plan and its result, occupy/abort, the EDF placement).
"""

from __future__ import annotations

import pytest
from staleflow.protocol import SNAPSHOT_FORMAT, StalenessManager
from staleflow.spec.mirror import SpecParams
from staleflow.verification.proofs import z3_proofs as zp
from staleflow.verification.proofs.conformance_grid import inv_counter_states

GRID = [(eta, b, x) for eta in range(4) for b in (1, 2) for x in range(3) if eta < 3 or b == 1]


def manager_in(eta: int, b: int, x: int, running: tuple[int, ...], done: tuple[int, ...]) -> StalenessManager:
    """A manager restored into the given counters, head buffer ``eta + 1``."""
    c = eta + 1
    groups = [
        [f"{status}{i}.{n}", c - eta + i, status]
        for i in range(eta + 1)
        for status, count in (("running", running[i]), ("done", done[i]))
        for n in range(count)
    ]
    return StalenessManager.restore(
        {"format": SNAPSHOT_FORMAT, "eta": eta, "batch_size": b, "redundancy": x, "version": c, "groups": groups}
    )


def offset_counts(manager: StalenessManager) -> zp.Counters:
    counts = manager.counts()
    return zp.Counters(counts.running, counts.done)


@pytest.mark.parametrize("eta, b, x", GRID)
def test_model_matches_the_manager_on_every_inv_state(eta: int, b: int, x: int) -> None:
    p = zp.Params(eta, b, x)
    states = 0
    for running, done in inv_counter_states(SpecParams(eta, b, x)):
        s = zp.Counters(running, done)
        assert zp.invariant(p, s) is True
        m = manager_in(eta, b, x, running, done)
        for version in range(m.version + 1):
            assert zp.reserve_slack(p, s, version + eta - m.version) == m.reserve_slack(version)
        plan, enabled = zp.consume_plan(p, s)
        assert enabled == m.can_consume()
        if enabled:
            batch = m.consume()
            taken = [0] * (eta + 1)
            for version in batch.group_versions:
                taken[version + eta - batch.version] += 1
            assert tuple(taken) == plan
            after, drops = zp.consume(p, s, plan)
            assert offset_counts(m) == after and len(batch.dropped) == drops
        placement = zp.edf_placement(p, s)
        views = manager_in(eta, b, x, running, done).buffers()
        assert [v.running + v.done for v in views] == [
            sum(placement[i, k] for i in range(eta + 1)) for k in range(eta + 1)
        ]
        assert zp.is_placement(p, s, placement) is True
        states += 1
    assert states > 0


@pytest.mark.parametrize("eta, b, x", [(2, 2, 1), (3, 1, 0)])
def test_occupy_and_abort_match_the_manager(eta: int, b: int, x: int) -> None:
    p = zp.Params(eta, b, x)
    for running, done in inv_counter_states(SpecParams(eta, b, x)):
        s = zp.Counters(running, done)
        for i in range(eta + 1):
            for status, model_step, operation in (
                ("running", zp.occupy, "occupy"),
                ("running", zp.abort_running, "abort"),
                ("done", zp.abort_done, "abort"),
            ):
                if (running if status == "running" else done)[i] == 0:
                    continue
                m = manager_in(eta, b, x, running, done)
                getattr(m, operation)(f"{status}{i}.0")
                assert offset_counts(m) == model_step(s, i)
                assert zp.invariant(p, model_step(s, i)) is True


def test_every_obligation_holds_for_small_eta() -> None:
    outcomes = zp.run_all(max_eta=3)
    assert {o.row for o in outcomes} == {row.name for row in zp.ROWS}
    failed = [o for o in outcomes if not o.ok]
    assert failed == []
    assert all(o.proved == "unsat" and o.premises == "sat" for o in outcomes)


def test_checks_report_one_passing_row_per_property(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zp, "QUICK_MAX_ETA", 2)
    rows = zp.checks(quick=True)
    assert [r.name for r in rows] == [f"z3 {row.name}" for row in zp.ROWS]
    assert all(r.result == "pass" and r.bounds.startswith("eta 0..2") for r in rows)


def test_a_wrong_admission_rule_is_refuted_with_a_counterexample(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checking only the prefix at the group's own offset breaks Inv for later offsets."""

    def own_offset_only(p: zp.Params, s: zp.Counters, offset: zp.Num) -> zp.Num:
        slack: zp.Num = 0
        for k in range(p.eta + 1):
            slack = zp.ite(offset == k, p.cap(k) - s.prefix(k), slack)
        return slack

    monkeypatch.setattr(zp, "reserve_slack", own_offset_only)
    outcome = next(zp.prove(q, 1) for q in zp.queries(1) if q.row == "reserve")
    assert outcome.proved == "sat" and not outcome.ok
    assert "j=0" in outcome.counterexample


def test_a_consume_without_its_guards_breaks_inv_and_s2(monkeypatch: pytest.MonkeyPatch) -> None:
    real_plan = zp.consume_plan

    def no_drop_guard(p: zp.Params, s: zp.Counters):  # type: ignore[no-untyped-def]
        plan, _ = real_plan(p, s)
        need = p.batch_size - zp.total(plan)
        return plan, need == 0

    monkeypatch.setattr(zp, "consume_plan", no_drop_guard)
    failing = {o.row for o in (zp.prove(q, 2) for q in zp.queries(2)) if not o.ok}
    assert {"s2-accounting", "consume"} <= failing


def test_unknown_counts_as_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zp, "QUICK_MAX_ETA", 0)
    monkeypatch.setattr(zp, "prove", lambda query, eta: zp.Outcome(query.row, eta, "unknown", "sat", 0.0))
    rows = zp.checks(quick=True)
    assert all(r.result == "fail" and "negation unknown" in r.detail for r in rows)

"""The link between the Z3 proofs and ``protocol/manager.py``: the proved model is the code.

``z3_proofs.py`` proves its obligations about model functions (``reserve_slack``, ``consume_plan``,
``consume``, ``occupy``, ``abort_*``, ``edf_placement``) that are written generically over numbers.
Evaluated on Python ints they are an executable model; this layer compares that model with the
real :class:`~staleflow.protocol.StalenessManager` on **every Inv counter state** of a grid, for
every head buffer ``c`` from 0 (versions below 0 do not exist, so the oldest offsets are empty) to
``eta + 1`` (version 0 past its deadline):

- ``reserve_slack(v)`` for every version ``0..c``, and ``can_reserve``;
- Consume enabledness, the plan (counted from the batch's group versions), the counters and drops
  after consume, and the batch tag ``c``;
- the counters after every occupy and abort (one group per offset and status);
- ``buffers()``: index, capacity and occupancy equal the EDF placement that the ``placement``
  obligation proves valid.

Without this row the Z3 rows would give the same verdict for any ``manager.py``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from staleflow.protocol import StalenessManager
from staleflow.verification.checks import CheckResult
from staleflow.verification.proofs import z3_proofs as zp
from staleflow.verification.proofs.conformance_grid import grid_snapshots
from staleflow.verification.proofs.snapshots import check_buffers

#: (eta, B, X) grids: every Inv counter state of each, at every head 0..eta+1.
GRID_QUICK: tuple[tuple[int, int, int], ...] = (
    *((eta, b, x) for eta in range(3) for b in (1, 2) for x in range(2)),
    (2, 1, 2), (3, 1, 0), (3, 1, 1), (4, 1, 0),
)
GRID_FULL: tuple[tuple[int, int, int], ...] = (
    *((eta, b, x) for eta in range(3) for b in (1, 2) for x in range(3)),
    (3, 1, 0), (3, 1, 1), (3, 1, 2), (3, 2, 0), (4, 1, 0), (4, 1, 1),
)


def _counters(manager: StalenessManager) -> zp.Counters:
    counts = manager.counts()
    return zp.Counters(counts.running, counts.done)


def compare_state(manager_cls: type[StalenessManager], snapshot: dict[str, Any]) -> None:
    """The model and the manager restored into ``snapshot`` agree on every query and action."""
    eta, c = snapshot["eta"], snapshot["version"]
    p = zp.Params(eta, snapshot["batch_size"], snapshot["redundancy"])
    m = manager_cls.restore(snapshot)
    s = _counters(m)
    assert zp.invariant(p, s) is True, f"restored counters {s} break Inv"
    for version in range(c + 1):
        slack = zp.reserve_slack(p, s, version + eta - c)
        assert m.reserve_slack(version) == slack, f"reserve_slack({version}) = {m.reserve_slack(version)}, model {slack}"
        assert m.can_reserve(version) == (slack > 0), f"can_reserve({version}) != model"
    check_buffers(m)
    plan, enabled = zp.consume_plan(p, s)
    assert m.can_consume() == enabled, f"can_consume() = {m.can_consume()}, model {enabled} (plan {plan})"
    if enabled:
        batch = m.consume()
        assert batch.version == c, f"batch tagged {batch.version}, head {c}"
        taken = [0] * (eta + 1)
        for version in batch.group_versions:
            taken[version + eta - c] += 1
        assert tuple(taken) == plan, f"consume took {tuple(taken)} per offset, model plan {plan}"
        after, drops = zp.consume(p, s, plan)
        assert _counters(m) == after, f"counters after consume {_counters(m)}, model {after}"
        assert len(batch.dropped) == drops, f"{len(batch.dropped)} drops, model {drops}"
    for i in range(eta + 1):
        for status, model_step, operation in (
            ("running", zp.occupy, "occupy"),
            ("running", zp.abort_running, "abort"),
            ("done", zp.abort_done, "abort"),
        ):
            if (s.running if status == "running" else s.done)[i] == 0:
                continue
            m = manager_cls.restore(snapshot)
            getattr(m, operation)(f"{status[0]}{i}.0")
            assert _counters(m) == model_step(s, i), f"{operation} at offset {i}: {_counters(m)}, model {model_step(s, i)}"


def compare_grid(manager_cls: type[StalenessManager], grid: Sequence[tuple[int, int, int]], seed: int = 0) -> int:
    """Every Inv state of every grid point, at every head; returns the states compared."""
    compared = 0
    for _, where, snapshot in grid_snapshots(grid, seed):
        try:
            compare_state(manager_cls, snapshot)
        except AssertionError as error:
            raise AssertionError(f"{where}: {error}") from None
        compared += 1
    return compared


#: Added by ``verify --nightly`` (deeper: eta 5, and B = 2 with X = 1 at eta 3).
GRID_NIGHTLY_EXTRA: tuple[tuple[int, int, int], ...] = ((3, 2, 1), (5, 1, 0))


def checks(quick: bool) -> list[CheckResult]:
    grid = GRID_QUICK if quick else GRID_FULL
    if not quick and os.environ.get("HYPOTHESIS_PROFILE") == "nightly":  # set by verify --nightly
        grid = (*grid, *GRID_NIGHTLY_EXTRA)
    started = time.perf_counter()
    try:
        explored, result, detail = f"{compare_grid(StalenessManager, grid):,} states", "pass", ""
    except Exception as error:  # noqa: BLE001 - a disagreement or a crash is a failed check
        explored, result, detail = "stopped at the first disagreement", "fail", f"{type(error).__name__}: {error}"[:500]
    etas = sorted({eta for eta, _, _ in grid})
    return [CheckResult(
        name="z3-model = manager.py",
        property="the Z3-proved model functions are the code: reserve_slack, consume plan/result, "
                 "occupy, abort, buffers() = EDF placement",
        method="model evaluated on ints vs StalenessManager restored into every Inv counter state",
        bounds=f"eta {etas[0]}..{etas[-1]} ({len(grid)} (eta, B, X) points, B <= 2, X <= 2), head 0..eta+1, "
               "shuffled arrival order",
        explored=explored,
        result=result,
        seconds=round(time.perf_counter() - started, 3),
        detail=detail,
    )]

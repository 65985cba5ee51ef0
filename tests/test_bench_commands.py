"""`staleflow bench` subcommands end to end at small arguments: exit code, the JSON figures each
promises (with their goals), and the exit code 2 of a bad argument. (``bench weight-sync``:
tests/test_bench_weight_sync.py; ``bench convergence`` aggregating finished runs:
tests/test_convergence_bench.py; ``bench mutation``'s judging: tests/test_bench_mutation.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from staleflow.cli import main


def _bench(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code = main(["bench", *argv, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def test_bench_protocol(capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = _bench(capsys, "protocol", "--batches", "5", "--consume-sizes", "4,8")
    assert code == 0  # the goals are figures to read (a loaded machine may miss them), not a failed check
    assert sorted(doc["steady_state"]) == ["eta=1,B=512", "eta=1,B=64", "eta=3,B=512", "eta=3,B=64"]
    assert all(row["consumed_batches"] >= 5 and row["all_ops_per_s"] > 0 for row in doc["steady_state"].values())
    assert sorted(doc["consume_by_batch_size"]) == ["4", "8"]
    assert set(doc["goals"]) == {"ops_per_s", "scaling_ratio", "consume_linear"}
    assert doc["goals"]["ops_per_s"]["met"] == (doc["slowest_all_ops_per_s"] >= doc["goals"]["ops_per_s"]["goal"])
    assert doc["command"].startswith("staleflow bench protocol")


def test_bench_coordinator(capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = _bench(capsys, "coordinator", "--scales", "2x16", "--ticks", "2")
    assert code == 0
    (row,) = doc["results"]
    assert (row["instances"], row["in_flight_requests"], row["on_instances"]) == (2, 64, 64)
    assert 0 < row["plan"]["median_ms"] <= row["plan"]["max_ms"]


def test_bench_load(capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = _bench(capsys, "load", "--scales", "2x16", "--ticks", "2", "--no-memory")
    (row,) = doc["results"]
    assert row["instances"] == 2 and row["plan_ms"]["median_ms"] > 0
    worst = max(row["plan_ms"]["p95_ms"], row["plan_rerouted_1pct_ms"]["p95_ms"])
    assert row["within_goal"] == (worst < doc["goal_ms"]) and doc["memory_fit"] is None  # --no-memory
    assert code == (0 if doc["ok"] else 1) and doc["ok"] == row["within_goal"]


def test_bench_chaos_seeds_and_one_replayed_seed(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, doc = _bench(capsys, "chaos", "--seeds", "2", "--steps", "2", "--healed-steps", "1", "--trace-dir", str(tmp_path))
    assert (code, doc["seeds_run"], doc["seeds"], doc["violations"]) == (0, 2, [0, 1], [])
    assert doc["steps"] == 6 and doc["faults_injected"] == sum(doc["faults_by_kind"].values()) > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chaos-0.jsonl", "chaos-1.jsonl"]
    code, doc = _bench(capsys, "chaos", "--seed", "1", "--steps", "2", "--healed-steps", "1", "--faults", "pull_fail")
    (result,) = doc["results"]
    assert code == 0 and result["seed"] == 1 and result["violation"] is None
    assert set(k for k, v in result["faults"].items() if v) <= {"pull_fail"}


@pytest.mark.parametrize(
    "argv",
    [["coordinator", "--scales", "2x8"], ["load", "--scales", "0x16"], ["chaos", "--seeds", "0"], ["chaos", "--faults", "no_such_fault"]],
    ids=["coordinator too few requests", "load no instances", "chaos no seeds", "chaos unknown fault"],
)
def test_bench_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(["bench", *argv])
    except SystemExit as exit_info:  # argparse's own refusals
        code = int(exit_info.code or 0)
    assert code == 2
    assert "error" in capsys.readouterr().err

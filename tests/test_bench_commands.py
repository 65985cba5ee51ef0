"""`staleflow bench` subcommands end to end at small arguments: exit code, the JSON figures each
promises (with their goals), and the exit code 2 of a bad argument. (``bench weight-sync``:
tests/test_bench_weight_sync.py; the trace cost counted, not timed: tests/test_trace_cost.py;
``bench convergence`` aggregating finished runs:
tests/test_convergence_bench.py; ``bench mutation``'s judging: tests/test_bench_mutation.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from staleflow.__main__ import main


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
    assert set(doc["goals"]) == {"ops_per_s", "scaling_ratio", "consume_linear", "trace_ratio"}
    assert doc["goals"]["ops_per_s"]["met"] == (doc["slowest_all_ops_per_s"] >= doc["goals"]["ops_per_s"]["goal"])
    assert doc["command"].startswith("staleflow bench protocol")
    assert set(doc["lock_cost"]) == {"eta=1,B=64", "eta=3,B=512"}
    rows = doc["lock_cost"].values()
    assert all(row["locked_ns_per_op"] - row["plain_ns_per_op"] == pytest.approx(row["lock_ns_per_op"]) for row in rows)
    trace = doc["trace_cost"]
    assert set(trace) == {"eta=1,B=64", "eta=3,B=512"}
    for row in trace.values():
        assert row["groups"] > 0 and row["refused_reserves"] > 0
        assert row["traced_ratio"] == pytest.approx(row["traced_ns_per_group"] / row["untraced_ns_per_group"])
    worst = max(row["traced_ratio"] for row in trace.values())
    assert doc["goals"]["trace_ratio"] == {"goal": 3.0, "met": worst <= 3.0}


def test_bench_protocol_tables_show_the_figures_and_verdicts(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The text report of the JSON figures (a made-up result: the tables print what they are given)."""
    from staleflow.bench import protocol

    monkeypatch.setenv("COLUMNS", "240")
    ops = {f"{op}_ops_per_s": 1_000.0 * (i + 1) for i, op in enumerate((*protocol.OPS, "all"))}
    result = {
        "steady_state": {"eta=1,B=64": ops}, "per_op_ns_by_active_groups": {"1000": {"reserve": 210, "occupy": 320, "abort": 430}},
        "consume_by_batch_size": {"64": {"consume_ms": 0.0123, "ns_per_group": 192}}, "slowest_all_ops_per_s": 12_345.0,
        "worst_scaling_ratio": 1.5, "consume_ns_per_group_ratio": 3.25, "command": "staleflow bench protocol --batches 5",
        "goals": {"ops_per_s": {"met": False}, "scaling_ratio": {"met": True}, "consume_linear": {"met": True}},
    }
    protocol._print_tables(result)
    protocol._print_lock_table({"eta=1,B=64": {"plain_ns_per_op": 100.0, "locked_ns_per_op": 150.0, "lock_ns_per_op": 50.0,
                                                "lock_overhead_pct": 50.0}})
    protocol._print_trace_table({"eta=1,B=64": {"untraced_ns_per_group": 1000.0, "traced_ns_per_group": 2500.0, "traced_ratio": 2.5,
                                                 "traced_refusals_ns_per_group": 4000.0, "traced_refusals_ratio": 4.0}})
    out = " ".join(capsys.readouterr().out.split())
    assert "│ 1,000 │ 2,500 │ 2.50x │ 4,000 │ 4.00x │" in out and "worst traced/untraced ratio 2.50x (goal <= 3.0x: met)" in out
    assert "eta=1,B=64" in out and "1,000" in out and "│ 1,000 │ 210 │ 320 │ 430 │" in out and "0.012" in out
    assert f"slowest steady state: 12,345 ops/s (goal >= {protocol.GOAL_OPS_PER_S:,}: NOT met)" in out
    assert "worst cost ratio 1k -> 100k groups: 1.50x" in out and "largest B over smallest: 3.25x" in out
    assert "reproduce: staleflow bench protocol --batches 5" in out and "│ 100 │ 150 │ 50 │ 50% │" in out


def test_bench_trace_cost_prints_the_timed_ratio_the_footprint_and_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    from staleflow.bench.trace_cost import recorded_ops, trace_footprint
    from staleflow.protocol import StalenessManager

    code, doc = _bench(capsys, "trace-cost", "--runs", "2", "--batches", "3")
    assert code == 0 and doc["runs"] == 2 and doc["command"] == "staleflow bench trace-cost --runs 2 --batches 3 --seed 0"
    assert sorted(doc["settings"]) == ["eta=1,B=64", "eta=3,B=512"]
    for key, row in doc["settings"].items():
        eta, batch_size = (int(part.split("=")[1]) for part in key.split(","))
        for figure in ("untraced_ns_per_group", "traced_ns_per_group", "traced_ratio", "traced_refusals_ratio"):
            assert 0 < row[figure]["min"] <= row[figure]["median"] <= row[figure]["max"], (key, figure)
        # the counted figures are the same on every machine: those of the suite's budget (tests/test_trace_cost.py)
        assert row["footprint"] == trace_footprint(StalenessManager(eta, batch_size), recorded_ops(eta, batch_size, 3, 0))
    worst = max(row["traced_ratio"]["median"] for row in doc["settings"].values())
    assert doc["goal"] == {"traced_ratio": 3.0, "worst_median": worst, "met": worst <= 3.0}
    assert main(["bench", "trace-cost", "--batches", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "Reproduce: staleflow bench trace-cost --runs 1 --batches 3 --seed 0"
    assert lines[-2].startswith("worst median traced/untraced ratio ") and "(goal <= 3.0x: " in lines[-2]
    assert sum("writes and" in line and "bytes per group" in line for line in lines) == 2


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


def test_bench_load_measures_memory_per_request_and_prints_its_verdicts(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "load", "--scales", "2x64", "8x512", "--ticks", "1"])
    lines = capsys.readouterr().out.splitlines()
    # Per scale a wall-time line and its CPU-time line; then the memory fit, the goal, the command.
    assert len(lines) == 7 and lines[-1] == "Reproduce: staleflow bench load --scales 2x64 8x512 --ticks 1"
    assert "2 instances,      64 in flight" in lines[0] and "8 instances,     512 in flight" in lines[2]
    assert all("in CPU time: plan" in lines[i] for i in (1, 3))
    assert all("peak memory" in lines[i] and "B per request" in lines[i] for i in (0, 2))
    memory, goal = lines[4], lines[5]
    assert memory.startswith("memory: ") and "bytes per in-flight request" in memory and "tolerance 15%" in memory
    assert code == (0 if "(linear," in memory and goal.endswith(": met") else 1)


def test_load_memory_fit_is_least_squares_and_judges_linearity() -> None:
    from staleflow.bench.load import linear_fit, peak_memory

    fit = linear_fit([(100, 1_500), (200, 2_500), (400, 4_500)])  # exactly 500 + 10 per request
    assert fit["bytes_per_request"] == pytest.approx(10) and fit["base_bytes"] == pytest.approx(500)
    assert fit["max_deviation"] == pytest.approx(0) and fit["linear"]
    bent = linear_fit([(100, 1_000), (200, 2_000), (400, 16_000)])  # grows faster than the requests
    assert bent["max_deviation"] > 0.15 and not bent["linear"]
    assert linear_fit([(64, 1_000), (64, 1_200)])["bytes_per_request"] == 0.0  # one size only: no slope
    small, large = peak_memory(2, 64, 0), peak_memory(8, 512, 0)
    assert 0 < small < large  # more requests in flight hold more memory


def test_bench_chaos_seeds_and_one_replayed_seed(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, doc = _bench(capsys, "chaos", "--seeds", "2", "--steps", "2", "--healed-steps", "1", "--trace-dir", str(tmp_path))
    assert (code, doc["seeds_run"], doc["seeds"], doc["violations"]) == (0, 2, [0, 1], [])
    assert doc["steps"] == 6 and doc["faults_injected"] == sum(doc["faults_by_kind"].values()) > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chaos-0.jsonl", "chaos-1.jsonl"]
    code, doc = _bench(capsys, "chaos", "--seed", "1", "--steps", "2", "--healed-steps", "1", "--faults", "pull_fail")
    (result,) = doc["results"]
    assert code == 0 and result["seed"] == 1 and result["violation"] is None
    assert set(k for k, v in result["faults"].items() if v) <= {"pull_fail"}


def test_bench_chaos_prints_a_replayed_seeds_scenario_and_faults_and_how_to_reproduce(capsys: pytest.CaptureFixture[str]) -> None:
    import re

    assert main(["bench", "chaos", "--seed", "0", "--steps", "2", "--healed-steps", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    scenario = json.loads(lines[0].removeprefix("scenario: "))
    assert (scenario["seed"], scenario["steps_faulty"], scenario["steps_healed"]) == (0, 2, 1) and lines[1] == "faults injected:"
    injected = [line for line in lines[2:-1] if line.startswith("  t=")]
    summary = re.fullmatch(r"1 seeds, 3 training steps, (\d+) faults \(([^)]*)\), .* 0 violations \(.* s\)", lines[-1])
    assert summary is not None and int(summary[1]) == len(injected) > 0  # one logged line per injected fault
    counts = dict(item.split(" ") for item in summary[2].split(", "))
    assert {kind: sum(f" {kind} " in line for line in injected) for kind in counts} == {k: int(v) for k, v in counts.items()}
    assert main(["bench", "chaos", "--seeds", "1", "--steps", "2", "--healed-steps", "1", "--faults", "pull_fail",
                 "--system", "staleflow"]) == 0
    reproduce = "Reproduce: staleflow bench chaos --seeds 1 --first 0 --faults pull_fail --system staleflow"
    assert capsys.readouterr().out.splitlines()[-1] == reproduce


@pytest.mark.parametrize(
    "argv",
    [["coordinator", "--scales", "2x8"], ["load", "--scales", "0x16"], ["load", "--ticks", "0"], ["chaos", "--seeds", "0"],
     ["chaos", "--faults", "no_such_fault"], ["chaos", "--steps", "0"], ["chaos", "--system", "verl-async"],
     ["trace-cost", "--runs", "0"]],
    ids=["coordinator too few requests", "load no instances", "load no ticks", "chaos no seeds", "chaos unknown fault",
         "chaos no steps", "chaos system without a bound", "trace-cost no runs"],
)
def test_bench_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(["bench", *argv])
    except SystemExit as exit_info:  # argparse's own refusals
        code = int(exit_info.code or 0)
    assert code == 2
    assert "error" in capsys.readouterr().err

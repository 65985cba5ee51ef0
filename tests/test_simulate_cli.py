"""``staleflow simulate`` on the small workload: JSON schema, the bound kept, plots, bad input."""

from __future__ import annotations

import argparse
import json

import pytest
from staleflow.app.upper_bound import upper_bound
from staleflow.cli import simulate as simulate_command
from staleflow.runtime.settings.workload import load_workload


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    simulate_command.add_arguments(parser)
    return simulate_command.run(parser.parse_args(argv))


def test_json_output_has_every_system_within_the_bound(capsys, tmp_path) -> None:
    code = run_cli(
        ["--workload", "small-ci", "--systems", "staleflow", "sync", "inflight-cap", "--eta", "2",
         "--steps", "5", "--json", "--out", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert code == 0
    report = json.loads(out)  # stdout holds the JSON and nothing else
    assert set(report["systems"]) == {"staleflow", "sync", "inflight-cap"}
    assert report["upper_bound_tokens_per_s"] == pytest.approx(upper_bound(load_workload("small-ci")).tokens_per_s)
    for figures in report["systems"].values():
        assert {"tokens_per_s", "step_time_s", "utilisation", "max_staleness", "staleness_histogram", "dropped"} <= set(figures)
        assert 0 < figures["tokens_per_s"] < report["upper_bound_tokens_per_s"]
        assert figures["steps"] == 5 and figures["lost"] == 0 and figures["duplicated"] == 0
        assert figures["dropped"] == 0
        assert 0 < figures["utilisation"] <= 1
        # every consumed group is within the bound; 5 batches of 16 groups
        assert figures["max_staleness"] <= figures["eta"]
        assert sum(figures["staleness_histogram"].values()) == 5 * 16
    assert report["systems"]["sync"]["max_staleness"] == 0
    assert report["staleflow_ratio"]["sync"] == pytest.approx(
        report["systems"]["staleflow"]["tokens_per_s"] / report["systems"]["sync"]["tokens_per_s"]
    )
    assert json.loads((tmp_path / "results.json").read_text())["by_eta"]["2"]["systems"].keys() == report["systems"].keys()
    for name in ("throughput.png", "staleness_eta2.png", "step_times_eta2.png", "instance_skew_eta2.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    written = json.loads((tmp_path / "results.json").read_text())
    results = written["by_eta"]["2"]["systems"]
    assert all(len(f["instance_skew"]["per_step"]) == 5 for f in results.values())  # the skew of every step
    # what tells this run apart from others of the workload and seed (scripts/simulate_tables.py groups by it)
    small = load_workload("small-ci")
    assert (written["tick_s"], written["workload_tick_s"]) == (small.simulation.tick_s, small.simulation.tick_s)
    assert written["rollout_gpus"] == small.gpus - small.cluster.trainer_gpus


def test_same_seed_gives_the_same_figures(capsys) -> None:
    figures = []
    for _ in range(2):
        assert run_cli(["--workload", "small-ci", "--systems", "staleflow", "--steps", "3", "--json"]) == 0
        figures.append(json.loads(capsys.readouterr().out)["systems"]["staleflow"]["tokens_per_s"])
    assert figures[0] == figures[1]


def test_table_names_systems_and_the_bound(capsys) -> None:
    assert run_cli(["--workload", "small-ci", "--systems", "staleflow", "sync", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "staleflow" in out and "sync" in out and "upper-bound" in out and "StaleFlow over the others: sync" in out


def test_table_prints_both_comparison_bases_with_steady_state(capsys) -> None:
    """The summary under each table: StaleFlow over each system the paper ran (with its share past
    eta and largest lag) and over their best, and over the best bound-keeping baseline; whole run
    and steady state (the first eta + 2 steps left out)."""
    assert run_cli(["--workload", "small-ci", "--systems", "staleflow", "verl-async", "areal-filter", "--eta", "1",
                    "--steps", "6"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "StaleFlow over the systems the paper ran (steady: without the first 3 steps): verl-async " in out
    assert "past eta, max lag" in out and "best of them" in out
    assert "StaleFlow over the best bound-keeping baseline (p99 staleness within eta 1):" in out
    assert "StaleFlow of the upper bound:" in out and "steady" in out
    # the latency-aware bound beside the throughput bound, and StaleFlow's share of it
    from staleflow.app.upper_bound import latency_bound

    workload = load_workload("small-ci")
    latency = latency_bound(workload, 1, upper_bound(workload)).tokens_per_s
    assert f"latency-bound │ {latency:,.0f} │" in out
    assert "StaleFlow of the latency-aware bound (each batch's longest response decoded alone within the eta + 1 step window):" in out


def test_bad_workload_exits_2_with_the_key_named(capsys, tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel: y\n")
    assert run_cli(["--workload", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "cost_model: Field required" in err and "cluster: Field required" in err


def test_unknown_system_and_bad_steps_exit_2(capsys) -> None:
    assert run_cli(["--workload", "small-ci", "--systems", "verl"]) == 2
    assert "unknown system 'verl'" in capsys.readouterr().err
    assert run_cli(["--workload", "small-ci", "--steps", "0"]) == 2
    assert "--steps must be >= 1" in capsys.readouterr().err


def test_trace_dir_writes_a_trace_per_run_that_the_spec_accepts(capsys, tmp_path) -> None:
    from staleflow.verification.proofs.trace_validation import validate_trace

    code = run_cli(
        ["--workload", "small-ci", "--systems", "staleflow", "sync", "--eta", "2", "--steps", "3",
         "--json", "--trace-dir", str(tmp_path)]
    )
    capsys.readouterr()
    assert code == 0
    traces = sorted(p.name for p in tmp_path.glob("*.jsonl"))
    assert traces == ["staleflow-eta2.jsonl", "sync-eta2.jsonl"]
    for name in traces:
        lines = (tmp_path / name).read_text().splitlines()
        consumes = [line for line in lines if '"consume"' in line]
        assert len(consumes) == 3
        result = validate_trace(tmp_path / name, use_tlc=False)
        assert result.ok, result.detail


def test_peers_report_measured_staleness_and_ratios_to_the_best_bound_keeping_baseline(capsys) -> None:
    """The default comparison: the peers as they run. Unbounded peers report their staleness past
    eta (measured, not failed); areal-tight admits with a smaller bound whose p99 is within eta;
    the best bound-keeping baseline is the fastest whose p99 staleness is within eta."""
    code = run_cli(["--workload", "small-ci", "--eta", "1", "--steps", "6", "--json", "--systems", "staleflow",
                    "areal", "areal-filter", "areal-tight", "verl-async", "verl-sync", "one-step-off", "roll-flash"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0  # a peer past eta is reported, not a failure
    systems = report["systems"]
    assert {"staleness_p99", "past_eta_share", "wasted_tokens", "proactive_aborted", "keeps_bound"} <= set(systems["areal"])
    unbounded = [name for name, f in systems.items() if not f["keeps_bound"]]
    assert sorted(unbounded) == ["areal", "areal-filter", "areal-tight", "verl-async"]
    assert max(systems[name]["max_staleness"] for name in ("areal", "verl-async")) > 1  # trained past eta
    assert systems["areal-filter"]["max_staleness"] <= 1 and systems["areal-filter"]["wasted_tokens"] > 0
    assert systems["areal-tight"]["admission_eta"] == 0 and systems["areal-tight"]["eta"] == 1
    assert systems["verl-sync"]["instances"] == 5 and systems["roll-flash"]["instances"] == 4  # colocated: every GPU
    for f in systems.values():
        hist = {int(k): v for k, v in f["staleness_histogram"].items()}
        assert f["past_eta_share"] == pytest.approx(sum(v for k, v in hist.items() if k > 1) / sum(hist.values()))
    keeping = [n for n, f in systems.items() if n != "staleflow" and f["staleness_p99"] <= 1]
    best = max(systems[n]["tokens_per_s"] for n in keeping)
    assert report["staleflow_ratio"]["best-bound-keeping"] == pytest.approx(systems["staleflow"]["tokens_per_s"] / best)
    # the paper's basis: the fastest of the systems the paper ran, as they run (past eta or not)
    paper = max(systems[n]["tokens_per_s"] for n in ("verl-sync", "one-step-off", "verl-async", "areal", "roll-flash"))
    assert report["staleflow_ratio"]["best-paper-system"] == pytest.approx(systems["staleflow"]["tokens_per_s"] / paper)
    # steady state: the same steps (after the first eta + 2 = 3) for every system, beside the whole run
    for f in systems.values():
        assert f["steady_skip_steps"] == 3 and sum(f["step_tokens"]) > 0
        assert f["steady_tokens_per_s"] == pytest.approx(sum(f["step_tokens"][3:]) / sum(f["step_times_s"][3:]))
    steady = report["staleflow_ratio_steady"]
    assert steady["areal"] == pytest.approx(systems["staleflow"]["steady_tokens_per_s"] / systems["areal"]["steady_tokens_per_s"])


def test_redundancy_and_estimation_error_from_the_command_line(capsys) -> None:
    base = ["--workload", "small-ci", "--eta", "2", "--steps", "4", "--json", "--systems", "staleflow"]
    assert run_cli([*base, "--batch-redundancy", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["systems"]["staleflow"]["dropped"] > 0
    assert run_cli([*base, "--group-redundancy", "2"]) == 0
    grouped = json.loads(capsys.readouterr().out)["systems"]["staleflow"]
    assert run_cli([*base, "--estimation-error", "0"]) == 0
    exact = json.loads(capsys.readouterr().out)
    assert exact["estimation_error"] == 0 and exact["systems"]["staleflow"]["tokens_per_s"] != grouped["tokens_per_s"]
    assert run_cli([*base, "--estimation-error", "0.7"]) == 2
    assert "--estimation-error must be in [0, 0.5)" in capsys.readouterr().err


def test_speculation_from_the_command_line_gives_siblings_to_staleflow_only(capsys) -> None:
    from staleflow.adapters.sim.speculation import DRAFT_ACCEPTANCE

    base = ["--workload", "small-ci", "--eta", "2", "--steps", "2", "--json", "--systems", "staleflow", "roll-flash"]
    assert run_cli([*base, "--speculation", "siblings"]) == 0
    systems = json.loads(capsys.readouterr().out)["systems"]
    assert systems["staleflow"]["draft_acceptance"] == DRAFT_ACCEPTANCE["siblings"]
    assert systems["roll-flash"]["draft_acceptance"] == DRAFT_ACCEPTANCE["request"]
    with pytest.raises(SystemExit):
        run_cli([*base, "--speculation", "everything"])
    assert "invalid choice: 'everything'" in capsys.readouterr().err


def test_acceptance_by_position_from_the_command_line_is_off_by_default(capsys) -> None:
    """``--draft-positions`` times the drafts at the acceptance measured along a response (one k for
    all, or per request); it needs ``--speculation``, and without it the run is the one-rate run."""
    base = ["--workload", "small-ci", "--eta", "1", "--steps", "2", "--json", "--systems", "staleflow", "--speculation", "siblings"]
    figures = {}
    for positions in ("off", "uniform", "per-request"):
        assert run_cli([*base, "--draft-positions", positions]) == 0
        figures[positions] = json.loads(capsys.readouterr().out)["systems"]["staleflow"]
    assert run_cli(base) == 0
    assert json.loads(capsys.readouterr().out)["systems"]["staleflow"]["tokens_per_s"] == figures["off"]["tokens_per_s"]
    assert figures["uniform"]["tokens_per_s"] != figures["off"]["tokens_per_s"]
    assert run_cli(base[:-2] + ["--draft-positions", "uniform"]) == 2
    assert "--draft-positions needs --speculation" in capsys.readouterr().err


def test_a_run_that_does_not_depend_on_eta_runs_once_and_matches_a_fresh_run(capsys) -> None:
    """verl-sync (bound 0) and one-step-off (bound 1) run once for every eta; areal-tight at eta 3
    reuses areal's run at eta 2 when its p99 is within 3. Reused figures equal a fresh run's, with
    the share past eta measured against the eta of the row."""
    base = ["--workload", "small-ci", "--steps", "4", "--json", "--systems"]
    assert run_cli([*base, "verl-sync", "one-step-off", "areal", "areal-tight", "--eta", "2", "3"]) == 0
    grid = json.loads(capsys.readouterr().out)["by_eta"]
    assert run_cli([*base, "verl-sync", "one-step-off", "areal", "--eta", "2"]) == 0
    fresh = json.loads(capsys.readouterr().out)["systems"]
    for name in ("verl-sync", "one-step-off"):
        assert not grid["2"]["systems"][name]["reused_run"] and grid["3"]["systems"][name]["reused_run"]
        assert grid["3"]["systems"][name]["tokens_per_s"] == fresh[name]["tokens_per_s"]
        assert grid["3"]["systems"][name]["step_times_s"] == fresh[name]["step_times_s"]
    tight, areal = grid["3"]["systems"]["areal-tight"], fresh["areal"]
    assert tight["admission_eta"] == 2 and tight["reused_run"] and tight["staleness_p99"] <= 3
    assert tight["tokens_per_s"] == areal["tokens_per_s"] and tight["staleness_histogram"] == areal["staleness_histogram"]
    hist = {int(k): v for k, v in areal["staleness_histogram"].items()}
    assert areal["past_eta_share"] == pytest.approx(sum(v for k, v in hist.items() if k > 2) / sum(hist.values()))
    assert tight["past_eta_share"] == pytest.approx(sum(v for k, v in hist.items() if k > 3) / sum(hist.values()))
    assert areal["past_eta_share"] > tight["past_eta_share"]


def test_rollout_gpus_re_splits_the_workload(capsys) -> None:
    base = ["--workload", "small-ci", "--systems", "staleflow", "--eta", "1", "--steps", "3", "--json"]
    assert run_cli([*base, "--rollout-gpus", "2"]) == 0
    split = json.loads(capsys.readouterr().out)["systems"]["staleflow"]
    assert split["instances"] == 2  # 2 of small-ci's 5 GPUs roll out, 3 train
    assert run_cli([*base, "--rollout-gpus", "5"]) == 2
    assert "gpus_per_instance (1) from 1 to 4 (the job has 5 GPUs), got 5" in " ".join(capsys.readouterr().err.split())

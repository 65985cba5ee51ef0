"""``staleflow bench convergence``: aggregation of fabricated runs (no training)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from staleflow.bench import convergence
from staleflow.bench.convergence import aggregate, load_run


def _write_run(
    folder: Path, rewards: list[float], elapsed: list[float], evals: tuple[float, float], tokens_per_s: float, staleness: dict[str, int]
) -> None:
    folder.mkdir(parents=True)
    records: list[dict[str, object]] = [{"kind": "eval", "step": 0, "eval_reward": evals[0], "eval_exact": 0.0}]
    for step, (reward, t) in enumerate(zip(rewards, elapsed), start=1):
        records.append(
            {
                "kind": "step",
                "step": step,
                "reward_mean": reward,
                "elapsed_s": t,
                "tokens_per_s": tokens_per_s * step / len(rewards),
                "group_staleness": staleness if step == 2 else {"0": 16},
            }
        )
    records.append({"kind": "checkpoint", "step": len(rewards), "path": "x"})
    records.append({"kind": "eval", "step": len(rewards), "eval_reward": evals[1], "eval_exact": 0.0})
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    (folder / "summary.json").write_text(json.dumps({"steps": len(rewards)}), encoding="utf-8")


@pytest.fixture
def study(tmp_path: Path) -> Path:
    _write_run(tmp_path / "eta2-seed0", [0.1, 0.3, 0.5, 0.7], [1.0, 2.0, 3.0, 4.0], (0.2, 0.6), 100.0, {"0": 1, "2": 15})
    _write_run(tmp_path / "eta2-seed1", [0.3, 0.3, 0.3, 0.9], [2.0, 4.0, 6.0, 8.0], (0.4, 0.8), 300.0, {"1": 16})
    return tmp_path


def test_load_run_reads_the_figures(study: Path) -> None:
    run = load_run(study / "eta2-seed0", eta=2, seed=0)
    assert run.steps == [1, 2, 3, 4]
    assert run.rewards == [0.1, 0.3, 0.5, 0.7]
    assert (run.eval_start, run.eval_end) == (0.2, 0.6)
    assert run.tokens_per_s == 100.0  # the last step's cumulative figure
    assert run.max_staleness == 2


def test_aggregate_mean_spread_and_curves(study: Path) -> None:
    runs = [load_run(study / "eta2-seed0", 2, 0), load_run(study / "eta2-seed1", 2, 1)]
    f = aggregate(runs, smooth=2)[2]
    assert f["seeds"] == [0, 1]
    assert f["eval_start"] == pytest.approx(0.3)
    assert f["eval_start_std"] == pytest.approx(0.02**0.5)  # sample stdev of 0.2, 0.4
    assert f["eval_end"] == pytest.approx(0.7)
    assert (f["eval_gain"], f["eval_gain_std"]) == pytest.approx((0.4, 0.0))
    assert f["reward_last"] == pytest.approx(0.6)  # (0.5 + 0.7) / 2 and (0.3 + 0.9) / 2
    assert f["reward_last_std"] == pytest.approx(0.0)
    assert f["tokens_per_s"] == pytest.approx(200.0)
    assert f["tokens_per_s_std"] == pytest.approx(141.4213562)
    assert f["run_loop_s"] == pytest.approx(6.0)
    assert f["common_s"] == 4.0
    assert f["reward_at_common_s"] == pytest.approx(0.45)
    assert f["reward_at_common_s_std"] == pytest.approx(0.045**0.5)  # sample stdev of 0.6, 0.3
    assert f["max_staleness"] == {0: 2, 1: 1}
    assert f["bound_ok"] is True
    # trailing means of 2: seed 0 [0.1, 0.2, 0.4, 0.6], seed 1 [0.3, 0.3, 0.3, 0.6]
    assert f["curve_step"]["mean"] == pytest.approx([0.2, 0.25, 0.35, 0.6])
    assert f["curve_step"]["min"] == pytest.approx([0.1, 0.2, 0.3, 0.6])
    assert f["curve_step"]["max"] == pytest.approx([0.3, 0.3, 0.4, 0.6])
    # time curves run from the later first step (2 s) to the shorter run's end (4 s)
    assert (f["curve_time"]["t"][0], f["curve_time"]["mean"][0]) == pytest.approx((2.0, 0.25))
    # at 4 s seed 0 is at 0.6, seed 1 at 0.3
    assert f["curve_time"]["t"][-1] == pytest.approx(4.0)
    assert f["curve_time"]["mean"][-1] == pytest.approx(0.45)
    assert (f["curve_time"]["min"][-1], f["curve_time"]["max"][-1]) == pytest.approx((0.3, 0.6))


def test_a_run_beyond_its_bound_is_flagged(study: Path) -> None:
    f = aggregate([load_run(study / "eta2-seed0", eta=1, seed=0)], smooth=2)[1]
    assert f["bound_ok"] is False
    assert f["eval_end_std"] == 0.0  # a single seed has no spread


def test_seeds_with_different_steps_are_refused(study: Path, tmp_path: Path) -> None:
    _write_run(tmp_path / "short", [0.1, 0.2], [1.0, 2.0], (0.1, 0.2), 50.0, {"0": 16})
    runs = [load_run(study / "eta2-seed0", 2, 0), load_run(tmp_path / "short", 2, 1)]
    with pytest.raises(ValueError, match="eta 2: the seeds' runs have different steps"):
        aggregate(runs, smooth=2)


def test_command_aggregates_finished_runs_without_training(study: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    convergence.add_arguments(parser)
    args = parser.parse_args(["--etas", "2", "--seeds", "0", "1", "--steps", "4", "--smooth", "2", "--out", str(study), "--no-train"])
    assert convergence.run(args) == 0
    figures = json.loads((study / "convergence.json").read_text(encoding="utf-8"))
    assert figures["etas"]["2"]["tokens_per_s"] == pytest.approx(200.0)
    assert (study / "convergence.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert (
        "| 2 | 0 1 | 0.300 ± 0.141 -> 0.700 ± 0.141 | +0.400 ± 0.000 | 0.600 ± 0.000 | 0.450 ± 0.212 | 200 ± 141 | 6 s | 2, 1 (ok) |" in out
    )
    assert "staleflow bench convergence --etas 2 --seeds 0 1 --steps 4" in out


def test_a_finished_run_of_other_steps_is_not_mixed_in(study: Path) -> None:
    with pytest.raises(ValueError, match="finished run of 4 steps, not 5"):
        convergence.train_one(2, 0, steps=5, out=study, quiet=True)


def test_a_run_without_steps_evaluations_or_rewards_is_refused(tmp_path: Path) -> None:
    def metrics(folder: str, records: list[dict]) -> Path:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        return tmp_path / folder

    evals = [{"kind": "eval", "step": 0, "eval_reward": 0.1}, {"kind": "eval", "step": 1, "eval_reward": 0.2}]
    step = {"kind": "step", "step": 1, "reward_mean": 0.5, "elapsed_s": 1.0, "tokens_per_s": 10.0}
    with pytest.raises(ValueError, match="no-steps: metrics.jsonl has no training steps"):
        load_run(metrics("no-steps", evals), 1, 0)
    with pytest.raises(ValueError, match="needs a start and an end evaluation \\(found 1\\)"):
        load_run(metrics("one-eval", [evals[0], step]), 1, 0)
    with pytest.raises(ValueError, match="steps \\[1\\] have no reward_mean"):
        load_run(metrics("no-reward", [*evals, {**step, "reward_mean": None}]), 1, 0)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    convergence.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_bad_arguments_and_an_empty_study_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert convergence.run(_args("--etas", "-1", "--steps", "0", "--out", str(tmp_path), "--no-train")) == 2
    assert capsys.readouterr().err == "error: --steps must be >= 1 (got 0); --etas: eta must be >= 0 (got -1)\n"
    assert convergence.run(_args("--etas", "2", "--steps", "4", "--out", str(tmp_path / "empty"), "--no-train")) == 2
    assert f"error: no finished run of 4 steps in {tmp_path / 'empty'}" in capsys.readouterr().err


def test_a_training_run_that_fails_is_listed_with_its_log_and_fails_the_study(
        study: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """eta 3's run is started for real and is refused at once (an unknown config key stands in for a
    crash); its leftover folder from an earlier attempt is removed first, and eta 2's finished runs
    are kept and aggregated."""
    def refused(eta: int, seed: int, steps: int, run_dir: Path) -> list[str]:
        return ["staleflow", "train", "no.such.key=1", "--run-dir", str(run_dir)]

    monkeypatch.setattr(convergence, "train_command", refused)
    (study / "eta3-seed0").mkdir()
    (study / "eta3-seed0" / "metrics.jsonl").write_text("{}\n", encoding="utf-8")  # started, never finished
    assert convergence.run(_args("--etas", "2", "3", "--seeds", "0", "--steps", "4", "--smooth", "2", "--out", str(study))) == 1
    out = capsys.readouterr().out
    assert f"staleflow train no.such.key=1 --run-dir {study / 'eta3-seed0'}  (log {study / 'logs' / 'eta3-seed0.log'})" in out
    assert "    exit 2 after " in out and f"runs that did not finish (see {study / 'logs'}): eta3-seed0" in out
    assert "unknown key" in (study / "logs" / "eta3-seed0.log").read_text(encoding="utf-8")
    assert not (study / "eta3-seed0").exists()
    figures = json.loads((study / "convergence.json").read_text(encoding="utf-8"))
    assert figures["failed"] == ["eta3-seed0"] and list(figures["etas"]) == ["2"]

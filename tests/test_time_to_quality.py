"""``staleflow bench time-to-quality``: threshold crossings, medians and speed-ups on recorded metrics
(no training), the study's cells and order, its files and bad input; and the deferred evaluation
``staleflow train`` runs it with (the weights saved at a step are the ones evaluated after the loop)."""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import pytest
from staleflow.bench import time_to_quality as ttq
from staleflow.bench.time_to_quality import cells, read_run, speedups, study_order, summarise_cell


def _records(
    evals: dict[int, float], elapsed: dict[int, float], deferred: bool = True, eval_s: float = 0.0, staleness: dict | None = None
) -> list[dict]:
    """Metrics records of a run: steps with their run-loop time, evaluations inline (after their
    step, taking ``eval_s``) or deferred (all after the loop)."""
    records: list[dict] = [{"kind": "eval", "step": 0, "eval_reward": evals[0], "eval_s": eval_s}]
    late = []
    for step, t in sorted(elapsed.items()):
        records.append(
            {"kind": "step", "step": step, "elapsed_s": t, "tokens_trained": 100 * step, "train_s": 0.5,
             "group_staleness": staleness or {"1": 1, "2": 3}, "utilisation": 0.9, "sync_seconds": 0.1 * step}
        )  # fmt: skip
        if step in evals:
            record = {"kind": "eval", "step": step, "eval_reward": evals[step], "eval_s": eval_s}
            (late if deferred else records).append({**record, "eval_deferred": True} if deferred else record)
    return records + late


def test_read_run_times_each_evaluation_by_the_run_loop() -> None:
    run = read_run(_records({0: 0.1, 2: 0.2, 4: 0.3}, {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}), "staleflow", 2, 0)
    assert run.eval_t == [0.0, 2.0, 4.0] and run.eval_reward == [0.1, 0.2, 0.3]
    assert (run.time_to(0.15), run.time_to(0.2), run.time_to(0.3)) == (2.0, 2.0, 4.0)
    assert run.time_to(0.31) == math.inf and run.time_to(0.05) == 0.0
    assert (run.time_to(0.1, gain=True), run.time_to(0.2, gain=True), run.time_to(0.25, gain=True)) == (2.0, 4.0, math.inf)
    assert run.loop_s == 4.0 and run.tokens_per_s == 100.0
    assert run.staleness == {1: 4, 2: 12} and run.mean_staleness == pytest.approx(1.75)
    assert run.train_s == 2.0 and run.utilisation == 0.9 and run.weight_sync_s == pytest.approx(0.4) and run.steps == 4


def test_inline_evaluations_are_taken_out_of_the_run_loop_time() -> None:
    # an inline evaluation after step 2 took 0.5 s: steps 3 and 4 ended 0.5 s later on the clock
    inline = _records({0: 0.1, 2: 0.2, 4: 0.3}, {1: 1.0, 2: 2.0, 3: 3.5, 4: 4.5}, deferred=False, eval_s=0.5)
    run = read_run(inline, "sync", 0, 0)
    assert run.eval_t == [0.0, 2.0, 4.0] and run.loop_s == 4.0


def test_bad_runs_are_named() -> None:
    with pytest.raises(ValueError, match="sync eta 0 seed 1: no training steps"):
        read_run([{"kind": "eval", "step": 0, "eval_reward": 0.1}], "sync", 0, 1)
    with pytest.raises(ValueError, match="needs at least 2 evaluations"):
        read_run(_records({0: 0.1}, {1: 1.0}), "sync", 0, 1)
    records = _records({0: 0.1, 2: 0.2}, {1: 1.0, 2: 2.0})
    records[-1]["step"] = 7
    with pytest.raises(ValueError, match="evaluations at steps \\[7\\] without a step record"):
        read_run(records, "sync", 0, 1)


def _run(system: str, seed: int, evals: dict[int, float], seconds_per_step: float):
    return read_run(_records(evals, {s: s * seconds_per_step for s in range(1, 5)}), system, 0 if system == "sync" else 2, seed)


def test_median_spread_not_reached_and_speedup_against_sync() -> None:
    sync = [_run("sync", s, {0: 0.1, 2: 0.2, 4: v}, 2.0) for s, v in enumerate((0.3, 0.3, 0.25))]
    fast = [_run("staleflow", s, {0: 0.1, 2: v, 4: 0.3}, 1.0) for s, v in enumerate((0.2, 0.1, 0.2))]
    figures = {"sync-eta0": summarise_cell(sync, [0.2, 0.3]), "staleflow-eta2": summarise_cell(fast, [0.2, 0.3])}
    speedups(figures, [0.2, 0.3])
    s, f = figures["sync-eta0"], figures["staleflow-eta2"]
    assert s["time_to"]["0.2"] == {"median": 4.0, "min": 4.0, "max": 4.0, "reached": 3, "per_seed": [4.0, 4.0, 4.0]}
    assert s["time_to"]["0.3"]["median"] == 8.0 and s["time_to"]["0.3"]["reached"] == 2  # one seed never reached it
    assert f["time_to"]["0.2"]["per_seed"] == [2.0, 4.0, 2.0] and f["time_to"]["0.2"]["median"] == 2.0
    assert f["speedup"] == {"0.2": 2.0, "0.3": 2.0}
    assert f["speedup_paired"] == {"0.2": 2.0, "0.3": None}  # per seed 4/2, 4/4, 4/2; sync seed 2 never reached 0.3
    assert s["speedup"] == {"0.2": 1.0, "0.3": 1.0}
    # the fitted learning rate: least-squares slope of every evaluation, per 100 s and per 100 steps
    assert s["gain_per_100s"]["per_seed"] == pytest.approx([2.5, 2.5, 1.875]) and s["gain_per_100s"]["median"] == pytest.approx(2.5)
    assert f["gain_per_100s"]["per_seed"] == pytest.approx([5.0, 5.0, 5.0])
    assert f["gain_per_100_steps"] == pytest.approx(5.0) and s["gain_per_100_steps"] == pytest.approx(5.0)
    assert f["rate_vs_sync"] == pytest.approx(2.0) and f["rate_vs_sync_paired"] == pytest.approx(2.0)  # per seed 2, 2, 2.67
    assert "+5.000 (+5.000 to +5.000) [2.00x; paired 2.00x] | +5.000 |" in ttq.table(figures, [0.2, 0.3])
    assert f["staleness"] == {1: 12, 2: 36} and f["mean_staleness"] == pytest.approx(1.75) and f["max_staleness"] == 2
    assert f["tokens_per_s"] == pytest.approx(100.0) and s["tokens_per_s"] == pytest.approx(50.0)
    assert f["trainer_busy"] == pytest.approx(0.5)  # 4 steps x 0.5 s over 4 s
    assert (f["step_s"], f["train_s_per_step"], f["weight_sync_s_per_step"]) == pytest.approx((1.0, 0.5, 0.1))
    # half the seeds missing a threshold: the median is "not reached", and so is the speed-up
    worse = summarise_cell([sync[2], _run("sync", 3, {0: 0.1, 2: 0.2, 4: 0.2}, 2.0)], [0.3])
    assert worse["time_to"]["0.3"]["median"] == math.inf
    figures = {"sync-eta0": worse, "staleflow-eta2": summarise_cell(fast, [0.3])}
    speedups(figures, [0.3])
    assert figures["staleflow-eta2"]["speedup"] == {"0.3": None}
    assert "not reached" in ttq.table(figures, [0.3])
    assert "to +0.3: median" in ttq.table(figures, [0.3], gain=True)
    assert summarise_cell(sync, [0.15], gain=True)["time_to"]["0.15"]["per_seed"] == [8.0, 8.0, 8.0]  # 0.1 + 0.15 reached at step 4
    assert ttq.json_safe({"a": [math.inf, 1.0]}) == {"a": [None, 1.0]}
    # a threshold every run met before the first step: no speed-up, and no division by zero
    figures = {"sync-eta0": summarise_cell(sync, [0.05]), "staleflow-eta2": summarise_cell(fast, [0.05])}
    speedups(figures, [0.05])
    assert figures["staleflow-eta2"]["time_to"]["0.05"]["median"] == 0.0
    assert figures["staleflow-eta2"]["speedup"] == {"0.05": None} and figures["staleflow-eta2"]["speedup_paired"] == {"0.05": None}


def test_cells_and_the_rotated_order() -> None:
    assert cells(["sync", "one-step-off", "staleflow", "staleflow-fresh"], [1, 2]) == [
        ("sync", 0), ("one-step-off", 1), ("staleflow", 1), ("staleflow", 2), ("staleflow-fresh", 1), ("staleflow-fresh", 2),
    ]  # fmt: skip
    order = study_order([("sync", 0), ("staleflow", 2)], [5, 6, 7])
    assert order == [("sync", 0, 5), ("staleflow", 2, 5), ("staleflow", 2, 6), ("sync", 0, 6), ("sync", 0, 7), ("staleflow", 2, 7)]


def _args(out: Path, **changes) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    ttq.add_arguments(parser)
    args = parser.parse_args(["--out", str(out), "--systems", "sync", "staleflow", "--seeds", "0", "1", "--steps", "4",
                              "--thresholds", "0.2", "0.3", "--no-train"])  # fmt: skip
    for key, value in changes.items():
        setattr(args, key, value)
    return args


def test_the_study_writes_its_table_plot_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for system, eta, per_step in (("sync", 0, 2.0), ("staleflow", 2, 1.0)):
        for seed in (0, 1):
            folder = tmp_path / f"{system}-eta{eta}-seed{seed}"
            folder.mkdir()
            staleness = {"0": 4} if eta == 0 else None
            records = _records({0: 0.1, 2: 0.2, 4: 0.3}, {s: s * per_step for s in range(1, 5)}, staleness=staleness)
            (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
            (folder / "summary.json").write_text(json.dumps({"steps": 4}))
    assert ttq.run(_args(tmp_path)) == 0
    figures = json.loads((tmp_path / "time-to-quality.json").read_text())
    assert figures["cells"]["staleflow-eta2"]["speedup"] == {"0.2": 2.0, "0.3": 2.0}
    assert [r["seed"] for r in figures["runs"]] == [0, 0, 1, 1]
    assert "| staleflow-eta2 | 2 | 2 s (2 s-2 s) [2.00x; paired 2.00x]" in (tmp_path / "time-to-quality.md").read_text()
    assert (tmp_path / "time-to-quality.png").stat().st_size > 10_000
    assert "reproduce: staleflow bench time-to-quality --systems sync staleflow" in capsys.readouterr().out
    # a run over its bound fails the study
    bad = tmp_path / "sync-eta0-seed1" / "metrics.jsonl"
    bad.write_text(bad.read_text().replace('"group_staleness": {"0": 4}', '"group_staleness": {"1": 4}'))
    assert ttq.run(_args(tmp_path)) == 1


def test_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert ttq.run(_args(tmp_path, systems=["verl", "areal"], steps=0, set=["x"], config=tmp_path / "none.yaml")) == 2
    err = capsys.readouterr().err
    for part in ("--steps must be >= 1", "'verl' is not a system a training job runs", "'areal' is not a system a training job runs",
                 "--set: 'x' is not KEY=VALUE", "none.yaml is not a file"):
        assert part in err
    assert ttq.run(_args(tmp_path / "empty")) == 2
    assert "no finished run of 4 steps" in capsys.readouterr().err


def test_deferred_evaluation_evaluates_the_weights_saved_at_each_step(tmp_path: Path) -> None:
    import torch
    from staleflow.adapters.torch.trainer import TorchTrainer
    from staleflow.app.evaluation import DeferredEvaluation, Evaluator
    from staleflow.app.job_parts import Tokens
    from staleflow.app.tiny_model import ensure_tiny_model
    from staleflow.runtime.settings.config import load_config

    model = ensure_tiny_model(Path(os.environ.get("STALEFLOW_TINY_MODEL_DIR", "~/.cache/staleflow/tiny-model")).expanduser())
    tokens = Tokens(model)
    config = load_config(overrides=["task.eval_prompts=8", "task.max_count=6", "rollout.max_new_tokens=8", "task.eval_timing=deferred"])
    evaluator = Evaluator(config, tokens, prompt_seed=3, model_dir=model)
    trainer = TorchTrainer(model, pad_id=tokens.pad_id)
    try:
        live = evaluator.run(trainer)
        logged: list[tuple[int, dict]] = []

        class Log:
            def eval(self, step: int, figures: dict) -> None:
                logged.append((step, figures))

        deferred = DeferredEvaluation(tmp_path / "snapshots", evaluator.run_saved)
        deferred.save(5, 3, trainer.weights())
        # another version: an output layer of zeros decodes token 0 every time
        broken = {k: torch.zeros_like(v) if k == "lm_head.weight" else v for k, v in trainer.weights().items()}
        deferred.save(10, 4, broken)
        assert sorted(p.name for p in (tmp_path / "snapshots").iterdir()) == ["step-10.safetensors", "step-5.safetensors"]
        deferred.run(Log())
    finally:
        trainer.close()
    assert [step for step, _ in logged] == [5, 10]
    first, second = logged[0][1], logged[1][1]
    assert first["eval_deferred"] is True and first["eval_version"] == 3 and second["eval_version"] == 4
    figures = ("eval_reward", "eval_exact", "eval_response_tokens")
    assert [first[k] for k in figures] == [live[k] for k in figures]  # the same weights decode the same answers
    assert second["eval_response_tokens"] != first["eval_response_tokens"]

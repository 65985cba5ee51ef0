"""The application side of real tasks: config keys, held-out evaluation through a rollout engine
(mean reward and pass@1 in the metrics), the start-up check of a scorer, warm-up gating, chat
rendering with the tiny model's template, and W&B logging (offline)."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import pytest
import torch
from skips import require
from staleflow.app.evaluation import EngineEvaluator
from staleflow.app.job_parts import wants_warmup
from staleflow.app.rewards import ScorerCheckError, check_scorer, scorer_arguments
from staleflow.runtime.run.rewarding import PooledReward
from staleflow.runtime.settings.config import ConfigError, load_config
from staleflow.runtime.tasks import Prompt, RewardSpecError
from staleflow.runtime.types import RolloutRequest, Trajectory

ARITHMETIC = Path(__file__).resolve().parents[1] / "runtime" / "settings" / "configs" / "arithmetic.yaml"


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8")


class ScriptedEngine:
    """A rollout engine that answers each prompt from a script (version-dependent)."""

    instance_id = "eval"

    def __init__(self, answers: dict[int, dict[str, list[str]]]) -> None:
        self.answers = answers
        self.version = -1
        self.loads: list[int] = []
        self._done: list[Trajectory] = []
        self._served: dict[str, int] = {}

    def load_weights(self, version: int, weights: object) -> None:
        self.loads.append(version)
        self.version = version
        self.weights = weights

    def submit(self, requests: list[RolloutRequest]) -> None:
        for r in requests:
            assert r.group_version <= self.version
            prompt = decode(r.prompt_ids)
            k = self._served.get(prompt, 0)
            self._served[prompt] = k + 1
            options = self.answers[self.version][prompt]
            text = options[k % len(options)]
            self._done.append(
                Trajectory(r.request_id, r.group_id, r.prompt_ids, encode(text), [0.0] * len(text), [self.version] * len(text), "stop")
            )

    def collect(self) -> list[Trajectory]:
        done, self._done = self._done, []
        return done

    def abort(self, ids: list[str]) -> None:
        pass


def _prepare(trajectory: Trajectory, metadata: dict) -> tuple:
    return scorer_arguments(decode(trajectory.output_ids), metadata)


PROMPTS = [Prompt("Ann has 2 pens and buys 3 more?", "5"), Prompt("Ben has 9 cups and loses 4?", "5"), Prompt("Jo has 1 key?", "1")]


@pytest.mark.slow
def test_engine_evaluation_reports_mean_reward_and_pass_at_1() -> None:
    engine = ScriptedEngine(
        {
            0: {PROMPTS[0].text: ["#### 5"], PROMPTS[1].text: ["#### 6"], PROMPTS[2].text: ["one"]},
            3: {PROMPTS[0].text: ["#### 5", "#### 4"], PROMPTS[1].text: ["#### 5"], PROMPTS[2].text: ["#### 1", "#### 1"]},
        }
    )
    evaluator = EngineEvaluator(
        engine, PROMPTS, encode=encode, reward=PooledReward("gsm8k", _prepare, workers=1), reward_timeout_s=30, max_new_tokens=8
    )
    try:
        greedy = evaluator.run(0, "model-v0")
        assert greedy["eval_reward"] == pytest.approx(1 / 3) and greedy["eval_pass@1"] == pytest.approx(1 / 3)
        assert greedy["eval_exact"] == greedy["eval_pass@1"] and greedy["eval_reward_failures"] == 0
        sampled = EngineEvaluator(
            engine,
            PROMPTS,
            encode=encode,
            reward=PooledReward("gsm8k", _prepare, workers=1),
            reward_timeout_s=30,
            max_new_tokens=8,
            samples=2,
            mode="sampled",
        )
        try:
            sampled.starts_at(0)
            engine.version = 0
            result = sampled.run(3, {"weights": 3})
            # prompt 0: 1 of 2 right; prompt 1: 2 of 2; prompt 2: 2 of 2 -> pass@1 (0.5 + 1 + 1) / 3
            assert result["eval_pass@1"] == pytest.approx(2.5 / 3) and result["eval_reward"] == pytest.approx(5 / 6)
            assert result["eval_version"] == 3 and engine.loads[-1] == 3
        finally:
            sampled.close()
        engine._served.clear()
        latest = evaluator.run(3, {"weights": 3})  # one response per prompt: the script's first answers
        assert latest["eval_pass@1"] == 1.0 and latest["eval_reward"] == 1.0
    finally:
        evaluator.close()


def test_the_evaluation_engine_gets_a_version_as_the_rollout_instances_pull_it_not_from_the_trainer(tmp_path: Path) -> None:
    """The job's evaluation loads version v through the run's parameter server (whatever it hands a
    rollout instance's Pull: a reference, a transfer), after the push in flight, never the trainer's
    state dict written to a file of its own; version 0 is the folder the instances start from."""
    from collections import Counter
    from types import SimpleNamespace

    from staleflow.app.training_job import TrainingJob
    from staleflow.runtime.run.weight_sync import WeightPublisher
    from staleflow.runtime.servers.parameter_server import ParameterServer

    handed_out = object()  # what the parameter server hands a Pull of version 3
    publisher = WeightPublisher(ParameterServer(copy_weights=lambda w: w), background=True, counters=Counter())
    publisher.push(3, handed_out)  # in the background: the evaluation waits for it
    engine = ScriptedEngine({v: {PROMPTS[0].text: ["#### 5"]} for v in (0, 3)})
    logged: list[tuple[int, dict]] = []
    job = TrainingJob(load_config(overrides=["warmup.when=never"]), tmp_path / "run")
    job._evaluator = EngineEvaluator(engine, PROMPTS[:1], encode=encode, reward=lambda t, m: 1.0, reward_timeout_s=30, max_new_tokens=8)
    job._loop = SimpleNamespace(weights=publisher)
    job._log = SimpleNamespace(eval=lambda step, figures: logged.append((step, figures)))
    job.model_v0 = tmp_path / "model-v0"
    try:
        job.trainer = SimpleNamespace(version=0, weights=lambda: pytest.fail("the trainer's weights went to the evaluation engine"))
        job._log_eval(0)
        assert engine.loads == [0] and engine.weights == str(tmp_path / "model-v0")
        job.trainer.version = 3
        job._log_eval(2)
        assert engine.loads == [0, 3] and engine.weights is handed_out
        assert [(step, figures["eval_version"]) for step, figures in logged] == [(0, 0), (2, 3)]
    finally:
        job._evaluator.close()
        publisher.close()


def test_new_task_keys_validate_and_the_shipped_config_loads() -> None:
    config = load_config(ARITHMETIC)
    assert config.task.reward == "gsm8k" and config.task.answer_key == "reward_model.ground_truth"
    assert config.task.eval_file == "data/arithmetic-eval.jsonl" and config.task.solution_key == "extra_info.answer"
    assert load_config(overrides=["task.reward=my_rewards:score", "task.prompt_file=x.jsonl"]).task.reward == "my_rewards:score"
    with pytest.raises(ConfigError, match="task.reward: 'bleu score' is not a scorer; allowed: repeat_letter, exact_match, gsm8k, math"):
        load_config(overrides=["task.reward=bleu score"])
    with pytest.raises(ConfigError, match="task.eval_samples=4 needs task.eval_sampling=sampled"):
        load_config(overrides=["task.eval_samples=4"])
    with pytest.raises(ConfigError, match="task.long_prompts: .*allowed: one of refuse, filter"):
        load_config(overrides=["task.long_prompts=truncate"])
    with pytest.raises(ConfigError, match="metrics.wandb.mode: .*allowed: one of online, offline"):
        load_config(overrides=["metrics.wandb.mode=cloud"])


def test_warmup_applies_to_the_tiny_model_only_unless_asked() -> None:
    assert wants_warmup(load_config())
    assert not wants_warmup(load_config(overrides=["model.path=/models/qwen"]))
    assert wants_warmup(load_config(overrides=["model.path=/models/qwen", "warmup.when=always"]))
    assert not wants_warmup(load_config(overrides=["warmup.when=never"]))
    assert not wants_warmup(load_config(overrides=["warmup.steps=0"]))


class _Data:
    def __init__(self, rows: list[Prompt]) -> None:
        self.train, self.held_out = rows, None


def test_a_scorer_is_checked_at_start_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "startup_scorers.py").write_text(
        textwrap.dedent(
            """
            def good(prompt, response, answer, metadata):
                return 1.0 if response == answer else 0.0

            def text(prompt, response, answer, metadata):
                return "yes"
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [Prompt("q", "42", {"data_source": "x"})]
    check_scorer(
        load_config(overrides=["task.reward=startup_scorers:good", "task.prompt_file=x.jsonl", "task.reward_timeout_s=20."]), _Data(rows)
    )
    with pytest.raises(ScorerCheckError, match="returned str \\('yes'\\), not a number"):
        check_scorer(
            load_config(overrides=["task.reward=startup_scorers:text", "task.prompt_file=x.jsonl", "task.reward_timeout_s=20."]),
            _Data(rows),
        )
    with pytest.raises(RewardSpecError, match="cannot import module 'missing_scorers'"):
        check_scorer(load_config(overrides=["task.reward=missing_scorers:f", "task.prompt_file=x.jsonl"]), _Data(rows))
    with pytest.raises(ScorerCheckError, match="gsm8k answer must be a number"):  # a built-in scorer on the wrong data
        check_scorer(load_config(overrides=["task.reward=gsm8k", "task.prompt_file=x.jsonl"]), _Data([Prompt("q", "forty")]))


def test_scorer_arguments_carry_the_row_not_the_run_keys() -> None:
    metadata = {
        "prompt": "text",
        "answer": "7",
        "max_new_tokens": 8,
        "source_prompt": [{"role": "user", "content": "q"}],
        "data_source": "d",
    }
    assert scorer_arguments("#### 7", metadata) == ([{"role": "user", "content": "q"}], "#### 7", "7", {"data_source": "d"})


def test_chat_rendering_with_the_tiny_models_template(tmp_path: Path, tiny_model: Path) -> None:
    from staleflow.app.job_parts import TaskData, Tokens

    model = tiny_model
    row = {
        "prompt": [{"role": "user", "content": "Ann has 2 pens and buys 3 more. How many pens now?"}],
        "reward_model": {"ground_truth": "5"},
    }
    (tmp_path / "p.jsonl").write_text(
        json.dumps(row) + "\n" + json.dumps({**row, "prompt": [{"role": "user", "content": "x" * 80}]}) + "\n"
    )
    overrides = [f"task.prompt_file={tmp_path / 'p.jsonl'}", "task.answer_key=reward_model.ground_truth", "task.reward=gsm8k"]
    tokens = Tokens(model, "auto")
    assert tokens.has_template
    with pytest.raises(ValueError, match="p.jsonl: line 2: prompt has 80 tokens, more than max_prompt_tokens=64"):
        TaskData(load_config(overrides=[*overrides, "task.max_prompt_tokens=64"]), tokens)
    data = TaskData(load_config(overrides=[*overrides, "task.max_prompt_tokens=64", "task.long_prompts=filter"]), tokens)
    assert [p.text for p in data.train] == [row["prompt"][0]["content"]]  # the template joins contents
    assert data.filtered == {str(tmp_path / "p.jsonl"): (1, 2)}


@pytest.mark.slow
def test_wandb_offline_logs_train_and_eval_scalars(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require("wandb", "tracking")
    from staleflow.app.metrics import MetricsLog

    monkeypatch.setenv("WANDB_SILENT", "true")
    settings = load_config(overrides=["metrics.wandb.project=staleflow-test"]).metrics.wandb.model_dump()
    log = MetricsLog(tmp_path, total_steps=2, tensorboard=False, progress=False, wandb=settings, wandb_config={"seed": 0})
    log.step(1, {"reward_mean": 0.5, "loss": 0.1})
    log.eval(1, {"eval_reward": 0.25, "eval_pass@1": 0.2})
    log.close()
    (record,) = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    deadline = time.monotonic() + 30  # wandb-core may still be writing the offline record after finish()
    while b"eval/eval_reward" not in record.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.2)
    data = record.read_bytes()
    for key in (b"train/reward_mean", b"eval/eval_pass@1", b"eval/eval_reward"):
        assert key in data
    assert (tmp_path / "wandb-run-id").read_text() in record.name
    assert [json.loads(line)["kind"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == ["step", "eval"]


USER_SCORER = 'def score(prompt, response, answer, metadata):\n    return 1.0 if response == "ok" else 0.25\n'


def test_a_users_scorer_with_evaluation_off_sets_the_job_up(tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts from a file, ``task.reward=module:function``, ``task.eval_prompts=0 task.eval_every=0``: the
    disabled evaluator no longer looks the reward up in the built-in table (it stopped the job at
    start-up with ``unknown reward 'my_scorer_a:score'``)."""
    from staleflow.app.evaluation import Evaluator, make_evaluator
    from staleflow.app.job_parts import TaskData, Tokens

    (tmp_path / "my_scorer_a.py").write_text(USER_SCORER)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"prompt": f"say ok {i}", "answer": "ok"}) + "\n" for i in range(3)))
    config = load_config(overrides=[f"task.prompt_file={tmp_path / 'rows.jsonl'}", "task.reward=my_scorer_a:score",
                                    "task.eval_prompts=0", "task.eval_every=0"])
    tokens = Tokens(tiny_model)
    data = TaskData(config, tokens)
    evaluator = make_evaluator(config, tokens, data, placement=None, base=tiny_model, clock=None, weights_dir=tmp_path, engines=[])
    assert isinstance(evaluator, Evaluator) and not evaluator.enabled
    assert [p.answer for p in data.train] == ["ok"] * 3


def test_the_trainers_greedy_evaluation_scores_through_the_resolved_scorer(tiny_model: Path) -> None:
    """The built-in job's greedy evaluation scores with the scorer ``task.reward`` resolves to (the same
    figures as the built-in two-argument reward gives)."""
    from staleflow.app.evaluation import Evaluator
    from staleflow.app.job_parts import TaskData, Tokens
    from staleflow.runtime.tasks import repeat_letter_reward

    config = load_config(overrides=["task.eval_prompts=4"])
    tokens = Tokens(tiny_model)
    evaluator = Evaluator(config, tokens, prompt_seed=1, data=TaskData(config, tokens))
    prompts = evaluator._prompts

    class GreedyTrainer:
        def generate_greedy(self, ids: list[list[int]], max_new: int, eos_id: int) -> list[list[int]]:
            return [tokens.encode(p.answer if i == 0 else p.answer[0] * 2) for i, p in enumerate(prompts)]

    figures = evaluator.run(GreedyTrainer())
    expected = [1.0] + [repeat_letter_reward(p.answer[0] * 2, p.answer) for p in prompts[1:]]
    assert figures["eval_reward"] == pytest.approx(sum(expected) / 4)
    assert figures["eval_exact"] == pytest.approx(sum(1 for r in expected if r == 1.0) / 4)


def test_the_progress_bar_and_tensorboard_record_what_the_jsonl_does(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``metrics.progress`` and ``metrics.tensorboard`` on: the bar's last state (reward, staleness
    histogram, versions), evaluations and events on the console, the scalars in TensorBoard's event
    file, and a NaN written to ``metrics.jsonl`` as null (JSON has none)."""
    from staleflow.app.metrics import MetricsLog, read_metrics
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLog(tmp_path, total_steps=2, tensorboard=True, progress=True)
    log.step(1, {"reward_mean": 0.5, "tokens_per_s": 1234.4, "loss": float("nan"), "group_staleness": {"1": 3, "0": 5}}, versions=[0, 1])
    task = log._progress.tasks[0]  # type: ignore[union-attr]
    assert (task.completed, task.total) == (1, 2)
    assert task.fields == {"reward": "0.500", "tps": "1234", "staleness": "0:5 1:3", "versions": "0/1"}
    log.eval(1, {"eval_reward": 0.25, "eval_rows": 8})
    log.event("checkpoint", step=1, path="checkpoints/step-000001")
    log.close()
    out = capsys.readouterr().out
    assert "eval at step 1: eval_reward 0.250" in out and "checkpoint: step=1, path=checkpoints/step-000001" in out
    records = read_metrics(tmp_path)
    assert [r["kind"] for r in records] == ["step", "eval", "checkpoint"] and records[0]["loss"] is None
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"train/reward_mean", "train/tokens_per_s", "eval/eval_reward", "eval/eval_rows"}
    assert [(e.step, e.value) for e in events.Scalars("train/reward_mean")] == [(1, 0.5)]


def test_the_base_model_is_the_users_folder_or_a_tiny_model_per_seed(tmp_path: Path) -> None:
    """``model.path`` without a ``config.json`` is refused by name; a user's folder is version 0 itself
    when there is no warm-up (not copied); the tiny model gets one folder per ``model.seed``, and
    different seeds different weights."""
    from safetensors.torch import load_file
    from staleflow.app.job_parts import base_model, warm_start

    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=f"model.path {tmp_path / 'empty'} is not a local model folder \\(no config.json\\)"):
        base_model(load_config(overrides=[f"model.path={tmp_path / 'empty'}"]))
    folders = {seed: base_model(load_config(overrides=[f"model.tiny_model_dir={tmp_path / 'tiny'}", f"model.seed={seed}"]))
               for seed in (0, 3)}
    assert folders == {0: tmp_path / "tiny", 3: tmp_path / "tiny-seed3"}
    weights = [load_file(str(next(folders[seed].glob("*.safetensors")))) for seed in (0, 3)]
    assert weights[0].keys() == weights[1].keys() and any(not torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    user = load_config(overrides=[f"model.path={folders[3]}", "warmup.when=never"])
    assert warm_start(user, folders[3], tmp_path / "run" / "model-v0", tokens=None) == (folders[3], 0.0)  # type: ignore[arg-type]
    assert not (tmp_path / "run").exists()

"""Rewards: the built-in scorers on known answers, users' module:function scorers (sync and async),
clear errors for unusable scorers, and the worker-process pool (a hanging scorer times out while
other groups go on; a dead worker is replaced)."""

from __future__ import annotations

import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest
from skips import require
from staleflow.runtime.run.rewarding import PooledReward, RewardRunner, ScorerPool
from staleflow.runtime.tasks import (
    RewardSpecError,
    ScorerResultError,
    check_reward_spec,
    gsm8k_reward,
    math_reward,
    resolve_scorer,
    score_items,
)
from staleflow.runtime.types import Trajectory

GSM8K_SOLUTION = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether.\n#### 72"


@pytest.mark.parametrize(
    "response, answer, reward",
    [
        (GSM8K_SOLUTION, "72", 1.0),  # a correct GSM8K answer ending in #### 72
        ("so #### 72.0", "72", 1.0),
        ("#### 1,000", "1000", 1.0),
        ("#### $18", "18", 1.0),
        ("#### 5 then #### 72", "72", 1.0),  # the last one counts
        ("#### 71", "72", 0.0),
        ("The answer is 72", "72", 0.0),  # strict format: no '#### N'
        ("", "72", 0.0),
        ("#### -3", "-3", 1.0),
        ("#### 72", GSM8K_SOLUTION, 1.0),  # the reference may be a whole GSM8K solution
    ],
)
def test_gsm8k_reward(response: str, answer: str, reward: float) -> None:
    assert gsm8k_reward(response, answer) == reward


def test_gsm8k_reward_refuses_a_non_numeric_answer() -> None:
    with pytest.raises(ValueError, match="gsm8k answer must be a number"):
        gsm8k_reward("#### 3", "three")


def test_math_reward_uses_math_verify() -> None:
    require("math_verify", "rewards")
    assert math_reward("so the answer is $\\boxed{\\frac{1}{2}}$", "0.5") == 1.0
    assert math_reward("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}") == 1.0
    assert math_reward("\\boxed{3}", "\\frac{1}{2}") == 0.0
    assert math_reward("no answer here", "7") == 0.0
    assert math_reward("The final answer is $\\boxed{x^2+2x+1}$", "(x+1)^2") == 1.0


@pytest.fixture
def user_scorers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "my_scorers.py").write_text(
        textwrap.dedent(
            """
            import asyncio, os, time

            def length_bonus(prompt, response, answer, metadata):
                return float(response == answer) + metadata.get("bonus", 0.0)

            async def async_match(prompt, response, answer, metadata):
                await asyncio.sleep(0.01)
                return 1 if answer in response else 0

            def sees_prompt(prompt, response, answer, metadata):
                return 1.0 if isinstance(prompt, list) and prompt[0]["role"] == "user" else 0.0

            def words(prompt, response, answer, metadata):
                return "one"

            def hangs(prompt, response, answer, metadata):
                if response == "hang":
                    time.sleep(600)
                return 1.0

            def dies(prompt, response, answer, metadata):
                os._exit(3)

            def two_args(response, answer):
                return 1.0

            NOT_A_FUNCTION = 3
            """
        )
    )
    (tmp_path / "broken_scorers.py").write_text("import not_a_module_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_scorers"
    for name in ("my_scorers", "broken_scorers"):
        sys.modules.pop(name, None)


def test_user_scorers_sync_and_async(user_scorers: str) -> None:
    sync = resolve_scorer(f"{user_scorers}:length_bonus")
    assert score_items("s", sync, [(None, "42", "42", {"bonus": 0.5}), (None, "41", "42", {})]) == [1.5, 0.0]
    async_scorer = resolve_scorer(f"{user_scorers}:async_match")
    assert score_items("a", async_scorer, [(None, "is 42", "42", {}), (None, "no", "42", {})]) == [1.0, 0.0]
    chat = resolve_scorer(f"{user_scorers}:sees_prompt")
    assert score_items("c", chat, [([{"role": "user", "content": "hi"}], "x", "y", {})]) == [1.0]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("bleu", "use one of repeat_letter, exact_match, gsm8k, math or 'module:function'"),
        ("no_such_module_xyz:score", "cannot import module 'no_such_module_xyz' \\(ModuleNotFoundError"),
        ("broken_scorers:score", "cannot import module 'broken_scorers' \\(ModuleNotFoundError: No module named 'not_a_module_anywhere'"),
        ("my_scorers:missing", "module 'my_scorers' has no attribute 'missing'"),
        ("my_scorers:NOT_A_FUNCTION", "'NOT_A_FUNCTION' is a int, not a function"),
        ("my_scorers:two_args", "cannot be called as score\\(prompt, response, answer, metadata\\)"),
    ],
)
def test_unusable_scorers_are_clear_errors_at_start_up(user_scorers: str, spec: str, message: str) -> None:
    with pytest.raises(RewardSpecError, match=message):
        check_reward_spec(spec)


def test_a_non_number_result_is_a_clear_error(user_scorers: str) -> None:
    with pytest.raises(ScorerResultError, match="scorer 'my_scorers:words' returned str \\('one'\\), not a number"):
        score_items("my_scorers:words", resolve_scorer("my_scorers:words"), [(None, "a", "b", {})])


def _trajectory(text: str) -> Trajectory:
    return Trajectory("r", "g", [1], [ord(c) for c in text], [0.0] * len(text), [0] * len(text), "stop")


def _prepare(trajectory: Trajectory, metadata: dict) -> tuple:
    return (metadata.get("prompt"), "".join(chr(i) for i in trajectory.output_ids), metadata["answer"], {})


@pytest.mark.slow
def test_a_hanging_scorer_is_cut_at_its_timeout_while_other_groups_go_on(user_scorers: str) -> None:
    """The timeout runs on a clock the test moves, so the machine's speed does not matter: the other
    group is scored while the hung one waits; just before its timeout the hung group is pending and its
    worker alive, once it passes the group fails with the timeout and its worker is killed and replaced."""
    now = [0.0]
    runner = RewardRunner(PooledReward(f"{user_scorers}:hangs", _prepare, workers=2), timeout_s=2.0, clock=lambda: now[0])
    try:
        runner.submit("hung", [_trajectory("hang")], {"answer": "x"})
        runner.submit("fine", [_trajectory("ok"), _trajectory("ok")], {"answer": "ok"})
        deadline, outcomes = time.monotonic() + 300, []
        while not outcomes:  # "fine" is queued after "hung": once it is scored, "hung" is in a worker
            assert time.monotonic() < deadline, "no scorer process scored the 'fine' group within 300 s"
            outcomes = runner.poll()  # never blocks: the run loop goes on meanwhile
            time.sleep(0.02)
        assert [(o.group_id, o.rewards, o.error) for o in outcomes] == [("fine", [1.0, 1.0], None)]
        (hung,) = [w.process for w in runner._scorers._workers if w.job == "hung"]  # type: ignore[union-attr]
        now[0] = 1.999  # just before the timeout: nothing is cut
        assert (runner.poll(), runner.pending(), runner.scorer_restarts, hung.is_alive()) == ([], 1, 0, True)
        now[0] = 2.0
        (late,) = runner.poll()
        assert (late.group_id, late.rewards, late.error) == ("hung", None, "reward timed out after 2.0 s")
        assert runner.pending() == 0 and runner.scorer_restarts == 1
        assert not hung.is_alive() and hung.exitcode == -signal.SIGKILL  # killed, not left hanging
        runner.submit("after", [_trajectory("ok")], {"answer": "ok"})  # the replaced worker scores again
        assert [(o.group_id, o.rewards) for o in runner.poll(block=True)] == [("after", [1.0])]
    finally:
        runner.close()


@pytest.mark.slow
def test_scorer_pool_reports_errors_and_replaces_dead_workers(user_scorers: str) -> None:
    pool = ScorerPool(f"{user_scorers}:words", workers=1, timeout_s=10)
    try:
        pool.submit("g", [(None, "a", "b", {})])
        (outcome,) = pool.poll(block=True)
        assert outcome.rewards is None and "returned str ('one'), not a number" in (outcome.error or "")
    finally:
        pool.close()
    pool = ScorerPool(f"{user_scorers}:dies", workers=1, timeout_s=10)
    try:
        pool.submit("g", [(None, "a", "b", {})])
        (outcome,) = pool.poll(block=True)
        assert outcome.rewards is None and "scorer process died (exit code 3)" in (outcome.error or "")
        assert pool.restarts == 1
    finally:
        pool.close()


@pytest.mark.slow
def test_a_scorer_pool_survives_a_worker_dead_while_idle_and_a_group_it_cannot_send(user_scorers: str) -> None:
    pool = ScorerPool(f"{user_scorers}:length_bonus", workers=1, timeout_s=30)
    try:
        pool.submit("first", [(None, "a", "a", {})])
        assert [(o.group_id, o.rewards) for o in pool.poll(block=True)] == [("first", [1.0])]
        (worker,) = pool._workers
        worker.process.kill()  # dies between jobs: the next send finds a broken pipe
        worker.process.join(timeout=10)
        pool.submit("next", [(None, "a", "b", {"bonus": 0.5})])
        assert pool.restarts == 1 and pool.pending() == 1  # the group waits for the fresh worker
        pool.submit("unpicklable", [(None, "a", "a", {"bonus": lambda: 0})])
        outcomes = {o.group_id: o for o in pool.poll(block=True)}
        assert outcomes["next"].rewards == [0.5] and outcomes["next"].error is None
        assert outcomes["unpicklable"].rewards is None
        assert (outcomes["unpicklable"].error or "").startswith("cannot send the group to a scorer: ")
        assert pool.pending() == 0
    finally:
        pool.close()


@pytest.mark.slow
def test_a_scorer_that_fails_to_load_in_its_worker_fails_each_group_with_why(user_scorers: str) -> None:
    pool = ScorerPool("broken_scorers:score", workers=1, timeout_s=30)  # check_reward_spec would refuse it at start-up
    try:
        pool.submit("g", [(None, "a", "a", {})])
        pool.submit("h", [(None, "a", "a", {})])
        outcomes = pool.poll(block=True)
        assert [o.group_id for o in outcomes] == ["g", "h"] and all(o.rewards is None for o in outcomes)
        assert all(str(o.error).startswith("RuntimeError: RewardSpecError: task.reward='broken_scorers:score': cannot import module")
                   for o in outcomes), outcomes
        assert pool.restarts == 0  # the worker lives on
    finally:
        pool.close()


@pytest.mark.slow
def test_scorer_workers_that_keep_dying_at_start_stop_the_run(user_scorers: str, tmp_path: Path) -> None:
    (tmp_path / "exits_on_import.py").write_text("import os\nos._exit(4)\n")
    pool = ScorerPool("exits_on_import:score", workers=1, timeout_s=30)
    try:
        pool.submit("g", [(None, "a", "a", {})])
        with pytest.raises(RuntimeError, match="scorer processes for 'exits_on_import:score' keep dying at start \\(exit code 4\\)"):
            pool.poll(block=True)
        assert pool.restarts == 5  # started again _MAX_STARTS times
    finally:
        pool.close()
        sys.modules.pop("exits_on_import", None)


def test_reward_runner_refuses_a_timeout_that_is_not_positive_and_fails_a_group_it_cannot_prepare() -> None:
    with pytest.raises(ValueError, match="reward timeout must be > 0 seconds, got 0"):
        RewardRunner(lambda trajectory, metadata: 1.0, timeout_s=0)
    with pytest.raises(ValueError, match="reward workers must be >= 1, got 0"):
        ScorerPool("gsm8k", workers=0, timeout_s=1)
    runner = RewardRunner(PooledReward("gsm8k", _prepare, workers=1), timeout_s=30)
    try:
        runner.submit("no-answer", [_trajectory("x")], {})  # _prepare needs metadata["answer"]
        assert runner.pending() == 1
        assert [(o.group_id, o.rewards, o.error) for o in runner.poll()] == [("no-answer", None, "KeyError: 'answer'")]
    finally:
        runner.close()


def test_builtin_scorers_in_the_pool() -> None:
    pool = ScorerPool("gsm8k", workers=1, timeout_s=30)
    try:
        pool.submit("g", [(None, GSM8K_SOLUTION, "72", {}), (None, "#### 7", "72", {})])
        (outcome,) = pool.poll(block=True)
        assert outcome.rewards == [1.0, 0.0] and outcome.error is None
    finally:
        pool.close()


def _group_prepare(trajectory: Trajectory, metadata: dict) -> tuple:
    return (None, str(len(trajectory.output_ids)), "", {"group": trajectory.group_id})


@pytest.mark.slow
def test_the_run_loop_goes_on_past_a_hanging_scorer(user_scorers: str, tmp_path: Path) -> None:
    from runtime_fakes import FakeEngine, FakeTrainer, prompt_groups
    from staleflow.runtime.coordination.cost_model import CostModel
    from staleflow.runtime.run.assembly import assemble_run
    from staleflow.runtime.run.clock import VirtualClock
    from staleflow.runtime.run.loop import RunParts
    from staleflow.runtime.run.run_spec import RunSpec
    from staleflow.runtime.settings.policies import make_policy

    (tmp_path / "loop_scorers.py").write_text(
        "import time\n"
        "def score(prompt, response, answer, metadata):\n"
        "    if metadata['group'] == 'g2':\n"
        "        time.sleep(600)\n"
        "    return float(response)\n"
    )
    sys.path.insert(0, str(tmp_path))
    clock = VirtualClock()
    trainer = FakeTrainer(clock, 1.0)
    parts = RunParts(
        engines=[FakeEngine(f"i{k}", clock, max_running=6) for k in range(2)],
        trainer=trainer,
        prompts=prompt_groups(4),
        cost_model=CostModel(thr=0.0064, o_b=0.0027, o_k=1.231e-4, a_b=0.0028, a_k=3.35e-8),
        clock=clock,
        reward_fn=PooledReward("loop_scorers:score", _group_prepare, workers=2),
    )
    loop = assemble_run(RunSpec(make_policy("staleflow"), eta=2, batch_size=4, tick_s=0.5, reward_timeout_s=1.5), parts)
    try:
        metrics = loop.run(3)
    finally:
        loop.close()
        sys.path.remove(str(tmp_path))
    assert metrics.steps == 3 and metrics.reward_failures == 1 and metrics.audit_ok
    trained = [t for b in trainer.batches for ts in b.groups.values() for t in ts]
    assert trained and "g2" not in {t.group_id for t in trained}
    assert all(t.reward == float(len(t.output_ids)) for t in trained)  # scored in the worker processes

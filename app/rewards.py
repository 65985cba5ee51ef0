"""The job's reward as the run loop and the evaluator call it: ``task.reward`` in scorer processes.

The driver decodes each response and hands the scorer ``(prompt, response, answer, metadata)``
(``runtime/tasks/rewards.py`` documents the convention); the scorer runs in ``task.reward_workers``
worker processes under ``task.reward_timeout_s`` (``runtime/run/rewarding.py``). :func:`check_scorer`
runs at start-up: a scorer that cannot be imported, or that does not return a number when it scores
the first row's own reference answer, stops the job before Ray and vLLM start.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any

from staleflow.runtime.run.rewarding import PooledReward, ScoreInput, ScorerPool
from staleflow.runtime.types import Trajectory

if TYPE_CHECKING:
    from staleflow.app.job_parts import TaskData, Tokens
    from staleflow.runtime.settings.config import JobConfig

#: group metadata that the run adds to a row's (the scorer's ``metadata`` is the row's own fields)
_RUN_KEYS = ("prompt", "answer", "max_new_tokens", "source_prompt")


class ScorerCheckError(ValueError):
    """The scorer failed its start-up check (it raised, hung, or returned something not a number)."""


def scorer_arguments(response: str, metadata: dict[str, Any]) -> ScoreInput:
    """``(prompt, response, answer, metadata)`` for a response of the group with ``metadata``."""
    prompt = metadata.get("source_prompt", metadata.get("prompt"))
    row = {k: v for k, v in metadata.items() if k not in _RUN_KEYS}
    return prompt, response, str(metadata["answer"]), row


def pooled_reward(config: JobConfig, tokens: Tokens, seconds: list[float], workers: int | None = None) -> PooledReward:
    """The job's reward for :class:`~staleflow.runtime.run.rewarding.RewardRunner`; ``seconds[0]``
    accumulates the driver's share (decoding)."""
    _importable_from_cwd()

    def prepare(trajectory: Trajectory, metadata: dict[str, Any]) -> ScoreInput:
        begin = time.perf_counter()
        try:
            return scorer_arguments(tokens.decode(trajectory.output_ids), metadata)
        finally:
            seconds[0] += time.perf_counter() - begin

    return PooledReward(config.task.reward, prepare, workers=workers or config.task.reward_workers)


def check_scorer(config: JobConfig, data: TaskData) -> None:
    """Resolve ``task.reward`` now; a user's scorer also scores the first row's reference answer
    (as the response) in a scorer process, and must return a number within the timeout."""
    from staleflow.runtime.tasks import check_reward_spec, make_group, resolve_scorer, score_items

    _importable_from_cwd()
    spec = config.task.reward
    check_reward_spec(spec)  # RewardSpecError: unknown name, import error, not callable, wrong arity
    rows = data.train or data.held_out
    if not rows:
        return
    first = rows[0]
    group = make_group(first, "check", encode=lambda text: [], n_samples=1, max_new_tokens=1)
    arguments = scorer_arguments(first.answer, group.metadata)
    if ":" not in spec:  # a built-in scorer: it cannot hang, check it here
        try:
            score_items(spec, resolve_scorer(spec), [arguments])
            return
        except Exception as err:  # noqa: BLE001 - reported with the row
            error = f"{type(err).__name__}: {err}"
    else:
        pool = ScorerPool(spec, workers=1, timeout_s=config.task.reward_timeout_s)
        try:
            pool.submit("check", [arguments])
            (outcome,) = pool.poll(block=True)
        finally:
            pool.close()
        if outcome.error is None:
            return
        error = outcome.error
    if error:
        raise ScorerCheckError(
            f"task.reward={spec!r} failed its start-up check (scoring the first row's reference answer "
            f"{first.answer!r} as the response): {error}"
        )


def _importable_from_cwd() -> None:
    """``module:function`` scorers are found on PYTHONPATH or in the directory the job runs from
    (the ``staleflow`` console script does not put it on ``sys.path`` by itself)."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)

"""A training job's evaluation: through a rollout engine (:class:`EngineEvaluator`) for prompts from
files, by the trainer's own greedy decoding (:class:`Evaluator`) for the built-in job, either of them
after the run loop (:class:`DeferredEvaluation`); :func:`make_evaluator` picks one.

A job whose prompts come from files is evaluated on ``task.eval_file`` (its first
``task.eval_prompts`` rows), or, without one, on a fixed seeded sample of the training rows (then the
figures are not held-out ones and are labelled so). The evaluator owns one extra rollout engine (the
same vLLM binding as the rollout instances, in its own Ray actor, sampling greedy or at
``rollout.temperature``); at each evaluation it loads the trainer's newest version into it as a
rollout instance's Pull does (from the run's parameter server, through the job's weight transfer:
a reference, vLLM's weight-transfer API, or a state dict written to the instances' scratch folder;
version 0 from the folder the instances start from), submits
every eval prompt (``task.eval_samples`` responses each when sampled) through the
:class:`~staleflow.runtime.interfaces.RolloutEngine` seam, collects the responses and scores them
with the job's reward in worker processes under the reward timeout.

Figures (``kind: eval`` records of ``metrics.jsonl``): ``eval_reward`` (mean reward over every
response; a failed or timed-out reward counts 0), ``eval_pass@1`` (per prompt, the fraction of its
responses with reward >= 1, averaged over prompts; with greedy decoding, the fraction of prompts
answered correctly), ``eval_exact`` (the same number, under the name the built-in job's report uses),
``eval_response_tokens`` (mean), ``eval_truncated`` (fraction stopped by ``rollout.max_new_tokens``),
``eval_reward_failures`` and ``eval_s``.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from staleflow.adapters.vllm.logs import EngineLogs, logged
from staleflow.adapters.vllm.settings import SamplingConfig
from staleflow.app.eval_lane import RolloutEvaluation
from staleflow.app.job_parts import TaskData, Tokens, prompt_source, start_engines
from staleflow.app.rewards import pooled_reward, scorer_arguments
from staleflow.runtime.interfaces import resolve_weights
from staleflow.runtime.run.rewarding import PooledReward, RewardRunner
from staleflow.runtime.settings.placement_plan import engine_gpus
from staleflow.runtime.tasks import Prompt, make_group, resolve_scorer, score_items
from staleflow.runtime.types import TEMPERATURE_KEY, RolloutRequest, Trajectory

if TYPE_CHECKING:
    from staleflow.runtime.settings.config import JobConfig

#: a response counts as correct (pass@1) at this reward or above
CORRECT_AT = 1.0


class EngineEvaluator:
    """Mean reward and pass@1 of ``prompts`` through ``engine`` (see the module docstring)."""

    def __init__(
        self,
        engine: Any,
        prompts: Sequence[Prompt],
        *,
        encode: Callable[[str], Sequence[int]],
        reward: PooledReward,
        reward_timeout_s: float,
        max_new_tokens: int,
        samples: int = 1,
        mode: str = "greedy",
        held_out: bool = True,
        timeout_s: float = 1800.0,
        temperature: float | None = None,
    ) -> None:
        if not prompts:
            raise ValueError("no evaluation prompts")
        self.enabled = True
        self.mode = mode
        self.held_out = held_out
        self._engine = engine
        self._samples = samples
        self._timeout = timeout_s
        self._groups = [
            make_group(p, f"eval-{i}", encode=encode, n_samples=samples, max_new_tokens=max_new_tokens) for i, p in enumerate(prompts)
        ]
        self._rewards = RewardRunner(reward, reward_timeout_s)
        self._rounds = itertools.count()
        self._loaded = -1
        # on a rollout instance the requests carry their own temperature (the engine samples at rollout.temperature)
        self._metadata = {} if temperature is None else {TEMPERATURE_KEY: temperature}

    def starts_at(self, version: int) -> None:
        """The engine already holds ``version`` (it was built on those weights): no load until a newer one."""
        self._loaded = version

    @property
    def prompts(self) -> int:
        return len(self._groups)

    def run(self, version: int, weights: Any) -> dict[str, Any]:
        """Evaluate model ``version`` on the evaluator's own engine (``weights``: what a Pull of it
        hands out, a state dict or a safetensors path), loaded there first unless it holds it already."""
        begin = time.perf_counter()
        if version > self._loaded:
            self._engine.load_weights(version, weights)
            self._loaded = version
        figures = self.run_loaded(self._engine, version)
        figures["eval_s"] = time.perf_counter() - begin
        return figures

    def run_loaded(self, engines: Any, version: int) -> dict[str, Any]:
        """Evaluate on ``engines`` as they are, each holding model ``version``: its own engine, or the
        :class:`~staleflow.app.eval_lane.EvaluationLane` of every rollout instance holding it (a
        sequence: the requests are dealt out among them)."""
        begin = time.perf_counter()
        spread = list(engines) if isinstance(engines, Sequence) else [engines]
        trajectories = self._generate(spread, next(self._rounds), max(version, 0))
        by_group: dict[str, list[Trajectory]] = {g.group_id: [] for g in self._groups}
        for trajectory in trajectories:
            by_group[trajectory.group_id].append(trajectory)
        for group in self._groups:
            self._rewards.submit(group.group_id, by_group[group.group_id], group.metadata)
        outcomes = {o.group_id: o for o in self._rewards.poll(block=True)}
        rewards: list[float] = []
        pass_at_1: list[float] = []
        failures = 0
        for group in self._groups:
            outcome = outcomes.get(group.group_id)
            scores = outcome.rewards if outcome is not None and outcome.rewards is not None else None
            if scores is None:
                failures += 1
                scores = [0.0] * len(by_group[group.group_id])
            rewards.extend(scores)
            pass_at_1.append(sum(1 for r in scores if r >= CORRECT_AT) / len(scores))
        lengths = [len(t.output_ids) for t in trajectories]
        pass1 = sum(pass_at_1) / len(pass_at_1)
        return {
            "eval_reward": sum(rewards) / len(rewards),
            "eval_pass@1": pass1,
            "eval_exact": pass1,
            "eval_response_tokens": sum(lengths) / len(lengths),
            "eval_truncated": sum(1 for t in trajectories if t.finish_reason == "length") / len(trajectories),
            "eval_reward_failures": failures,
            "eval_version": version,
            "eval_s": time.perf_counter() - begin,
        }

    def _generate(self, engines: list[Any], round_no: int, version: int) -> list[Trajectory]:
        """Every eval request, dealt out in turn among ``engines``, until all are back (or the timeout:
        each engine's missing ones are aborted)."""
        requests = [
            RolloutRequest(
                request_id=f"eval{round_no}-{group.group_id}-{k}",
                group_id=group.group_id,
                prompt_ids=list(group.prompt_ids),
                max_new_tokens=int(group.metadata["max_new_tokens"]),
                group_version=version,
                metadata=dict(self._metadata),
            )
            for group in self._groups
            for k in range(self._samples)
        ]
        shares = [requests[i :: len(engines)] for i in range(len(engines))]
        for engine, share in zip(engines, shares):
            if share:
                engine.submit(share)
        done: dict[str, Trajectory] = {}
        deadline = time.monotonic() + self._timeout
        while len(done) < len(requests):
            for engine in engines:
                for trajectory in engine.collect():
                    done[trajectory.request_id] = trajectory
            if len(done) < len(requests):
                if time.monotonic() > deadline:
                    for engine, share in zip(engines, shares):
                        engine.abort([r.request_id for r in share if r.request_id not in done])
                    missing = len(requests) - len(done)
                    raise TimeoutError(f"evaluation: {missing} of {len(requests)} responses not back after {self._timeout} s")
                time.sleep(0.01)
        return [done[r.request_id] for r in requests]

    def close(self) -> None:
        self._rewards.close()


class DeferredEvaluation:
    """Evaluation after the run loop (``task.eval_timing=deferred``).

    At each evaluation step :meth:`save` writes the trainer's weights to ``folder`` (a safetensors
    file: milliseconds for small models); :meth:`run` evaluates every saved version in step order
    once the run loop has finished and logs each as a ``kind: eval`` record of its step, marked
    ``eval_deferred: true``. So the run loop's wall time holds no evaluation for any system, and
    rollout instances do not get free generation time while the trainer waits for an evaluation.

    Args:
        folder: where the weights go (created).
        evaluate: ``evaluate(version, weights_file)`` -> the eval figures (an evaluator's ``run``
            or ``run_saved``).
    """

    def __init__(self, folder: Path, evaluate: Callable[[int, str], dict[str, Any]]) -> None:
        self._folder = folder
        self._evaluate = evaluate
        self._saved: list[tuple[int, int, Path]] = []

    def save(self, step: int, version: int, weights: Any) -> None:
        """Keep ``weights`` (a state dict, or a reference to one, fetched here) of model ``version`` for step ``step``."""
        from safetensors.torch import save_file

        weights = resolve_weights(weights)
        self._folder.mkdir(parents=True, exist_ok=True)
        path = self._folder / f"step-{step}.safetensors"
        save_file({name: tensor.detach().contiguous() for name, tensor in weights.items()}, str(path))
        self._saved.append((step, version, path))

    def run(self, log: Any) -> None:
        """Evaluate every saved version and log its figures (``log.eval``)."""
        for step, version, path in self._saved:
            log.eval(step, {**self._evaluate(version, str(path)), "eval_deferred": True})
        self._saved = []


class Evaluator:
    """Greedy reward of the trainer's current weights on a fixed, seeded prompt set (the built-in job),
    scored in this process by the job's scorer (``task.reward``: a built-in name or ``module:function``)."""

    def __init__(
        self, config: JobConfig, tokens: Tokens, prompt_seed: int, data: TaskData | None = None, model_dir: Path | None = None
    ) -> None:
        self.enabled = config.task.eval_prompts > 0
        self._model_dir = model_dir  # the architecture of :meth:`run_saved` (the base model's folder)
        self._decoder: Any = None
        self._tokens = tokens
        self._spec = config.task.reward
        self._score = resolve_scorer(self._spec) if self.enabled else None  # a disabled evaluator scores nothing
        self._max_new = config.rollout.max_new_tokens
        self._prompts = list(itertools.islice(prompt_source(config, tokens, prompt_seed, data), config.task.eval_prompts))
        self._metadata = [make_group(p, f"eval-{i}", encode=tokens.encode, n_samples=1, max_new_tokens=self._max_new).metadata
                          for i, p in enumerate(self._prompts)]

    def run(self, trainer: Any) -> dict[str, float]:
        begin = time.perf_counter()
        outputs = trainer.generate_greedy([self._tokens.encode(p.text) for p in self._prompts], self._max_new, self._tokens.eos_id)
        return self._figures(outputs, begin)

    def run_saved(self, version: int, weights_file: str) -> dict[str, float]:
        """The same figures for weights saved to a safetensors file (``version``: for the record), decoded
        by a model of the base model's architecture (the deferred evaluation, after the run loop)."""
        from safetensors.torch import load_file
        from staleflow.adapters.rlkit.causal_lm import PublishedWeightsDecoder

        begin = time.perf_counter()
        if self._model_dir is None:
            raise ValueError("Evaluator.run_saved needs the evaluator built with model_dir")
        if self._decoder is None:
            self._decoder = PublishedWeightsDecoder(self._model_dir, self._tokens.pad_id)
        prompts = [self._tokens.encode(p.text) for p in self._prompts]
        outputs = self._decoder.generate(load_file(weights_file), prompts, self._max_new, self._tokens.eos_id)
        return {**self._figures(outputs, begin), "eval_version": version}

    def _figures(self, outputs: list[list[int]], begin: float) -> dict[str, float]:
        if self._score is None:
            raise ValueError("the evaluator is disabled (task.eval_prompts=0)")
        items = [scorer_arguments(self._tokens.decode(o), metadata) for o, metadata in zip(outputs, self._metadata)]
        rewards = score_items(self._spec, self._score, items)
        return {
            "eval_reward": sum(rewards) / len(rewards),
            "eval_exact": sum(1 for r in rewards if r == 1.0) / len(rewards),
            "eval_response_tokens": sum(len(o) for o in outputs) / len(outputs),
            "eval_s": time.perf_counter() - begin,
        }


def make_evaluator(
    config: JobConfig, tokens: Tokens, data: TaskData, placement: Any, base: Path, clock: Any, weights_dir: Path, engines: Sequence[Any],
    logs: EngineLogs | None = None,
) -> Any:
    """The trainer's greedy :class:`Evaluator` for the built-in stream, or a disabled one
    (``task.eval_prompts=0``); for prompts from files, an :class:`EngineEvaluator` on the rollout
    instances (``engines``, each a :class:`~staleflow.app.eval_lane.SharedEngine`; ``task.eval_engine=rollout``,
    :class:`~staleflow.app.eval_lane.RolloutEvaluation`) or on its own rollout engine
    (``task.eval_engine=own``: a Ray actor of ``placement``, which on GPUs is ready when this returns,
    so that the trainer does not start during its memory profiling:
    :func:`~staleflow.app.job_parts.start_engines`). ``weights_dir``: the rollout instances' scratch
    folder for the weight files they reload; ``logs``: the own engine actor's
    :class:`~staleflow.adapters.vllm.logs.EngineLogs`."""
    if data.train is None and data.held_out is None:
        return Evaluator(config, tokens, prompt_seed=config.seed + 2, data=data, model_dir=base)
    if config.task.eval_prompts == 0:
        return Evaluator(config, tokens, prompt_seed=config.seed + 2, data=data)  # disabled
    held_out = data.held_out is not None
    prompts = data.held_out if data.held_out is not None else list(itertools.islice(data.stream(config.seed + 2), config.task.eval_prompts))
    greedy = config.task.eval_sampling == "greedy"
    sampling = SamplingConfig(temperature=0.0 if greedy else config.rollout.temperature, stop_token_ids=(tokens.eos_id,))
    engine = None
    if config.task.eval_engine == "own":
        from staleflow.adapters.vllm.engine import VLLMEngine  # torch and vLLM: imported once the job has set vLLM's environment

        # its own group, planned like a rollout instance (placement_plan.has_eval_engine); on GPUs ready before the trainer starts
        start = functools.partial(
            placement.place_reserved,
            "eval",
            logged(VLLMEngine, logs),
            "eval",
            str(base),
            sampling=sampling,
            max_model_len=config.rollout.max_model_len,
            max_num_seqs=config.rollout.max_num_seqs,
            seed=config.seed * 1000 + 999,
            clock=clock,
            weights_dir=str(weights_dir),
            engine_kwargs=config.rollout.engine_settings(),
            start_timeout_s=config.rollout.start_timeout_s,
            verify_weights=config.rollout.verify_weights,
        )
        [engine] = start_engines([start], [engine_gpus(config, "eval")])
    evaluator = EngineEvaluator(
        engine,
        prompts,
        encode=tokens.encode,
        reward=pooled_reward(config, tokens, [0.0], workers=1),
        reward_timeout_s=config.task.reward_timeout_s,
        max_new_tokens=config.rollout.max_new_tokens,
        samples=config.task.eval_samples,
        mode=config.task.eval_sampling,
        held_out=held_out,
        temperature=None if engine is not None else sampling.temperature,
    )
    return evaluator if engine is not None else RolloutEvaluation(evaluator, engines)

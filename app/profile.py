"""Measure a real vLLM engine's decode latency and fit the cost model (``staleflow profile``, ``cli/profile.py``).

The engine runs batches of ``n`` requests with prompts of ``P`` tokens, each generating exactly
``--decode-tokens`` tokens; every pure decode step (no prefill in it) is one measurement of the
latency ``L(n, K)`` with ``K`` the tokens in KV cache. Steps are pooled into profile points: the
steps of one batch are split into quarters of its decode (``K`` grows as it decodes) and each quarter
gives one point at its mean ``K`` with the lower quartile of its latencies. A step that another
process preempted can only be slower, never faster, so on a shared machine the lower quartile is
closer to the engine's own cost than the median or the mean. The cost model of
:mod:`staleflow.runtime.coordination.cost_model` is fitted to the points, its mean relative error is reported
(the paper: 10.5%), and the coefficients are written where the coordinator loads them
(:meth:`CostModel.load`): ``coordinator.cost_model.profile`` makes it the prior that a training job's
online fit (:mod:`staleflow.runtime.coordination.cost_fit`) starts from.
"""

from __future__ import annotations

import itertools
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from staleflow.app.tiny_model import ensure_tiny_model
from staleflow.runtime.coordination.cost_fit import quantile as quantile_of
from staleflow.runtime.coordination.cost_model import (
    CostModel,
    FitReport,
    ProfileRecord,
    fit_cost_model,
)
from staleflow.runtime.settings.config_sections import default_tiny_model_dir

POINTS_PER_BATCH = 4


@dataclass(frozen=True)
class ProfileResult:
    """The pooled profile points, the fitted model, its fit report and what the run cost."""

    points: list[ProfileRecord]
    steps: int
    model: CostModel
    report: FitReport
    seconds: float
    reload_ms: float | None = None

    @property
    def peak_tokens_per_s(self) -> float:
        """The best measured decode throughput ``n / L`` over the points."""
        return max(p.n / p.latency for p in self.points)

    def to_dict(self) -> dict[str, Any]:
        return {
            "coefficients": self.model.to_dict(),
            "fit": self.report.to_dict(),
            "peak_tokens_per_s": self.peak_tokens_per_s,
            "reload_ms": self.reload_ms,
            "decode_steps": self.steps,
            "points": [{"n": p.n, "kv_tokens": p.kv_tokens, "latency": p.latency} for p in self.points],
            "seconds": self.seconds,
        }


def profile_engine(
    engine: Any,
    batch_sizes: Sequence[int],
    prompt_lengths: Sequence[int],
    decode_tokens: int = 64,
    vocab: int = 260,
    seed: int = 0,
    on_batch: Any = None,
) -> ProfileResult:
    """Run the grid on ``engine`` (a :class:`~staleflow.adapters.vllm.engine.VLLMEngine` that
    ignores EOS) and fit the cost model. One warm-up batch runs first and is not measured."""
    from staleflow.runtime.types import RolloutRequest

    if decode_tokens < 2 * POINTS_PER_BATCH:
        raise ValueError(f"decode_tokens must be at least {2 * POINTS_PER_BATCH}, got {decode_tokens}")
    rng = random.Random(seed)
    started = time.perf_counter()
    counter = iter(range(10**9))

    def run_batch(n: int, prompt_len: int) -> list[ProfileRecord]:
        ids = [f"profile-{next(counter)}" for _ in range(n)]
        requests = [
            RolloutRequest(rid, rid, [rng.randrange(4, vocab) for _ in range(prompt_len)], decode_tokens, engine.version) for rid in ids
        ]
        engine.decode_steps()  # drop anything measured before this batch
        engine.submit(requests)
        pending = set(ids)
        while pending:
            pending -= {t.request_id for t in engine.collect()}
            time.sleep(0.002)
        return [s for s in engine.decode_steps() if s.n == n]

    run_batch(max(batch_sizes), min(prompt_lengths))  # warm-up
    points: list[ProfileRecord] = []
    steps = 0
    for prompt_len in prompt_lengths:
        for n in batch_sizes:
            measured = run_batch(n, prompt_len)
            steps += len(measured)
            batch_points = pool_steps(measured, POINTS_PER_BATCH)
            points.extend(batch_points)
            if on_batch is not None:
                on_batch(n, prompt_len, batch_points)
    model, report = fit_cost_model(points)
    return ProfileResult(points, steps, model, report, time.perf_counter() - started)


def measure_reload_ms(engine: Any, weights: Path, repeats: int = 5) -> float:
    """Median milliseconds of an in-place reload of ``weights`` (the engine's own version again)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.load_weights(engine.version, weights)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def pool_steps(steps: Sequence[ProfileRecord], groups: int, quantile: float = 0.25) -> list[ProfileRecord]:
    """Split one batch's steps (in order, so ``K`` grows) into ``groups`` consecutive runs of
    nearly equal length; each becomes a point at its mean ``K`` with the ``quantile`` of its latencies."""
    if not steps:
        return []
    points = []
    count = min(groups, len(steps))
    bounds = [round(i * len(steps) / count) for i in range(count + 1)]
    for start, end in itertools.pairwise(bounds):
        chunk = steps[start:end]
        points.append(
            ProfileRecord(
                n=chunk[0].n,
                kv_tokens=round(statistics.fmean(s.kv_tokens for s in chunk)),
                latency=quantile_of(sorted(s.latency for s in chunk), quantile),
            )
        )
    return points


def run_engine_settings(config: str | Path | None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """vLLM's ``EngineArgs`` of the rollout engines of the job in ``config`` (None: the built-in job)
    with ``overrides``, as ``staleflow train`` builds them (dtype, CUDA graphs or eager, GPU memory,
    tensor parallelism); raises ``ConfigError`` for a config that does not load."""
    from staleflow.runtime.settings.config import load_config

    return load_config(config, overrides).rollout.engine_settings()


def profile_model(
    model: str | None,
    *,
    out: str,
    batch_sizes: Sequence[int],
    prompt_lengths: Sequence[int],
    decode_tokens: int = 64,
    max_model_len: int = 512,
    seed: int = 0,
    engine_kwargs: Mapping[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> ProfileResult:
    """Profile ``model`` (a local folder; None: the built-in tiny model) on a vLLM engine, measure its
    in-place reload, and write the fitted coefficients to ``out``; ``log`` gets one line per batch.
    ``engine_kwargs``: vLLM's ``EngineArgs`` of the run the coefficients are for (its rollout dtype,
    CUDA graphs or eager, tensor parallelism: ``RolloutConfig.engine_settings``), so the engine
    measured is the one the run will use."""
    from staleflow.adapters.vllm.engine import SamplingConfig, VLLMEngine

    model_dir = Path(model) if model else ensure_tiny_model(Path(default_tiny_model_dir()).expanduser())
    log(f"profiling {model_dir}: n in {list(batch_sizes)}, prompt lengths {list(prompt_lengths)}")

    def show(n: int, prompt_len: int, points: list[ProfileRecord]) -> None:
        latencies = ", ".join(f"{p.latency * 1e3:.2f}" for p in points)
        log(f"  n={n:4d} prompt={prompt_len:4d}: step ms [{latencies}] at K up to {max(p.kv_tokens for p in points)}")

    with VLLMEngine(
        "profile",
        model_dir,
        sampling=SamplingConfig(temperature=1.0, ignore_eos=True),
        max_model_len=max_model_len,
        max_num_seqs=max(batch_sizes),
        seed=seed,
        engine_kwargs=engine_kwargs,
    ) as engine:
        result = profile_engine(engine, batch_sizes, prompt_lengths, decode_tokens, seed=seed, on_batch=show)
        result = replace(result, reload_ms=measure_reload_ms(engine, model_dir))
    result.model.save(out)
    return result

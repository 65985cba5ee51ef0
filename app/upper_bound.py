"""The throughput no system can beat on a workload: every instance always at its best, training never waited for.

Tokens are response tokens per second of wall-clock time, as ``staleflow simulate`` reports them.

Rollout side. A request of response length ``R`` stays ``R`` decode steps in an instance and holds
``P + t`` KV tokens at its ``t``-th step (``P``: prompt tokens). In a steady state the running slots
are held by requests in proportion to ``R``, so the mean KV tokens per running request is

    k = P + E[R^2] / (2 E[R]).

An instance running ``n`` requests then produces ``T(n) = n / L(n, n k)`` tokens/s, which grows with
``n``; the best it can do is the largest ``n`` that fits: ``n* = min(max_running, C / k)`` (``C``:
KV capacity; ``n*`` may be fractional: a time average). Each request also costs ``prefill * P``
seconds of prompt prefill, spread over its ``E[R]`` tokens, so one instance reaches at most

    1 / (1 / T(n*) + prefill * P / E[R])    tokens/s,

and the rollout bound is that times the number of instances. Weight loads are not charged.

Training side. A batch of ``B`` groups of ``N`` responses holds ``B N E[R]`` response tokens and
takes ``base + per_token * B N (P + E[R]) + per_token2 * B N E[(P + R)^2]`` seconds (the workload's
training model on its trainer GPUs), so training consumes at most
``B N E[R] / step_time`` tokens/s. The upper bound is the smaller of the two.

``E[R]`` and ``E[R^2]`` are estimated from a large seeded sample of the workload's length
distribution.

The latency-aware bound (:func:`latency_bound`) adds what a system that keeps the staleness bound
``eta`` can reach given each response's decode latency. A group generated with version ``b - eta``
starts no earlier than the end of training step ``b - eta - 1`` and must be done when step ``b``
starts, so ``eta + 1`` step periods hold the batch's longest response decoded plus one training
step: the mean period is at least ``(E[D_max] + t_train) / (eta + 1)``, where ``D_max`` is the
batch's longest response decoded at the best per-token speed there is (alone on an instance:
``prefill(P) + sum_t L(1, P + t)``) and ``t_train`` the training step. With ``B N E[R]`` tokens a
batch, the bound is the smaller of that rate and the throughput bound above. ``D_max`` comes from
seeded batches of the workload's grouped length draws (a prompt's difficulty shared by its group).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from staleflow.runtime.settings.workload import Workload


@dataclass(frozen=True)
class UpperBound:
    """The bound and the figures it comes from."""

    tokens_per_s: float
    rollout_tokens_per_s: float
    training_tokens_per_s: float
    per_instance_tokens_per_s: float
    best_running: float
    mean_kv_per_request: float
    mean_response_tokens: float
    limited_by: str

    def to_dict(self) -> dict[str, float | str]:
        return asdict(self)


@dataclass(frozen=True)
class LatencyBound:
    """The latency-aware bound at ``eta`` (module docstring) and the figures it comes from."""

    eta: int
    tokens_per_s: float
    latency_tokens_per_s: float
    step_s: float
    longest_decode_s: float
    training_s: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def latency_bound(workload: Workload, eta: int, bound: UpperBound, seed: int = 0, batches: int = 64) -> LatencyBound:
    """:class:`LatencyBound` of ``workload`` at ``eta``, beside its throughput ``bound`` (module docstring)."""
    import numpy as np

    if eta < 0:
        raise ValueError(f"eta must be >= 0, got {eta}")
    rng = np.random.default_rng(seed)
    groups, size = workload.batch.groups_per_step, workload.batch.group_size
    longest = np.array([max(workload.response_tokens.sample(rng, size).max() for _ in range(groups)) for _ in range(batches)])
    spec, prompt = workload.instance, workload.prompt_tokens
    prefill = spec.prefill_s_per_token * prompt + spec.prefill_attn_s_per_token2 * prompt * prompt / 2
    decode = float((prefill + workload.build_cost_model().decode_seconds(longest.astype(float), 1, prompt)).mean())
    batch_tokens = groups * size * bound.mean_response_tokens
    training = batch_tokens / bound.training_tokens_per_s
    step = (decode + training) / (eta + 1)
    latency = batch_tokens / step
    return LatencyBound(eta=eta, tokens_per_s=min(bound.tokens_per_s, latency), latency_tokens_per_s=latency, step_s=step,
                        longest_decode_s=decode, training_s=training)


def upper_bound(workload: Workload, seed: int = 0, samples: int = 200_000) -> UpperBound:
    """Compute :class:`UpperBound` for ``workload`` (see the module docstring for the formula)."""
    import numpy as np

    draws = workload.response_tokens.sample(np.random.default_rng(seed), samples, shared=False).astype(float)
    mean_r = float(draws.mean())
    mean_kv = workload.prompt_tokens + float((draws**2).mean()) / (2 * mean_r)
    cost = workload.build_cost_model()
    spec = workload.instance
    best_n = min(float(spec.max_running), spec.kv_capacity_tokens / mean_kv)
    decode = cost.throughput(best_n, best_n * mean_kv)
    prompt = workload.prompt_tokens
    prefill_per_token = (spec.prefill_s_per_token * prompt + spec.prefill_attn_s_per_token2 * prompt * prompt / 2) / mean_r
    per_instance = 1.0 / (1.0 / decode + prefill_per_token)
    rollout = per_instance * workload.cluster.rollout_instances

    responses = workload.batch.groups_per_step * workload.batch.group_size
    lengths = workload.prompt_tokens + draws
    step_time = workload.training.step_time(
        round(responses * (workload.prompt_tokens + mean_r)), workload.cluster.trainer_gpus, responses * float((lengths**2).mean()))
    training = responses * mean_r / step_time if step_time > 0 else float("inf")
    return UpperBound(
        tokens_per_s=min(rollout, training),
        rollout_tokens_per_s=rollout,
        training_tokens_per_s=training,
        per_instance_tokens_per_s=per_instance,
        best_running=best_n,
        mean_kv_per_request=mean_kv,
        mean_response_tokens=mean_r,
        limited_by="rollout" if rollout <= training else "training",
    )

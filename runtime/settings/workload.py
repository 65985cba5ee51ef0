"""Workload files for ``staleflow simulate``: cluster, cost model, lengths, batch and training time.

A workload is a YAML file validated by :class:`Workload` (pydantic); a wrong or missing key is
reported with its dotted path. The shipped files live in ``runtime/settings/workloads/`` and can be named
without a path (``--workload qwen3-30b-a3b-128gpu``).

Response lengths are long-tailed: a log-normal clipped at the maximum response length (a response
that reaches the maximum is truncated there, as in RL post-training). The log-normal's location is
solved so that the *clipped* mean equals ``mean``. A prompt's difficulty is shared by its group:
``prompt_sigma`` of the log-scale spread is drawn once per prompt, the rest per response (the
marginal distribution stays the same), so the long responses of a batch cluster in a few groups.

An instance's KV capacity is either given (``instance.kv_capacity_tokens``) or derived from its GPU
memory (``instance.memory``): ``(gpus * gpu_gb * utilization - weights_gb - reserved_gb * gpus) /
kv_bytes_per_token``, vLLM's own accounting (weights and activations out of the memory it may use).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from staleflow.runtime.coordination.cost_model import CostModel
from staleflow.runtime.types import PromptGroup

WORKLOAD_DIR = Path(__file__).parent / "workloads"

#: Length sets drawn per prompt for re-sampling (``PromptGroup.resamples``).
RETRIES = 2
#: ``RolloutRequest.metadata`` key: the response length of that one request (an int), which the
#: simulated engine generates before it finishes the request. A simulated group carries it in each
#: entry of its ``sample_metadata`` (the trajectory server copies entry ``i`` into request ``i``).
REQUEST_LENGTH_KEY = "response_length"


class WorkloadError(ValueError):
    """A workload file that cannot be read or does not validate; the message names the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CostModelSpec(_Strict):
    """Decode cost coefficients of one instance (see :class:`~staleflow.runtime.coordination.cost_model.CostModel`)."""

    thr: float = Field(ge=0)
    o_b: float = Field(ge=0)
    o_k: float = Field(ge=0)
    a_b: float = Field(ge=0)
    a_k: float = Field(ge=0)

    def build(self) -> CostModel:
        return CostModel(thr=self.thr, o_b=self.o_b, o_k=self.o_k, a_b=self.a_b, a_k=self.a_k)


class ClusterSpec(_Strict):
    rollout_instances: int = Field(ge=1, description="rollout instances (vLLM engines)")
    gpus_per_instance: int = Field(ge=1, description="GPUs per rollout instance (TP x PP)")
    trainer_gpus: int = Field(ge=0, description="GPUs of the trainer (the FLOPs training model divides over them)")


class MemorySpec(_Strict):
    """Where an instance's KV capacity comes from (GB = 1e9 bytes)."""

    gpu_gb: float = Field(gt=0, description="memory of one GPU")
    utilization: float = Field(default=0.9, gt=0, le=1, description="share vLLM may use (gpu_memory_utilization)")
    weights_gb: float = Field(ge=0, description="model weights of the whole instance (split over its GPUs)")
    reserved_gb: float = Field(default=3.0, ge=0, description="activations, CUDA graphs, per GPU")
    kv_bytes_per_token: int = Field(ge=1, description="2 x layers x KV heads x head dim x bytes, whole instance")

    def kv_tokens(self, gpus: int) -> int:
        free = gpus * (self.gpu_gb * self.utilization - self.reserved_gb) - self.weights_gb
        return max(0, int(free * 1e9 // self.kv_bytes_per_token))


class InstanceSpec(_Strict):
    kv_capacity_tokens: int = Field(ge=1, description="KV-cache capacity of one instance, in tokens")
    max_running: int = Field(default=256, ge=1, description="most requests decoding at once (vLLM max_num_seqs)")
    prefill_s_per_token: float = Field(default=0.0, ge=0, description="seconds per token to (re)build the KV cache of an admitted request")
    prefill_attn_s_per_token2: float = Field(
        default=0.0, ge=0,
        description="attention cost of a prefill per (token, earlier token) pair: c tokens cost c^2/2 times this on top",
    )
    weight_load_s: float = Field(default=0.0, ge=0, description="seconds a Pull blocks the instance")
    reload_recomputes_kv: bool = Field(
        default=True, description="a Pull also rebuilds the KV cache of the requests that stay (prefill of their tokens)"
    )


def clipped_lognormal_mean(mu: float, sigma: float, low: float, high: float) -> float:
    """``E[clip(X, low, high)]`` for ``X = exp(N(mu, sigma^2))``: the mean of log-normal lengths clipped to ``[low, high]``."""
    lo, hi = math.log(low), math.log(high)

    def cdf(x: float) -> float:
        return 0.5 * math.erfc(-x / math.sqrt(2))

    body = math.exp(mu + sigma * sigma / 2) * (cdf((hi - mu - sigma * sigma) / sigma) - cdf((lo - mu - sigma * sigma) / sigma))
    return low * cdf((lo - mu) / sigma) + body + high * cdf((mu - hi) / sigma)


class LognormalLengths(_Strict):
    """Log-normal response lengths with log-scale spread ``sigma``, clipped at ``max``, clipped mean ``mean``."""

    distribution: Literal["lognormal"]
    mean: float = Field(gt=0)
    sigma: float = Field(gt=0, le=4)
    max: int = Field(ge=1)
    min: int = Field(default=1, ge=1)
    prompt_sigma: float = Field(default=0.0, ge=0, description="log-scale spread shared by a prompt's group")

    @model_validator(mode="after")
    def _check(self) -> LognormalLengths:
        if not self.min < self.mean < self.max:
            raise ValueError(f"need min < mean < max, got min={self.min}, mean={self.mean}, max={self.max}")
        if self.prompt_sigma >= self.sigma:
            raise ValueError(f"need prompt_sigma < sigma, got prompt_sigma={self.prompt_sigma}, sigma={self.sigma}")
        return self

    def truncated_share(self) -> float:
        """The share of responses that reach ``max`` (truncated there)."""
        return 0.5 * math.erfc((math.log(self.max) - self.mu) / (self.sigma * math.sqrt(2)))

    @cached_property
    def mu(self) -> float:
        """Log-scale location whose clipped mean (:func:`clipped_lognormal_mean`) equals ``mean`` (the
        clipped mean grows with ``mu``: found by bisection)."""
        s, lo, hi = self.sigma, math.log(self.min), math.log(self.max)
        low, high = lo - 10 * s, hi + 10 * s
        for _ in range(200):
            mid = (low + high) / 2
            if clipped_lognormal_mean(mid, s, self.min, self.max) < self.mean:
                low = mid
            else:
                high = mid
        return (low + high) / 2

    def sample(self, rng: Any, size: int, shared: bool = True) -> Any:
        """``size`` lengths; with ``prompt_sigma`` and ``shared`` they are one group's (one shared
        difficulty); ``shared=False`` draws from the marginal (statistics over many prompts)."""
        import numpy as np

        if self.prompt_sigma and shared:
            difficulty = rng.normal(0.0, self.prompt_sigma)
            draws = np.exp(self.mu + difficulty + rng.normal(0.0, math.sqrt(self.sigma**2 - self.prompt_sigma**2), size))
        else:
            draws = rng.lognormal(self.mu, self.sigma, size)
        return np.clip(np.rint(draws), self.min, self.max).astype(np.int64)


class UniformLengths(_Strict):
    distribution: Literal["uniform"]
    min: int = Field(ge=1)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _check(self) -> UniformLengths:
        if self.min > self.max:
            raise ValueError(f"need min <= max, got min={self.min}, max={self.max}")
        return self

    def sample(self, rng: Any, size: int, shared: bool = True) -> Any:
        """``size`` independent lengths (no per-prompt difficulty: ``shared`` changes nothing)."""
        return rng.integers(self.min, self.max + 1, size)


class FixedLengths(_Strict):
    distribution: Literal["fixed"]
    tokens: int = Field(ge=1)

    @property
    def max(self) -> int:
        return self.tokens

    def sample(self, rng: Any, size: int, shared: bool = True) -> Any:
        """``size`` equal lengths (``shared`` changes nothing)."""
        import numpy as np

        return np.full(size, self.tokens, dtype=np.int64)


LengthSpec = Annotated[LognormalLengths | UniformLengths | FixedLengths, Field(discriminator="distribution")]


class BatchSpec(_Strict):
    groups_per_step: int = Field(ge=1, description="prompt groups per training batch (B)")
    group_size: int = Field(ge=1, description="responses per prompt (N)")


class NetworkSpec(_Strict):
    """Weight transfer (GB = 1e9 bytes; defaults: free). A parameter-server pull takes
    ``weights_gb / min(link_gb_per_s, ps_gb_per_s / pulls in flight)`` on top of
    ``instance.weight_load_s``; a global broadcast takes ``weights_gb / broadcast_gb_per_s`` and
    blocks the trainer and every instance."""

    weights_gb: float = Field(default=0.0, ge=0, description="bytes of one model version")
    ps_gb_per_s: float = Field(default=1e9, gt=0, description="the parameter server's total egress")
    link_gb_per_s: float = Field(default=1e9, gt=0, description="one instance's link")
    broadcast_gb_per_s: float = Field(default=1e9, gt=0, description="a global NCCL broadcast, end to end")
    host_gb_per_s: float = Field(
        default=1e9, gt=0, description="one trainer GPU's link to host memory (PCIe), for a system that offloads the trainer's states")


class TrainingSpec(_Strict):
    """Training step time ``base_s + per_token_s * tokens + per_token2_s * sum(c^2)`` over the batch's
    trajectories (``c`` a trajectory's prompt + response tokens).

    Either ``per_token_s`` is given (a measured or assumed rate: small test workloads), or it is
    derived from FLOPs: ``active_params``, ``mfu`` and ``gpu_tflops`` (all three) give
    ``(flops_per_param + recompute_flops_per_param) x active_params / (mfu x gpu_tflops x 1e12 x
    trainer GPUs)`` seconds per token, where ``flops_per_param`` = 6 counts the forward (2) and
    backward (4) passes and ``recompute_flops_per_param`` = 2 the trainer's recompute of the old
    log-probs (one more forward). ``attn_flops_per_token2`` (optional): forward attention FLOPs per
    (token, earlier token) pair, ``4 x layers x query heads x head dim``; the step then also costs
    ``4 x attn_flops_per_token2 x c^2 / 2`` FLOPs per trajectory (forward, backward twice, recompute;
    causal: half the pairs) at the same rate.

    The recompute is a system's choice, not the workload's: a system that trains on the rollout's
    own log-probs (verl's fully-async recipe, ``use_rollout_log_probs: True`` by default) passes
    ``recompute=False`` and its step costs the forward and backward passes only. So is a reference
    model's forward pass over the batch (``reference=True``: ROLL's RLVR pipeline at the commit the
    paper measured computes reference log-probs every step of a full-parameter run), one more
    forward at the recompute's cost (``recompute_flops_per_param`` per parameter per token, one
    attention pass). A ``per_token_s`` rate is taken to include the recompute and no reference
    pass; each forward left out or added moves it by ``recompute_flops_per_param / (flops_per_param
    + recompute_flops_per_param)`` of itself.
    """

    base_s: float = Field(default=0.0, ge=0, description="fixed cost of a step (optimizer, gradient all-reduce)")
    per_token_s: float | None = Field(default=None, ge=0, description="seconds per batch token (instead of the FLOPs model)")
    active_params: float | None = Field(default=None, gt=0, description="parameters a token passes through (MoE: the active ones)")
    mfu: float | None = Field(default=None, gt=0, le=1, description="model FLOPs utilisation of the trainer")
    gpu_tflops: float | None = Field(default=None, gt=0, description="dense bf16 peak of one trainer GPU, TFLOP/s")
    flops_per_param: float = Field(default=6.0, gt=0, description="FLOPs per active parameter per trained token: forward and backward")
    recompute_flops_per_param: float = Field(
        default=2.0, ge=0, description="FLOPs per active parameter per trained token of the old log-prob recompute (a forward)")
    attn_flops_per_token2: float = Field(default=0.0, ge=0, description="forward attention FLOPs per (token, earlier token) pair")
    mfu_source: str = Field(default="", description="where the MFU figure comes from (reported, not used)")

    @model_validator(mode="after")
    def _one_rate(self) -> TrainingSpec:
        flops = {"active_params": self.active_params, "mfu": self.mfu, "gpu_tflops": self.gpu_tflops}
        given = [k for k, v in flops.items() if v is not None]
        if self.per_token_s is not None and given:
            raise ValueError(f"give per_token_s or the FLOPs model ({', '.join(flops)}), not both (got per_token_s and {', '.join(given)})")
        if self.per_token_s is None and len(given) != len(flops):
            missing = [k for k in flops if k not in given]
            raise ValueError(f"the FLOPs model needs {', '.join(missing)} (or give per_token_s instead)")
        if self.per_token_s is not None and self.attn_flops_per_token2:
            raise ValueError("attn_flops_per_token2 needs the FLOPs model (active_params, mfu, gpu_tflops), not per_token_s")
        return self

    def flop_rate(self, trainer_gpus: int) -> float:
        """FLOP/s the trainer achieves on ``trainer_gpus`` GPUs (FLOPs model only)."""
        assert self.mfu is not None and self.gpu_tflops is not None
        return self.mfu * self.gpu_tflops * 1e12 * max(1, trainer_gpus)

    @staticmethod
    def _forwards(recompute: bool, reference: bool) -> int:
        """Forward passes over the batch besides training's own: the recompute, the reference model's."""
        return int(recompute) + int(reference)

    def seconds_per_token(self, trainer_gpus: int, recompute: bool = True, reference: bool = False) -> float:
        """``per_token_s``, or the FLOPs model's on ``trainer_gpus`` GPUs; ``recompute``: with the old
        log-prob recompute; ``reference``: with a reference model's forward pass."""
        flops = self.flops_per_param + self.recompute_flops_per_param * self._forwards(recompute, reference)
        if self.per_token_s is not None:
            return self.per_token_s * flops / (self.flops_per_param + self.recompute_flops_per_param)
        assert self.active_params is not None
        return flops * self.active_params / self.flop_rate(trainer_gpus)

    def seconds_per_token2(self, trainer_gpus: int, recompute: bool = True, reference: bool = False) -> float:
        """Seconds per squared trajectory length: causal attention of training (forward, backward
        twice) and of each further forward pass (``recompute``, ``reference``)."""
        if not self.attn_flops_per_token2:
            return 0.0
        passes = 3 + self._forwards(recompute, reference)
        return passes * self.attn_flops_per_token2 / 2 / self.flop_rate(trainer_gpus)

    def step_time(
        self, batch_tokens: int, trainer_gpus: int, sum_sq_tokens: float = 0.0, recompute: bool = True, reference: bool = False,
    ) -> float:
        """Seconds of one step over ``batch_tokens`` tokens whose trajectories' squared lengths sum to
        ``sum_sq_tokens``; ``recompute``: the trainer recomputes the old log-probs (most systems do);
        ``reference``: a reference model's forward pass over the batch too (ROLL Flash as the paper ran it)."""
        return (self.base_s + self.seconds_per_token(trainer_gpus, recompute, reference) * batch_tokens
                + self.seconds_per_token2(trainer_gpus, recompute, reference) * sum_sq_tokens)


class SimulationSpec(_Strict):
    """Granularity of the simulation (not of the job): coordinator tick and event collection."""

    tick_s: float = Field(default=1.0, gt=0, description="period of full coordinator ticks (snapshots, migration)")
    event_quantum_s: float = Field(default=0.0, ge=0, description="engines announce events on this grid (0: exact)")


class Workload(_Strict):
    """A simulated RL post-training job: see ``docs/simulation.md`` for every key."""

    name: str
    description: str = ""
    model: str
    cost_model: CostModelSpec
    cluster: ClusterSpec
    instance: InstanceSpec
    prompt_tokens: int = Field(ge=1)
    response_tokens: LengthSpec
    batch: BatchSpec
    training: TrainingSpec
    network: NetworkSpec = NetworkSpec()
    simulation: SimulationSpec = SimulationSpec()

    @model_validator(mode="before")
    @classmethod
    def _derive_kv(cls, data: Any) -> Any:
        """``instance.memory`` -> ``instance.kv_capacity_tokens`` (one of the two, not both)."""
        if not isinstance(data, dict) or not isinstance(data.get("instance"), dict) or "memory" not in data["instance"]:
            return data
        instance = dict(data["instance"])
        if "kv_capacity_tokens" in instance:
            raise ValueError("instance: give kv_capacity_tokens or memory, not both")
        memory = MemorySpec.model_validate(instance.pop("memory"))
        gpus = data.get("cluster", {}).get("gpus_per_instance", 1) if isinstance(data.get("cluster"), dict) else 1
        instance["kv_capacity_tokens"] = memory.kv_tokens(int(gpus))
        return {**data, "instance": instance}

    @model_validator(mode="after")
    def _fits_kv(self) -> Workload:
        longest = self.prompt_tokens + self.response_tokens.max
        if longest + 1 > self.instance.kv_capacity_tokens:
            raise ValueError(
                f"instance.kv_capacity_tokens={self.instance.kv_capacity_tokens} cannot hold the longest "
                f"request (prompt_tokens + response_tokens.max + 1 = {longest + 1})"
            )
        return self

    @property
    def gpus(self) -> int:
        return self.cluster.rollout_instances * self.cluster.gpus_per_instance + self.cluster.trainer_gpus

    def with_rollout_gpus(self, rollout_gpus: int) -> Workload:
        """The same job with ``rollout_gpus`` of its GPUs rolling out and the rest training (the total
        stays; the training time follows the trainer's GPUs), named ``NAME@ROLLOUT_GPUS`` when the
        split is not the workload's own. :class:`WorkloadError` if the split does not fit whole
        instances or leaves no GPU to either side."""
        per = self.cluster.gpus_per_instance
        if rollout_gpus % per or not per <= rollout_gpus < self.gpus:
            raise WorkloadError(
                f"{self.name}: rollout GPUs must be a multiple of gpus_per_instance ({per}) from {per} to "
                f"{self.gpus - 1} (the job has {self.gpus} GPUs), got {rollout_gpus}")
        if rollout_gpus == self.gpus - self.cluster.trainer_gpus:
            return self
        cluster = self.cluster.model_copy(update={"rollout_instances": rollout_gpus // per, "trainer_gpus": self.gpus - rollout_gpus})
        return self.model_copy(update={"cluster": cluster, "name": f"{self.name}@{rollout_gpus}"})

    def build_cost_model(self) -> CostModel:
        return self.cost_model.build()

    def prompt_groups(self, seed: int, start: int = 0, n_extra: int = 0) -> Iterator[PromptGroup]:
        """An endless stream of prompt groups ``g{start}, g{start+1}, ...`` with drawn response lengths
        in ``sample_metadata`` (one ``{REQUEST_LENGTH_KEY: n}`` per sample, ``group_size + n_extra``
        of them: extras for group-level redundancy; ``RETRIES`` more sets of the same difficulty in
        ``resamples``) and ``metadata["max_new_tokens"]`` the maximum response length.
        Deterministic for a given seed: every system of a comparison gets the same lengths."""
        import numpy as np

        rng = np.random.default_rng(seed)
        prompt = [1] * self.prompt_tokens
        index = start
        size = self.batch.group_size + n_extra
        while True:
            draws = [int(x) for x in self.response_tokens.sample(rng, size * (1 + RETRIES))]
            sets = [[{REQUEST_LENGTH_KEY: n} for n in draws[i * size:(i + 1) * size]] for i in range(1 + RETRIES)]
            yield PromptGroup(
                group_id=f"g{index}",
                prompt_ids=prompt,  # one shared (read-only) list: prompts are all alike here
                n_samples=self.batch.group_size,
                n_extra=n_extra,
                metadata={"max_new_tokens": self.response_tokens.max},
                sample_metadata=sets[0],
                resamples=sets[1:],
            )
            index += 1

    def length_stats(self, seed: int = 0, samples: int = 200_000) -> dict[str, float]:
        """Mean, max and percentiles of ``samples`` drawn response lengths (what the docs report)."""
        import numpy as np

        draws = self.response_tokens.sample(np.random.default_rng(seed), samples, shared=False)
        return {
            "mean": float(draws.mean()),
            "p50": float(np.percentile(draws, 50)),
            "p99": float(np.percentile(draws, 99)),
            "max": float(draws.max()),
            "truncated": float((draws >= self.response_tokens.max).mean()),
            "mean_sq_over_mean": float((draws.astype(float) ** 2).mean() / draws.mean()),
        }


def _format_validation_error(source: str, exc: ValidationError) -> str:
    lines = [f"{source}: invalid workload"]
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        lines.append(f"  {where}: {err['msg']}")
    return "\n".join(lines)


def resolve_workload_path(name_or_path: str | Path) -> Path:
    """A file path as given, else a shipped workload by name (with or without ``.yaml``)."""
    path = Path(name_or_path)
    if path.exists():
        return path
    shipped = WORKLOAD_DIR / (path.name if path.suffix in (".yaml", ".yml") else f"{path.name}.yaml")
    if shipped.exists():
        return shipped
    names = ", ".join(sorted(p.stem for p in WORKLOAD_DIR.glob("*.yaml")))
    raise WorkloadError(f"{name_or_path}: no such file, and no shipped workload by that name (shipped: {names})")


def parse_workload(data: Any, source: str = "workload") -> Workload:
    """Validate a parsed mapping; :class:`WorkloadError` names every bad key."""
    if not isinstance(data, dict):
        raise WorkloadError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return Workload.model_validate(data)
    except ValidationError as exc:
        raise WorkloadError(_format_validation_error(source, exc)) from None


def load_workload(name_or_path: str | Path) -> Workload:
    """Read and validate a workload YAML file (or a shipped workload by name)."""
    import yaml

    path = resolve_workload_path(name_or_path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise WorkloadError(f"{path}: not valid YAML ({exc})") from None
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read ({exc.strerror})") from None
    return parse_workload(data, source=str(path))


def shipped_workloads() -> list[str]:
    return sorted(p.stem for p in WORKLOAD_DIR.glob("*.yaml"))

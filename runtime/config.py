"""The typed configuration of a training job (``staleflow train``).

A job is described by a YAML file validated by :class:`JobConfig` (pydantic v2), with ``key=value``
overrides from the command line on dotted keys (``protocol.eta=4``, ``train.lr=1e-4``). The values
of an override are parsed as YAML (``true``, ``3``, ``[0.9, 0.98]``, ``1e-4``). Types are strict: a
flag for a number (``seed: true``), a quoted number (``seed: '3'``) or a word for a flag are errors. Every invalid value is reported
as ``<dotted key>: <problem>; allowed: <range or choices>``, unknown keys are refused, and settings
that contradict each other are refused with both keys named.

The defaults are the built-in CPU job (``shared/reference/cpu-rl-demo.md``); the shipped
``runtime/configs/default.yaml`` spells them out and must stay equal to them.
"""

from __future__ import annotations

import enum
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    model_validator,
)
from pydantic.fields import FieldInfo

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "default.yaml"
#: the coordinator knobs a config may set for the system's policy (null: the policy's own value)
POLICY_KNOBS = ("mu", "phi_wait", "phi_throughput", "sync_kv_fraction")


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``3e-4`` (no dot) as a string; this loader reads it as a float, as YAML 1.2 does."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


class ConfigError(ValueError):
    """A job configuration that cannot be used; the message names every bad key."""


class System(str, enum.Enum):
    """Which rollout/training system runs the job (design section 3.3: baselines in the same code).

    ``sync``: generate a whole batch, train, update every instance (VeRL). ``one-step-off``:
    staleness 1 with global updates (VeRL-Pipeline). ``inflight-cap``: AReaL/VeRL-Async admission
    with partial rollout and global updates. ``start-version-gc``: ROLL-style, abort groups older
    than the bound. ``staleflow``: the staleness protocol with the coordinator's routing,
    synchronisation and migration; ``staleflow-no-*`` switch one strategy off (ablations).
    The policies themselves are in ``runtime/policies.py``.
    """

    SYNC = "sync"
    ONE_STEP_OFF = "one-step-off"
    INFLIGHT_CAP = "inflight-cap"
    START_VERSION_GC = "start-version-gc"
    STALEFLOW = "staleflow"
    STALEFLOW_NO_ROUTING = "staleflow-no-routing"
    STALEFLOW_NO_SYNC = "staleflow-no-sync"
    STALEFLOW_NO_MIGRATION = "staleflow-no-migration"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_enum_values=False)


class ModelConfig(_Section):
    """The policy model. ``path`` null: the built-in tiny model, built locally (no hub) in
    ``tiny_model_dir`` (``<tiny_model_dir>-seed<seed>`` for a seed other than 0)."""

    path: str | None = None
    tiny_model_dir: str = Field("~/.cache/staleflow/tiny-model", min_length=1)
    seed: StrictInt = Field(0, ge=0)


class TaskConfig(_Section):
    """Prompts and the reward. ``prompt_file`` null: the built-in "repeat the letter" task."""

    name: Literal["repeat_letter"] = "repeat_letter"
    max_count: StrictInt = Field(64, ge=1, le=400)
    prompt_file: str | None = None
    prompt_key: str = Field("prompt", min_length=1)
    answer_key: str = Field("answer", min_length=1)
    reward: Literal["repeat_letter", "exact_match"] = "repeat_letter"
    reward_timeout_s: StrictFloat = Field(5.0, gt=0, le=3600)
    max_prompt_tokens: StrictInt = Field(32, ge=1, le=65536)
    eval_prompts: StrictInt = Field(128, ge=0, le=100000)
    eval_every: StrictInt = Field(25, ge=0, le=1_000_000)


class WarmupConfig(_Section):
    """Supervised warm-up on reference answers so rewards have variance from the first RL step."""

    steps: StrictInt = Field(100, ge=0, le=100000)
    batch_size: StrictInt = Field(64, ge=1, le=65536)
    lr: StrictFloat = Field(3e-3, gt=0, le=1)


class RolloutConfig(_Section):
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
    cpus_per_instance: StrictFloat = Field(0, ge=0, le=1024)
    """CPUs each rollout actor reserves in Ray (0: none, as on a small machine where they share)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """vLLM's weight and activation dtype; auto: bfloat16 on GPU instances, float32 on CPU ones."""
    gpu_memory_utilization: StrictFloat = Field(0.9, gt=0, le=1)
    """Share of each GPU vLLM may take (weights, activations, KV cache); GPU instances only."""
    enforce_eager: StrictBool | None = None
    """Disable CUDA graphs; null: eager on CPU, graphs on GPU."""
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Passed to vLLM's ``EngineArgs`` as they are (they override StaleFlow's settings)."""

    def engine_settings(self) -> dict[str, Any]:
        """The vLLM ``EngineArgs`` these settings resolve to (the binding adds its own)."""
        gpu = self.gpus_per_instance > 0
        settings: dict[str, Any] = {
            "dtype": self.dtype if self.dtype != "auto" else ("bfloat16" if gpu else "float32"),
            "enforce_eager": self.enforce_eager if self.enforce_eager is not None else not gpu,
        }
        if gpu:
            settings["tensor_parallel_size"] = self.gpus_per_instance
            settings["gpu_memory_utilization"] = self.gpu_memory_utilization
        return {**settings, **self.engine_kwargs}


class ServersConfig(_Section):
    """Where the trajectory server and the parameter server run."""

    placement: Literal["driver", "ray"] = "driver"
    """``ray``: each in its own Ray actor, and a Pull hands the instance a reference, so weights go
    from the parameter server's actor straight to the instance (never through the driver);
    ``driver``: in the driver process (every server call is a local call: the small CPU job)."""
    cpus: StrictFloat = Field(0, ge=0, le=1024)
    """CPUs each server actor reserves (``ray`` placement)."""
    weight_transfer: Literal["reference", "broadcast"] = "reference"
    """``ray`` placement: how an instance gets a version. ``reference``: its engine fetches the state
    dict from the parameter server's actor; ``broadcast``: a collective broadcast from the server
    into the instance's workers, in buckets (gloo on CPU, NCCL on GPU)."""
    wire_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Dtype of weights on the wire of a broadcast (the model's own dtype is restored on arrival)."""
    bucket_mb: StrictInt = Field(64, ge=1, le=65536)
    """Size of one broadcast bucket, MiB."""

    @model_validator(mode="after")
    def _broadcast_needs_ray(self) -> ServersConfig:
        if self.weight_transfer == "broadcast" and self.placement != "ray":
            raise ValueError("servers.weight_transfer=broadcast needs servers.placement=ray (the server sends from its own actor)")
        return self

    def broadcast_settings(self) -> dict[str, Any] | None:
        """The broadcast settings of a Ray-placed parameter server (None: reference pulls)."""
        if self.weight_transfer != "broadcast":
            return None
        return {"wire_dtype": self.wire_dtype, "bucket_bytes": self.bucket_mb << 20}


class ClusterConfig(_Section):
    """Where the job's actors run (Ray)."""

    address: str | None = None
    """An existing Ray cluster (``auto``, ``ray://host:10001``); null: ``RAY_ADDRESS`` if set, else a
    local cluster started for the job."""
    num_cpus: StrictInt | None = Field(2, ge=1, le=1_000_000)
    """CPUs of a local cluster (null: all of this machine's); ignored for an existing cluster."""
    num_gpus: StrictInt | None = Field(None, ge=0, le=1_000_000)
    """GPUs of a local cluster (null: those Ray detects); ignored for an existing cluster."""


#: ``protocol.eta`` when the config leaves it out (or null): what each system means by default.
DEFAULT_ETA = {"sync": 0, "one-step-off": 1, "inflight-cap": 2, "start-version-gc": 2, "staleflow": 2}


class ProtocolConfig(_Section):
    """The staleness protocol: bound ``eta``, groups per batch, redundancy slack.

    ``eta`` left out or null takes the system's default (:data:`DEFAULT_ETA`).
    """

    eta: StrictInt = Field(2, ge=0, le=1024)
    batch_groups: StrictInt = Field(16, ge=1, le=1_000_000)
    redundancy: StrictInt = Field(0, ge=0, le=1_000_000)


class CostModelConfig(_Section):
    """Decode cost model of one instance, ``L(n, K) = a_b + a_k*K + max(thr, o_b + o_k*n)`` seconds.

    Defaults: the tiny model on vLLM-CPU with one thread, fitted from 289 decode steps on the
    development machine (mean relative error 23%); ``staleflow profile`` fits one for your setup.
    """

    thr: StrictFloat = Field(2.137e-3, ge=0)
    o_b: StrictFloat = Field(0.0, ge=0)
    o_k: StrictFloat = Field(1.549e-4, ge=0)
    a_b: StrictFloat = Field(5.41e-4, ge=0)
    a_k: StrictFloat = Field(3.42e-6, ge=0)


class CoordinatorConfig(_Section):
    """The coordinator's knobs (design section 3.2). Ablations are systems (``staleflow-no-routing``...).

    The strategy knobs are defined once, by the system's policy
    (:class:`~staleflow.runtime.policies.SystemPolicy`: the paper's ``mu`` 0.3, ``phi_wait`` 3,
    ``phi_throughput`` 5, ``sync_kv_fraction`` 0.1); left out or null, a knob takes the chosen
    system's value. The built-in CPU job sets ``mu`` 0.02: with the CPU cost model, 0.3 stopped
    routing at about 14 requests per instance, where vLLM-CPU still gains throughput from bigger
    batches.
    """

    mu: StrictFloat | None = Field(None, ge=0, le=1)
    phi_wait: StrictInt | None = Field(None, ge=0, le=1_000_000)
    phi_throughput: StrictFloat | None = Field(None, ge=0, le=1000)
    sync_kv_fraction: StrictFloat | None = Field(None, ge=0, le=1)
    tick_s: StrictFloat = Field(0.05, gt=0, le=60)
    cost_model: CostModelConfig = CostModelConfig()

    def policy_knobs(self) -> dict[str, float | int]:
        """The knobs this config sets (the others keep the system's values)."""
        return {name: value for name in POLICY_KNOBS if (value := getattr(self, name)) is not None}


class TrainConfig(_Section):
    """The optimiser and the RL objective (``adapters/torch/algorithms.py``)."""

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
    micro_batch_tokens: StrictInt = Field(8192, ge=16, le=10_000_000)  # packed tokens per forward/backward
    logprob_chunk: StrictInt = Field(1024, ge=1, le=1_000_000)  # positions per [chunk, vocab] log-softmax
    activation_checkpointing: StrictBool = False
    dtype: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    gpus: StrictInt = Field(0, ge=0, le=1_000_000)
    """GPUs of the trainer (0: it trains on CPU in the driver process)."""

    @model_validator(mode="after")
    def _betas_in_range(self) -> TrainConfig:
        for i, beta in enumerate(self.betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"train.betas[{i}] = {beta} is out of range; allowed: 0 <= beta < 1")
        return self


class CheckpointConfig(_Section):
    """Checkpoints: model, optimiser, protocol snapshot and server state every ``every`` steps."""

    every: StrictInt = Field(50, ge=0, le=10_000_000)
    keep: StrictInt = Field(2, ge=1, le=1000)


class MetricsConfig(_Section):
    """Where metrics go besides ``metrics.jsonl`` (always written)."""

    tensorboard: StrictBool = True
    progress: StrictBool = True
    report: StrictBool = True


class JobConfig(_Section):
    """A training job. Defaults: the built-in CPU job."""

    system: System = System.STALEFLOW
    seed: StrictInt = Field(0, ge=0)
    run_dir: str | None = None
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    warmup: WarmupConfig = WarmupConfig()
    cluster: ClusterConfig = ClusterConfig()
    servers: ServersConfig = ServersConfig()
    rollout: RolloutConfig = RolloutConfig()
    protocol: ProtocolConfig = ProtocolConfig()
    coordinator: CoordinatorConfig = CoordinatorConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    metrics: MetricsConfig = MetricsConfig()

    @model_validator(mode="before")
    @classmethod
    def _default_eta(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw
        protocol = raw.get("protocol")
        if protocol is None:
            protocol = {}
        if isinstance(protocol, dict) and protocol.get("eta") is None:
            system = raw.get("system", System.STALEFLOW)
            system_name = system.value if isinstance(system, System) else system
            # an unknown system is reported by its own field; give eta the common default meanwhile
            raw = {**raw, "protocol": {**protocol, "eta": DEFAULT_ETA.get(str(system_name), 2)}}
        return raw

    @model_validator(mode="after")
    def _consistent(self) -> JobConfig:
        problems: list[str] = []
        eta, system = self.protocol.eta, self.system
        if system is System.SYNC and eta != 0:
            problems.append(f"system=sync trains on-policy; it needs protocol.eta=0 (got {eta})")
        if system is System.ONE_STEP_OFF and eta != 1:
            problems.append(f"system=one-step-off needs protocol.eta=1 (got {eta})")
        if system is System.SYNC and self.protocol.redundancy != 0:
            problems.append(f"system=sync has no redundancy; protocol.redundancy must be 0 (got {self.protocol.redundancy})")
        if self.rollout.group_size < 2:
            problems.append(
                f"rollout.group_size={self.rollout.group_size}: group advantages need at least 2 samples per group"
            )
        if self.protocol.batch_groups % self.train.minibatches != 0:
            problems.append(
                f"train.minibatches={self.train.minibatches} must divide protocol.batch_groups="
                f"{self.protocol.batch_groups} (minibatches hold whole groups)"
            )
        if self.task.max_prompt_tokens + self.rollout.max_new_tokens > self.rollout.max_model_len:
            problems.append(
                f"task.max_prompt_tokens ({self.task.max_prompt_tokens}) + rollout.max_new_tokens "
                f"({self.rollout.max_new_tokens}) exceeds rollout.max_model_len ({self.rollout.max_model_len})"
            )
        if self.task.prompt_file is None and self.task.reward != "repeat_letter":
            problems.append(f"the built-in task is scored by task.reward=repeat_letter (got {self.task.reward})")
        if self.task.prompt_file is None and self.task.max_count + 1 > self.rollout.max_new_tokens:
            problems.append(
                f"task.max_count={self.task.max_count} needs rollout.max_new_tokens >= {self.task.max_count + 1} "
                f"(answer plus end of sequence), got {self.rollout.max_new_tokens}"
            )
        if self.train.world_size > 1 and self.train.backend == "torch":
            problems.append(f"train.world_size={self.train.world_size} needs train.backend=fsdp (torch is one process)")
        if self.task.eval_every > 0 and self.task.eval_prompts == 0:
            problems.append("task.eval_every > 0 needs task.eval_prompts > 0 (or set task.eval_every=0)")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def batch_trajectories(self) -> int:
        """Trajectories trained per step: ``batch_groups * group_size``."""
        return self.protocol.batch_groups * self.rollout.group_size


# ---------------------------------------------------------------------------------------- loading
def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> JobConfig:
    """The job in ``path`` (default: the built-in job) with ``key=value`` ``overrides`` applied."""
    source = Path(path) if path is not None else DEFAULT_CONFIG
    try:
        raw = yaml.load(source.read_text(encoding="utf-8"), Loader=_Loader)
    except OSError as err:
        raise ConfigError(f"cannot read config file {source}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {source} is not valid YAML: {err}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {source} must hold a mapping of sections, got {type(raw).__name__}")
    for override in overrides:
        apply_override(raw, override)
    where = f"config {source}" + (f" with overrides {' '.join(overrides)}" if overrides else "")
    return validate_config(raw, source=where)


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Set the dotted key of ``key=value`` in the nested dict ``raw`` (value parsed as YAML)."""
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {override!r} is not of the form key=value (e.g. protocol.eta=4)")
    try:
        value = yaml.load(text, Loader=_Loader) if text.strip() else None
    except yaml.YAMLError:
        value = text
    parts = key.split(".")
    node = raw
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {'.'.join(parts[: depth + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def validate_config(raw: dict[str, Any], source: str = "config") -> JobConfig:
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as err:
        lines = [_describe(error) for error in err.errors()]
        raise ConfigError(f"invalid {source}:\n  " + "\n  ".join(lines)) from None


def dump_config(config: JobConfig) -> str:
    """The config as YAML that :func:`load_config` reads back to an equal config."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def _describe(error: Any) -> str:
    loc = tuple(str(part) for part in error["loc"])
    key = ".".join(loc) if loc else "config"
    message = error["msg"]
    if error["type"] == "value_error":  # our own cross-field checks carry their keys already
        return message.removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        allowed = _section_keys(loc[:-1])
        return f"{key}: unknown key; allowed keys here: {', '.join(allowed)}"
    got = error.get("input")
    allowed = _allowed(loc)
    text = f"{key}: {message} (got {got!r})"
    return f"{text}; allowed: {allowed}" if allowed else text


def _field(loc: tuple[str, ...]) -> FieldInfo | None:
    model: Any = JobConfig
    info: FieldInfo | None = None
    for part in loc:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return info if part.isdigit() else None
        info = model.model_fields[part]
        model = info.annotation
    return info


def _section_keys(loc: tuple[str, ...]) -> list[str]:
    model: Any = JobConfig
    for part in loc:
        model = model.model_fields[part].annotation
    return list(model.model_fields)


def _allowed(loc: tuple[str, ...]) -> str:
    """The allowed range or choices of the field at ``loc``, from its type and constraints."""
    info = _field(loc)
    if info is None:
        return ""
    annotation = info.annotation
    choices = _choices(annotation)
    if choices:
        return "one of " + ", ".join(choices)
    bounds = []
    for meta in info.metadata:
        for name, symbol in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            value = getattr(meta, name, None)
            if value is not None:
                bounds.append(f"{symbol} {value}")
        if getattr(meta, "min_length", None):
            bounds.append("non-empty")
    type_name = _type_name(annotation)
    if bounds:
        return f"{type_name} " + " and ".join(bounds)
    return type_name


def _type_name(annotation: Any) -> str:
    if typing.get_origin(annotation) is typing.Annotated:  # StrictFloat and friends
        return _type_name(typing.get_args(annotation)[0])
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and args:
        return "null or " + " or ".join(_type_name(a) for a in args)
    if typing.get_origin(annotation) is tuple:
        return "list of " + ", ".join(_type_name(a) for a in args)
    return getattr(annotation, "__name__", str(annotation))


def _choices(annotation: Any) -> list[str]:
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return [str(member.value) for member in annotation]
    if typing.get_origin(annotation) is Literal:
        return [str(arg) for arg in typing.get_args(annotation)]
    return []

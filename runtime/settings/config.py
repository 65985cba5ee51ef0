"""The typed configuration of a training job (``staleflow train``).

A job is described by a YAML file validated by :class:`JobConfig` (pydantic v2), with ``key=value``
overrides from the command line on dotted keys (``protocol.eta=4``, ``train.lr=1e-4``). The values
of an override are parsed as YAML (``true``, ``3``, ``[0.9, 0.98]``, ``1e-4``). Types are strict: a
flag for a number (``seed: true``), a quoted number (``seed: '3'``) or a word for a flag are errors. Every invalid value is reported
as ``<dotted key>: <problem>; allowed: <range or choices>``, unknown keys are refused, and settings
that contradict each other are refused with both keys named. Which systems a job runs, their
default ``eta`` and their rules come from the table of systems,
:data:`~staleflow.runtime.settings.policies.POLICIES`.

The defaults are the built-in CPU job (``docs/training.md``); the shipped
``runtime/settings/configs/default.yaml`` spells them out and must stay equal to them.
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
    Field,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from staleflow.runtime.settings.config_sections import (
    CheckpointConfig,
    ClusterConfig,
    ConfigSection,
    CoordinatorConfig,
    MetricsConfig,
    ModelConfig,
    ProtocolConfig,
    RolloutConfig,
    ServersConfig,
    TaskConfig,
    TrainConfig,
    WarmupConfig,
)
from staleflow.runtime.settings.policies import DEFAULT_ETA, find_policy, make_policy, training_systems

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "default.yaml"


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``3e-4`` (no dot) as a string; this loader reads it as a float, as YAML 1.2 does."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


class ConfigError(ValueError):
    """A job configuration that cannot be used; the message names every bad key."""


class JobConfig(ConfigSection):
    """A training job. Defaults: the built-in CPU job."""

    system: str = "staleflow"
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

    @field_validator("system", mode="before")
    @classmethod
    def _trainable_system(cls, value: Any) -> Any:
        """A system of the table (:data:`~staleflow.runtime.settings.policies.POLICIES`) that a job can train with."""
        names = training_systems()
        if value not in names:
            raise ValueError(f"system: Input should be a system a training job runs (got {value!r}); allowed: one of {', '.join(names)}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _default_eta(cls, raw: Any) -> Any:
        """``protocol.eta`` left out or null: the system's :attr:`~staleflow.runtime.settings.policies.SystemPolicy.default_eta`."""
        if not isinstance(raw, dict):
            return raw
        protocol = raw.get("protocol")
        if protocol is None:
            protocol = {}
        if isinstance(protocol, dict) and protocol.get("eta") is None:
            # an unknown system is reported by its own field; give eta the common default meanwhile
            policy = find_policy(str(raw.get("system", "staleflow")))
            raw = {**raw, "protocol": {**protocol, "eta": DEFAULT_ETA if policy is None else policy.default_eta}}
        return raw

    @model_validator(mode="after")
    def _consistent(self) -> JobConfig:
        problems: list[str] = []
        policy = make_policy(self.system)  # the system's rules are its entry in the table of systems
        eta, fixed = self.protocol.eta, policy.fixed_eta
        if fixed is not None and eta != fixed:
            why = "trains on-policy; it " if fixed == 0 else ""
            problems.append(f"system={self.system} {why}needs protocol.eta={fixed} (got {eta})")
        if not policy.takes_redundancy and self.protocol.redundancy != 0:
            problems.append(
                f"system={self.system} has no redundancy; protocol.redundancy must be 0 (got {self.protocol.redundancy})"
            )
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
        if self.task.eval_sampling == "greedy" and self.task.eval_samples > 1:
            problems.append(
                f"task.eval_samples={self.task.eval_samples} needs task.eval_sampling=sampled (greedy gives one answer per prompt)"
            )
        if self.train.world_size > 1 and self.train.backend == "torch":
            problems.append(f"train.world_size={self.train.world_size} needs train.backend=fsdp (torch is one process)")
        if self.task.eval_every > 0 and self.task.eval_prompts == 0:
            problems.append("task.eval_every > 0 needs task.eval_prompts > 0 (or set task.eval_every=0)")
        if self.parameter_server_needs_gpu and 0 < self.train.gpus < 1 and 0 < self.rollout.gpu_share < 1:
            problems.append(
                f"servers.weight_transfer=broadcast over NCCL with train.gpus={self.train.gpus:g} and instances sharing GPUs: the "
                "parameter server sends from trainer rank 0's GPU, which a rollout instance's receiving worker may share, and NCCL "
                "refuses two ranks of one group on one GPU; use servers.weight_transfer=reference"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def batch_trajectories(self) -> int:
        """Trajectories trained per step: ``batch_groups * group_size``."""
        return self.protocol.batch_groups * self.rollout.group_size

    @property
    def parameter_server_needs_gpu(self) -> bool:
        """Whether the job's parameter server broadcasts over NCCL, and so must hold a GPU:
        ``servers.transfer_backend=nccl``, or ``auto`` with GPU rollout instances (vLLM's CUDA build
        receives over NCCL; a server without a GPU would pick gloo and be refused at the first pull)."""
        servers = self.servers
        if servers.placement != "ray" or servers.weight_transfer != "broadcast":
            return False
        return servers.transfer_backend == "nccl" or (servers.transfer_backend == "auto" and self.rollout.gpus_per_instance > 0)


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
        lines = list(dict.fromkeys(_describe(error) for error in _one_per_union(err.errors())))
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


def _one_per_union(errors: list[Any]) -> list[Any]:
    """Pydantic reports a value that fits no arm of a union (``auto`` or a bounded int) once per arm,
    its loc ending in the arm's tag; keep one error per field, the first arm that is not a literal,
    at the field's own loc (:func:`_allowed` names every arm)."""
    kept: dict[tuple[str, ...], tuple[bool, Any]] = {}
    for error in errors:
        loc = tuple(str(part) for part in error["loc"])
        if _is_union_arm(loc):
            literal = loc[-1].startswith("literal")
            if loc[:-1] not in kept or (kept[loc[:-1]][0] and not literal):
                kept[loc[:-1]] = (literal, {**error, "loc": loc[:-1]})
        else:
            kept[loc] = (False, error)
    return [error for _, error in kept.values()]


def _is_union_arm(loc: tuple[str, ...]) -> bool:
    parent = _field(loc[:-1]) if len(loc) > 1 and _field(loc) is None else None
    return parent is not None and typing.get_origin(parent.annotation) in (typing.Union, types.UnionType)


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
    return _describe_type(info.annotation, info.metadata)


def _describe_type(annotation: Any, metadata: list[Any]) -> str:
    arms = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    if any(typing.get_origin(arm) is Literal for arm in arms):  # e.g. "auto" or a bounded int
        return " or ".join(", ".join(_choices(arm)) if typing.get_origin(arm) is Literal else _describe_type(*_unwrap(arm))
                           for arm in arms)
    choices = _choices(annotation)
    if choices:
        return "one of " + ", ".join(choices)
    bounds = []
    for meta in metadata:
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


def _unwrap(annotation: Any) -> tuple[Any, list[Any]]:
    """``Annotated[int, Field(ge=16)]`` -> ``(int, [its constraints])``; other types as they are."""
    if typing.get_origin(annotation) is typing.Annotated:
        base, *extra = typing.get_args(annotation)
        return base, [m for meta in extra for m in getattr(meta, "metadata", [meta])]
    return annotation, []


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

"""Before a training job starts: its config (a job file, or the run it resumes, with overrides), its run
directory and checkpoint, the dry run's plan, and the check that what the job needs is installed."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from staleflow.app.checkpoints import CHECKPOINTS, latest_checkpoint
from staleflow.app.dry_run import DryRun, check_plan
from staleflow.runtime.settings.config import ConfigError, JobConfig, dump_config, load_config
from staleflow.runtime.settings.placement_plan import plan_placement

#: what :func:`prepare_job` and :func:`check_installed` raise for a job that cannot start (the command's exit 2)
PREPARATION_ERRORS = (ConfigError, FileNotFoundError, ValueError, ImportError)


@dataclass(frozen=True)
class PreparedJob:
    """The resolved config, where the run's files go, and the checkpoint it resumes from (None: a new run)."""

    config: JobConfig
    run_dir: Path
    checkpoint: Path | None = None


def prepare_job(config_file: str | None, overrides: list[str], run_dir: str | None = None, resume: str | None = None) -> PreparedJob:
    """A new run of ``config_file`` (None: the built-in job) in ``run_dir`` (default ``runs/<UTC timestamp>``),
    or, with ``resume``, the run in that folder continued from its newest checkpoint."""
    if resume:
        folder = Path(resume)
        if config_file:
            raise ValueError("--resume takes the config of the run it resumes; give overrides only")
        config = load_config(folder / "config.yaml", overrides)
        checkpoint = latest_checkpoint(folder)
        if checkpoint is None:
            raise FileNotFoundError(f"{folder} has no checkpoint to resume from ({folder / CHECKPOINTS}/step-*)")
        return PreparedJob(config, folder, checkpoint)
    config = load_config(config_file, overrides)
    if config_file:
        config = data_paths_near(config, Path(config_file).parent)
    chosen = run_dir or config.run_dir
    folder = Path(chosen) if chosen else _new_run_folder(Path("runs"), datetime.now(UTC).strftime("%Y%m%d-%H%M%S"))
    if folder.exists() and any(folder.iterdir()):
        raise ValueError(f"run directory {folder} is not empty; choose another or --resume it")
    return PreparedJob(config, folder)


def _new_run_folder(parent: Path, stamp: str) -> Path:
    """``parent/stamp``, or ``parent/stamp-2``, ``-3``... where a run started in the same second has it."""
    folder, n = parent / stamp, 1
    while folder.exists() and any(folder.iterdir()):
        n += 1
        folder = parent / f"{stamp}-{n}"
    return folder


def data_paths_near(config: JobConfig, folder: Path) -> JobConfig:
    """A relative ``task.prompt_file``/``task.eval_file`` that is not found from the working directory
    but is beside the config file (a shipped example's data) is taken from there."""
    task = config.task
    updates = {}
    for key in ("prompt_file", "eval_file"):
        value = getattr(task, key)
        if value and not Path(value).is_absolute() and not Path(value).exists() and (folder / value).exists():
            updates[key] = str(folder / value)
    return config.model_copy(update={"task": task.model_copy(update=updates)}) if updates else config


def run_decisions(config: JobConfig) -> dict[str, Any]:
    """What the run will use beyond placement: how weights travel, the dtypes and the vLLM executor."""
    servers, rollout, train = config.servers, config.rollout, config.train
    engine = rollout.engine_settings()
    broadcast = servers.broadcast_settings()
    return {
        "weight_transfer": servers.weight_transfer,
        "transfer_backend": transfer_backend(config) if broadcast else None,
        "transfer_host": (broadcast["host"] or "the parameter server's node IP") if broadcast else None,
        "wire_dtype": servers.wire_dtype if broadcast else None,
        "rollout_dtype": engine["dtype"],
        "rollout_executor": engine.get("distributed_executor_backend", "uni"),
        "tensor_parallel_size": rollout.tensor_parallel_size,
        "train_dtype": train.dtype if train.dtype != "auto" else ("bf16" if train.gpus > 0 else "fp32"),
        "train_device": "cuda" if train.gpus > 0 else "cpu",
        "evaluation": evaluation_place(config),
    }


def evaluation_place(config: JobConfig) -> str:
    """Where the job evaluates (``task.eval_engine``; the built-in task: the trainer)."""
    task = config.task
    if task.eval_prompts == 0:
        return "off"
    if task.prompt_file is None:
        return "the trainer's greedy decoding"
    return "an engine of its own" if task.eval_engine == "own" else "every rollout instance holding the newest version, between steps"


def transfer_backend(config: JobConfig) -> str:
    """The backend a broadcasting parameter server will send with: ``nccl`` where it is planned a GPU
    (:attr:`~staleflow.runtime.settings.config.JobConfig.parameter_server_needs_gpu`: ``nccl``, or
    ``auto`` with GPU instances), else ``gloo``."""
    return "nccl" if config.parameter_server_needs_gpu else "gloo"


def dry_run(config: JobConfig, as_json: bool) -> tuple[str, DryRun]:
    """The resolved config, the placement plan, the run's decisions (:func:`run_decisions`) and the
    dry run's checks (:mod:`~staleflow.app.dry_run`), as text or JSON; and the checks (their
    problems refuse the run, their warnings do not)."""
    plan = plan_placement(config, os.environ.get("RAY_ADDRESS") if config.cluster.address is None else None)
    decisions = run_decisions(config)
    checks = check_plan(config, plan)
    if as_json:
        out = {"config": config.model_dump(mode="json"), "placement": plan.to_dict(), "run": decisions,
               "checks": checks.report, "problems": checks.problems, "warnings": checks.warnings}
        return json.dumps(out, indent=1), checks
    report = dict(checks.report)
    memory = report.pop("trainer_memory")
    report["trainer_memory"] = memory["text"] if isinstance(memory, dict) else memory
    lines = "\n".join(f"  {key}: {value}" for key, value in {**decisions, **report}.items())
    return f"{dump_config(config)}\n# placement plan\n{plan.describe()}\n# run\n{lines}", checks


def check_installed(config: JobConfig) -> None:
    """Fail early, with the fix, when a part the job needs is not installed."""
    if importlib.util.find_spec("vllm") is None:
        raise ImportError("the rollout instances need vLLM: pip install -e '.[cpu-infer]' (CPU) or '.[gpu]' (CUDA)")
    if config.train.backend == "megatron" and importlib.util.find_spec("megatron") is None:
        raise ImportError("train.backend=megatron needs megatron-core: pip install -e '.[megatron]'")
    if config.train.gpus > 0 and config.train.backend == "torch":
        raise ValueError(
            f"train.gpus={config.train.gpus} places trainer ranks as Ray actors: it needs train.backend=fsdp or megatron "
            "(train.backend=torch trains in the driver process)"
        )
    if config.metrics.wandb.project is not None and importlib.util.find_spec("wandb") is None:
        raise ImportError("metrics.wandb.project needs wandb: pip install -e '.[tracking]'")

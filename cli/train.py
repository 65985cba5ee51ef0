"""``staleflow train``: a real RL training run (vLLM rollout, torch training) under the staleness protocol.

With no arguments it runs the built-in job (``runtime/settings/configs/default.yaml``): the tiny model learns
the "repeat the letter" task on this machine's CPU in a few minutes, with two vLLM rollout
instances. ``--system sync`` runs the synchronous baseline on the same job. ``key=value``
arguments override the config (``staleflow train protocol.eta=4 train.steps=300``).

A run directory (default ``runs/<UTC timestamp>``) receives ``config.yaml``, ``model-v0/`` (the
warmed-up starting model), ``metrics.jsonl``, ``instances.jsonl``, ``trace.jsonl`` (the protocol
trace for ``staleflow verify --trace``; a resumed run appends a segment to it),
``tensorboard/``, ``checkpoints/step-<n>/`` and, at the end, ``summary.json`` and ``report.md``
with its plots. ``--resume DIR`` continues a run from its newest checkpoint: trainer weights and
optimiser, the protocol state (every active group keeps its version, so the bound holds across the
resume), the trajectory server with its partial rollouts, and the prompt stream position.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from staleflow.cli.train_checkpoints import CHECKPOINTS, LOOP_STATE, latest_checkpoint, restore_trainer, save_checkpoint
from staleflow.cli.train_setup import Evaluator, TaskData, Tokens, base_model, make_trainer, warm_start
from staleflow.cli.train_summary import step_record, summarise, summary_text

if TYPE_CHECKING:
    from staleflow.runtime.settings.config import JobConfig

SUMMARY_FILE = "summary.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. protocol.eta=4")
    parser.add_argument("--config", metavar="YAML", help="job file (default: the built-in job)")
    parser.add_argument(
        "--system", help="staleflow (default), sync, one-step-off, inflight-cap, start-version-gc, staleflow-no-{routing,sync,migration}"
    )
    parser.add_argument("--steps", type=int, help="training steps (same as train.steps=N)")
    parser.add_argument("--run-dir", metavar="DIR", help="where the run's files go (default runs/<UTC timestamp>)")
    parser.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its newest checkpoint")
    parser.add_argument(
        "--dry-run", action="store_true", help="print the resolved config and the placement plan (actors, CPUs, GPUs); start nothing"
    )
    parser.add_argument("--json", action="store_true", help="with --dry-run: print them as JSON")


def run(args: argparse.Namespace) -> int:
    from staleflow.adapters.ray.placement import PlacementError
    from staleflow.cli.train_rewards import ScorerCheckError
    from staleflow.runtime.settings.config import ConfigError
    from staleflow.runtime.tasks import PromptFileError, RewardSpecError

    try:
        config, run_dir, checkpoint = _prepare(args)
        if args.dry_run:
            print(_dry_run(config, as_json=args.json))
            return 0
        _check_installed(config)
    except (ConfigError, FileNotFoundError, ValueError, ImportError) as err:
        print(f"staleflow train: {err}", file=sys.stderr)
        return 2
    try:
        summary = train(config, run_dir, checkpoint)
    except (PlacementError, PromptFileError, RewardSpecError, ScorerCheckError) as err:  # raised before anything starts
        print(f"staleflow train: {err}", file=sys.stderr)
        return 2
    print(summary_text(summary, run_dir))
    return 0 if summary["audit_ok"] and summary["bound_ok"] else 1


def _place_servers(config: JobConfig, placement: Any) -> dict[str, Any]:
    """The trajectory and parameter servers as Ray actors (``servers.placement=ray``), or none: the
    run loop then makes them in this process."""
    if config.servers.placement != "ray":
        return {}
    from staleflow.adapters.ray.parameter_server import RemoteParameterServer
    from staleflow.runtime.servers.trajectory_server import TrajectoryServer

    return {
        "trajectory_server": placement.place_reserved("trajectory-server", TrajectoryServer),
        "parameter_server": RemoteParameterServer.place(
            placement, "parameter-server", broadcast=config.servers.broadcast_settings()
        ),
    }


def _dry_run(config: JobConfig, as_json: bool) -> str:
    """The resolved config and the placement plan, as text or JSON."""
    from staleflow.runtime.settings.config import dump_config
    from staleflow.runtime.settings.placement_plan import plan_placement

    plan = plan_placement(config, os.environ.get("RAY_ADDRESS") if config.cluster.address is None else None)
    if as_json:
        return json.dumps({"config": config.model_dump(mode="json"), "placement": plan.to_dict()}, indent=1)
    return f"{dump_config(config)}\n# placement plan\n{plan.describe()}"


# ------------------------------------------------------------------------------------ preparing
def _prepare(args: argparse.Namespace) -> tuple[JobConfig, Path, Path | None]:
    from staleflow.runtime.settings.config import load_config

    overrides = list(args.overrides)
    if args.system:
        overrides.append(f"system={args.system}")
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    checkpoint = None
    if args.resume:
        run_dir = Path(args.resume)
        if args.config:
            raise ValueError("--resume takes the config of the run it resumes; give overrides only")
        config = load_config(run_dir / "config.yaml", overrides)
        checkpoint = latest_checkpoint(run_dir)
        if checkpoint is None:
            raise FileNotFoundError(f"{run_dir} has no checkpoint to resume from ({run_dir / CHECKPOINTS}/step-*)")
    else:
        config = load_config(args.config, overrides)
        if args.config:
            config = _data_paths_near(config, Path(args.config).parent)
        chosen = args.run_dir or config.run_dir
        run_dir = Path(chosen) if chosen else Path("runs") / datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        if run_dir.exists() and any(run_dir.iterdir()):
            raise ValueError(f"run directory {run_dir} is not empty; choose another or --resume it")
    return config, run_dir, checkpoint


def _data_paths_near(config: JobConfig, folder: Path) -> JobConfig:
    """A relative ``task.prompt_file``/``task.eval_file`` that is not found from the working directory
    but is beside the config file (a shipped example's data) is taken from there."""
    task = config.task
    updates = {}
    for key in ("prompt_file", "eval_file"):
        value = getattr(task, key)
        if value and not Path(value).is_absolute() and not Path(value).exists() and (folder / value).exists():
            updates[key] = str(folder / value)
    return config.model_copy(update={"task": task.model_copy(update=updates)}) if updates else config


def _check_installed(config: JobConfig) -> None:
    """Fail early, with the fix, when a part the job needs is not installed."""
    import importlib.util

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

# -------------------------------------------------------------------------------------- training
def train(config: JobConfig, run_dir: Path, checkpoint: Path | None = None) -> dict[str, Any]:
    """Run the job in ``config`` (resuming from ``checkpoint`` if given); returns the summary."""
    from staleflow.adapters.vllm.engine import set_vllm_env_defaults

    set_vllm_env_defaults()  # before vLLM (or torch) reads its environment
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from staleflow.adapters.ray.placement import RayPlacement
    from staleflow.adapters.vllm.engine import SamplingConfig, VLLMEngine
    from staleflow.cli.metrics import EngineLedger, MetricsLog, TrackedEngine
    from staleflow.cli.train_rewards import check_scorer, pooled_reward
    from staleflow.runtime.coordination.cost_model import CostModel
    from staleflow.runtime.run.assembly import assemble_run
    from staleflow.runtime.run.clock import RealClock
    from staleflow.runtime.run.loop import RunParts
    from staleflow.runtime.run.run_spec import RunSpec
    from staleflow.runtime.settings.config import dump_config
    from staleflow.runtime.settings.placement_plan import plan_placement
    from staleflow.runtime.tasks import make_group

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(config), encoding="utf-8")
    torch.manual_seed(config.seed)
    started = time.perf_counter()
    resuming = checkpoint is not None
    base = base_model(config)
    tokens = Tokens(base, config.task.chat_template)
    data = TaskData(config, tokens)  # a malformed row or an unusable scorer stops the job here
    check_scorer(config, data)
    clock = RealClock()
    # Each vLLM engine needs a process of its own (vLLM keeps per-process global state), so the
    # instances are Ray actors. They start on the base model while the warm-up runs here, then
    # load the warmed weights as version 0.
    cluster = config.cluster
    placement = RayPlacement(
        attributes=(), address=cluster.address, num_cpus=cluster.num_cpus, num_gpus=cluster.num_gpus,
        include_dashboard=False, log_to_driver=False,
    )
    try:  # every actor's resources at once, before any engine starts
        placement.reserve(plan_placement(config))
    except BaseException:
        placement.close()
        raise
    sampling = SamplingConfig(temperature=config.rollout.temperature, stop_token_ids=(tokens.eos_id,))
    engine_start = time.perf_counter()
    remote_engines = [
        placement.place_reserved(
            f"rollout-{i}",
            VLLMEngine,
            f"rollout-{i}",
            str(base),
            sampling=sampling,
            max_model_len=config.rollout.max_model_len,
            max_num_seqs=config.rollout.max_num_seqs,
            seed=config.seed * 1000 + i,
            clock=clock,
            weights_dir=str(run_dir / ".weights"),
            engine_kwargs=config.rollout.engine_settings(),
            start_timeout_s=config.rollout.start_timeout_s,
            # tensor parallelism needs vLLM's engine core in its own processes (one per GPU)
            env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"} if config.rollout.gpus_per_instance > 1 else None,
        )
        for i in range(config.rollout.instances)
    ]
    evaluator = _evaluator(config, tokens, data, placement, base, clock, run_dir)
    model_v0 = run_dir / "model-v0"
    warmup_seconds = 0.0
    if not resuming:
        model_v0, warmup_seconds = warm_start(config, base, model_v0, tokens, data)
    elif not model_v0.is_dir():  # a run of a user's model without warm-up starts from the model itself
        model_v0 = base
    if model_v0 == base and not isinstance(evaluator, Evaluator):
        evaluator.starts_at(0)
    trainer = make_trainer(config, model_v0, tokens, placement.placement_group)
    saved_state = None
    if checkpoint is not None:  # the trainer first, so the instances start at its version
        saved_state = json.loads((checkpoint / LOOP_STATE).read_text(encoding="utf-8"))
        restore_trainer(trainer, checkpoint, saved_state)
        for engine in remote_engines:
            engine.load_weights(trainer.version, trainer.weights())
    elif model_v0 != base:  # the engines started on the base model
        for engine in remote_engines:
            engine.load_weights(0, str(model_v0 / "model.safetensors"))
    engine_seconds = time.perf_counter() - engine_start

    log = MetricsLog(
        run_dir,
        total_steps=config.train.steps,
        tensorboard=config.metrics.tensorboard,
        progress=config.metrics.progress,
        append=resuming,
        wandb=config.metrics.wandb.model_dump() if config.metrics.wandb.project else None,
        wandb_config=config.model_dump(mode="json"),
    )
    for path, (skipped, rows) in data.filtered.items():
        log.event("prompts_filtered", file=path, skipped=skipped, rows=rows, max_prompt_tokens=config.task.max_prompt_tokens)
    ledger = EngineLedger(run_dir / "instances.jsonl", append=resuming)
    engines = [TrackedEngine(e, ledger, instance_id=f"rollout-{i}") for i, e in enumerate(remote_engines)]

    reward_seconds = [0.0]  # the driver's share: decoding responses for the scorer processes
    reward = pooled_reward(config, tokens, reward_seconds)
    prompt_stream = data.stream(config.seed + 1)
    groups: Iterator[Any] = (
        make_group(
            prompt,
            f"g{n}",
            encode=tokens.encode,
            n_samples=config.rollout.group_size,
            n_extra=config.rollout.group_extra,
            max_new_tokens=config.rollout.max_new_tokens,
        )
        for n, prompt in enumerate(prompt_stream)
    )
    if saved_state is not None:  # continue the prompt stream where the checkpointed run had drawn to
        groups = itertools.islice(groups, int(saved_state["prompts_drawn"]), None)
    servers = _place_servers(config, placement)
    parts = RunParts(
        **servers,
        engines=engines,
        trainer=trainer,
        prompts=groups,
        cost_model=CostModel(**config.coordinator.cost_model.model_dump()),
        clock=clock,
        reward_fn=reward,
    )
    # A resumed run appends a segment (header = the restored protocol state) to the same trace.
    trace_path = run_dir / "trace.jsonl"
    loop = assemble_run(RunSpec.from_job(config), parts, trace_path=trace_path)
    first_step = 0
    trained_before = 0  # tokens trained before a resume, so throughput covers this run only
    if saved_state is not None:
        loop.load_state_dict(saved_state)
        first_step = int(saved_state["steps_done"])
        trained_before = int(saved_state["tokens"][1])
        log.event("resumed", step=first_step, checkpoint=str(checkpoint))

    def evaluate() -> dict[str, Any]:
        if isinstance(evaluator, Evaluator):
            return evaluator.run(trainer)
        weights = trainer.weights() if trainer.version > 0 else str(model_v0)
        return evaluator.run(trainer.version, weights)

    if not resuming and evaluator.enabled:
        log.eval(0, evaluate())
    deferred = None  # task.eval_timing=deferred: weights saved now, evaluated after the run loop
    if evaluator.enabled and config.task.eval_timing == "deferred":
        from staleflow.cli.train_eval import DeferredEvaluation

        saved_eval = evaluator.run_saved if isinstance(evaluator, Evaluator) else evaluator.run
        deferred = DeferredEvaluation(run_dir / ".eval-snapshots", saved_eval)

    evaluated: set[int] = set()

    def evaluate_at(step: int) -> None:
        """Evaluate the weights of ``step`` once (a run stopped by its time limit right after an
        evaluation step would otherwise evaluate that step twice)."""
        if step in evaluated:
            return
        evaluated.add(step)
        if deferred is not None:
            deferred.save(step, trainer.version, trainer.weights())
        else:
            log.eval(step, evaluate())

    deadline = None if config.train.max_time_s is None else time.perf_counter() + config.train.max_time_s
    metrics = None
    try:
        for step in range(first_step + 1, config.train.steps + 1):
            metrics = loop.run(1)
            record = step_record(metrics, ledger, reward_seconds[0], trained_before)
            log.step(step, record, versions=ledger.versions())
            if evaluator.enabled and config.task.eval_every and step % config.task.eval_every == 0 and step < config.train.steps:
                evaluate_at(step)
            if config.checkpoint.every and step % config.checkpoint.every == 0 and step < config.train.steps:
                folder = save_checkpoint(loop, trainer, run_dir, step, config.checkpoint.keep)
                log.event("checkpoint", step=step, path=str(folder))
            if deadline is not None and time.perf_counter() > deadline:
                log.event("time_limit", step=step, max_time_s=config.train.max_time_s)
                break
        if metrics is None:
            metrics = loop.metrics()
        final_step = metrics.steps
        if evaluator.enabled:
            evaluate_at(final_step)
        if deferred is not None:
            deferred.run(log)
        # Interrupt every running request (its partial goes to the trajectory server) so that the
        # final audit is exact, and keep that state as the last checkpoint (--resume extends a run).
        if config.checkpoint.every:
            folder = save_checkpoint(loop, trainer, run_dir, final_step, config.checkpoint.keep)
            log.event("checkpoint", step=final_step, path=str(folder))
        else:
            loop.state_dict()
        audit = loop.audit()
        summary = summarise(
            config,
            loop.manager.eta,
            metrics,
            audit,
            trained_before,
            ledger,
            trace_path,
            time.perf_counter() - started,
            warmup_seconds,
            engine_seconds,
            reward_seconds[0],
            run_dir,
        )
    finally:
        log.close()
        if not isinstance(evaluator, Evaluator):
            evaluator.close()
        loop.close()
        ledger.close()
        placement.close()
    (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1), encoding="utf-8")
    shutil.rmtree(run_dir / ".weights", ignore_errors=True)
    shutil.rmtree(run_dir / ".eval-weights", ignore_errors=True)
    shutil.rmtree(run_dir / ".eval-snapshots", ignore_errors=True)
    if config.metrics.report:
        from staleflow.cli.report import write_report

        write_report(run_dir)
    return summary


def _evaluator(config: JobConfig, tokens: Tokens, data: TaskData, placement: Any, base: Path, clock: Any, run_dir: Path) -> Any:
    """The trainer's greedy evaluator for the built-in stream (as before); for prompts from files, an
    :class:`~staleflow.cli.train_eval.EngineEvaluator` on its own rollout engine (a Ray actor)."""
    if data.train is None and data.held_out is None:
        return Evaluator(config, tokens, prompt_seed=config.seed + 2, data=data, model_dir=base)
    if config.task.eval_prompts == 0:
        return Evaluator(config, tokens, prompt_seed=config.seed + 2, data=data)  # disabled
    from staleflow.adapters.vllm.engine import SamplingConfig, VLLMEngine
    from staleflow.cli.train_eval import EngineEvaluator
    from staleflow.cli.train_rewards import pooled_reward

    held_out = data.held_out is not None
    prompts = data.held_out if data.held_out is not None else list(itertools.islice(data.stream(config.seed + 2), config.task.eval_prompts))
    greedy = config.task.eval_sampling == "greedy"
    engine = placement.place(
        VLLMEngine,
        "eval",
        str(base),
        sampling=SamplingConfig(temperature=0.0 if greedy else config.rollout.temperature, stop_token_ids=(tokens.eos_id,)),
        max_model_len=config.rollout.max_model_len,
        max_num_seqs=config.rollout.max_num_seqs,
        seed=config.seed * 1000 + 999,
        clock=clock,
        weights_dir=str(run_dir / ".eval-weights"),
        start_timeout_s=config.rollout.start_timeout_s,
    )
    return EngineEvaluator(
        engine,
        prompts,
        encode=tokens.encode,
        reward=pooled_reward(config, tokens, [0.0], workers=1),
        reward_timeout_s=config.task.reward_timeout_s,
        max_new_tokens=config.rollout.max_new_tokens,
        samples=config.task.eval_samples,
        mode=config.task.eval_sampling,
        held_out=held_out,
    )

"""``staleflow train``: a real RL training run (vLLM rollout, torch training) under the staleness protocol.

With no arguments it runs the built-in job (``runtime/configs/default.yaml``): the tiny model learns
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
from typing import Any

CHECKPOINTS = "checkpoints"
LOOP_STATE = "loop_state.json"
TRAINER_DIR = "trainer"
SUMMARY_FILE = "summary.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. protocol.eta=4")
    parser.add_argument("--config", metavar="YAML", help="job file (default: the built-in job)")
    parser.add_argument("--system", help="staleflow (default), sync, one-step-off, inflight-cap, start-version-gc, staleflow-no-{routing,sync,migration}")
    parser.add_argument("--steps", type=int, help="training steps (same as train.steps=N)")
    parser.add_argument("--run-dir", metavar="DIR", help="where the run's files go (default runs/<UTC timestamp>)")
    parser.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its newest checkpoint")


def run(args: argparse.Namespace) -> int:
    from staleflow.runtime.config import ConfigError

    try:
        config, run_dir, checkpoint = _prepare(args)
        _check_installed(config)
    except (ConfigError, FileNotFoundError, ValueError, ImportError) as err:
        print(f"staleflow train: {err}", file=sys.stderr)
        return 2
    summary = train(config, run_dir, checkpoint)
    print(_summary_text(summary, run_dir))
    return 0 if summary["audit_ok"] and summary["bound_ok"] else 1


# ------------------------------------------------------------------------------------ preparing
def _prepare(args: argparse.Namespace) -> tuple[Any, Path, Path | None]:
    from staleflow.runtime.config import load_config

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
        chosen = args.run_dir or config.run_dir
        run_dir = Path(chosen) if chosen else Path("runs") / datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        if run_dir.exists() and any(run_dir.iterdir()):
            raise ValueError(f"run directory {run_dir} is not empty; choose another or --resume it")
    return config, run_dir, checkpoint


def _check_installed(config: Any) -> None:
    """Fail early, with the fix, when a part the job needs is not installed."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ImportError("the rollout instances need vLLM: pip install -e '.[cpu-infer]' (CPU) or '.[gpu]' (CUDA)")
    if config.train.backend == "megatron" and importlib.util.find_spec("megatron") is None:
        raise ImportError("train.backend=megatron needs megatron-core: pip install -e '.[megatron]'")


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint folder of a run (one with its loop state written last)."""
    folders = sorted((run_dir / CHECKPOINTS).glob("step-*"))
    complete = [f for f in folders if (f / LOOP_STATE).is_file()]
    return complete[-1] if complete else None


class _Tokens:
    """The tokenizer's encode/decode as the task and reward need them."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.eos_id = int(self.tokenizer.eos_token_id)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_id

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))


def _base_model(config: Any) -> Path:
    if config.model.path is not None:
        path = Path(config.model.path).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.path {path} is not a local model folder (no config.json)")
        return path
    from staleflow.cli.tiny_model import TinyModelSpec, ensure_tiny_model

    folder = Path(config.model.tiny_model_dir).expanduser()
    if config.model.seed != 0:  # one folder per initialisation
        folder = folder.with_name(f"{folder.name}-seed{config.model.seed}")
    return ensure_tiny_model(folder, TinyModelSpec(seed=config.model.seed))


def _prompt_source(config: Any, tokens: _Tokens, seed: int) -> Iterator[Any]:
    from staleflow.runtime.tasks import (
        cycle_prompts,
        load_prompts,
        repeat_letter_prompts,
    )

    if config.task.prompt_file is None:
        return repeat_letter_prompts(seed, config.task.max_count)
    prompts = load_prompts(
        config.task.prompt_file,
        encode=tokens.encode,
        max_prompt_tokens=config.task.max_prompt_tokens,
        prompt_key=config.task.prompt_key,
        answer_key=config.task.answer_key,
    )
    return cycle_prompts(prompts, seed)


# -------------------------------------------------------------------------------------- training
def train(config: Any, run_dir: Path, checkpoint: Path | None = None) -> dict[str, Any]:
    """Run the job in ``config`` (resuming from ``checkpoint`` if given); returns the summary."""
    from staleflow.adapters.vllm.engine import set_vllm_env_defaults

    set_vllm_env_defaults()  # before vLLM (or torch) reads its environment
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from staleflow.cli.metrics import EngineLedger, MetricsLog, TrackedEngine
    from staleflow.adapters.vllm.engine import SamplingConfig, VLLMEngine
    from staleflow.adapters.ray.placement import RayPlacement
    from staleflow.runtime.assembly import RunSpec, assemble_run
    from staleflow.runtime.clock import RealClock
    from staleflow.runtime.config import dump_config
    from staleflow.runtime.cost_model import CostModel
    from staleflow.runtime.loop import RunParts
    from staleflow.runtime.tasks import make_group, reward_fn

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(config), encoding="utf-8")
    torch.manual_seed(config.seed)
    started = time.perf_counter()
    resuming = checkpoint is not None
    base = _base_model(config)
    tokens = _Tokens(base)
    clock = RealClock()
    # Each vLLM engine needs a process of its own (vLLM keeps per-process global state), so the
    # instances are Ray actors. They start on the base model while the warm-up runs here, then
    # load the warmed weights as version 0.
    placement = RayPlacement(attributes=(), num_cpus=2, include_dashboard=False, log_to_driver=False)
    sampling = SamplingConfig(temperature=config.rollout.temperature, stop_token_ids=(tokens.eos_id,))
    engine_start = time.perf_counter()
    remote_engines = [
        placement.place(
            VLLMEngine,
            f"rollout-{i}",
            str(base),
            sampling=sampling,
            max_model_len=config.rollout.max_model_len,
            max_num_seqs=config.rollout.max_num_seqs,
            seed=config.seed * 1000 + i,
            clock=clock,
            weights_dir=str(run_dir / ".weights"),
        )
        for i in range(config.rollout.instances)
    ]
    model_v0 = run_dir / "model-v0"
    warmup_seconds = 0.0
    if not resuming:
        model_v0, warmup_seconds = _warm_start(config, base, model_v0, tokens)
    trainer = _make_trainer(config, model_v0, tokens)
    saved_state = None
    if checkpoint is not None:  # the trainer first, so the instances start at its version
        saved_state = json.loads((checkpoint / LOOP_STATE).read_text(encoding="utf-8"))
        _restore_trainer(trainer, checkpoint, saved_state)
        for engine in remote_engines:
            engine.load_weights(trainer.version, trainer.weights())
    else:
        for engine in remote_engines:
            engine.load_weights(0, str(model_v0 / "model.safetensors"))
    engine_seconds = time.perf_counter() - engine_start

    log = MetricsLog(run_dir, total_steps=config.train.steps, tensorboard=config.metrics.tensorboard, progress=config.metrics.progress, append=resuming)
    ledger = EngineLedger(run_dir / "instances.jsonl", append=resuming)
    engines = [TrackedEngine(e, ledger, instance_id=f"rollout-{i}") for i, e in enumerate(remote_engines)]

    score = reward_fn(config.task.reward)
    reward_seconds = [0.0]

    def reward(trajectory: Any, metadata: dict[str, Any]) -> float:
        begin = time.perf_counter()
        try:
            return score(tokens.decode(trajectory.output_ids), metadata["answer"])
        finally:
            reward_seconds[0] += time.perf_counter() - begin

    prompt_stream = _prompt_source(config, tokens, config.seed + 1)
    groups: Iterator[Any] = (
        make_group(prompt, f"g{n}", encode=tokens.encode, n_samples=config.rollout.group_size, n_extra=config.rollout.group_extra, max_new_tokens=config.rollout.max_new_tokens)
        for n, prompt in enumerate(prompt_stream)
    )
    if saved_state is not None:  # continue the prompt stream where the checkpointed run had drawn to
        groups = itertools.islice(groups, int(saved_state["prompts_drawn"]), None)
    parts = RunParts(
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

    evaluator = _Evaluator(config, tokens, prompt_seed=config.seed + 2)
    if not resuming and evaluator.enabled:
        log.eval(0, evaluator.run(trainer))

    deadline = None if config.train.max_time_s is None else time.perf_counter() + config.train.max_time_s
    metrics = None
    try:
        for step in range(first_step + 1, config.train.steps + 1):
            metrics = loop.run(1)
            record = _step_record(metrics, ledger, reward_seconds[0], trained_before)
            log.step(step, record, versions=ledger.versions())
            if evaluator.enabled and config.task.eval_every and step % config.task.eval_every == 0 and step < config.train.steps:
                log.eval(step, evaluator.run(trainer))
            if config.checkpoint.every and step % config.checkpoint.every == 0 and step < config.train.steps:
                folder = _save_checkpoint(loop, trainer, run_dir, step, config.checkpoint.keep)
                log.event("checkpoint", step=step, path=str(folder))
            if deadline is not None and time.perf_counter() > deadline:
                log.event("time_limit", step=step, max_time_s=config.train.max_time_s)
                break
        if metrics is None:
            metrics = loop.metrics()
        final_step = metrics.steps
        final_eval = evaluator.run(trainer) if evaluator.enabled else {}
        if final_eval:
            log.eval(final_step, final_eval)
        # Interrupt every running request (its partial goes to the trajectory server) so that the
        # final audit is exact, and keep that state as the last checkpoint (--resume extends a run).
        if config.checkpoint.every:
            folder = _save_checkpoint(loop, trainer, run_dir, final_step, config.checkpoint.keep)
            log.event("checkpoint", step=final_step, path=str(folder))
        else:
            loop.state_dict()
        audit = loop.audit()
        summary = _summary(config, loop.manager.eta, metrics, audit, trained_before, ledger, trace_path, time.perf_counter() - started, warmup_seconds, engine_seconds, reward_seconds[0], run_dir)
    finally:
        log.close()
        loop.close()
        ledger.close()
        placement.close()
    (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1), encoding="utf-8")
    shutil.rmtree(run_dir / ".weights", ignore_errors=True)
    if config.metrics.report:
        from staleflow.cli.report import write_report

        write_report(run_dir)
    return summary


def _warm_start(config: Any, base: Path, target: Path, tokens: _Tokens) -> tuple[Path, float]:
    """Version 0 of the run: the base model after the supervised warm-up (or a copy of it)."""
    if config.warmup.steps == 0:
        shutil.copytree(base, target)
        return target, 0.0
    from staleflow.cli.warmup import warm_up

    result = warm_up(
        base,
        target,
        _prompt_source(config, tokens, config.seed + 3),
        encode=tokens.encode,
        eos_id=tokens.eos_id,
        pad_id=tokens.pad_id,
        steps=config.warmup.steps,
        batch_size=config.warmup.batch_size,
        lr=config.warmup.lr,
        seed=config.seed,
    )
    return result.path, result.seconds


def _make_trainer(config: Any, model_dir: Path, tokens: _Tokens) -> Any:
    from staleflow.adapters.torch.trainer import TorchTrainer, TrainerSettings

    settings = TrainerSettings.from_config(config)
    if config.train.backend == "megatron":
        from staleflow.adapters.megatron.trainer import MegatronTrainer

        return MegatronTrainer(model_dir, settings=settings, pad_id=tokens.pad_id, seed=config.seed)
    return TorchTrainer(model_dir, settings=settings, pad_id=tokens.pad_id, seed=config.seed, threads=config.train.threads)


class _Evaluator:
    """Greedy reward of the trainer's current weights on a fixed, seeded prompt set."""

    def __init__(self, config: Any, tokens: _Tokens, prompt_seed: int) -> None:
        from staleflow.runtime.tasks import reward_fn

        self.enabled = config.task.eval_prompts > 0
        self._tokens = tokens
        self._score = reward_fn(config.task.reward)
        self._max_new = config.rollout.max_new_tokens
        self._prompts = list(itertools.islice(_prompt_source(config, tokens, prompt_seed), config.task.eval_prompts))

    def run(self, trainer: Any) -> dict[str, float]:
        begin = time.perf_counter()
        outputs = trainer.generate_greedy([self._tokens.encode(p.text) for p in self._prompts], self._max_new, self._tokens.eos_id)
        rewards = [self._score(self._tokens.decode(o), p.answer) for o, p in zip(outputs, self._prompts)]
        return {
            "eval_reward": sum(rewards) / len(rewards),
            "eval_exact": sum(1 for r in rewards if r == 1.0) / len(rewards),
            "eval_s": time.perf_counter() - begin,
        }


def _step_record(metrics: Any, ledger: Any, reward_seconds: float, trained_before: int) -> dict[str, Any]:
    train = dict(metrics.train_metrics[-1]) if metrics.train_metrics else {}
    buffer = max(metrics.staleness_per_buffer) if metrics.staleness_per_buffer else None
    record = {
        **train,
        "elapsed_s": metrics.elapsed_s,
        "step_time_s": metrics.step_times_s[-1] if metrics.step_times_s else 0.0,
        "tokens_per_s": (metrics.tokens_trained - trained_before) / metrics.elapsed_s,
        "tokens_trained": metrics.tokens_trained,
        "tokens_generated": metrics.tokens_generated,
        "buffer": buffer,
        "group_staleness": {} if buffer is None else {str(s): n for s, n in metrics.staleness_per_buffer[buffer].items()},
        "dropped": metrics.dropped,
        "reward_failures": metrics.reward_failures,
        "utilisation": metrics.utilisation,
        "reward_s_total": reward_seconds,
        **{k: v for k, v in ledger.summary().items()},
    }
    return record


def _summary(config: Any, eta: int, metrics: Any, audit: Any, trained_before: int, ledger: Any, trace_path: Path, wall: float, warmup_s: float, engine_s: float, reward_s: float, run_dir: Path) -> dict[str, Any]:
    from staleflow.cli.metrics import read_metrics

    records = read_metrics(run_dir)
    steps = [r for r in records if r.get("kind") == "step"]
    evals = [r for r in records if r.get("kind") == "eval"]
    rewards = [r["reward_mean"] for r in steps if r.get("reward_mean") is not None]
    window = min(20, max(1, len(rewards) // 3)) if rewards else 0
    train_s = sum(r.get("train_s", 0.0) for r in steps)
    data = metrics.to_dict()
    data.pop("train_metrics", None)
    data.pop("step_times_s", None)
    return {
        "system": config.system.value,
        "eta": eta,
        "steps": metrics.steps,
        "wall_s": wall,
        "warmup_s": warmup_s,
        "engine_start_s": engine_s,
        "reward_first": sum(rewards[:window]) / window if window else None,
        "reward_last": sum(rewards[-window:]) / window if window else None,
        "reward_window": window,
        "eval_first": evals[0]["eval_reward"] if evals else None,
        "eval_last": evals[-1]["eval_reward"] if evals else None,
        "eval_exact_first": evals[0]["eval_exact"] if evals else None,
        "eval_exact_last": evals[-1]["eval_exact"] if evals else None,
        "bound_ok": metrics.max_staleness <= eta,
        "time_breakdown_s": {
            "run": metrics.elapsed_s,
            "train": train_s,
            "reward": reward_s,
            "weight_sync": ledger.summary()["sync_seconds"],
            "rollout_busy_mean": metrics.utilisation * metrics.elapsed_s,
        },
        "instances": ledger.summary(),
        "trace": str(trace_path),
        **{k: v for k, v in data.items() if k not in ("system", "steps")},
        # the audit after the final quiesce (the loop's own is taken while instances still run)
        "tokens_per_s": (metrics.tokens_trained - trained_before) / metrics.elapsed_s,  # this run (after a resume)
        "audit_ok": audit.ok,
        "lost": len(audit.lost),
        "duplicated": len(audit.duplicated),
        "orphaned": len(audit.orphaned),
        "audit_problems": list(audit.problems[:10]),
        "trajectory_server": {"groups": audit.groups, "requests": audit.requests},
    }


def _summary_text(summary: dict[str, Any], run_dir: Path) -> str:
    def fmt(value: Any) -> str:
        return "-" if value is None else f"{value:.3f}"

    inst = summary["instances"]
    lines = [
        (
            f"system {summary['system']} (eta {summary['eta']}): {summary['steps']} steps in {summary['wall_s']:.0f} s "
            f"(run loop {summary['elapsed_s']:.0f} s)"
        ),
        (
            f"  train reward, first {summary['reward_window']} -> last {summary['reward_window']} steps: "
            f"{fmt(summary['reward_first'])} -> {fmt(summary['reward_last'])}"
        ),
        (
            f"  greedy eval reward: {fmt(summary['eval_first'])} -> {fmt(summary['eval_last'])} "
            f"(exact {fmt(summary['eval_exact_first'])} -> {fmt(summary['eval_exact_last'])})"
        ),
        (
            f"  trained tokens/s: {summary['tokens_per_s']:.0f}; staleness histogram {summary['staleness_histogram']} "
            f"(max {summary['max_staleness']} <= eta {summary['eta']}: {summary['bound_ok']})"
        ),
        (
            f"  instances: max version spread {inst['max_version_spread']:.0f}, interrupted {inst['interrupted_requests']:.0f}, "
            f"resumed elsewhere {inst['resumed_elsewhere']:.0f}, weight syncs {inst['weight_syncs']:.0f}"
        ),
        f"  audit: lost {summary['lost']}, duplicated {summary['duplicated']}, orphaned {summary['orphaned']}, ok {summary['audit_ok']}",
        f"  files: {run_dir}/ (report.md, metrics.jsonl, {Path(summary['trace']).name}, checkpoints/)",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ checkpoints
def _save_checkpoint(loop: Any, trainer: Any, run_dir: Path, step: int, keep: int) -> Path:
    """Trainer (model, optimiser), then the loop (protocol, servers, partials); loop state last."""
    folder = run_dir / CHECKPOINTS / f"step-{step:06d}"
    state = loop.state_dict()  # interrupts running requests: their partials go to the TS
    trainer.save_checkpoint(folder / TRAINER_DIR)
    (folder / LOOP_STATE).write_text(json.dumps(state), encoding="utf-8")
    for old in sorted((run_dir / CHECKPOINTS).glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return folder


def _restore_trainer(trainer: Any, checkpoint: Path, state: dict[str, Any]) -> None:
    version = trainer.load_checkpoint(checkpoint / TRAINER_DIR)
    if state["parameter_server"]["latest_version"] != version:
        raise ValueError(
            f"checkpoint {checkpoint}: trainer is at version {version} but the loop state at "
            f"{state['parameter_server']['latest_version']}"
        )

"""A real RL training job (vLLM rollout, torch training) under the staleness protocol: :class:`TrainingJob`.

``build()`` starts everything the config asks for: the tokenizer and prompts, the scorer's start-up
check, the Ray placement with every actor's resources reserved at once, the vLLM rollout instances,
the evaluator, version 0 (after the warm-up), the trainer, the metrics files and the run loop; a
resumed job restores the trainer, the protocol state, the servers and the prompt stream position from
its checkpoint. ``run()`` trains to ``train.steps`` (or the time limit), evaluating and checkpointing
on the way, closes everything and writes ``summary.json`` (and ``report.md``); ``close()`` releases
whatever ``build()`` started (a context manager calls it).

The run directory receives ``config.yaml``, ``model-v0/`` (the warmed-up starting model),
``metrics.jsonl``, ``instances.jsonl``, ``trace.jsonl`` (the protocol trace for ``staleflow verify
--trace``; a resumed run appends a segment to it), ``tensorboard/``, ``logs/`` (every notice of the
engines and of Ray: :mod:`~staleflow.app.run_logs`), ``checkpoints/step-<n>/`` and, at the end,
``summary.json`` and ``report.md`` with its plots.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from staleflow.adapters.ray.cluster import ClusterStartError
from staleflow.adapters.ray.parameter_server import RemoteParameterServer
from staleflow.adapters.ray.placement import PlacementError, RayPlacement
from staleflow.adapters.vllm.build import VLLMBuildError, check_build_fits, installed_build
from staleflow.adapters.vllm.logs import logged
from staleflow.adapters.vllm.settings import SamplingConfig, set_vllm_env_defaults
from staleflow.app.checkpoints import LOOP_STATE, restore_trainer, save_checkpoint
from staleflow.app.eval_lane import RolloutEvaluation, SharedEngine
from staleflow.app.evaluation import DeferredEvaluation, EngineEvaluator, Evaluator, make_evaluator
from staleflow.app.job_parts import (
    TaskData,
    Tokens,
    base_model,
    job_cost_model,
    make_trainer,
    start_engines,
    warm_start,
    wire_weights_gb,
)
from staleflow.app.metrics import EngineLedger, MetricsLog, TrackedEngine
from staleflow.app.report import write_report
from staleflow.app.rewards import ScorerCheckError, check_scorer, pooled_reward
from staleflow.app.run_logs import DriverLogs, engine_logs
from staleflow.app.summary import RunOutcome, step_record, summarise
from staleflow.app.weights_scratch import DISK_SCRATCH, model_bytes, weights_scratch_dir
from staleflow.runtime.run.assembly import assemble_run
from staleflow.runtime.run.clock import RealClock
from staleflow.runtime.run.loop import RunParts
from staleflow.runtime.run.run_spec import RunSpec
from staleflow.runtime.servers.trajectory_server import TrajectoryServer
from staleflow.runtime.settings.config import dump_config
from staleflow.runtime.settings.placement_plan import engine_gpus, has_eval_engine, plan_placement
from staleflow.runtime.tasks import PromptFileError, RewardSpecError, make_group

if TYPE_CHECKING:
    from staleflow.runtime.settings.config import JobConfig

SUMMARY_FILE = "summary.json"
TRACE_FILE = "trace.jsonl"
#: what a job raises before anything starts for a config it cannot run (the command's exit 2)
START_ERRORS = (PlacementError, ClusterStartError, VLLMBuildError, PromptFileError, RewardSpecError, ScorerCheckError)
#: scratch folders of a run, removed when it ends
SCRATCH = (DISK_SCRATCH, ".eval-snapshots")


def train(config: JobConfig, run_dir: Path, checkpoint: Path | None = None) -> dict[str, Any]:
    """Run the job in ``config`` (resuming from ``checkpoint`` if given); returns the summary."""
    with TrainingJob(config, run_dir, checkpoint) as job:
        job.build()
        return job.run()


class TrainingJob:
    """One training run of ``config`` in ``run_dir``, from scratch or from ``checkpoint`` (see the module docstring)."""

    def __init__(self, config: JobConfig, run_dir: Path, checkpoint: Path | None = None) -> None:
        self.config = config
        self.run_dir = run_dir
        self.checkpoint = checkpoint
        self.trace_path = run_dir / TRACE_FILE
        self._started = 0.0
        self._warmup_s = 0.0
        self._engine_s = 0.0
        self._reward_s = [0.0]  # the driver's share of rewarding: decoding responses for the scorer processes
        self._saved_state: dict[str, Any] | None = None
        self._first_step = 0
        self._trained_before = 0  # tokens trained before a resume, so throughput covers this run only
        self._loop_over = False  # the run loop's last state is taken: no request runs, no Pull follows
        self._deferred: DeferredEvaluation | None = None  # task.eval_timing=deferred: evaluated after the run loop
        self._placement: Any = None
        self._driver_logs: DriverLogs | None = None
        self._weights_dir: Path | None = None  # where the engines write the weight files they reload
        self._evaluator: Any = None
        self._log: MetricsLog | None = None
        self._ledger: EngineLedger | None = None
        self._loop: Any = None

    def __enter__(self) -> TrainingJob:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.close()

    # ------------------------------------------------------------------------------ the three steps
    def build(self) -> None:
        """Start every part of the job (a malformed row or an unusable scorer stops it before Ray starts)."""
        set_vllm_env_defaults()  # before vLLM (or torch) reads its environment
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        import torch  # after the environment above

        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(dump_config(self.config), encoding="utf-8")
        torch.manual_seed(self.config.seed)
        self._started = time.perf_counter()
        base = base_model(self.config)
        self.tokens = Tokens(base, self.config.task.chat_template)
        self.data = TaskData(self.config, self.tokens)
        check_scorer(self.config, self.data)
        clock = RealClock()
        self._reserve()
        engine_start = time.perf_counter()
        evaluation_engines = 1 if has_eval_engine(self.config) else 0
        self._weights_dir = weights_scratch_dir(self.run_dir, model_bytes(base), self.config.rollout.instances + evaluation_engines)
        engines = self._start_engines(base, clock, self._weights_dir)
        self._evaluator = make_evaluator(
            self.config, self.tokens, self.data, self._placement, base, clock, self._weights_dir, engines,
            logs=engine_logs(self.run_dir, "eval", self.config.metrics.verbose),
        )
        self._start_model(base, engines)
        self._engine_s = time.perf_counter() - engine_start
        self._open_records()
        self._loop = self._assemble(engines, clock, base)
        if self._saved_state is not None:
            self._resume_loop()

    def run(self) -> dict[str, Any]:
        """Train, evaluate and checkpoint to the last step; close the job and write its summary (returned) and report."""
        try:
            if self.checkpoint is None and self._evaluator.enabled:
                self._log_eval(0)
            if self._evaluator.enabled and self.config.task.eval_timing == "deferred":
                saved_eval = self._evaluator.run_saved if isinstance(self._evaluator, Evaluator) else self._evaluator.run
                self._deferred = DeferredEvaluation(self.run_dir / ".eval-snapshots", saved_eval)
            metrics = self._train_steps()
            summary = self._finish(metrics)
        finally:
            self.close()
        (self.run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1), encoding="utf-8")
        for scratch in SCRATCH:
            shutil.rmtree(self.run_dir / scratch, ignore_errors=True)
        if self.config.metrics.report:
            write_report(self.run_dir)
        return summary

    def close(self) -> None:
        """Release whatever :meth:`build` started, newest first (again: nothing)."""
        if self._log is not None:
            self._log.close()
        if self._evaluator is not None and not isinstance(self._evaluator, Evaluator):
            self._evaluator.close()
        if self._loop is not None:
            self._loop.close()
        if self._ledger is not None:
            self._ledger.close()
        if self._placement is not None:
            self._placement.close()
        if self._driver_logs is not None:
            self._driver_logs.close()
        if self._weights_dir is not None:
            shutil.rmtree(self._weights_dir, ignore_errors=True)
        self._log = self._evaluator = self._loop = self._ledger = self._placement = self._driver_logs = None

    # ---------------------------------------------------------------------------------- building
    def _reserve(self) -> None:
        """The Ray placement, with every actor's resources reserved at once before any engine starts."""
        cluster = self.config.cluster
        self._driver_logs = DriverLogs(self.run_dir, self.config.metrics.verbose)
        self._placement = RayPlacement(
            attributes=(), address=cluster.address, num_cpus=cluster.num_cpus, num_gpus=cluster.num_gpus,
            # vLLM's and NCCL's errors in the actors reach the driver's output (``log_to_driver=False`` hid them)
            include_dashboard=False, log_to_driver=True,
        )
        self._placement.reserve(plan_placement(self.config))
        check_build_fits(self.config.rollout.gpus_per_instance, installed_build())  # before any engine starts

    def _start_engines(self, base: Path, clock: RealClock, weights_dir: Path) -> list[SharedEngine]:
        """The vLLM rollout instances as Ray actors (vLLM keeps per-process global state), on the base
        model: they start while the warm-up runs here, then load the warmed weights as version 0.
        Each is wrapped for the evaluation to share (:class:`~staleflow.app.eval_lane.SharedEngine`).
        ``weights_dir``: where they write the weight files they reload (:mod:`~staleflow.app.weights_scratch`)."""
        from staleflow.adapters.vllm.engine import VLLMEngine  # torch and vLLM: after the job set vLLM's environment

        rollout = self.config.rollout
        sampling = SamplingConfig(temperature=rollout.temperature, stop_token_ids=(self.tokens.eos_id,))
        started = start_engines(
            [
                lambda i=i: self._placement.place_reserved(
                    f"rollout-{i}", logged(VLLMEngine, engine_logs(self.run_dir, f"rollout-{i}", self.config.metrics.verbose)),
                    f"rollout-{i}", str(base),
                    sampling=sampling, max_model_len=rollout.max_model_len, max_num_seqs=rollout.max_num_seqs,
                    seed=self.config.seed * 1000 + i, clock=clock, weights_dir=str(weights_dir),
                    engine_kwargs=rollout.engine_settings(), start_timeout_s=rollout.start_timeout_s,
                    verify_weights=rollout.verify_weights,
                )
                for i in range(rollout.instances)
            ],
            [engine_gpus(self.config, f"rollout-{i}") for i in range(rollout.instances)],
        )
        return [SharedEngine(engine, f"rollout-{i}") for i, engine in enumerate(started)]  # the evaluation may borrow them

    def _start_model(self, base: Path, engines: list[Any]) -> None:
        """Version 0 (after the warm-up, for a new run), the trainer on it, and the engines at the trainer's version."""
        self.model_v0 = self.run_dir / "model-v0"
        if self.checkpoint is None:
            self.model_v0, self._warmup_s = warm_start(self.config, base, self.model_v0, self.tokens, self.data)
        elif not self.model_v0.is_dir():  # a run of a user's model without warm-up starts from the model itself
            self.model_v0 = base
        if self.model_v0 == base and isinstance(self._evaluator, EngineEvaluator):
            self._evaluator.starts_at(0)
        self.trainer = make_trainer(self.config, self.model_v0, self.tokens, self._placement.group_handle("trainer"))
        if self.checkpoint is not None:  # the trainer first, so the instances start at its version
            self._saved_state = json.loads((self.checkpoint / LOOP_STATE).read_text(encoding="utf-8"))
            restore_trainer(self.trainer, self.checkpoint, self._saved_state)
            for engine in engines:
                engine.load_weights(self.trainer.version, self.trainer.weights())
        elif self.model_v0 != base:  # the engines started on the base model
            for engine in engines:
                engine.load_weights(0, str(self.model_v0 / "model.safetensors"))

    def _open_records(self) -> None:
        """``metrics.jsonl`` (with TensorBoard, W&B, the progress bar) and ``instances.jsonl``; a resumed run appends."""
        config, resuming = self.config, self.checkpoint is not None
        self._log = MetricsLog(
            self.run_dir, total_steps=config.train.steps, tensorboard=config.metrics.tensorboard, progress=config.metrics.progress,
            append=resuming, wandb=config.metrics.wandb.model_dump() if config.metrics.wandb.project else None,
            wandb_config=config.model_dump(mode="json"),
        )
        for path, (skipped, rows) in self.data.filtered.items():
            self._log.event("prompts_filtered", file=path, skipped=skipped, rows=rows, max_prompt_tokens=config.task.max_prompt_tokens)
        self._ledger = EngineLedger(self.run_dir / "instances.jsonl", append=resuming)

    def _assemble(self, engines: list[Any], clock: RealClock, base: Path) -> Any:
        """The run loop over the tracked engines, the trainer, the prompt groups and the job's reward
        (a resumed run appends a segment, headed by the restored protocol state, to the same trace)."""
        config = self.config
        parts = RunParts(
            **self._servers(),
            engines=[TrackedEngine(e, self._ledger, instance_id=f"rollout-{i}") for i, e in enumerate(engines)],
            trainer=self.trainer,
            prompts=self._groups(),
            cost_model=job_cost_model(config, base),
            clock=clock,
            reward_fn=pooled_reward(config, self.tokens, self._reward_s),
        )
        return assemble_run(RunSpec.from_job(config, wire_weights_gb(config, base)), parts, trace_path=self.trace_path)

    def _groups(self) -> Iterator[Any]:
        """The GRPO groups of the prompt stream; a resumed run continues where the checkpointed one had drawn to."""
        rollout = self.config.rollout
        groups: Iterator[Any] = (
            make_group(prompt, f"g{n}", encode=self.tokens.encode, n_samples=rollout.group_size, n_extra=rollout.group_extra,
                       max_new_tokens=rollout.max_new_tokens)
            for n, prompt in enumerate(self.data.stream(self.config.seed + 1))
        )
        if self._saved_state is not None:
            groups = itertools.islice(groups, int(self._saved_state["prompts_drawn"]), None)
        return groups

    def _servers(self) -> dict[str, Any]:
        """The trajectory and parameter servers as Ray actors (``servers.placement=ray``), or none: the
        run loop then makes them in this process."""
        if self.config.servers.placement != "ray":
            return {}
        return {
            "trajectory_server": self._placement.place_reserved("trajectory-server", TrajectoryServer),
            "parameter_server": RemoteParameterServer.place(
                self._placement, "parameter-server", broadcast=self.config.servers.broadcast_settings()
            ),
        }

    def _resume_loop(self) -> None:
        state = self._saved_state
        assert state is not None and self._log is not None
        self._loop.load_state_dict(state)
        self._first_step = int(state["steps_done"])
        self._trained_before = int(state["tokens"][1])
        self._log.event("resumed", step=self._first_step, checkpoint=str(self.checkpoint))

    # ---------------------------------------------------------------------------------- training
    def _train_steps(self) -> Any:
        """The run loop one step at a time to ``train.steps`` or ``train.max_time_s``; returns its metrics."""
        config, log, ledger = self.config, self._log, self._ledger
        assert log is not None and ledger is not None
        deadline = None if config.train.max_time_s is None else time.perf_counter() + config.train.max_time_s
        metrics = None
        for step in range(self._first_step + 1, config.train.steps + 1):
            metrics = self._loop.run(1)
            log.step(step, step_record(metrics, ledger, self._reward_s[0], self._trained_before), versions=ledger.versions())
            if deadline is not None and time.perf_counter() > deadline:  # its evaluation and checkpoint are the final ones
                log.event("time_limit", step=step, max_time_s=config.train.max_time_s)
                break
            if self._evaluator.enabled and config.task.eval_every and step % config.task.eval_every == 0 and step < config.train.steps:
                self._evaluate_at(step)
            if config.checkpoint.every and step % config.checkpoint.every == 0 and step < config.train.steps:
                self._checkpoint(step)
        return metrics if metrics is not None else self._loop.metrics()

    def _finish(self, metrics: Any) -> dict[str, Any]:
        """The last evaluation and checkpoint, the final audit and the summary. On the rollout
        instances the last evaluation comes after the loop's last state (no request runs, no Pull
        follows), so that the final version may be loaded into one of them."""
        on_rollout = isinstance(self._evaluator, RolloutEvaluation)
        if self._evaluator.enabled and not on_rollout:
            self._evaluate_at(metrics.steps)
        if self._deferred is not None:
            self._deferred.run(self._log)
        # Interrupt every running request (its partial goes to the trajectory server) so that the
        # final audit is exact, and keep that state as the last checkpoint (--resume extends a run).
        if self.config.checkpoint.every:
            self._checkpoint(metrics.steps)
        else:
            self._loop.state_dict()
        self._loop_over = True
        if self._evaluator.enabled and on_rollout:
            self._evaluate_at(metrics.steps)
        outcome = RunOutcome(
            eta=self._loop.manager.eta, metrics=metrics, audit=self._loop.audit(), ledger=self._ledger, run_dir=self.run_dir,
            trace_path=self.trace_path, wall_s=time.perf_counter() - self._started, warmup_s=self._warmup_s,
            engine_start_s=self._engine_s, reward_s=self._reward_s[0], trained_before=self._trained_before,
        )
        return summarise(self.config, outcome)

    def _checkpoint(self, step: int) -> None:
        assert self._log is not None
        folder = save_checkpoint(self._loop, self.trainer, self.run_dir, step, self.config.checkpoint.keep)
        self._log.event("checkpoint", step=step, path=str(folder))

    def _evaluate_at(self, step: int) -> None:
        """Evaluate the weights of ``step`` now, or save them for later (``task.eval_timing=deferred``)."""
        if self._deferred is not None:
            self._deferred.save(step, self.trainer.version, self.trainer.weights())
        else:
            self._log_eval(step)

    def _log_eval(self, step: int) -> None:
        assert self._log is not None
        if isinstance(self._evaluator, Evaluator):
            figures = self._evaluator.run(self.trainer)
        elif isinstance(self._evaluator, RolloutEvaluation) and not self._loop_over:
            figures = self._evaluator.run_between_steps()
        elif isinstance(self._evaluator, RolloutEvaluation):
            version = self.trainer.version
            figures = self._evaluator.run_after_loop(version, lambda: self._loop.weights.pull(version)[1])
        elif self.trainer.version > 0:  # the version as the rollout instances pull it, through the same transfer
            figures = self._evaluator.run(*self._loop.weights.pull(self.trainer.version))
        else:  # version 0: the files the rollout instances start from
            figures = self._evaluator.run(0, str(self.model_v0))
        self._log.eval(step, figures)

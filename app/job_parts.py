"""The parts of a training job built from its config: the tokenizer, the base model (a local folder or
the built-in tiny model), the prompt stream, version 0 after the warm-up, the trainer binding and the
rollout instances' cost model.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from staleflow.app.tiny_model import TinyModelSpec, ensure_tiny_model
from staleflow.runtime.coordination.cost_fit import OnlineCostModel
from staleflow.runtime.coordination.cost_model import CostModel
from staleflow.runtime.settings.config_sections import default_tiny_model_dir
from staleflow.runtime.settings.cost_prior import ModelShape
from staleflow.runtime.settings.devices import device_spec
from staleflow.runtime.settings.placement_plan import trainer_rank_gpus
from staleflow.runtime.tasks import Prompt, cycle_prompts, plain_render, read_prompt_file, repeat_letter_prompts

if TYPE_CHECKING:
    from staleflow.runtime.settings.config import JobConfig


class Tokens:
    """The tokenizer's encode/decode as the task and reward need them, and its chat template."""

    def __init__(self, model_dir: Path, chat_template: str = "auto") -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.eos_id = int(self.tokenizer.eos_token_id)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_id
        self.has_template = chat_template == "auto" and bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def render(self, messages: list[dict[str, Any]]) -> str:
        """Chat messages as the model's prompt: its chat template with the generation prompt (``auto``
        and the tokenizer has one), else their contents one per line."""
        if not self.has_template:
            return plain_render(messages)
        return str(self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def base_model(config: JobConfig) -> Path:
    if config.model.path is not None:
        path = Path(config.model.path).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.path {path} is not a local model folder (no config.json)")
        return path
    folder = Path(config.model.tiny_model_dir or default_tiny_model_dir()).expanduser()
    if config.model.seed != 0:  # one folder per initialisation
        folder = folder.with_name(f"{folder.name}-seed{config.model.seed}")
    return ensure_tiny_model(folder, TinyModelSpec(seed=config.model.seed))


class TaskData:
    """The job's prompts: the built-in stream, or the rows of ``task.prompt_file`` (read once), and
    the held-out rows of ``task.eval_file``. Rows over ``task.max_prompt_tokens`` are refused or,
    with ``task.long_prompts=filter``, skipped and counted (``filtered``)."""

    def __init__(self, config: JobConfig, tokens: Tokens) -> None:
        self._config = config
        self._tokens = tokens
        self.filtered: dict[str, tuple[int, int]] = {}  # file -> (rows skipped, rows)
        self.train = self._read(config.task.prompt_file) if config.task.prompt_file else None
        self.held_out = self._read(config.task.eval_file)[: config.task.eval_prompts] if config.task.eval_file else None

    def _read(self, path: str) -> list[Any]:
        task = self._config.task
        loaded = read_prompt_file(
            path,
            encode=self._tokens.encode,
            max_prompt_tokens=task.max_prompt_tokens,
            prompt_key=task.prompt_key,
            answer_key=task.answer_key,
            solution_key=task.solution_key,
            render=self._tokens.render,
            long_prompts=task.long_prompts,
        )
        if loaded.filtered:
            self.filtered[path] = (loaded.filtered, loaded.rows)
            print(
                f"staleflow train: {path}: skipped {loaded.filtered} of {loaded.rows} rows longer than "
                f"task.max_prompt_tokens={task.max_prompt_tokens} (task.long_prompts=filter)",
                file=sys.stderr,
            )
        return loaded.prompts

    def stream(self, seed: int) -> Iterator[Any]:
        if self.train is None:
            return repeat_letter_prompts(seed, self._config.task.max_count)
        return cycle_prompts(self.train, seed)


def prompt_source(config: JobConfig, tokens: Tokens, seed: int, data: TaskData | None = None) -> Iterator[Any]:
    """An endless prompt stream of the job (``data``: the files already read)."""
    return (data if data is not None else TaskData(config, tokens)).stream(seed)


def wants_warmup(config: JobConfig) -> bool:
    """``warmup.when``: auto warms up the built-in tiny model only; a user's model is used as it is."""
    if config.warmup.steps == 0 or config.warmup.when == "never":
        return False
    return config.warmup.when == "always" or config.model.path is None


def warm_start(config: JobConfig, base: Path, target: Path, tokens: Tokens, data: TaskData | None = None) -> tuple[Path, float]:
    """Version 0 of the run: the base model after the supervised warm-up, a copy of the tiny model,
    or a user's model folder itself (not copied) when there is no warm-up."""
    if not wants_warmup(config):
        if config.model.path is not None:
            return base, 0.0
        shutil.copytree(base, target)
        return target, 0.0
    from staleflow.app.warmup import warm_up  # torch: imported once the job has set vLLM's environment

    # the warm-up's target: the worked solution (task.solution_key) where the rows have one
    rows = (p if p.target is None else Prompt(p.text, p.target, p.metadata) for p in prompt_source(config, tokens, config.seed + 3, data))
    result = warm_up(
        base,
        target,
        rows,
        encode=tokens.encode,
        eos_id=tokens.eos_id,
        pad_id=tokens.pad_id,
        steps=config.warmup.steps,
        batch_size=config.warmup.batch_size,
        lr=config.warmup.lr,
        seed=config.seed,
    )
    return result.path, result.seconds


def start_engines(starts: list[Callable[[], Any]], gpus: Sequence[frozenset[str]]) -> list[Any]:
    """Start the engines: those on disjoint GPUs together, those that may share a GPU one at a time,
    each ready before the next starts there. ``gpus[i]``: what engine ``i`` holds of the GPUs
    (:func:`~staleflow.runtime.settings.placement_plan.engine_gpus`: names, equal where two engines
    may share a GPU; empty on CPU, where nothing is waited for). vLLM charges every change of free GPU
    memory during its start-up profiling to itself (vllm/utils/mem_utils.py), so an engine starting
    beside another one on a shared GPU sizes its KV cache wrongly or fails; on GPUs of its own it
    measures only its own. Engines are waited for in the order they started, and an engine never
    starts before an earlier one that holds any of its GPUs. The evaluation engine starts after the
    rollout instances are ready (:func:`~staleflow.app.evaluation.make_evaluator`), and the trainer
    after all of them (:meth:`~staleflow.app.training_job.TrainingJob.build`)."""
    engines: list[Any] = [None] * len(starts)
    pending, starting = list(range(len(starts))), []  # starting: started, not known ready, in start order
    while pending or starting:
        held = set().union(*(gpus[i] for i in starting))
        for i in list(pending):
            if not gpus[i] & held:
                engines[i] = starts[i]()
                pending.remove(i)
                starting += [i] if gpus[i] else []
            held |= gpus[i]  # an engine waiting for these GPUs keeps later ones behind it
        if starting:
            engines[starting.pop(0)].idle()  # returns once the engine's actor has built the engine
    return engines


def make_trainer(config: JobConfig, model_dir: Path, tokens: Tokens, placement_group: Any = None) -> Any:
    from staleflow.adapters.rlkit.settings import TrainerSettings
    from staleflow.adapters.torch.trainer import TorchTrainer

    settings = TrainerSettings.from_config(config)
    # The config decides, not the driver's torch (a CPU-only head node, or a GPU box with train.gpus=0
    # whose driver GPU no placement reserved); each rank then checks it sees a GPU (fsdp.rank_device).
    device = "cuda" if config.train.gpus > 0 else "cpu"
    # Multi-process trainers' ranks are Ray actors (placed by Ray, a GPU each) on GPUs, and wherever the
    # servers are Ray actors: then rank 0 publishes into Ray's object store and no weights pass the driver.
    ray = sys.modules.get("ray")
    on_ray = device == "cuda" or config.servers.placement == "ray"
    launcher = "ray" if on_ray and ray is not None and ray.is_initialized() else "process"
    if config.train.backend == "megatron":
        from staleflow.adapters.megatron.trainer import MegatronTrainer

        t = config.train
        # Megatron trains on GPUs only, where train.dtype=auto is bf16; fp32 only when asked for.
        return MegatronTrainer(model_dir, settings=settings, pad_id=tokens.pad_id, seed=config.seed, bf16=settings.dtype != "fp32",
                               tensor_parallel=t.tensor_parallel,
                               pipeline_parallel=t.pipeline_parallel, world_size=t.world_size, launcher=launcher,
                               gpus_per_rank=trainer_rank_gpus(config) or 0.0, placement_group=placement_group if t.gpus else None)
    if config.train.backend == "fsdp":
        from staleflow.adapters.fsdp.trainer import FSDPTrainer

        return FSDPTrainer(model_dir, settings=settings, pad_id=tokens.pad_id, seed=config.seed, threads=config.train.threads,
                           world_size=config.train.world_size, device=device, launcher=launcher,
                           gpus_per_rank=trainer_rank_gpus(config) or 0.0, placement_group=placement_group if config.train.gpus else None)
    return TorchTrainer(model_dir, settings=settings, pad_id=tokens.pad_id, seed=config.seed, threads=config.train.threads, device=device)


def job_cost_model(config: JobConfig, model_dir: Path) -> OnlineCostModel:
    """The rollout instances' cost model (``coordinator.cost_model``): the prior is a ``staleflow
    profile`` file if one is given (measured on these engines' device), else the roofline of the
    model's shape (its ``config.json``, in the engines' dtype) on the configured device; it is
    refitted online to the engines' decode steps unless ``online`` is false. Never a fit of another
    device: the config carries no coefficients."""
    settings, rollout = config.coordinator.cost_model, config.rollout
    if settings.profile is not None:
        prior, source = CostModel.load(settings.profile), f"profile {settings.profile}"
    else:
        device = settings.device_name(rollout.gpus_per_instance)
        dtype_bytes = 4 if rollout.engine_settings()["dtype"] == "float32" else 2
        shape = ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text(encoding="utf-8")), dtype_bytes)
        prior, source = shape.cost_model(device_spec(device), rollout.tensor_parallel_size), f"roofline of {model_dir.name} on {device}"
    return OnlineCostModel(prior, source, online=settings.online, refit_s=settings.refit_s, max_n=rollout.max_num_seqs)


def wire_weights_gb(config: JobConfig, model_dir: Path) -> float:
    """A version's bytes on the wire of a broadcast, GB: the parameters of the model's shape (its
    ``config.json``; a tied embedding once) in ``servers.wire_dtype``, which the ``adaptive`` sync's
    transfer costs take (:func:`~staleflow.runtime.run.run_spec.job_transfer_costs`)."""
    wire_bytes = 4 if config.servers.wire_dtype == "float32" else 2
    return ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text(encoding="utf-8")), wire_bytes).weights_gb

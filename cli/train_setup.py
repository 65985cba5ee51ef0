"""The parts of a training job that ``staleflow train`` builds from its config: the tokenizer, the
base model (a local folder or the built-in tiny model), the prompt stream, version 0 after the
warm-up, the trainer binding and the evaluator.
"""

from __future__ import annotations

import itertools
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from staleflow.runtime.config import JobConfig


class Tokens:
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


def base_model(config: JobConfig) -> Path:
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


def prompt_source(config: JobConfig, tokens: Tokens, seed: int) -> Iterator[Any]:
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


def warm_start(config: JobConfig, base: Path, target: Path, tokens: Tokens) -> tuple[Path, float]:
    """Version 0 of the run: the base model after the supervised warm-up (or a copy of it)."""
    if config.warmup.steps == 0:
        shutil.copytree(base, target)
        return target, 0.0
    from staleflow.cli.warmup import warm_up

    result = warm_up(
        base,
        target,
        prompt_source(config, tokens, config.seed + 3),
        encode=tokens.encode,
        eos_id=tokens.eos_id,
        pad_id=tokens.pad_id,
        steps=config.warmup.steps,
        batch_size=config.warmup.batch_size,
        lr=config.warmup.lr,
        seed=config.seed,
    )
    return result.path, result.seconds


def make_trainer(config: JobConfig, model_dir: Path, tokens: Tokens) -> Any:
    import torch
    from staleflow.adapters.torch.trainer import TorchTrainer, TrainerSettings

    settings = TrainerSettings.from_config(config)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if config.train.backend == "megatron":
        from staleflow.adapters.megatron.trainer import MegatronTrainer

        return MegatronTrainer(model_dir, settings=settings, pad_id=tokens.pad_id, seed=config.seed)
    if config.train.backend == "fsdp":
        import sys

        from staleflow.adapters.torch.fsdp import FSDPTrainer

        ray = sys.modules.get("ray")  # on GPUs, ranks are Ray actors with a GPU each (placed by Ray)
        launcher = "ray" if device == "cuda" and ray is not None and ray.is_initialized() else "process"
        return FSDPTrainer(model_dir, settings=settings, pad_id=tokens.pad_id, seed=config.seed, threads=config.train.threads,
                           world_size=config.train.world_size, device=device, launcher=launcher)
    return TorchTrainer(model_dir, settings=settings, pad_id=tokens.pad_id, seed=config.seed, threads=config.train.threads, device=device)


class Evaluator:
    """Greedy reward of the trainer's current weights on a fixed, seeded prompt set."""

    def __init__(self, config: JobConfig, tokens: Tokens, prompt_seed: int) -> None:
        from staleflow.runtime.tasks import reward_fn

        self.enabled = config.task.eval_prompts > 0
        self._tokens = tokens
        self._score = reward_fn(config.task.reward)
        self._max_new = config.rollout.max_new_tokens
        self._prompts = list(itertools.islice(prompt_source(config, tokens, prompt_seed), config.task.eval_prompts))

    def run(self, trainer: Any) -> dict[str, float]:
        begin = time.perf_counter()
        outputs = trainer.generate_greedy([self._tokens.encode(p.text) for p in self._prompts], self._max_new, self._tokens.eos_id)
        rewards = [self._score(self._tokens.decode(o), p.answer) for o, p in zip(outputs, self._prompts)]
        return {
            "eval_reward": sum(rewards) / len(rewards),
            "eval_exact": sum(1 for r in rewards if r == 1.0) / len(rewards),
            "eval_s": time.perf_counter() - begin,
        }

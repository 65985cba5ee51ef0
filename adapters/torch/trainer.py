"""The :class:`~staleflow.runtime.interfaces.Trainer` seam on a Hugging Face causal LM in plain torch.

One training step per batch (``adapters/rlkit/algorithms.py`` for the objective), run in a background
thread so that :meth:`TorchTrainer.start_step` returns at once and the run loop goes on routing and
collecting while the step runs. torch releases the GIL inside its kernels, so the step uses a core
of its own while vLLM decodes in another thread; placed in a Ray actor (``adapters/ray/placement.py``),
it runs in a process of its own with ``threads`` intra-op threads.

Versions: the trainer holds version ``v`` and trains only on buffer ``v`` (``batch.version == v``);
the step turns it into ``v + 1``. :meth:`weights` always returns a complete, consistent copy of the
newest finished version (never weights that a running step is changing).

The model runs in eval mode (no dropout), so the log-probs of the first minibatch at the start of a
step *are* the proximal policy's: no extra forward pass is needed unless ``minibatches > 1``.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from staleflow.adapters.rlkit.causal_lm import greedy_decode, load_causal_lm
from staleflow.adapters.rlkit.checkpoint import CHECKPOINT_MODEL, CHECKPOINT_STATE, check_trainer_state, read_trainer_checkpoint
from staleflow.adapters.rlkit.packed_step import batch_metrics, split_groups, train_minibatches
from staleflow.adapters.rlkit.packing import LogProbModel, batch_sequences, enable_activation_checkpointing, resolve_micro_batch_tokens
from staleflow.adapters.rlkit.settings import TrainerSettings
from staleflow.adapters.rlkit.staged_version import unique_tensors
from staleflow.adapters.rlkit.step_thread import BackgroundStepTrainer
from staleflow.runtime.types import TrainingBatch, TrainResult

CHECKPOINT_FORMAT = "staleflow-torch/1"


class TorchTrainer(BackgroundStepTrainer):
    """GRPO training of a causal LM on CPU (or one GPU with ``device="cuda"``).

    Args:
        model_path: local model folder holding version ``version``'s weights.
        settings: optimiser and objective.
        pad_id: padding token id.
        version: the version of the weights in ``model_path``.
        threads: torch intra-op threads (process-wide; ``None`` leaves torch's setting alone).
        device: where the model lives.
        seed: torch seed.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        settings: TrainerSettings = TrainerSettings(),
        pad_id: int = 0,
        version: int = 0,
        threads: int | None = None,
        device: str = "cpu",
        seed: int = 0,
    ) -> None:
        if threads is not None:
            torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self._settings = settings
        self._pad_id = pad_id
        self._device = torch.device(device)
        self._dtype = settings.compute_dtype(self._device)
        self._model = load_causal_lm(model_path, self._device, self._dtype, settings.attention).to(self._device)
        self._model.eval()  # no dropout: see the module docstring
        self._micro_batch_tokens = resolve_micro_batch_tokens(self._model, settings.micro_batch_tokens)
        if settings.activation_checkpointing:
            enable_activation_checkpointing(self._model)
        self._logprob_model = LogProbModel(self._model, chunk=settings.logprob_chunk, temperature=settings.temperature)
        self._optimizer = torch.optim.AdamW(
            self._model.parameters(),
            lr=settings.lr,
            betas=settings.betas,
            weight_decay=settings.weight_decay,
        )
        warmup = settings.lr_warmup_steps
        self._scheduler = torch.optim.lr_scheduler.LambdaLR(
            self._optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
        )
        self._start_background(version, self._copy_weights(), "torch-trainer")

    # ------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, folder: str | os.PathLike[str]) -> Path:
        """Write model, optimiser, schedule, version and RNG state to ``folder`` (no step may run)."""
        from safetensors.torch import save_file

        target = self._checkpoint_folder(folder)
        with self._lock:
            save_file({k: v.contiguous() for k, v in self._published.items()}, str(target / CHECKPOINT_MODEL))
            torch.save(
                {
                    "format": CHECKPOINT_FORMAT,
                    "version": self._version,
                    "optimizer": self._optimizer.state_dict(),
                    "scheduler": self._scheduler.state_dict(),
                    "torch_rng": torch.get_rng_state(),
                    "python_rng": random.getstate(),
                },
                target / CHECKPOINT_STATE,
            )
        return target

    def load_checkpoint(self, folder: str | os.PathLike[str]) -> int:
        """Restore what :meth:`save_checkpoint` wrote; returns the restored version."""
        source = self._restore_folder(folder)
        # Read and check everything before touching the model: a refused load changes nothing.
        model_state = self._model.state_dict()
        expected = dict(unique_tensors(model_state.items()))
        weights, state = read_trainer_checkpoint(source, expected, tied=set(model_state) - set(expected))
        if not isinstance(state, dict) or state.get("format", CHECKPOINT_FORMAT) != CHECKPOINT_FORMAT:
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"checkpoint file {source / CHECKPOINT_STATE} is not a torch trainer state ({CHECKPOINT_FORMAT}): {found}")
        groups = [group["params"] for group in self._optimizer.state_dict()["param_groups"]]
        shapes = dict(enumerate(tuple(p.shape) for p in self._model.parameters()))
        check_trainer_state(state, source / CHECKPOINT_STATE, groups, shapes)
        with self._lock:
            self._model.load_state_dict(weights, strict=False)  # checked above: only the tied names are left out
            self._optimizer.load_state_dict(state["optimizer"])
            self._scheduler.load_state_dict(state["scheduler"])
            torch.set_rng_state(state["torch_rng"])
            random.setstate(state["python_rng"])
            self._version = int(state["version"])
            self._published = self._copy_weights()
        return self._version

    # --------------------------------------------------------------------------------- evaluation
    def generate_greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_id: int, batch_size: int = 64) -> list[list[int]]:
        """Greedy responses of the current weights (blocks; waits for a running step's lock)."""
        outputs: list[list[int]] = []
        with self._lock, torch.no_grad():
            for start in range(0, len(prompts), batch_size):
                chunk = prompts[start : start + batch_size]
                outputs.extend(greedy_decode(self._model, chunk, max_new_tokens, eos_id, self._pad_id, self._device))
        return outputs

    # ----------------------------------------------------------------------------------- the step
    def _step(self, batch: TrainingBatch) -> TrainResult:
        started = time.perf_counter()
        settings = self._settings
        groups = batch_sequences(batch, scale_advantages=settings.scale_advantages)
        minibatches = split_groups(groups, settings.minibatches)
        with self._lock:
            metrics = train_minibatches(
                self._logprob_model,
                self._optimizer,
                list(self._model.parameters()),
                minibatches,
                loss=settings.loss,
                grad_clip=settings.grad_clip,
                max_tokens=self._micro_batch_tokens,
                device=self._device,
                autocast=self._autocast,
            )
            lr = self._scheduler.get_last_lr()[0]
            self._scheduler.step()
            new_version = self._version + 1
            self._published = self._copy_weights()
            self._version = new_version
        seconds = time.perf_counter() - started
        metrics.update(batch_metrics(groups, batch.version))
        metrics.update({"lr": lr, "train_s": seconds, "train_tokens_per_s": metrics["tokens"] / seconds if seconds > 0 else 0.0})
        return TrainResult(version=new_version, metrics=metrics)

    def _autocast(self) -> Any:
        if self._dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self._device.type, dtype=self._dtype)

    def _copy_weights(self) -> dict[str, torch.Tensor]:
        """A copy of every weight, a tied one (``lm_head.weight`` of a model whose output layer is its
        embedding) once, under its first name, as Hugging Face saves it and receivers expect."""
        return {k: v.detach().to("cpu", copy=True) for k, v in unique_tensors(self._model.state_dict().items())}

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from staleflow.adapters.rlkit.algorithms import Correction, LossSettings
from staleflow.adapters.rlkit.hf_folder import check_model_folder
from staleflow.adapters.rlkit.packed_step import batch_metrics, split_groups, train_minibatches
from staleflow.adapters.rlkit.packing import LogProbModel, batch_sequences, enable_activation_checkpointing, resolve_micro_batch_tokens
from staleflow.adapters.rlkit.step_thread import BackgroundStepTrainer
from staleflow.runtime.types import TrainingBatch, TrainResult

CHECKPOINT_MODEL = "model.safetensors"
CHECKPOINT_STATE = "trainer_state.pt"
CHECKPOINT_FORMAT = "staleflow-torch/1"


@dataclass(frozen=True)
class TrainerSettings:
    """Optimiser, schedule and objective of a :class:`TorchTrainer` (see ``runtime/settings/config.py``)."""

    lr: float = 3e-4
    lr_warmup_steps: int = 10
    betas: tuple[float, float] = (0.9, 0.98)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    minibatches: int = 1
    loss: LossSettings = field(default_factory=LossSettings)
    scale_advantages: bool = True
    temperature: float = 1.0
    micro_batch_tokens: int | None = None  # None: auto (resolve_micro_batch_tokens)
    logprob_chunk: int = 1024
    activation_checkpointing: bool = False
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16: the compute dtype

    @classmethod
    def from_config(cls, job: Any) -> TrainerSettings:
        """Settings of a :class:`~staleflow.runtime.settings.config.JobConfig`."""
        t = job.train
        return cls(
            lr=t.lr,
            lr_warmup_steps=t.lr_warmup_steps,
            betas=tuple(t.betas),
            weight_decay=t.weight_decay,
            grad_clip=t.grad_clip,
            minibatches=t.minibatches,
            loss=LossSettings(correction=Correction(t.correction), clip_eps=t.clip_eps, weight_cap=t.weight_cap),
            scale_advantages=t.scale_advantages,
            temperature=job.rollout.temperature,
            micro_batch_tokens=None if t.micro_batch_tokens == "auto" else t.micro_batch_tokens,
            logprob_chunk=t.logprob_chunk,
            activation_checkpointing=t.activation_checkpointing,
            dtype=t.dtype,
        )

    def compute_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype of forward and backward: ``auto`` is bf16 on a GPU and fp32 elsewhere."""
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return {"fp32": torch.float32, "bf16": torch.bfloat16}[self.dtype]


def load_causal_lm(path: str | os.PathLike[str]) -> Any:
    """A local Hugging Face causal LM in float32 (never the hub: a missing folder is an error).

    Single-file or sharded safetensors (``model.safetensors.index.json``), tied embeddings or not;
    the folder is checked first (:func:`~staleflow.adapters.rlkit.hf_folder.check_model_folder`).
    """
    folder = check_model_folder(path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)


def empty_causal_lm(path: str | os.PathLike[str]) -> Any:
    """The causal LM of a local Hugging Face folder on the meta device, in float32: its modules and
    shapes without memory (only ``config.json`` is read); the weights come later."""
    folder = check_model_folder(path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(folder))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


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
        self._model = load_causal_lm(model_path).to(self._device)
        self._model.eval()  # no dropout: see the module docstring
        self._dtype = settings.compute_dtype(self._device)
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
        weights, state = read_trainer_checkpoint(source, self._model.state_dict())
        if not isinstance(state, dict) or state.get("format", CHECKPOINT_FORMAT) != CHECKPOINT_FORMAT:
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"checkpoint file {source / CHECKPOINT_STATE} is not a torch trainer state ({CHECKPOINT_FORMAT}): {found}")
        groups = [group["params"] for group in self._optimizer.state_dict()["param_groups"]]
        shapes = dict(enumerate(tuple(p.shape) for p in self._model.parameters()))
        check_trainer_state(state, source / CHECKPOINT_STATE, groups, shapes)
        with self._lock:
            self._model.load_state_dict(weights, strict=True)
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
        return {k: v.detach().to("cpu", copy=True) for k, v in self._model.state_dict().items()}


def read_trainer_checkpoint(source: Path, expected: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], Any]:
    """The weights and the training state of a trainer checkpoint folder, read, the weights checked
    against ``expected`` (name -> tensor of the model's shape; meta tensors do): a missing file is a
    FileNotFoundError, a damaged one or weights of another model a ValueError, each naming the file.
    The state is not checked yet (its format is the trainer's own)."""
    from safetensors.torch import load_file

    for name in (CHECKPOINT_MODEL, CHECKPOINT_STATE):
        if not (source / name).is_file():
            raise FileNotFoundError(f"checkpoint {source} has no {name}")
    weights = _read_checkpoint_file(source / CHECKPOINT_MODEL, lambda path: load_file(str(path)))
    state = _read_checkpoint_file(source / CHECKPOINT_STATE, lambda path: torch.load(path, weights_only=False))
    _check_weights_match(weights, expected, source / CHECKPOINT_MODEL)
    return weights, state


def check_trainer_state(state: dict[str, Any], path: Path, groups: Sequence[Sequence[Any]], shapes: Mapping[Any, tuple[int, ...]]) -> None:
    """Refuse a trainer state (``trainer_state.pt``) that cannot be restored whole, naming the file and
    the part: a missing part, a version that is not a count, an optimiser state of other parameter
    groups (``groups``: the parameter keys of each group) or of other shapes (``shapes``: by key, where known), a
    scheduler or RNG state that does not load. Checked before anything is loaded: a refused load
    changes nothing."""
    missing = [k for k in ("version", "optimizer", "scheduler", "torch_rng", "python_rng") if k not in state]
    if missing:
        raise ValueError(f"checkpoint file {path} lacks {missing}")
    version = state["version"]
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"checkpoint file {path} holds version {version!r}, not a count >= 0")
    optimizer = state["optimizer"]
    found = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
    if not isinstance(found, list) or not isinstance(optimizer.get("state"), dict) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in found
    ):
        raise ValueError(f"checkpoint file {path} holds no optimiser state (state and param_groups)")
    if [sorted(map(str, g["params"])) for g in found] != [sorted(map(str, g)) for g in groups]:
        raise ValueError(
            f"checkpoint file {path} holds optimiser state of other parameters: groups of "
            f"{[len(g['params']) for g in found]} parameters, this model's optimiser has {[len(g) for g in groups]}"
        )
    wrong = [
        f"{key}.{name}: {tuple(value.shape)} in the file, {shapes[key]} in the model"
        for key, entry in optimizer["state"].items()
        for name, value in (entry.items() if isinstance(entry, dict) else ())
        if key in shapes and isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != tuple(shapes[key])
    ]
    unknown = sorted(set(map(str, optimizer["state"])) - {str(key) for group in groups for key in group})
    if wrong or unknown:
        raise ValueError(f"checkpoint file {path} holds optimiser state of another model: {(wrong + unknown)[:3]}")
    scheduler = state["scheduler"]
    if not isinstance(scheduler, dict) or not {"last_epoch", "base_lrs", "lr_lambdas"} <= set(scheduler):
        raise ValueError(f"checkpoint file {path} holds no learning-rate schedule state (last_epoch, base_lrs, lr_lambdas)")
    rng = state["torch_rng"]
    if not isinstance(rng, torch.Tensor) or rng.dtype != torch.uint8 or rng.shape != torch.get_rng_state().shape:
        raise ValueError(f"checkpoint file {path} holds no torch RNG state (a uint8 tensor of {tuple(torch.get_rng_state().shape)})")
    try:
        random.Random().setstate(state["python_rng"])
    except (TypeError, ValueError) as error:
        raise ValueError(f"checkpoint file {path} holds no Python RNG state ({error})") from error


def _read_checkpoint_file(path: Path, read: Any) -> Any:
    """``read(path)``, with any failure (truncated, corrupt) reported as a ValueError naming the file."""
    try:
        return read(path)
    except Exception as error:  # safetensors and torch raise many types for a damaged file
        raise ValueError(f"checkpoint file {path} cannot be read ({type(error).__name__}: {error})") from error


def _check_weights_match(weights: dict[str, torch.Tensor], expected: Mapping[str, Any], path: Path) -> None:
    """Refuse weights of another model (missing, extra or differently shaped tensors), naming them."""
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    mismatched = [
        f"{name}: {tuple(weights[name].shape)} in the file, {tuple(expected[name].shape)} in the model"
        for name in sorted(set(weights) & set(expected))
        if weights[name].shape != expected[name].shape
    ]
    if missing or extra or mismatched:
        details = "; ".join(
            part
            for part in (
                f"missing {missing[:3]}" if missing else "",
                f"unexpected {extra[:3]}" if extra else "",
                f"size mismatch {mismatched[:3]}" if mismatched else "",
            )
            if part
        )
        raise ValueError(f"checkpoint file {path} holds another model's weights: {details}")


class PublishedWeightsDecoder:
    """Greedy decoding of a multi-process trainer's published weights on a CPU copy of the model, in
    the driver (evaluation only; rollout is vLLM's). The copy is built on first use."""

    def __init__(self, model_path: str | os.PathLike[str], pad_id: int) -> None:
        self._model_path, self._pad_id = model_path, pad_id
        self._model: Any = None

    def generate(self, published: Mapping[str, torch.Tensor], prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_id: int,
                 batch_size: int = 64) -> list[list[int]]:
        outputs: list[list[int]] = []
        with torch.no_grad():
            if self._model is None:
                self._model = load_causal_lm(self._model_path).eval()
            missing, unexpected = self._model.load_state_dict(published, strict=False)
            tied = {"lm_head.weight"} if getattr(self._model.config, "tie_word_embeddings", False) else set()
            if set(missing) - tied or unexpected:  # a tied lm_head is the embedding, published or not
                raise ValueError(f"published weights do not fit the model: missing {sorted(set(missing) - tied)}, unexpected {unexpected}")
            for start in range(0, len(prompts), batch_size):
                chunk = prompts[start : start + batch_size]
                outputs.extend(greedy_decode(self._model, chunk, max_new_tokens, eos_id, self._pad_id, torch.device("cpu")))
        return outputs


def greedy_decode(
    model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_id: int, pad_id: int, device: torch.device
) -> list[list[int]]:
    """Greedy decoding of left-padded prompts with Hugging Face ``generate``."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :] = torch.tensor(list(prompt))
        mask[i, width - len(prompt) :] = 1
    out = model.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    responses = []
    for row in out[:, width:].tolist():
        response = []
        for token in row:
            if token == eos_id:
                break
            response.append(token)
        responses.append(response)
    return responses

"""The :class:`~staleflow.runtime.interfaces.Trainer` seam on Megatron-core (GPU).

The same RL step as :mod:`staleflow.adapters.torch.trainer` (``adapters/torch/algorithms.py``: GRPO
advantages, off-policy correction, per-token loss), on a Megatron-core ``GPTModel`` wrapped in
Megatron's ``DistributedDataParallel`` and stepped by Megatron's optimizer
(``get_megatron_optimizer``, gradient clipping and the optional distributed optimizer included).

The model is built from a Hugging Face Qwen2/Llama-style config and its weights are converted from
the Hugging Face checkpoint (:func:`hf_to_megatron`); :meth:`MegatronTrainer.weights` converts back
(:func:`megatron_to_hf`), so the parameter server and vLLM keep using Hugging Face names.

**What runs where.** On CPU, Megatron-core installs, imports and builds the model, and with two
monkeypatches (``tests/test_megatron_trainer.py`` only: ``torch.cuda.current_device`` and the CUDA
RNG tracker) its forward pass runs, which the tests use to check the weight conversion against the
Hugging Face model logit for logit. Megatron's optimizer and DDP need CUDA (253 hard-coded CUDA
references; ``get_megatron_optimizer`` allocates on ``cuda``), so :class:`MegatronTrainer` itself
runs **only on a CUDA GPU** and refuses to start without one. Parallelism: data parallel over the
ranks of ``torch.distributed`` (launch with ``torchrun``; one process is world size 1) with tensor
and pipeline parallel size 1; larger TP/PP sizes are refused rather than half-supported.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from staleflow.adapters.megatron.convert import (  # noqa: F401 - re-exported: the trainer's public conversion API
    build_gpt_model,
    hf_to_megatron,
    load_hf_into_megatron,
    megatron_to_hf,
    transformer_config_from_hf,
)
from staleflow.adapters.torch.algorithms import (
    Correction,
    PackedBatch,
    pack_batch,
    policy_loss,
    token_staleness,
)
from staleflow.adapters.torch.step_thread import BackgroundStepTrainer
from staleflow.adapters.torch.trainer import TrainerSettings, _check_weights_match, _read_checkpoint_file
from staleflow.runtime.types import TrainingBatch, TrainResult

CHECKPOINT_FILE = "megatron_trainer.pt"


def causal_mask(length: int, device: torch.device) -> torch.Tensor:
    """Megatron's attention mask (True = masked out) for causal attention, ``[1, 1, length, length]``.

    Given explicitly: with ``attention_mask=None`` Megatron builds its default mask on ``cuda``.
    """
    return torch.triu(torch.ones(length, length, dtype=torch.bool, device=device), diagonal=1)[None, None]


def megatron_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Next-token log-probs ``[rows, length - 1]`` of a (right-padded) batch under a GPTModel.

    Causal attention alone is exact for right padding: a real token never attends to the pads
    after it, and the pads' own outputs are masked out of the loss. (``attention_mask`` is
    accepted for symmetry with the torch trainer.)
    """
    from megatron.core import tensor_parallel

    positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)
    logits = model(input_ids=input_ids, position_ids=positions, attention_mask=causal_mask(input_ids.shape[1], input_ids.device))
    logits = logits[:, :-1].float() / temperature
    targets = input_ids[:, 1:]
    # vocab_parallel_cross_entropy wants [sequence, batch, vocab]; it handles a vocab split over TP ranks.
    nll = tensor_parallel.vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(), targets.transpose(0, 1).contiguous())
    return -nll.transpose(0, 1)


# ----------------------------------------------------------------------------------- the trainer
class MegatronTrainer(BackgroundStepTrainer):
    """GRPO training on Megatron-core, one CUDA GPU per rank (see the module docstring).

    Same constructor and extras (``save_checkpoint``, ``load_checkpoint``, ``generate_greedy``) as
    :class:`~staleflow.adapters.torch.trainer.TorchTrainer`, so the run loop and ``staleflow
    train`` (``train.backend=megatron``) use either.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        settings: TrainerSettings | None = None,
        pad_id: int = 0,
        version: int = 0,
        seed: int = 0,
        bf16: bool = True,
        tensor_parallel: int = 1,
        pipeline_parallel: int = 1,
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "the Megatron trainer needs a CUDA GPU (Megatron-core's optimizer and DDP are CUDA-only); "
                "use train.backend=torch on CPU"
            )
        if tensor_parallel != 1 or pipeline_parallel != 1:
            raise ValueError("the Megatron trainer supports tensor_parallel=1 and pipeline_parallel=1 (data parallel over ranks)")
        from megatron.core import parallel_state
        from megatron.core import tensor_parallel as mcore_tp
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from safetensors.torch import load_file
        from transformers import AutoConfig

        folder = Path(model_path)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"model folder {folder} has no config.json")
        _init_distributed()
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        mcore_tp.model_parallel_cuda_manual_seed(seed)
        torch.manual_seed(seed)

        self._settings = settings = settings if settings is not None else TrainerSettings()
        self._pad_id = pad_id
        self._hf_config = AutoConfig.from_pretrained(str(folder))
        self._config = transformer_config_from_hf(self._hf_config, bf16=bf16)
        model = build_gpt_model(self._hf_config, self._config).cuda()
        load_hf_into_megatron(model, _load_hf_weights(folder, load_file), self._hf_config)
        if bf16:
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(self._config, model)
        self._model = DistributedDataParallel(
            config=self._config,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False),
            module=model,
        )
        self._optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=settings.lr,
                weight_decay=settings.weight_decay,
                adam_beta1=settings.betas[0],
                adam_beta2=settings.betas[1],
                clip_grad=settings.grad_clip,
                bf16=bf16,
                params_dtype=torch.bfloat16 if bf16 else torch.float32,
            ),
            [self._model],
        )
        self._steps_taken = 0
        self._start_background(version, self._hf_weights(), "megatron-trainer")

    # ------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, folder: str | os.PathLike[str]) -> Path:
        target = self._checkpoint_folder(folder)
        with self._lock:
            torch.save(
                {
                    "version": self._version,
                    "steps_taken": self._steps_taken,
                    "model": self._model.module.state_dict(),
                    "optimizer": self._optimizer.state_dict(),
                },
                target / CHECKPOINT_FILE,
            )
        return target

    def load_checkpoint(self, folder: str | os.PathLike[str]) -> int:
        """Restore what :meth:`save_checkpoint` wrote; every key and shape is checked before the model is touched."""
        if self._running is not None:
            raise RuntimeError("cannot restore while a training step is running")
        expected = self._model.module.state_dict()
        state = read_megatron_checkpoint(folder, expected, map_location="cuda", optimizer=self._optimizer.state_dict())
        with self._lock:
            self._model.module.load_state_dict(state["model"], strict=False)  # strict on every tensor: checked above
            self._optimizer.load_state_dict(state["optimizer"])
            self._version = int(state["version"])
            self._steps_taken = int(state["steps_taken"])
            self._published = self._hf_weights()
        return self._version

    def generate_greedy(self, prompts: Any, max_new_tokens: int, eos_id: int, batch_size: int = 64) -> list[list[int]]:
        """Greedy decoding by repeated full forward passes (evaluation only; rollout is vLLM's)."""
        outputs: list[list[int]] = []
        with self._lock, torch.no_grad():
            self._model.eval()
            for prompt in prompts:
                ids = torch.tensor([list(prompt)], device="cuda")
                response: list[int] = []
                for _ in range(max_new_tokens):
                    positions = torch.arange(ids.shape[1], device="cuda").unsqueeze(0)
                    mask = causal_mask(ids.shape[1], ids.device)
                    token = int(self._model(input_ids=ids, position_ids=positions, attention_mask=mask)[0, -1].argmax())
                    if token == eos_id:
                        break
                    response.append(token)
                    ids = torch.cat([ids, torch.tensor([[token]], device="cuda")], dim=1)
                outputs.append(response)
        return outputs

    # ----------------------------------------------------------------------------------- the step
    def _step(self, batch: TrainingBatch) -> TrainResult:
        started = time.perf_counter()
        settings = self._settings
        packed = pack_batch(batch, pad_id=self._pad_id, scale_advantages=settings.scale_advantages)
        with self._lock:
            self._model.train()
            self._set_lr()
            proximal = None
            if settings.minibatches > 1 and settings.loss.correction is not Correction.NONE:
                with torch.no_grad():
                    proximal = self._logprobs(packed)
            rows = packed.input_ids.shape[0]
            bounds = [round(i * rows / settings.minibatches) for i in range(settings.minibatches + 1)]
            sums: dict[str, float] = {}
            grad_norms = []
            for a, b in itertools.pairwise(bounds):
                part = packed.rows(slice(a, b))
                logp = self._logprobs(part)
                prox = proximal[a:b] if proximal is not None else logp.detach()
                self._model.zero_grad_buffer()
                self._optimizer.zero_grad()
                loss, metrics = policy_loss(logp, _on(part, logp.device), settings.loss, prox)
                loss.backward()
                self._model.finish_grad_sync()
                ok, grad_norm, _ = self._optimizer.step()
                if not ok:
                    raise RuntimeError("Megatron optimizer step was skipped (non-finite gradients)")
                grad_norms.append(float(grad_norm or 0.0))
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + value
            self._steps_taken += 1
            self._published = self._hf_weights()
            self._version += 1
        seconds = time.perf_counter() - started
        n = len(bounds) - 1
        metrics = {key: value / n for key, value in sums.items() if key != "tokens"}
        staleness = token_staleness(packed, batch.version).float()
        metrics.update(
            {
                "tokens": float(packed.response_tokens),
                "grad_norm": max(grad_norms),
                "reward_mean": float(packed.rewards.mean()),
                "token_staleness_mean": float(staleness.mean()),
                "token_staleness_max": float(staleness.max()),
                "train_s": seconds,
            }
        )
        return TrainResult(version=self._version, metrics=metrics)

    def _set_lr(self) -> None:
        warmup = self._settings.lr_warmup_steps
        factor = min(1.0, (self._steps_taken + 1) / warmup) if warmup > 0 else 1.0
        for group in self._optimizer.param_groups:
            group["lr"] = self._settings.lr * factor

    def _logprobs(self, part: PackedBatch) -> torch.Tensor:
        return megatron_logprobs(self._model, part.input_ids.cuda(), part.attention_mask.cuda(), self._settings.temperature)

    def _hf_weights(self) -> dict[str, torch.Tensor]:
        state = {k: v for k, v in self._model.module.state_dict().items() if not k.endswith("_extra_state")}
        state = {k.removeprefix("module."): v for k, v in state.items()}  # Float16Module wraps the model
        return {k: v.detach().float().cpu().clone() for k, v in megatron_to_hf(state, self._hf_config).items()}


def read_megatron_checkpoint(
    folder: str | os.PathLike[str], expected: Mapping[str, Any], map_location: str = "cpu", optimizer: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The Megatron trainer's checkpoint in ``folder``, refused (naming the file and the part) if it is
    missing, unreadable, lacks a part, holds a version or step count that is not a count, weights of
    another model than ``expected`` (a state dict), or an optimiser state whose parts differ from
    ``optimizer`` (this trainer's optimiser state dict, where given)."""
    source = Path(folder) / CHECKPOINT_FILE
    if not source.is_file():
        raise FileNotFoundError(f"checkpoint {folder} has no {CHECKPOINT_FILE}")
    state = _read_checkpoint_file(source, lambda path: torch.load(path, map_location=map_location, weights_only=False))
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint file {source} holds a {type(state).__name__}, not a Megatron trainer state")
    missing = [k for k in ("version", "steps_taken", "model", "optimizer") if k not in state]
    if missing:
        raise ValueError(f"checkpoint file {source} lacks {missing}")
    bad = [k for k in ("version", "steps_taken") if isinstance(state[k], bool) or not isinstance(state[k], int) or state[k] < 0]
    if bad:
        raise ValueError(f"checkpoint file {source} holds {', '.join(f'{k}={state[k]!r}' for k in bad)}: not a count >= 0")
    if not isinstance(state["model"], dict) or not isinstance(state["optimizer"], dict):
        raise ValueError(f"checkpoint file {source} holds no model or optimiser state dict")
    if optimizer is not None and set(state["optimizer"]) != set(optimizer):
        parts = sorted(state["optimizer"])
        raise ValueError(f"checkpoint file {source} holds optimiser state with parts {parts}, this optimiser's are {sorted(optimizer)}")
    weights = {k: v for k, v in state["model"].items() if not k.endswith("_extra_state")}
    _check_weights_match(weights, {k: v for k, v in expected.items() if not k.endswith("_extra_state")}, source)
    return state


def _on(part: PackedBatch, device: torch.device) -> PackedBatch:
    return PackedBatch(
        input_ids=part.input_ids.to(device),
        attention_mask=part.attention_mask.to(device),
        loss_mask=part.loss_mask.to(device),
        behaviour_logprobs=part.behaviour_logprobs.to(device),
        versions=part.versions.to(device),
        advantages=part.advantages.to(device),
        rewards=part.rewards.to(device),
    )


def _load_hf_weights(folder: Path, load_file: Any) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(str(file)))
    return weights


def _init_distributed() -> None:
    """Join (or, for a single process, create) the default process group: NCCL on one GPU per rank."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl", rank=rank, world_size=world)

"""A trained model as a Hugging Face folder (``staleflow export``, ``cli/export.py``).

:func:`export` reads the trainer's weights from a run's checkpoint (``checkpoints/step-N/trainer/``: the torch
trainer's ``model.safetensors`` (or an FSDP one of the full format that came before), the FSDP
trainer's shards (``shards/``, gathered in this process), or the Megatron trainer's
``megatron_trainer.pt``, converted back to Hugging Face names), checks them against the run's starting model (``model-v0/``: every
tensor name and shape, after turning transformers' in-memory names into its checkpoint layout: a
Qwen3-MoE's fused experts are written one tensor per expert), and writes ``config.json``, the tokenizer files and sharded safetensors
(``model.safetensors.index.json`` above ``--max-shard-size``) to ``--out``, loadable by
transformers and vLLM. Bad input (no such run, step or checkpoint, weights of another model, an output
folder that is not empty) raises FileNotFoundError, FileExistsError or ValueError.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from staleflow.adapters.fsdp.sharded_checkpoint import SHARDS, read_model_weights
from staleflow.adapters.fsdp.trainer import FSDP_PREFIX
from staleflow.adapters.rlkit.causal_lm import checkpoint_layout
from staleflow.adapters.rlkit.hf_folder import INDEX, check_model_folder, read_weights, weight_shapes, write_hf_folder
from staleflow.app.checkpoints import CHECKPOINTS, TRAINER_DIR, latest_checkpoint

MODEL_V0 = "model-v0"


def export(run_dir: Path, out: Path, *, step: int | None = None, dtype: str = "bf16", max_shard_bytes: int = 2 * 1024**3) -> dict[str, Any]:
    """Write the checkpoint's weights as a Hugging Face folder; returns what was written."""
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a run directory")
    base = run_dir / MODEL_V0
    check_model_folder(base)
    if step is None:
        checkpoint = latest_checkpoint(run_dir)
        if checkpoint is None:
            raise FileNotFoundError(f"{run_dir} has no complete checkpoint under {CHECKPOINTS}/")
    else:
        checkpoint = run_dir / CHECKPOINTS / f"step-{step:06d}"
        if not checkpoint.is_dir():
            found = sorted(p.name for p in (run_dir / CHECKPOINTS).glob("step-*"))
            raise FileNotFoundError(f"{run_dir} has no checkpoint of step {step} (found: {', '.join(found) or 'none'})")
    weights = checkpoint_layout(trainer_weights(checkpoint / TRAINER_DIR, base), base)
    expected = weight_shapes(base)
    _check_against(weights, expected, checkpoint / TRAINER_DIR)
    target = write_hf_folder(out, weights, source=base, dtype=dtype, max_shard_bytes=max_shard_bytes)
    (target / "staleflow_export.json").write_text(
        json.dumps({"run_dir": str(run_dir), "checkpoint": checkpoint.name, "dtype": dtype}, indent=1), encoding="utf-8"
    )
    index = target / INDEX
    shards = len(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())) if index.is_file() else 1
    unique = {k: v for k, v in weights.items() if k in expected}
    return {
        "checkpoint": f"{run_dir.name}/{checkpoint.name}",
        "out": str(target),
        "tensors": len(unique),
        "parameters": sum(v.numel() for v in unique.values()),
        "dtype": dtype,
        "shards": shards,
    }


def trainer_weights(folder: Path, base: Path) -> dict[str, Any]:
    """Hugging Face-named weights of a trainer checkpoint folder (torch, FSDP or Megatron)."""
    if (folder / "model.safetensors").is_file():
        return read_weights(folder / "model.safetensors")
    if (folder / SHARDS).is_dir():
        return {k.removeprefix(FSDP_PREFIX): v for k, v in read_model_weights(folder).items()}
    if (folder / "megatron_trainer.pt").is_file():
        import torch
        from staleflow.adapters.megatron.trainer import megatron_to_hf
        from transformers import AutoConfig

        try:
            state = torch.load(folder / "megatron_trainer.pt", map_location="cpu", weights_only=False)["model"]
        except Exception as error:  # a truncated or foreign file
            raise ValueError(f"{folder / 'megatron_trainer.pt'} cannot be read ({type(error).__name__}: {error})") from error
        state = {k.removeprefix("module."): v for k, v in state.items() if not k.endswith("_extra_state")}
        try:
            return megatron_to_hf(state, AutoConfig.from_pretrained(str(base)))
        except KeyError as error:
            raise ValueError(f"{folder / 'megatron_trainer.pt'} lacks the tensor {error} of the run's model") from error
    raise FileNotFoundError(f"checkpoint folder {folder} has neither model.safetensors, {SHARDS}/ nor megatron_trainer.pt")


def _check_against(weights: dict[str, Any], expected: dict[str, tuple[int, ...]], folder: Path) -> None:
    """Every tensor of the starting model, with its shape (a tied ``lm_head.weight`` may be extra)."""
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected) - {"lm_head.weight"})
    common = sorted(set(expected) & set(weights))
    wrong = [f"{k}: {tuple(weights[k].shape)} vs {expected[k]}" for k in common if tuple(weights[k].shape) != expected[k]]
    if missing or extra or wrong:
        raise ValueError(
            f"checkpoint {folder} does not match the run's model-v0: missing {missing[:3]}, unexpected {extra[:3]}, shapes {wrong[:3]}"
        )

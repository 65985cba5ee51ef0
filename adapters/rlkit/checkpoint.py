"""Trainer checkpoint files, read and checked before anything is restored: a missing file is a
FileNotFoundError, a damaged file, weights of another model or a training state that cannot be
restored whole a ValueError naming the file. A refused load changes nothing.

The torch trainer writes a folder of ``model.safetensors`` (the full weights) and
``trainer_state.pt`` (version, optimiser, schedule, RNG states, and the binding's format tag); the
FSDP trainer writes its shards beside a ``trainer_state.pt`` without the optimiser
(:mod:`~staleflow.adapters.fsdp.sharded_checkpoint`); the Megatron trainer writes its own files and
reads them with :func:`read_checkpoint_file` and :func:`check_weights_match`.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_MODEL = "model.safetensors"
CHECKPOINT_STATE = "trainer_state.pt"


def read_trainer_checkpoint(source: Path, expected: Mapping[str, Any], tied: Collection[str] = ()) -> tuple[dict[str, torch.Tensor], Any]:
    """The weights and the training state of a trainer checkpoint folder, read, the weights checked
    against ``expected`` (name -> tensor of the model's shape; meta tensors do): a missing file is a
    FileNotFoundError, a damaged one or weights of another model a ValueError, each naming the file.
    ``tied``: names that are another weight (a tied ``lm_head.weight``), dropped where a checkpoint
    written before they were left out holds them. The state is not checked yet (its format is the
    trainer's own)."""
    from safetensors.torch import load_file

    for name in (CHECKPOINT_MODEL, CHECKPOINT_STATE):
        if not (source / name).is_file():
            raise FileNotFoundError(f"checkpoint {source} has no {name}")
    weights = read_checkpoint_file(source / CHECKPOINT_MODEL, lambda path: load_file(str(path)))
    weights = {name: tensor for name, tensor in weights.items() if name not in tied}
    state = read_checkpoint_file(source / CHECKPOINT_STATE, lambda path: torch.load(path, weights_only=False))
    check_weights_match(weights, expected, source / CHECKPOINT_MODEL)
    return weights, state


def check_trainer_state(state: dict[str, Any], path: Path, groups: Sequence[Sequence[Any]], shapes: Mapping[Any, tuple[int, ...]]) -> None:
    """Refuse a trainer state (``trainer_state.pt``) that cannot be restored whole, naming the file and
    the part: a missing part, a version that is not a count, an optimiser state of other parameter
    groups (``groups``: the parameter keys of each group) or of other shapes (``shapes``: by key, where known), a
    scheduler or RNG state that does not load. Checked before anything is loaded: a refused load
    changes nothing."""
    if "optimizer" not in state:
        raise ValueError(f"checkpoint file {path} lacks ['optimizer']")
    check_run_state(state, path)
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


def check_run_state(state: dict[str, Any], path: Path) -> None:
    """Refuse a trainer state whose version, learning-rate schedule or RNG states cannot be
    restored, naming the file and the part (the optimiser state is the trainer's own)."""
    missing = [k for k in ("version", "scheduler", "torch_rng", "python_rng") if k not in state]
    if missing:
        raise ValueError(f"checkpoint file {path} lacks {missing}")
    version = state["version"]
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"checkpoint file {path} holds version {version!r}, not a count >= 0")
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


def read_checkpoint_file(path: Path, read: Any) -> Any:
    """``read(path)``, with any failure (truncated, corrupt) reported as a ValueError naming the file."""
    try:
        return read(path)
    except Exception as error:  # safetensors and torch raise many types for a damaged file
        raise ValueError(f"checkpoint file {path} cannot be read ({type(error).__name__}: {error})") from error


def check_weights_match(weights: dict[str, torch.Tensor], expected: Mapping[str, Any], path: Path) -> None:
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

"""Hugging Face model folders: checked before use, read (single file or sharded), written (export).

A model folder holds ``config.json`` and its weights as ``model.safetensors`` or as shards
(``model-0000k-of-0000n.safetensors``) listed by ``model.safetensors.index.json``; tokenizer files
beside them. Every problem (no config, no weights, a missing shard, a shard that lacks a tensor the
index promises) is reported naming the folder and the file, before anything loads.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def check_model_folder(path: str | os.PathLike[str]) -> Path:
    """``path`` as a folder with a config and a complete set of safetensors weights, else an error."""
    folder = Path(path)
    if not (folder / CONFIG).is_file():
        raise FileNotFoundError(f"model folder {folder} has no {CONFIG} (refusing to reach for the hub)")
    weight_files(folder)
    return folder


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder (the index's shards, or ``model.safetensors``)."""
    index = folder / INDEX
    if index.is_file():
        files = sorted(set(_weight_map(index).values()))
        missing = [name for name in files if not (folder / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists {len(files)} shards but {len(missing)} are missing: {missing[:3]}")
        return [folder / name for name in files]
    if (folder / WEIGHTS).is_file():
        return [folder / WEIGHTS]
    stray = sorted(p.name for p in folder.glob("*.safetensors"))
    if stray:
        raise FileNotFoundError(f"model folder {folder} has {stray[:3]} but neither {WEIGHTS} nor {INDEX}")
    raise FileNotFoundError(f"model folder {folder} has no weights ({WEIGHTS} or {INDEX} with its shards)")


def _weight_map(index: Path) -> dict[str, str]:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
        weight_map = data["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError("empty or not a mapping")
        return {str(k): str(v) for k, v in weight_map.items()}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{index} is not a safetensors index ({type(error).__name__}: {error})") from error


def read_weights(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a model folder (or of one safetensors file), checked against the index."""
    from safetensors.torch import load_file

    source = Path(path)
    if source.is_file():
        return _load(source, load_file)
    weights: dict[str, torch.Tensor] = {}
    for file in weight_files(source):
        weights.update(_load(file, load_file))
    if (source / INDEX).is_file():
        promised = _weight_map(source / INDEX)
        absent = sorted(set(promised) - set(weights))
        if absent:
            raise ValueError(f"{source / INDEX} lists tensors that no shard holds: {absent[:3]}")
    return weights


def weight_shapes(path: str | os.PathLike[str]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of a model folder, from the files' headers (no tensor is read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in weight_files(Path(path)):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
        except Exception as error:  # a damaged header
            raise ValueError(f"weights file {file} cannot be read ({type(error).__name__}: {error})") from error
    return shapes


def _load(file: Path, load_file: Any) -> dict[str, torch.Tensor]:
    try:
        return dict(load_file(str(file)))
    except Exception as error:  # safetensors raises several types for a damaged file
        raise ValueError(f"weights file {file} cannot be read ({type(error).__name__}: {error})") from error


def tied_embeddings(config: Mapping[str, Any]) -> bool:
    """Whether a config ties the output layer to the input embeddings (Hugging Face's default: yes)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else None
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    return bool(text.get("tie_word_embeddings", True)) if text else True


def write_hf_folder(
    out: str | os.PathLike[str],
    weights: Mapping[str, torch.Tensor],
    *,
    source: str | os.PathLike[str],
    dtype: str = "bf16",
    max_shard_bytes: int = 2 * 1024**3,
) -> Path:
    """Write ``weights`` as a Hugging Face folder at ``out``: config and tokenizer files from ``source``
    (a model folder of the same architecture), weights in ``dtype``, sharded above ``max_shard_bytes``.

    A tied output layer is written once (as the embeddings), as Hugging Face does. ``out`` must not
    exist or be empty; the folder is built beside it and renamed into place, so a failure leaves none.
    """
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    target, origin = Path(out), Path(source)
    if target.exists() and any(target.iterdir()):
        raise FileExistsError(f"{target} exists and is not empty")
    config = json.loads((origin / CONFIG).read_text(encoding="utf-8"))
    tensors = {k: v.detach().to("cpu", DTYPES[dtype]).contiguous() for k, v in weights.items()}
    if tied_embeddings(config) and "lm_head.weight" in tensors:
        head = tensors.pop("lm_head.weight")
        embed = tensors.get("model.embed_tokens.weight")
        if embed is not None and not torch.equal(head, embed):
            raise ValueError("the config ties the embeddings but lm_head.weight differs from model.embed_tokens.weight")
    config["torch_dtype"] = config["dtype"] = _DTYPE_NAMES[DTYPES[dtype]]
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        for item in origin.iterdir():  # tokenizer, generation config, chat template...
            if item.is_file() and not item.name.endswith(".safetensors") and item.name not in (INDEX, CONFIG):
                shutil.copy2(item, staging / item.name)
        (staging / CONFIG).write_text(json.dumps(config, indent=2), encoding="utf-8")
        if len(shards) == 1:
            save_file(shards[0], str(staging / WEIGHTS), metadata={"format": "pt"})
        else:
            weight_map = {}
            for k, shard in enumerate(shards, start=1):
                name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(staging / name), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(shard, name))
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (staging / INDEX).write_text(json.dumps(index, indent=2), encoding="utf-8")
        staging.chmod(0o755)
        if target.exists():
            target.rmdir()
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return target

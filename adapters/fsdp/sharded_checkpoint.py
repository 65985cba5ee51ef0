"""The FSDP trainer's sharded checkpoint: each rank writes and reads only its own shards.

A checkpoint folder holds ``shards/`` (``torch.distributed.checkpoint``, as verl and torchtitan
write theirs: one ``__<rank>_<n>.distcp`` file per rank with that rank's shards of the weights and
of the AdamW state, keyed by parameter name, and a ``.metadata`` index of every shard written by
rank 0) and ``trainer_state.pt`` (written by rank 0 after the shards, so a folder with it is whole:
format, version, schedule, RNG states). No rank gathers the full weights or optimiser state.
``torch.distributed.checkpoint`` reshards on load, so a checkpoint restores at any world size.

:func:`check_shards` reads only the index and refuses, before any rank is touched, a checkpoint of
another model or one whose shard files are missing or shorter than the index says;
:func:`read_model_weights` reads the full weights in one process (``staleflow export``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

SHARDS = "shards"
MODEL_KEY, OPTIMIZER_KEY = "model", "optimizer"
MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's state of each parameter, shaped like it


def save_shards(model: Any, optimizer: Any, folder: Path) -> None:
    """Write every rank's shards of the weights and the optimiser state to ``folder / SHARDS`` (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {MODEL_KEY: get_model_state_dict(model), OPTIMIZER_KEY: get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder / SHARDS, overwrite=True))


def load_shards(model: Any, optimizer: Any, folder: Path) -> None:
    """Read this rank's shards of what :func:`save_shards` wrote (any world size) into ``model`` and
    ``optimizer`` (a collective; :func:`check_shards` first)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, set_state_dict

    state = {MODEL_KEY: get_model_state_dict(model), OPTIMIZER_KEY: get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, storage_reader=dcp.FileSystemReader(folder / SHARDS))
    set_state_dict(model, optimizer, model_state_dict=state[MODEL_KEY], optim_state_dict=state[OPTIMIZER_KEY])


def check_shards(folder: Path, shapes: Mapping[str, tuple[int, ...]], parameters: Sequence[str]) -> None:
    """Refuse shards that cannot be restored whole into a model of these weight ``shapes`` (by
    name; AdamW holds state of the ``parameters``, the names its optimiser steps): a missing index
    or shard file is a FileNotFoundError; an unreadable index, a shard file shorter than the index
    says, or weights or AdamW state of other names or shapes a ValueError, each naming the file."""
    metadata = _index(folder / SHARDS)
    lengths: dict[str, int] = {}
    for info in metadata.storage_data.values():
        lengths[info.relative_path] = max(lengths.get(info.relative_path, 0), info.offset + info.length)
    for name, length in sorted(lengths.items()):
        path = folder / SHARDS / name
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {folder} lacks the shard file {path.name} its index names")
        if path.stat().st_size < length:
            raise ValueError(f"checkpoint shard file {path} holds {path.stat().st_size} bytes; its index needs {length}")
    found = _tensor_shapes(metadata)
    expected = {(MODEL_KEY, name): shape for name, shape in shapes.items()}
    expected |= {(OPTIMIZER_KEY, "state", name, moment): shapes[name] for name in parameters for moment in MOMENTS}
    missing = sorted(".".join(key) for key in set(expected) - set(found))
    extra = sorted(".".join(key) for key in set(found) - set(expected) if key[0] == MODEL_KEY or key[-1] in MOMENTS)
    wrong = [f"{'.'.join(k)}: {found[k]} in the file, {v} in the model" for k, v in sorted(expected.items())
             if k in found and found[k] != v]
    if missing or extra or wrong:
        raise ValueError(
            f"checkpoint {folder} holds another model's state: missing {missing[:3]}, unexpected {extra[:3]}, shapes {wrong[:3]}"
        )


def read_model_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The full weights of a sharded checkpoint, read in this process (no process group), by the
    trainer's parameter names."""
    import torch.distributed.checkpoint as dcp

    metadata = _index(folder / SHARDS)
    weights = {
        key[1]: torch.empty(shape, dtype=metadata.state_dict_metadata[flat].properties.dtype)
        for flat, key in _keys(metadata).items() if key[0] == MODEL_KEY and (shape := _tensor_shapes(metadata).get(key)) is not None
    }
    try:
        dcp.load({MODEL_KEY: weights}, storage_reader=dcp.FileSystemReader(folder / SHARDS))
    except Exception as error:  # torch.distributed.checkpoint wraps every rank's failure
        raise ValueError(f"checkpoint {folder / SHARDS} cannot be read ({type(error).__name__}: {error})") from error
    return weights


def _index(shards: Path) -> Any:
    """The ``.metadata`` index of a ``torch.distributed.checkpoint`` folder."""
    import torch.distributed.checkpoint as dcp

    if not (shards / ".metadata").is_file():
        raise FileNotFoundError(f"checkpoint {shards.parent} has no {SHARDS}/.metadata (no sharded checkpoint there)")
    try:
        return dcp.FileSystemReader(shards).read_metadata()
    except Exception as error:  # a truncated or foreign file
        raise ValueError(f"checkpoint index {shards / '.metadata'} cannot be read ({type(error).__name__}: {error})") from error


def _keys(metadata: Any) -> dict[str, tuple[str, ...]]:
    """Each flat key of the index as the path into the saved state (a parameter name is one part)."""
    return {flat: tuple(path) for flat, path in (metadata.planner_data or {}).items()}


def _tensor_shapes(metadata: Any) -> dict[tuple[str, ...], tuple[int, ...]]:
    """The shape of every tensor in the index, by its path into the saved state."""
    keys = _keys(metadata)
    entries = metadata.state_dict_metadata.items()
    return {keys[flat]: tuple(entry.size) for flat, entry in entries if flat in keys and hasattr(entry, "size")}

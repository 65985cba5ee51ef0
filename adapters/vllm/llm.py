"""The few calls into vLLM's engine and scheduler that the rollout engine needs."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from staleflow.adapters.vllm.settings import set_vllm_env_defaults
from staleflow.runtime.types import RolloutRequest


def make_llm_engine(engine_args: dict[str, Any]) -> Any:
    set_vllm_env_defaults()
    unmask_devices_for_ray_executor(engine_args)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(EngineArgs(**engine_args))


def unmask_devices_for_ray_executor(engine_args: Mapping[str, Any], environ: Any = os.environ) -> str | None:
    """With vLLM's Ray executor (a tensor-parallel GPU instance) the engine actor holds no GPU of its
    own (``num_gpus=0``: its Ray workers take one per bundle), and Ray may hide every GPU from it by
    setting ``CUDA_VISIBLE_DEVICES`` empty (older Ray releases did so for every actor without GPUs;
    Ray 2.60 does where ``RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1``). The engine core started from this
    process would inherit the empty mask and find no CUDA device. Remove the mask before vLLM starts,
    as OpenRLHF's engine actor does; each worker gets its own from Ray. Returns the value removed
    (None: nothing to do)."""
    if engine_args.get("distributed_executor_backend") != "ray":
        return None
    removed: str | None = environ.pop("CUDA_VISIBLE_DEVICES", None)
    return removed


def pure_decode(scheduler: Any) -> bool:
    """True when the next step decodes one token for each running request and prefills nothing."""
    if len(scheduler.waiting):
        return False
    return all(r.num_computed_tokens >= r.num_prompt_tokens for r in scheduler.running)


def kv_tokens(scheduler: Any) -> int:
    return sum(int(r.num_computed_tokens) for r in scheduler.running)


def default_weights_dir() -> Path:
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / "staleflow-weights"


def weights_file(weights: Any, weights_dir: Path, instance_id: str) -> tuple[Path, bool]:
    """A safetensors file for ``weights`` (a file, a folder holding ``model.safetensors``, a folder
    of shards with ``model.safetensors.index.json``, or a state dict; the last two are written to a
    temporary file in ``weights_dir``) and whether it is temporary."""
    if isinstance(weights, (str, os.PathLike)):
        path = Path(weights)
        if path.is_dir() and not (path / "model.safetensors").is_file() and (path / "model.safetensors.index.json").is_file():
            from safetensors.torch import load_file

            shards = sorted({str(name) for name in json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values()})
            weights = {key: tensor for shard in shards for key, tensor in load_file(str(path / shard)).items()}
        else:
            if path.is_dir():
                path = path / "model.safetensors"
            if not path.is_file():
                raise FileNotFoundError(f"{instance_id}: no safetensors weights at {path}")
            return path, False
    if isinstance(weights, Mapping):
        from safetensors.torch import save_file

        weights_dir.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(prefix=f"{instance_id}-", suffix=".safetensors", dir=weights_dir)
        os.close(handle)
        tensors = {key: value.detach().to("cpu").contiguous() for key, value in weights.items()}
        save_file(tensors, name)
        return Path(name), True
    raise TypeError(
        f"{instance_id}: weights must be a safetensors path or a state dict, not {type(weights).__name__}"
    )


def check_request(request: RolloutRequest, instance_id: str, max_model_len: int) -> None:
    """Refuse (``ValueError``, naming the instance and request) a request an engine cannot serve as given."""
    name = f"{instance_id}: request {request.request_id!r}"
    if not request.prompt_ids:
        raise ValueError(f"{name} has an empty prompt")
    if not len(request.output_ids) == len(request.logprobs) == len(request.versions):
        raise ValueError(
            f"{name}: output_ids, logprobs and versions differ in length "
            f"({len(request.output_ids)}, {len(request.logprobs)}, {len(request.versions)})"
        )
    if request.remaining_tokens < 0:
        raise ValueError(f"{name} has more output tokens than max_new_tokens ({request.max_new_tokens})")
    total = len(request.prompt_ids) + request.max_new_tokens
    if total > max_model_len:
        raise ValueError(
            f"{name}: prompt ({len(request.prompt_ids)}) + max_new_tokens ({request.max_new_tokens}) "
            f"= {total} exceeds max_model_len {max_model_len}"
        )

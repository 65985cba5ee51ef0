"""How StaleFlow runs vLLM: the process environment it needs on CPU, and the sampling settings of an
engine. vLLM reads its environment at import time: call :func:`set_vllm_env_defaults` first."""

from __future__ import annotations

import os
from dataclasses import dataclass

#: CPU defaults: in-process engine core, one OpenMP thread without pinning (spin-waiting against
#: another busy process slows vLLM 10-20x), 1 GiB of KV cache, no warm-up, no hub access, and logs
#: on stderr (stdout is for results: ``staleflow profile --json``).
VLLM_ENV_DEFAULTS = {
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_CI_ENV": "1",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
}


def set_vllm_env_defaults() -> None:
    """Set :data:`VLLM_ENV_DEFAULTS` where the environment does not set them (call before importing vLLM)."""
    for key, value in VLLM_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


@dataclass(frozen=True)
class SamplingConfig:
    """How every request of an engine is sampled. ``temperature=0`` is greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    #: generate exactly ``max_new_tokens`` (profiling); EOS still counts as a token
    ignore_eos: bool = False

"""Test-wide environment: CPU vLLM and Ray settings that keep the suite fast and quiet on 2 cores.

Set before any test module imports vllm, torch or ray (see shared/reference/environment.md).
"""

import os

for _name, _value in {
    "OMP_NUM_THREADS": "1",  # OpenMP spin-waiting against other busy processes slows vLLM 10-20x
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_CI_ENV": "1",
    "HF_HUB_OFFLINE": "1",  # the tiny model is local; never reach for a hub
    "RAY_AUTH_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
    "MPLBACKEND": "Agg",
}.items():
    os.environ.setdefault(_name, _value)

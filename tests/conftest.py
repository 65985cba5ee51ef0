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


import sys
from pathlib import Path

import pytest

_PARENT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True, scope="session")
def _no_sibling_packages() -> None:
    """The repository root holds an ``__init__.py`` (the package is the root itself), so pytest puts the
    root's parent folder on sys.path when it sets up that package, before the first test; a sibling
    folder there (another clone, say one named like a library: ``h11``) would shadow real packages."""
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _PARENT]

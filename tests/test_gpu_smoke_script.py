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


def test_the_trainer_only_check_imports_its_three_backends_without_vllm_or_ray(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHON": sys.executable, "STALEFLOW_SMOKE_DIR": str(tmp_path), "WHEELS": str(tmp_path / "none")}
    done = subprocess.run(["bash", "scripts/gpu-smoke.sh", "--trainer-only", "--dry-run"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("GPU-SMOKE-DRY-RUN")]
    assert lines == [f"GPU-SMOKE-DRY-RUN {b}: imports ok without ray or vllm" for b in ("fsdp", "torch", "megatron")]

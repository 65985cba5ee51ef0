"""``staleflow_protocol.areal`` in AReaL's own environment: a separate venv with areal 1.0.4, its light
dependencies, CPU torch and only the light ``staleflow-protocol`` package from ``protocol/`` (never
the ``staleflow`` package), where ``tests/areal_dropin_run.py`` runs two data-parallel ranks for 50
steps with a recover from AReaL's ``RecoverInfo`` at step 25.

Deviation from "AReaL's own pins": areal 1.0.4 declares ``torch<2.11``, but the only CPU torch these
machines can install is the local ``torch 2.13.0+cpu`` wheel (PyPI's torch is the CUDA build, several
GB); so the venv has torch 2.13.0 and areal is installed with ``--no-deps`` (as are its light
dependencies below, which would otherwise resolve areal's torch pin). Everything else areal imports
on its rollout path is installed normally.

The venv is built and cached by ``tests/peer_venv.py`` (not shared with the main venv: AReaL's
venv has its own transformers, ray and numpy).
``pytest -m "not areal"`` deselects it.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.peer_venv import peer_python

RUN = Path(__file__).with_name("areal_dropin_run.py")
#: The CPU torch (the local wheel), the build requirement of the light package, and what areal's
#: rollout path imports beyond AReaL's light dependencies: installed with their own dependencies.
WITH_DEPS = [
    "torch==2.13.0", "setuptools>=70.1", "numpy", "pyyaml", "packaging", "transformers", "pillow", "aiohttp",
    "httpx", "lark", "uvloop", "ray", "numba", "einops", "openai",
]
#: areal and the light packages it needs (--no-deps: resolving them would replace torch).
NO_DEPS = [
    "areal==1.0.4", "torchdata==0.11.0", "hydra-core==1.4.0.dev1", "omegaconf==2.4.0.dev2",
    "antlr4-python3-runtime==4.13.2", "colorlog==6.12.0", "tenacity==9.2.1", "flask==3.1.3", "werkzeug",
    "click", "itsdangerous==2.2.0", "blinker==1.9.0", "orjson==3.13.0", "aiofiles==25.1.0",
]

pytestmark = [pytest.mark.areal, pytest.mark.slow]


@pytest.fixture(scope="session")
def areal_python() -> tuple[Path, float]:
    """AReaL's venv (``tests/peer_venv.py``) with the light package from the current sources: its
    python, and the seconds this took."""
    return peer_python("areal", WITH_DEPS, NO_DEPS)


def test_areal_venv_has_the_light_package_and_not_staleflow(areal_python: tuple[Path, float]) -> None:
    python, _ = areal_python
    probe = ("import importlib.util, json, areal, torch, staleflow_protocol.areal as a; "
             "print(json.dumps([areal.__version__, torch.__version__, importlib.util.find_spec('staleflow') is None, "
             "a.__name__, sorted(m for m in __import__('sys').modules if m.split('.')[0] == 'staleflow')]))")
    done = subprocess.run([str(python), "-I", "-c", probe], capture_output=True, text=True, cwd=python.parent, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == ["1.0.4", "2.13.0+cpu", True, "staleflow_protocol.areal", []]


SIGNATURES = """
import inspect, json
from areal.infra import RolloutController, WorkflowExecutor
from staleflow_protocol.areal import ProtocolRolloutController, ProtocolWorkflowExecutor
params = lambda f: list(inspect.signature(f).parameters)
print(json.dumps([params(ProtocolWorkflowExecutor.prepare_batch) == params(WorkflowExecutor.prepare_batch),
                  params(ProtocolRolloutController.prepare_batch) == params(RolloutController.prepare_batch),
                  issubclass(ProtocolRolloutController, RolloutController), params(RolloutController.prepare_batch)]))
"""


def test_the_drop_ins_take_areals_prepare_batch_arguments(areal_python: tuple[Path, float]) -> None:
    """Both paths keep AReaL's own prepare_batch parameters: the controller's are RLTrainer's call
    (RemoteInfEngine.prepare_batch has the same and passes the executor its subset)."""
    python, _ = areal_python
    done = subprocess.run([str(python), "-I", "-c", SIGNATURES], capture_output=True, text=True, cwd=python.parent, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [True, True, True, [
        "self", "dataloader", "workflow", "workflow_kwargs", "should_accept_fn", "group_size", "dynamic_bs"]]


def test_areal_two_ranks_recover_mid_run_bound_kept_trace_accepted(areal_python: tuple[Path, float], tmp_path: Path) -> None:
    python, built = areal_python
    started = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "COV_", "COVERAGE"))}
    done = subprocess.run([str(python), "-I", str(RUN), str(tmp_path / "run"), "50", "25"], capture_output=True, text=True,
                          cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}, timeout=1100)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    print(f"AReaL venv: {built:.1f} s; two-rank run with recover: {time.perf_counter() - started:.1f} s")
    assert (result["steps"], result["recover_at"]) == (50, 25)
    # the prompt of task 1, refused at episode start, is submitted again (task 2) before a new prompt
    assert result["refusal_submissions"][:3] == [[0, 10], [1, 11], [2, 11]]
    for rank in ("0", "1"):
        got = result["ranks"][rank]
        assert got["trained"] == 100 and got["past_eta"] == 0  # 50 batches of 2 groups, none past eta
        assert got["stale"] > 0  # groups one version old were trained: the bound was exercised
        assert got["unaccounted"] == 0 and got["pending_at_end"] > 0  # every drawn prompt accounted for
        assert "accepted" in got["trace"] and "2 segment(s)" in got["trace"]  # the recover is a new segment

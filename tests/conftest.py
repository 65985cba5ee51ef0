"""Test-wide setup: CPU vLLM and Ray settings, the test tiers, timeouts, and the shared fixtures.

Environment: set before any test module imports vllm, torch or ray.

Tiers (markers applied here, automatically, from :data:`TIERS`; a test file not in the table is
``integration``): ``unit`` (pure Python, no subprocess, seconds in all: ``pytest -m unit``),
``integration`` (tools, trainers, subprocesses, the model checker) and ``e2e`` (vLLM engines, Ray
clusters, whole training runs). A test marked ``vllm`` or ``ray`` is ``e2e`` whatever its file; one
marked ``slow`` or ``java`` is at least ``integration``. Every test has a timeout (pytest-timeout):
the ``timeout`` of pyproject's pytest section, :data:`E2E_TIMEOUT_S` in the ``e2e`` tier, or its own
``@pytest.mark.timeout(...)``.

Shared fixtures: ``tiny_model`` (the built-in tiny model, built once per session in a temporary
folder that ``$STALEFLOW_TINY_MODEL_DIR`` also names, so that ``staleflow train`` in a test or its
subprocesses never writes to the home directory) and ``ray_cluster`` (one local Ray cluster shared
by consecutive tests that only need some cluster; stopped before any other test, which may start
its own or check that none runs).
"""

from __future__ import annotations

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

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from skips import pytest_configure as register_skip_policy

UNIT, INTEGRATION, E2E = "unit", "integration", "e2e"
DEFAULT_TIER = INTEGRATION
E2E_TIMEOUT_S = 1200  # a whole training run on 2 loaded cores, with the engines' start-up
#: test file -> tier; files not listed get DEFAULT_TIER
TIERS = {
    "test_algorithms.py": UNIT,
    "test_config.py": UNIT,
    "test_convergence_bench.py": UNIT,
    "test_cost_model.py": UNIT,
    "test_protocol.py": UNIT,
    "test_readme.py": UNIT,
    "test_rewards.py": UNIT,
    "test_runtime_loop.py": UNIT,
    "test_runtime_parameter_server.py": UNIT,
    "test_runtime_rewarding.py": UNIT,
    "test_runtime_strategies.py": UNIT,
    "test_runtime_trajectory_server.py": UNIT,
    "test_safety_alarms.py": UNIT,
    "test_sim_engine.py": UNIT,
    "test_sim_tokens.py": UNIT,
    "test_sim_trainer.py": UNIT,
    "test_sim_workload.py": UNIT,
    "test_task_data.py": UNIT,
    "test_tasks.py": UNIT,
    "test_train_tasks.py": UNIT,
    "test_conftest_tiers.py": UNIT,
    "test_locked_manager.py": UNIT,
    "test_trace_format.py": UNIT,
    "test_trace_cost.py": UNIT,
    "test_architecture.py": INTEGRATION,
    "test_bad_input.py": INTEGRATION,
    "test_bench_commands.py": INTEGRATION,
    "test_bench_mutation.py": INTEGRATION,
    "test_chaos.py": INTEGRATION,
    "test_docs_site.py": INTEGRATION,
    "test_export.py": INTEGRATION,
    "test_fsdp_trainer.py": INTEGRATION,
    "test_megatron_trainer.py": INTEGRATION,
    "test_mutants_caught.py": INTEGRATION,
    "test_packing.py": INTEGRATION,
    "test_placement.py": INTEGRATION,
    "test_protocol_model.py": INTEGRATION,
    "test_protocol_package.py": INTEGRATION,
    "test_python_api_examples.py": INTEGRATION,
    "test_recovery_paths.py": INTEGRATION,
    "test_sim_bench_coordinator.py": INTEGRATION,
    "test_simulate_cli.py": INTEGRATION,
    "test_spec_tlc.py": INTEGRATION,
    "test_tiny_model.py": INTEGRATION,
    "test_torch_trainer.py": INTEGRATION,
    "test_trace_validation.py": INTEGRATION,
    "test_verification_links.py": INTEGRATION,
    "test_verify_cli.py": INTEGRATION,
    "test_verify_real.py": INTEGRATION,
    "test_z3_proofs.py": INTEGRATION,
    "test_areal_dropin.py": E2E,
    "test_bench_weight_sync.py": E2E,
    "test_driver_kill.py": E2E,
    "test_profile_command.py": E2E,
    "test_runtime_ray.py": E2E,
    "test_train_e2e.py": E2E,
    "test_vllm_engine.py": E2E,
    "test_vllm_engine_failure.py": E2E,
    "test_vllm_logprobs.py": E2E,
    "test_vllm_tied_embeddings.py": E2E,
}
_ORDER = (UNIT, INTEGRATION, E2E)


def tier_of(filename: str, markers: set[str]) -> str:
    """The tier of a test in ``filename`` carrying ``markers`` (see the module docstring)."""
    tier = TIERS.get(filename, DEFAULT_TIER)
    floor = E2E if markers & {"vllm", "ray"} else INTEGRATION if markers & {"slow", "java"} else UNIT
    return max(tier, floor, key=_ORDER.index)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tiers: dict[str, str] = {}
    for item in items:
        tier = tier_of(item.path.name, {mark.name for mark in item.iter_markers()})
        if "ray_cluster" in getattr(item, "fixturenames", ()) and item.get_closest_marker("ray") is None:
            item.add_marker(pytest.mark.ray)
            tier = E2E
        item.add_marker(getattr(pytest.mark, tier))
        if tier == E2E and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(E2E_TIMEOUT_S))
        tiers[item.nodeid] = tier
    # The longest tests first (end to end, then integration, then unit; file order within a tier): the
    # three workers (pyproject: -n 3 --dist loadfile --no-loadscope-reorder) take whole files in this
    # order, so the run ends on short unit files instead of one worker finishing a training run.
    items.sort(key=lambda item: _ORDER.index(tiers[item.nodeid]), reverse=True)


@pytest.fixture(autouse=True, scope="session")
def _session_environment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The built-in tiny model goes to this session's temporary folder, not to the home directory."""
    from staleflow.runtime.settings.config_sections import TINY_MODEL_DIR_ENV

    before = os.environ.get(TINY_MODEL_DIR_ENV)
    os.environ[TINY_MODEL_DIR_ENV] = str(tmp_path_factory.mktemp("tiny-model") / "model")
    yield
    if before is None:
        os.environ.pop(TINY_MODEL_DIR_ENV, None)
    else:
        os.environ[TINY_MODEL_DIR_ENV] = before


@pytest.fixture(scope="session")
def tiny_model(_session_environment: None) -> Path:
    """The built-in tiny model (default spec), built once per session; tests must not write into it."""
    from staleflow.app.tiny_model import ensure_tiny_model
    from staleflow.runtime.settings.config_sections import default_tiny_model_dir

    return ensure_tiny_model(Path(default_tiny_model_dir()))


class _SharedRay:
    """One local Ray cluster for the tests that need some cluster, started on first use."""

    started = False

    def start(self) -> Any:
        import ray

        if not ray.is_initialized():
            ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False)  # logical GPUs: placement only
            self.started = True
        return ray

    def stop(self) -> None:
        import ray

        if self.started and ray.is_initialized():
            ray.shutdown()
        self.started = False


_RAY = _SharedRay()


@pytest.fixture
def ray_cluster() -> Any:
    """The shared local Ray cluster (2 CPUs, 4 logical GPUs for placement tests); returns the ``ray`` module. Parts placed on it must be
    closed by the test; the cluster stays up for the next test that asks for it."""
    return _RAY.start()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before a test (and its fixtures) that does not ask for the shared cluster, stop it: such a test
    may start a cluster of its own (a training run) or check that none is running."""
    if "ray_cluster" not in getattr(item, "fixturenames", ()):
        _RAY.stop()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _RAY.stop()


def pytest_configure(config: pytest.Config) -> None:
    register_skip_policy(config)  # a skip tests/skips.py does not accept fails the run

"""The AReaL drop-in keeps AReaL 1.0.4's behaviour where the bound does not require otherwise, checked
against AReaL's own classes built from the same arguments in AReaL's venv (``tests/areal_compat_run.py``,
one process for all sections): the default concurrency cap, AReaL's public attributes, its clamping of
a zero batch, the constructor, and the numbers of the intended differences (docs/integrating.md,
"Where the drop-in differs from AReaL"). The venv is the one ``tests/test_areal_dropin.py`` builds.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.peer_venv import peer_command, peer_python
from tests.test_areal_dropin import NO_DEPS, WITH_DEPS

RUN = Path(__file__).with_name("areal_compat_run.py")

pytestmark = [pytest.mark.areal, pytest.mark.slow]


@pytest.fixture(scope="module")
def compat(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    python, _ = peer_python("areal", WITH_DEPS, NO_DEPS)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "COV_", "COVERAGE"))}
    done = subprocess.run(peer_command(python, str(RUN), isolated=True), capture_output=True, text=True,
                          cwd=tmp_path_factory.mktemp("areal-compat"), env={**env, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_default_concurrency_cap_is_areals(compat: dict[str, Any]) -> None:
    """``max_concurrent_rollouts`` unset: AReaL starts ``consumer_batch_size`` (a rank's share on the
    executor), not the protocol's whole slack ``(eta + 1) * batch`` (256 for batch 64, eta 3: 128 per rank of two)."""
    assert compat["default_cap"] == {
        "executor 64 eta 3 dp 2": [32, 32], "controller 64 eta 3": [64, 64], "protocol slack 64 eta 3": [128, 256],
        "executor 16 eta 2 dp 2": [8, 8], "controller 16 eta 2": [16, 16], "protocol slack 16 eta 2": [24, 48]}


def test_managers_have_areals_public_attributes(compat: dict[str, Any]) -> None:
    """``max_concurrent_rollouts``, ``consumer_batch_size`` and ``max_staleness``, as AReaL's managers
    hold them: per rank on the executor (two ranks here), the trainer's on the controller."""
    assert compat["attributes"] == {
        "executor None 16 2 dp 2": [[8, 8, 2], [8, 8, 2]], "controller None 16 2": [[16, 16, 2], [16, 16, 2]],
        "executor 100 32 5 dp 2": [[50, 16, 5], [50, 16, 5]], "controller 100 32 5": [[100, 32, 5], [100, 32, 5]]}


def test_a_zero_batch_runs_one_as_in_areal(compat: dict[str, Any]) -> None:
    """``consumer_batch_size`` 0 and ``max_concurrent_rollouts`` 0 count as 1 (AReaL's clamping), and a
    batch of 3 over 4 data-parallel ranks gives each rank's protocol a batch of 1 (the docs' recipe gave 0,
    which the protocol refuses): the same attributes and the same single start as AReaL's. A protocol of
    another batch is refused, naming the 1 that AReaL runs."""
    assert compat["zero_batch"] == {
        "manager 0 0 eta 0": [[0, 0, 0, 1], [0, 0, 0, 1], 1],
        "executor 0 0 dp 1": [[1, 1, 1, 1], [1, 1, 1, 1], 1],
        "executor 3 None dp 4": [[1, 1, 1, 1], [1, 1, 1, 1], 1],
        "mismatch": "error: ValueError: protocol and AReaL rollout config disagree: the protocol's batch_size is 2 but "
                    "AReaL's consumer_batch_size is 0 (AReaL runs 1)"}


def test_built_from_areals_own_constructor_arguments(compat: dict[str, Any]) -> None:
    """``ProtocolStalenessManager`` has ``StalenessManager``'s parameters (then keyword-only extras) and,
    built by name from the arguments of AReaL's own unit tests, the same capacity at version 0;
    ``ProtocolRolloutController`` builds from AReaL's arguments alone, its protocol from the config."""
    got = compat["constructor"]
    assert got["params"][:4] == got["areal_params"] == ["version_provider", "max_concurrent_rollouts", "consumer_batch_size",
                                                         "max_staleness"]
    assert got["capacities"] == [[10, 10], [100, 100], [5, 5], [12, 12], [3, 3], [1, 1], [1000, 1000], [50, 50]]
    assert got["controller"] == ["ProtocolRolloutController", 2, 16, 16, 16]


def test_callbacks_without_a_task_are_counted_as_areal_counts_them(compat: dict[str, Any]) -> None:
    """Outside an episode (no task id in AReaL's context) an accepted rollout keeps its place against
    the capacity and a rejected one gives it back, as AReaL counts them (the sequences of AReaL's own
    unit tests: 10 of 10 rejected, 15 accepted and 5 rejected of 20, 5 of 5 accepted)."""
    assert compat["callbacks_without_context"] == [[10, 10], [17, 17], [7, 7]]


def test_the_documented_difference_in_numbers(compat: dict[str, Any]) -> None:
    """docs/integrating.md's table: at version 5, eta 2, batch 4, AReaL's manager new at that version
    admits 32, the protocol 12; trained oldest first, AReaL's samples 13-32 are 3-7 versions late (20 past
    eta 2). AReaL's recover hook resets its count; the drop-in refuses a protocol not restored. The pending
    limits agree but for the protocol's ``redundancy``; an evaluation episode holds no place in the drop-in;
    an episode at a version ahead of the protocol's trainer is an error the trainer hears."""
    got = compat["differences"]
    assert (got["admitted"], got["excess_samples"], got["excess_late"], got["past_eta"]) == ([32, 12], [13, 32], [3, 7], 20)
    assert got["recovered_areal_starts"] == 12
    assert got["recovered_dropin"].startswith("recovered model version 5 but the protocol is at 0: restore the protocol snapshot")
    assert got["pending_limit"] == [12, 12, 13]  # (eta + 1) * batch, plus the protocol's redundancy
    assert got["evaluation_episode"] == [11, 12]  # AReaL counts an accepted evaluation sample; to the protocol it is none of its
    ahead = "version 1 is ahead of the trainer: the newest model is 0"
    assert got["engine_ahead"] == [f"InvalidVersionError: {ahead}", f"RuntimeError: protocol error in a rollout: {ahead}"]

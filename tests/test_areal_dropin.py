"""``staleflow_protocol.bindings.areal`` in AReaL's own environment: a separate venv made by
``pip install areal==1.0.4`` with every one of AReaL's own pins (on Linux x86_64 that is PyPI's torch
2.10 CUDA build, which runs on the CPU here, and about 9 GB in all; ``pip check`` must find nothing
broken) and only the light ``staleflow-protocol`` package from ``protocol/`` (never the ``staleflow``
package), where ``tests/areal_dropin_run.py`` runs two data-parallel ranks for 50 steps with a
recover from AReaL's ``RecoverInfo`` at step 25, ``tests/areal_ppo_trainer_run.py`` AReaL's real
``PPOTrainer`` on CPU, two data-parallel ranks or two tensor-parallel ones, with a recover through its
``RecoverHandler``, and ``tests/areal_guards_run.py`` the binding's guards (config, bypasses, the recover
order on a rank that never consumes).

The venv is built and cached by ``tests/peer_venv.py`` (not shared with the main venv: AReaL's
venv has its own torch, transformers, ray and numpy): about 5 minutes cold with the package index,
under a second warm. ``pytest -m "not areal"`` deselects it.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.peer_venv import peer_command, peer_python

RUN = Path(__file__).with_name("areal_dropin_run.py")
GUARDS_RUN = Path(__file__).with_name("areal_guards_run.py")
PPO_RUN = Path(__file__).with_name("areal_ppo_trainer_run.py")
#: AReaL with its own dependencies and pins, and the build requirement of the light package (which is
#: then installed offline, without dependencies: it has none).
WITH_DEPS = ["areal==1.0.4", "setuptools>=70.1"]
NO_DEPS: list[str] = []

pytestmark = [pytest.mark.areal, pytest.mark.slow]


@pytest.fixture(scope="session")
def areal_python() -> tuple[Path, float]:
    """AReaL's venv (``tests/peer_venv.py``) with the light package from the current sources: its
    python, and the seconds this took."""
    return peer_python("areal", WITH_DEPS, NO_DEPS)


PINS = """
import importlib.metadata as md, importlib.util, json, sys, areal, torch, staleflow_protocol.bindings.areal as a
from packaging.requirements import Requirement
torch_pin = [r for r in map(Requirement, md.requires("areal")) if r.name == "torch" and r.marker.evaluate()]
print(json.dumps([areal.__version__, torch.__version__, [str(r.specifier) for r in torch_pin],
                  all(r.specifier.contains(torch.__version__) for r in torch_pin),
                  importlib.util.find_spec("staleflow") is None, a.__name__,
                  sorted(m for m in sys.modules if m.split(".")[0] == "staleflow")]))
"""


def test_areal_venv_keeps_areals_own_pins_and_has_only_the_light_package(areal_python: tuple[Path, float]) -> None:
    """Every requirement of every installed package holds (``pip check``: AReaL's pins, torch<2.11
    among them), the torch is the one AReaL's own marker selects here, and ``staleflow`` is absent."""
    python, _ = areal_python
    checked = subprocess.run([str(python), "-m", "pip", "check"], capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0 and "No broken requirements found" in checked.stdout, checked.stdout[-3000:]
    done = subprocess.run([str(python), "-I", "-c", PINS], capture_output=True, text=True, cwd=python.parent, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    areal_version, torch_version, torch_pin, torch_in_pin, no_staleflow, module, loaded = json.loads(done.stdout.splitlines()[-1])
    assert (areal_version, torch_pin, no_staleflow, module, loaded) == (
        "1.0.4", ["<2.11,>=2.9.1"], True, "staleflow_protocol.bindings.areal", [])
    assert torch_in_pin is True, torch_version


SIGNATURES = """
import inspect, json
from areal.infra import RolloutController, WorkflowExecutor
from staleflow_protocol.bindings.areal import ProtocolRolloutController, ProtocolWorkflowExecutor
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


WRAPPED_ENGINES = """
import json
from areal.api.cli_args import InferenceEngineConfig
from areal.engine import RemoteSGLangEngine, RemotevLLMEngine
from areal.infra.workflow_executor import WorkflowExecutor
from staleflow_protocol import LockedStalenessManager
from staleflow_protocol.bindings.areal import ProtocolWorkflowExecutor, use_protocol
got = []
for cls in (RemotevLLMEngine, RemoteSGLangEngine):
    engine = cls(InferenceEngineConfig(consumer_batch_size=2, max_head_offpolicyness=1))
    inner = engine._engine  # the RemoteInfEngine it wraps, given the executor its initialize() builds (no servers here)
    inner.workflow_executor = WorkflowExecutor(inner.config, inner)
    inner.workflow_executor.initialize(train_data_parallel_size=1)
    executor = use_protocol(engine, LockedStalenessManager.create(1, 2), train_data_parallel_size=1)
    got.append([cls.__name__, engine.workflow_executor is executor, isinstance(executor, ProtocolWorkflowExecutor),
                executor.inference_engine is inner, executor.staleness.version_provider is inner])
    executor.destroy()
print(json.dumps(got))
"""


def test_use_protocol_on_areals_sglang_and_vllm_engines(areal_python: tuple[Path, float]) -> None:
    """PPOTrainer's rollout is a RemoteSGLangEngine or RemotevLLMEngine: each wraps a RemoteInfEngine
    and exposes its ``workflow_executor`` without a setter; the protocol's executor replaces the
    wrapped engine's, and that engine (the one episodes generate with) is its version source."""
    python, _ = areal_python
    done = subprocess.run([str(python), "-I", "-c", WRAPPED_ENGINES], capture_output=True, text=True, cwd=python.parent, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [["RemotevLLMEngine", True, True, True, True],
                                                        ["RemoteSGLangEngine", True, True, True, True]]


def _run_in_venv(python: Path, tmp_path: Path, *args: str, timeout: int, script: Path = RUN) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "COV_", "COVERAGE"))}
    done = subprocess.run(peer_command(python, str(script), *args, isolated=True), capture_output=True, text=True,
                          cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_areal_controller_path_and_recover_handler(areal_python: tuple[Path, float], tmp_path: Path) -> None:
    """AReaL's default path and RLTrainer's recover, as far as CPU and this venv allow.

    Controller: ``ProtocolRolloutController`` with AReaL's own dispatcher, async task runner and Flask
    callback server, 8 steps; only the ``Scheduler`` is faked (``InProcessScheduler``: two in-process
    workers where LocalScheduler would start RPC-server processes, each launching an SGLang/vLLM
    server, which need GPUs), and the workers' engine is the CPU ``FakeEngine``. The controller is
    built directly, and by AReaL's real ``PPOTrainer._init_rollout`` in single-controller mode under
    ``ProtocolTrainerHooks`` (its ``__init__`` reduced to the attributes ``_init_rollout`` reads), then
    that trainer-built controller again through a recover (``RecoverInfo`` dump, a second life, the
    single-controller ``on_version_recovered``). ``LocalScheduler`` cannot start its workers here
    (docs/integrating.md, "What AReaL 1.0.4 cannot run here").
    Recover: AReaL's own ``RecoverHandler.dump`` / ``load`` (and ``RecoverInfo`` on disk) through
    ``ProtocolTrainerHooks``, mixed into a fast stand-in for ``PPOTrainer.__init__`` that keeps its
    order (dataloader, rollout, load, ``on_version_recovered``); the train engine is a torch tensor
    saved by RecoverHandler's ``save`` / ``load`` calls, and ``load`` gets no inference engine. The
    real PPOTrainer, with its FSDP actor and the weight push: the last test of this module."""
    python, _ = areal_python
    result = _run_in_venv(python, tmp_path, "--trainer-paths", str(tmp_path / "run"), timeout=900)
    controller = result["controller"]
    assert (controller["steps"], controller["workers"], controller["version"]) == (8, 2, 8)
    assert controller["exact_ids"] is True  # each trained trajectory is the one its consumed task produced
    assert controller["stale"] > 0 and controller["callbacks"] >= 8 * 2  # the bound was exercised, over HTTP callbacks
    assert "accepted" in controller["trace"]  # and the bound held on every trained sample (asserted in the run)
    # PPOTrainer's own single-controller _init_rollout, under the hooks, builds the protocol's controller
    hooked = result["trainer_controller"]
    assert hooked["built"] == ["ProtocolRolloutController", "RemotevLLMEngine"]  # the vllm backend's engine class
    assert (hooked["steps"], hooked["workers"], hooked["version"], hooked["exact_ids"]) == (8, 2, 8, True)
    assert hooked["stale"] > 0 and "accepted" in hooked["trace"]
    for built in (controller, hooked):
        # a direct submit / wait / rollout_batch on the protocol's controller is refused by name
        assert [message.split(" would ")[0] for message in built["bypasses"]] == [
            f"RuntimeError: ProtocolRolloutController.{method}" for method in ("submit", "wait", "rollout_batch")]
        # the protocol's task ids start at its own first id, far above AReaL's own (its TaskIdGenerator, from 0)
        assert built["id_spaces"] == {"protocol_from": built["first_task_id"], "areal_next": 0} and built["first_task_id"] >= 2**32
    # AReaL's default mode through a recover: the trainer-built controller dumped after step 3 with episodes in
    # flight; the second life restores the loader (protocol at 4, untrained prompts to retry), the controller's
    # version and on_version_recovered(4), as PPOTrainer.__init__ does in single-controller mode
    sc_recover = result["controller_recover"]
    assert sc_recover["steps"] == list(range(8)) and sc_recover["in_flight_at_dump"] > 0
    assert sc_recover["resumed"]["protocol_version"] == 4 and sc_recover["resumed"]["retry"] > 0
    assert sc_recover["unique_ids"] is True and sc_recover["unique_prompts"] is True
    assert "accepted" in sc_recover["trace"] and "2 segment(s)" in sc_recover["trace"]
    recover = result["recover_handler"]
    assert recover["steps"] == list(range(8)) and recover["restored_at"] == 4  # dumped after step 3, resumed at 4
    # died mid-flight, no prompt lost: each saved one is trained, pending or spent by a protocol drop
    assert recover["in_flight_at_dump"] > 0 and recover["saved_prompts_kept"] is True
    assert recover["unique_ids"] is True and recover["unique_prompts"] is True
    assert "accepted" in recover["trace"] and "2 segment(s)" in recover["trace"]


def test_areal_guards_bypasses_and_a_non_head_rank_recovers(areal_python: tuple[Path, float], tmp_path: Path) -> None:
    """``tests/areal_guards_run.py``: eta and batch size checked against AReaL's config where the protocol's
    rollout is built (SPMD executor, controller, the trainer hooks); direct submit / wait / rollout_batch
    refused on the executor and on AReaL's engine wrapping it; RLTrainer's recover order on a rank that
    is not a data-parallel head (never consumes, protocol at version 0, ``on_version_recovered(4)``)."""
    python, _ = areal_python
    result = _run_in_venv(python, tmp_path, str(tmp_path / "run"), timeout=600, script=GUARDS_RUN)
    disagree = "ValueError: protocol and AReaL rollout config disagree: "
    assert result["config"] == {
        "executor_eta": disagree + "the protocol's eta is 2 but AReaL's max_head_offpolicyness is 1",
        "executor_batch": disagree + "the protocol's batch_size is 4 but AReaL's consumer_batch_size is 4 // 2 data-parallel ranks = 2",
        "controller_batch": disagree + "the protocol's batch_size is 4 but AReaL's consumer_batch_size is 2",
        "hooks": disagree + "the protocol's eta is 2 but AReaL's max_head_offpolicyness is 1",
        "matching_build": ["ProtocolWorkflowExecutor", "ProtocolRolloutController"]}
    for refusals in result["bypasses"].values():
        assert [message.split(" would ")[0] for message in refusals] == [
            f"RuntimeError: ProtocolWorkflowExecutor.{method}" for method in ("submit", "wait", "rollout_batch")]
        assert all("bypass the protocol's admission" in message for message in refusals)
    non_head = result["non_head"]
    assert (non_head["consumes"], non_head["recovered_step"], non_head["protocol_version"], non_head["rollout_version"]) == (False, 3, 0, 4)
    assert non_head["prepare_batch"].startswith("RuntimeError: prepare_batch on a rank that never consumes")
    # the check keeps its teeth where it matters: a head whose protocol was not restored is refused
    assert non_head["head_unrestored"].startswith("ValueError: recovered model version 4 but the protocol is at 0")


def test_areal_two_ranks_recover_mid_run_bound_kept_trace_accepted(areal_python: tuple[Path, float], tmp_path: Path) -> None:
    python, built = areal_python
    started = time.perf_counter()
    result = _run_in_venv(python, tmp_path, str(tmp_path / "run"), "50", "25", timeout=1100)
    print(f"AReaL venv: {built:.1f} s; two-rank run with recover: {time.perf_counter() - started:.1f} s")
    assert (result["steps"], result["recover_at"]) == (50, 25)
    # the prompt of task 1, refused at episode start, is submitted again (task 2) before a new prompt
    assert result["refusal_submissions"]["submissions"][:3] == [[0, 10], [1, 11], [2, 11]]  # from the protocol's first task id
    # a checkpoint now keeps 11 (in flight again) and 12 (drawn with the loader's batch, not yet submitted)
    assert result["refusal_submissions"]["saved"] == [11, 12]
    for rank in ("0", "1"):
        got = result["ranks"][rank]
        assert got["trained"] == 100 and got["past_eta"] == 0  # 50 batches of 2 groups, none past eta
        assert got["stale"] > 0  # groups one version old were trained: the bound was exercised
        # every prompt the loader's own state says it handed out is accounted for (the run also checks that
        # the newest one, were it lost, would be reported)
        assert got["unaccounted"] == 0 and got["pending_at_end"] > 0 and got["drawn"] >= got["trained"] + got["pending_at_end"]
        assert "accepted" in got["trace"] and "2 segment(s)" in got["trace"]  # the recover is a new segment


def test_areal_real_ppo_trainer_on_cpu_recovers_mid_run(areal_python: tuple[Path, float], tmp_path: Path) -> None:
    """AReaL's real ``PPOTrainer`` (SPMD mode) with ``ProtocolTrainerHooks``, on CPU, two data-parallel
    ranks (``actor.backend="fsdp:d2"``, a process each with torchrun's environment, each with its own
    protocol of ``consumer_batch_size // 2`` groups and its own trace): the FSDP actor trains a tiny
    local Qwen2 for 6 steps; after step 2 both ranks die with episodes in flight and two new ones
    recover through AReaL's ``RecoverHandler``. Only the inference server is faked
    (``tests/areal_ppo_trainer_run.py`` says exactly what is real and what is faked)."""
    python, _ = areal_python
    started = time.perf_counter()
    result = _run_in_venv(python, tmp_path, str(tmp_path / "run"), "6", "2", timeout=900, script=PPO_RUN)
    print(f"real PPOTrainer, two ranks, 6 steps with a recover: {time.perf_counter() - started:.1f} s")
    assert result["steps"] == 6
    # each step the two ranks together trained exactly their consumed batches (2 groups of 2 samples each):
    # AReaL's DistRolloutCoordinator all-gathers them and splits them again by length, so a rank trains
    # whole groups of either rank's batch, all consumed at the step's version
    assert result["trained_is_consumed"] is True and result["samples_per_step"] == [8]
    assert result["prompts_once"] is True  # no prompt trained twice, over both ranks (each draws its own shard)
    for rank in ("0", "1"):
        got = result["ranks"][rank]
        assert got["updates"] == [3, 3]  # PPOTrainer.train ran the actor's PPO update each step, on each rank
        assert got["groups_per_step"] == [2] and min(got["trained_groups_per_step"]) >= 1  # consumed 2, trained at least 1
        assert got["ids_once"] is True and got["prompts_once"] is True  # each consumed id trained once, no prompt twice
        # v <= b <= v + eta on every sample the rank consumed (some one version stale), trained by an actor at b
        assert got["bound_ok"] is True and got["stale"] > 0 and got["actor_at_batch_version"] is True
        # the dump after step 2 holds the rank's protocol at version 3 and its prompts in flight; the rank's
        # second life starts there (protocol, rollout and actor versions) and trains those prompts first
        assert (got["dumped_step"], got["dumped_protocol_version"]) == (2, 3)
        assert got["in_flight_at_death"] > 0 and got["dumped_prompts"]
        resumed = got["resumed"]
        assert (resumed["dp_rank"], resumed["recovered_step"], resumed["protocol_version"], resumed["engine_version"],
                resumed["actor_version"]) == (int(rank), 2, 3, 3, 3)
        assert resumed["retry"] == got["dumped_prompts"] and got["dumped_prompts_kept"] is True
        assert resumed["max_concurrent_rollouts"] == 4  # the rank's share of the trainer's 8, as AReaL's executor takes it
        assert got["final_version"] == 6
        assert got["trace_rc"] == 0 and "accepted" in got["trace"] and "2 segment(s)" in got["trace"]
        assert got["trace_batches"] == list(range(6))  # both lives' consumes: the recover appended, erased nothing
    # the weights the server loaded (rank 0 pushes them): one push per step, each new, and after the recover
    # the push of the restored actor equals the last one before the death (AReaL's DCP checkpoint of the FSDP actor)
    loads = result["weight_loads"]
    assert len(loads) == 7 and loads[3] == loads[2] and len(set(loads)) == 6 and result["initial_weights"] not in loads


# 56-74 s of CI's 15 minutes on 2 cores; the idle rank's recovery stays in CI:
# test_areal_guards_bypasses_and_a_non_head_rank_recovers
@pytest.mark.nightly
def test_areal_real_ppo_trainer_tensor_parallel_recovers_on_a_rank_that_never_consumes(
        areal_python: tuple[Path, float], tmp_path: Path) -> None:
    """The real ``PPOTrainer`` as above with ``actor.backend="fsdp:d1t2"``: tensor parallelism over the two
    ranks (AReaL 1.0.4's FSDP engine builds its device mesh on CPU over gloo), one data-parallel group.
    Rank 0 is its head: it alone draws and consumes (the whole batch of 4 groups); rank 1 trains the batch
    AReaL broadcasts to it and never consumes, so its protocol stays at version 0. After step 1 both die
    with episodes in flight; in the second life ``PPOTrainer.__init__`` calls ``on_version_recovered(2)``
    on both ranks, which passes on rank 1's idle protocol (it raised there before the hooks marked it)."""
    python, _ = areal_python
    started = time.perf_counter()
    result = _run_in_venv(python, tmp_path, str(tmp_path / "run"), "4", "1", "d1t2", timeout=900, script=PPO_RUN)
    print(f"real PPOTrainer, fsdp:d1t2, 4 steps with a recover: {time.perf_counter() - started:.1f} s")
    assert result["steps"] == 4 and result["updates"] == {"0": [2, 2], "1": [2, 2]}
    head, member = result["head"], result["member"]
    assert head["ids_once"] is True and head["bound_ok"] is True and head["stale"] > 0
    assert head["dumped_protocol_version"] == 2 and head["resumed"]["protocol_version"] == 2
    assert head["trace_rc"] == 0 and "2 segment(s)" in head["trace"] and head["trace_batches"] == [0, 1, 2, 3]
    assert member["protocol_versions"] == [0, 0] and member["dumped_protocol_version"] == 0 and member["saved"] == [[], []]
    resumed = member["resumed"]  # the second life of the rank that never consumes: recovered, at the checkpoint's version
    assert (resumed["dp_rank"], resumed["recovered_step"], resumed["protocol_version"], resumed["engine_version"],
            resumed["actor_version"], resumed["retry"]) == (0, 1, 0, 2, 2, [])
    assert member["actor_versions"] == [0, 1, 2, 3] and member["trained_the_heads_batch"] is True and member["trace_rc"] == 0
    loads = result["weight_loads"]  # rank 0 pushes: one per step, and after the recover the restored actor's (the last before)
    assert len(loads) == 5 and loads[2] == loads[1] and len(set(loads)) == 4 and result["initial_weights"] not in loads

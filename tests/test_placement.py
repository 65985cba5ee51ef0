"""Placement of a training job: the plan from the config, refusal naming what the cluster lacks,
and actors that each get their own (logical) GPUs."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import pytest
from skips import require
from staleflow.runtime.settings.config import load_config
from staleflow.runtime.settings.placement_plan import BundlePlan, GroupPlan, PlacementPlan, missing_resources, plan_placement


def _bundles(plan: PlacementPlan) -> dict[str, list[dict[str, float]]]:
    return {g.name: [b.resources() for b in g.bundles] for g in plan.groups}


def test_a_tensor_parallel_instance_has_one_gpu_per_bundle_and_its_engine_actor_takes_no_gpu() -> None:
    """Finding 1 (issue 24): vLLM's Ray executor refuses a bundle with more than one GPU
    (vllm/v1/executor/ray_utils.py, initialize_ray_cluster), and its workers would wait for GPUs
    an engine actor holding all of them never frees. Each TP-2 instance: its own one-node group of
    two {GPU: 1} bundles, the engine actor with num_gpus=0, its workers told which bundles to use."""
    config = load_config(overrides=["rollout.instances=3", "rollout.gpus_per_instance=2", "rollout.cpus_per_instance=4"])
    plan = plan_placement(config)
    assert _bundles(plan) == {f"rollout-{i}": [{"CPU": 4.0, "GPU": 1.0}, {"GPU": 1.0}] for i in range(3)}
    assert {g.strategy for g in plan.groups} == {"STRICT_PACK"}
    actor = plan.actor("rollout-1")
    assert (actor.group, actor.bundle, actor.num_gpus, actor.gpus, actor.worker_bundles) == ("rollout-1", 0, 0.0, 2.0, (0, 1))
    assert actor.environment == {"VLLM_RAY_BUNDLE_INDICES": "0,1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    assert config.rollout.engine_settings()["distributed_executor_backend"] == "ray"
    assert (plan.total_cpus, plan.total_gpus) == (12, 6)


def test_an_instance_wider_than_a_node_spreads_its_workers_over_nodes() -> None:
    plan = plan_placement(load_config(overrides=["rollout.instances=1", "rollout.gpus_per_instance=16", "cluster.gpus_per_node=8"]))
    assert plan.group("rollout-0").strategy == "PACK" and len(plan.group("rollout-0").bundles) == 16
    one_node = plan_placement(load_config(overrides=["rollout.gpus_per_instance=8", "cluster.gpus_per_node=8"]))
    assert one_node.group("rollout-0").strategy == "STRICT_PACK"


def test_a_one_gpu_instance_holds_its_gpu_in_the_actor_and_runs_vllms_engine_core_in_a_process_of_its_own() -> None:
    """Finding 7 (issue 35): with the core in the actor's process, the engine thread of the actor
    would run torch.compile and CUDA-graph capture off the main thread; OpenRLHF and verl run vLLM's
    core in its own process, as `vllm serve` does. A one-GPU instance (or a share of one) does too;
    a CPU instance of tensor-parallel size 1 keeps the in-process core (start-up 2-3 s, not 13-19 s)."""
    for overrides in (["rollout.gpus_per_instance=1"], ["rollout.gpus_per_instance=1", "rollout.instances_per_gpu=2"]):
        config = load_config(overrides=overrides)
        actor = plan_placement(config).actor("rollout-0")
        own_core = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
        assert (actor.num_gpus, actor.worker_bundles, actor.environment) == (config.rollout.gpu_share, (), own_core)
        assert "distributed_executor_backend" not in config.rollout.engine_settings()
    assert plan_placement(load_config()).actor("rollout-0").environment == {}


def test_the_built_in_cpu_job_reserves_nothing_but_token_bundles() -> None:
    plan = plan_placement(load_config())
    assert (plan.total_cpus, plan.total_gpus, len(plan.actors)) == (0, 0, 2)
    assert all(b.resources() == {"CPU": 0.001} for g in plan.groups for b in g.bundles)
    assert [(a.num_cpus, a.num_gpus) for a in plan.actors] == [(0.001, 0), (0.001, 0)]
    assert missing_resources(plan, {"CPU": 2.0}) == []


def test_missing_resources_name_the_resource_the_need_and_the_groups() -> None:
    groups = tuple(GroupPlan(f"rollout-{i}", "STRICT_PACK", (BundlePlan(1, 4, f"rollout-{i}"),)) for i in range(2))
    plan = PlacementPlan(groups, (), None)
    assert missing_resources(plan, {"CPU": 8, "GPU": 8}) == []
    assert missing_resources(plan, {"CPU": 1, "GPU": 6}) == [
        "GPU: the job needs 8 (rollout-0, rollout-1), the cluster has 6",
        "CPU: the job needs 2 (rollout-0, rollout-1), the cluster has 1",
    ]


def test_vllm_settings_resolve_by_device_and_pass_engine_kwargs_through() -> None:
    cpu = load_config().rollout.engine_settings()
    assert cpu == {"dtype": "float32", "enforce_eager": True}
    gpu = load_config(overrides=["rollout.gpus_per_instance=4", "rollout.engine_kwargs={max_num_batched_tokens: 8192}"]).rollout
    assert gpu.engine_settings() == {
        "dtype": "bfloat16", "enforce_eager": False, "tensor_parallel_size": 4, "gpu_memory_utilization": 0.9,
        "distributed_executor_backend": "ray", "max_num_batched_tokens": 8192,
    }


def test_dry_run_prints_config_and_plan_and_starts_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    from staleflow.__main__ import main

    assert main(["train", "--dry-run", "--json", "rollout.gpus_per_instance=2", "cluster.address=ray://head:10001"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["rollout"]["gpus_per_instance"] == 2
    assert out["placement"]["cluster_address"] == "ray://head:10001"
    assert out["placement"]["total_gpus"] == 4 and len(out["placement"]["actors"]) == 2
    import ray

    assert not ray.is_initialized()


def test_train_refuses_a_run_it_cannot_start_or_resume_before_anything_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from staleflow.__main__ import main
    from staleflow.runtime.settings.config import dump_config

    assert main(["train", "--dry-run", "--json", "--system", "sync", "--steps", "3"]) == 0
    config = json.loads(capsys.readouterr().out)["config"]
    assert (config["system"], config["train"]["steps"]) == ("sync", 3)
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "metrics.jsonl").write_text("{}\n", encoding="utf-8")
    (tmp_path / "unsaved").mkdir()
    (tmp_path / "unsaved" / "config.yaml").write_text(dump_config(load_config()), encoding="utf-8")
    refused = {
        f"run directory {tmp_path / 'used'} is not empty; choose another or --resume it": ["--run-dir", str(tmp_path / "used")],
        "--resume takes the config of the run it resumes; give overrides only": ["--resume", str(tmp_path / "unsaved"), "--config", "x"],
        f"{tmp_path / 'unsaved'} has no checkpoint to resume from": ["--resume", str(tmp_path / "unsaved")],
    }
    for message, argv in refused.items():
        assert main(["train", *argv]) == 2
        assert capsys.readouterr().err.startswith(f"staleflow train: {message}")
    import ray

    assert not ray.is_initialized()


def _tensor_parallel_probe() -> dict[str, object]:
    """Runs in an engine actor: what vLLM's Ray executor would find there (its captured placement
    group and the GPUs one worker per bundle gets)."""

    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = ray.util.get_current_placement_group()

    @ray.remote(num_cpus=0, num_gpus=1)
    def worker_gpus() -> str:
        return os.environ.get("CUDA_VISIBLE_DEVICES", "")

    strategies = [PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i) for i in range(len(group.bundle_specs))]
    return {
        "actor_gpus": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        "bundles": group.bundle_specs,
        "worker_gpus": ray.get([worker_gpus.options(scheduling_strategy=s).remote() for s in strategies]),
        "bundle_indices": os.environ.get("VLLM_RAY_BUNDLE_INDICES"),
    }


@pytest.mark.ray
def test_tensor_parallel_engines_capture_their_group_and_their_workers_get_one_gpu_each(ray_cluster) -> None:  # type: ignore[no-untyped-def]
    """Finding 1 on a real Ray cluster (4 logical GPUs): inside each TP-2 engine actor the current
    placement group is the instance's own, of two one-GPU bundles; the actor holds no GPU; a worker
    per bundle gets its own GPU, and the two instances' GPUs do not overlap. A bigger plan is refused
    before any actor starts."""
    import ray
    from staleflow.adapters.ray.placement import PlacementError, RayPlacement

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import the tests folder
    plan = plan_placement(load_config(overrides=["rollout.instances=2", "rollout.gpus_per_instance=2"]))
    placement = RayPlacement(attributes=())  # the shared cluster: 2 CPUs, 4 (logical) GPUs
    try:
        placement.reserve(plan)
        probes = [placement.place_reserved(a.name, _tensor_parallel_probe) for a in plan.actors]
        seen = [{key: probe.get(key) for key in ("actor_gpus", "bundles", "worker_gpus", "bundle_indices")} for probe in probes]
        for probe in seen:
            assert probe["actor_gpus"] == "" and probe["bundle_indices"] == "0,1"
            assert [b["GPU"] for b in probe["bundles"]] == [1.0, 1.0]
        workers = [set(p["worker_gpus"]) for p in seen]
        assert all(len(w) == 2 for w in workers) and not workers[0] & workers[1], seen
        bigger = plan_placement(load_config(overrides=["rollout.instances=3", "rollout.gpus_per_instance=2"]))
        with pytest.raises(PlacementError, match="GPU: the job needs 6 .* the cluster has 4"):
            placement.reserve(bigger)
        assert len(ray.util.list_named_actors()) == 0 and len(placement._actors) == 2  # nothing more started
        # within the cluster's totals but not its free GPUs (the first plan holds all 4): refused in time, its groups removed
        free_plan = plan_placement(load_config(overrides=["rollout.instances=1", "rollout.gpus_per_instance=2"]))
        live = lambda: sorted(g["placement_group_id"] for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED")  # noqa: E731
        held = live()
        with pytest.raises(PlacementError, match=r"could not place the job's 1 placement groups within 2 s \(no node holds a group\? "
                                                 r"the widest is rollout-0: 2 GPU on "):
            placement.reserve(free_plan, timeout_s=2)
        assert live() == held and placement._plan is plan
    finally:
        placement.close()
    assert ray.is_initialized()  # a placement on a cluster it did not start leaves the cluster running


@pytest.mark.ray
def test_train_exits_2_naming_the_missing_gpus_before_any_engine_starts(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    require("vllm", "cpu-infer")  # without it, train refuses earlier
    import ray
    from staleflow.__main__ import main

    code = main([
        "train", "--run-dir", str(tmp_path / "run"), "rollout.gpus_per_instance=1", "cluster.num_gpus=1",
        f"model.tiny_model_dir={tmp_path / 'tiny'}", "metrics.progress=false",
    ])
    err = capsys.readouterr().err
    assert code == 2
    assert "lacks resources for this job: GPU: the job needs 2 (rollout-0, rollout-1), the cluster has 1" in err
    assert not (tmp_path / "run" / "model-v0").exists()  # refused before the warm-up and any engine
    assert not ray.is_initialized()


def test_ray_placed_servers_are_in_the_plan() -> None:
    plan = plan_placement(load_config(overrides=["servers.placement=ray", "servers.cpus=1"]))
    assert [(a.name, a.group, a.num_cpus, a.gpus) for a in plan.actors][2:] == [
        ("trajectory-server", "servers", 1, 0), ("parameter-server", "servers", 1, 0)]
    assert [a.name for a in plan_placement(load_config()).actors] == ["rollout-0", "rollout-1"]


def test_instances_can_share_a_gpu() -> None:
    plan = plan_placement(load_config(overrides=["rollout.gpus_per_instance=1", "rollout.instances_per_gpu=2"]))
    assert [a.gpus for a in plan.actors] == [0.5, 0.5] and plan.total_gpus == 1
    assert missing_resources(plan, {"CPU": 2, "GPU": 1}) == []
    with pytest.raises(Exception, match="instances_per_gpu=2 .* needs rollout.gpus_per_instance=1"):
        load_config(overrides=["rollout.gpus_per_instance=2", "rollout.instances_per_gpu=2"])


def test_fsdp_ranks_with_gpus_come_first_in_the_plan_and_the_smoke_run_fits_one_gpu() -> None:
    import subprocess
    from pathlib import Path

    overrides = ["train.backend=fsdp", "train.world_size=2", "train.gpus=1", "rollout.gpus_per_instance=1"]
    plan = plan_placement(load_config(overrides=overrides))
    assert [(a.name, a.gpus) for a in plan.actors] == [("trainer-0", 1), ("trainer-1", 1), ("rollout-0", 1), ("rollout-1", 1)]
    assert plan.total_gpus == 4
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(["bash", "scripts/gpu-smoke.sh", "--plan"], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "\ntotal: 1 CPU, 1 GPU\n" in out.stdout
    assert "trainer-0         trainer rank      0.5 GPU (actor: 1 CPU, 0.5 GPU)" in out.stdout
    assert "weight_transfer: reference" in out.stdout  # one GPU cannot hold an NCCL sender and its receivers
    with pytest.raises(Exception, match="NCCL refuses two ranks of one group on one GPU; use servers.weight_transfer=reference"):
        load_config(overrides=["train.backend=fsdp", "train.gpus=0.5", "rollout.gpus_per_instance=1", "rollout.instances_per_gpu=4",
                               "servers.placement=ray", "servers.weight_transfer=broadcast"])


@pytest.mark.parametrize(
    ("name", "gpus", "actors"),
    [("qwen2.5-1.5b-gsm8k-8gpu", 8, 10), ("qwen3-30b-a3b-multinode", 64, 30)],
)
def test_the_example_gpu_jobs_pass_the_dry_run(name: str, gpus: int, actors: int, capsys: pytest.CaptureFixture[str]) -> None:
    from pathlib import Path

    from staleflow.__main__ import main

    config = Path(__file__).resolve().parents[1] / "runtime" / "settings" / "configs" / "examples" / f"{name}.yaml"
    assert main(["train", "--config", str(config), "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["placement"]
    assert (plan["total_gpus"], len(plan["actors"])) == (gpus, actors)


def test_megatron_ranks_are_planned_like_fsdp_ranks() -> None:
    overrides = ["train.backend=megatron", "train.world_size=4", "train.tensor_parallel=2", "train.pipeline_parallel=2", "train.gpus=1"]
    plan = plan_placement(load_config(overrides=overrides))
    assert [a.name for a in plan.actors][:4] == ["trainer-0", "trainer-1", "trainer-2", "trainer-3"]
    assert plan.total_gpus == 4  # + the rollout instances, on CPU here


_EIGHT_GPUS = {"CPU": 64, "GPU": 8}


@pytest.mark.parametrize(
    ("overrides", "groups"),
    [
        # one node of 8 GPUs: 6 TP-1 instances + FSDP on 2
        (["rollout.instances=6", "rollout.gpus_per_instance=1", "rollout.cpus_per_instance=4", "train.backend=fsdp",
          "train.world_size=2", "train.gpus=1"],
         {"trainer": [{"CPU": 1.0, "GPU": 1.0}] * 2, **{f"rollout-{i}": [{"CPU": 4.0, "GPU": 1.0}] for i in range(6)}}),
        # 8 GPUs: 2 TP-2 instances + FSDP on 4
        (["rollout.instances=2", "rollout.gpus_per_instance=2", "rollout.cpus_per_instance=4", "train.backend=fsdp",
          "train.world_size=4", "train.gpus=1"],
         {"trainer": [{"CPU": 1.0, "GPU": 1.0}] * 4, **{f"rollout-{i}": [{"CPU": 4.0, "GPU": 1.0}, {"GPU": 1.0}] for i in range(2)}}),
    ],
    ids=["6xTP1+fsdp2", "2xTP2+fsdp4"],
)
def test_one_node_of_eight_gpus_is_planned_bundle_by_bundle(overrides: list[str], groups: dict[str, list[dict[str, float]]]) -> None:
    plan = plan_placement(load_config(overrides=overrides))
    assert _bundles(plan) == groups
    assert plan.total_gpus == 8 and missing_resources(plan, _EIGHT_GPUS) == []
    assert [(a.name, a.bundle) for a in plan.actors if a.group == "trainer"] == [(f"trainer-{r}", r) for r in range(len(groups["trainer"]))]
    assert sum(a.gpus for a in plan.actors) == 8  # every GPU has exactly one user


def test_the_qwen3_moe_example_plans_twelve_tensor_parallel_instances_and_sixteen_ranks() -> None:
    examples = Path(__file__).resolve().parents[1] / "runtime" / "settings" / "configs" / "examples"
    config = load_config(examples / "qwen3-30b-a3b-multinode.yaml")
    plan = plan_placement(config)
    engines = [g for g in plan.groups if g.name.startswith("rollout-") or g.name == "eval"]
    assert len(engines) == 12 and all(len(g.bundles) == 4 and g.strategy == "STRICT_PACK" for g in engines)
    first, rest = {"CPU": 8.0, "GPU": 1.0}, {"GPU": 1.0}
    assert all(b.resources() == (first if i == 0 else rest) for g in engines for i, b in enumerate(g.bundles))
    assert "eval" not in [g.name for g in engines]  # the rollout instances evaluate (task.eval_engine=rollout)
    own = plan_placement(load_config(examples / "qwen3-30b-a3b-multinode.yaml", ["task.eval_engine=own"]))
    assert own.actor("eval").role == "evaluation engine" and own.actor("eval").num_gpus == 0
    assert len(plan.group("trainer").bundles) == 16 and plan.total_gpus == 64


def test_the_evaluation_engine_reserves_its_own_bundle_shaped_like_a_rollout_instance() -> None:
    """Finding 2 (issue 24): the evaluation engine ran on a GPU it never reserved. Now a job that
    evaluates on an engine (prompts from files) plans it like a rollout instance; the built-in task
    (evaluated by the trainer), a job with evaluation off and one evaluating on its rollout
    instances (task.eval_engine=rollout, the default since issue 35) plan none."""
    data = Path(__file__).resolve().parents[1] / "runtime" / "settings" / "configs" / "data"
    files = [f"task.prompt_file={data / 'arithmetic-train.jsonl'}", "rollout.gpus_per_instance=1", "task.eval_engine=own"]
    plan = plan_placement(load_config(overrides=files))
    assert _bundles(plan)["eval"] == _bundles(plan)["rollout-0"] == [{"GPU": 1.0}]
    assert plan.actor("eval").num_gpus == 1.0
    assert "eval" not in _bundles(plan_placement(load_config(overrides=[*files, "task.eval_prompts=0", "task.eval_every=0"])))
    assert "eval" not in _bundles(plan_placement(load_config(overrides=["rollout.gpus_per_instance=1"])))
    assert "eval" not in _bundles(plan_placement(load_config(overrides=[*files[:2]])))


def test_collective_trainer_ranks_may_not_share_a_gpu() -> None:
    """Finding 10 (issue 24): train.gpus=0.5 with world_size 2 packed two NCCL ranks on one GPU,
    which NCCL refuses ("Duplicate GPU detected"); it is refused naming both fields."""
    with pytest.raises(Exception, match=r"train.gpus=0.5 with train.world_size=2: ranks of one collective need a GPU each"):
        load_config(overrides=["train.backend=fsdp", "train.world_size=2", "train.gpus=0.5"])
    assert load_config(overrides=["train.backend=fsdp", "train.world_size=1", "train.gpus=0.5"]).train.gpus == 0.5


def test_a_tensor_parallel_cpu_instance_runs_vllms_multiprocessing_executor() -> None:
    """vLLM's Ray executor refuses the CPU platform ("current platform cpu does not support ray",
    vllm/v1/executor/ray_utils.py), so a CPU instance of tensor-parallel size 2 uses the mp executor
    with its engine core in a process of its own; the actor holds the instance's CPUs."""
    config = load_config(overrides=["rollout.tensor_parallel=2", "rollout.cpus_per_instance=1"])
    assert config.rollout.engine_settings() == {
        "dtype": "float32", "enforce_eager": True, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    actor = plan_placement(config).actor("rollout-0")
    assert (actor.num_cpus, actor.num_gpus, actor.environment) == (1.0, 0.0, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    with pytest.raises(Exception, match="rollout.tensor_parallel=2 differs from rollout.gpus_per_instance=4"):
        load_config(overrides=["rollout.tensor_parallel=2", "rollout.gpus_per_instance=4"])


def test_the_dry_run_shows_every_bundle_its_user_and_the_runs_transfer_dtypes_and_kernels(capsys: pytest.CaptureFixture[str]) -> None:
    from staleflow.__main__ import main

    argv = ["train", "--dry-run", "--json", "rollout.instances=2", "rollout.gpus_per_instance=2", "train.backend=fsdp",
            "train.world_size=4", "train.gpus=1", "servers.placement=ray", "servers.weight_transfer=broadcast",
            "servers.transfer_backend=nccl"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    groups = {g["name"]: g for g in out["placement"]["groups"]}
    assert groups["rollout-1"]["node_constraint"] == "one node"
    assert [(b["gpus"], b["used_by"]) for b in groups["rollout-1"]["bundles"]] == [
        (1.0, "rollout-1 (engine actor and worker 0)"), (1.0, "rollout-1 worker 1")]
    assert [b["used_by"] for b in groups["trainer"]["bundles"]] == ["trainer-0 and parameter-server", "trainer-1", "trainer-2", "trainer-3"]
    run = out["run"]
    assert (run["transfer_backend"], run["transfer_host"], run["wire_dtype"]) == ("nccl", "the parameter server's node IP", "bfloat16")
    assert (run["rollout_dtype"], run["rollout_executor"], run["train_dtype"], run["train_device"]) == ("bfloat16", "ray", "bf16", "cuda")


def test_the_trainers_device_follows_the_config_and_each_rank_checks_its_own_gpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Finding 5 (issue 24): the driver decided the trainer's device from its own torch.cuda, so
    train.gpus=0 on a GPU box asked Ray for GPUs outside the placement group (waiting forever), and a
    CPU-only head with train.gpus=1 trained silently in fp32 on CPU. Now the config decides, each
    rank checks what it sees, and a Ray worker group's call has a deadline."""
    import torch
    from staleflow.adapters.fsdp import trainer as fsdp
    from staleflow.app import job_parts

    built: dict[str, object] = {}
    monkeypatch.setattr(fsdp, "FSDPTrainer", lambda *args, **kwargs: built.update(kwargs))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the driver sees a GPU
    tokens = type("T", (), {"pad_id": 0})()
    job_parts.make_trainer(load_config(overrides=["train.backend=fsdp", "train.world_size=2"]), tmp_path, tokens)  # type: ignore[arg-type]
    assert (built["device"], built["gpus_per_rank"], built["placement_group"]) == ("cpu", 0, None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a rank on a node without CUDA
    with pytest.raises(RuntimeError, match=r"trainer rank 1 was given GPUs \(train.gpus > 0\) but sees no CUDA device"):
        fsdp.rank_device("cuda", 1)
    assert fsdp.rank_device("cpu", 1) == torch.device("cpu")


@pytest.mark.ray
def test_a_ray_worker_group_call_that_gets_no_answer_fails_naming_the_ranks(ray_cluster) -> None:  # type: ignore[no-untyped-def]
    import time

    from staleflow.adapters.rlkit.worker_group import RayWorkers, WorkerGroupError

    workers = RayWorkers(lambda: time, 1, num_cpus=0, timeout_s=300.0)
    try:
        assert workers.call_all("sleep", [(0.0,)]) == [None]  # the actor's start-up, unbounded on a loaded machine
        workers.timeout_s = 2.0
        with pytest.raises(WorkerGroupError, match=r"ranks \[0\] did not answer 'sleep' within 2 s"):
            workers.call_all("sleep", [(30.0,)])
    finally:
        workers.close()


class _RecordedEngine:
    """A fake engine whose start and readiness are recorded in ``events``."""

    def __init__(self, name: str, events: list[str]) -> None:
        self.name, self.events = name, events
        events.append(f"start {name}")

    def idle(self) -> bool:
        self.events.append(f"ready {self.name}")
        return True


def test_engines_on_disjoint_gpus_start_together_and_those_sharing_a_gpu_one_at_a_time() -> None:
    """Issue 35 (finding 7), issue 24 (finding 4): vLLM attributes every change of free GPU memory
    during its start-up profiling to itself, so engines that may share a GPU start one at a time,
    each ready before the next; engines on GPUs of their own (whole-GPU bundles) start together."""
    from staleflow.app.job_parts import start_engines

    events: list[str] = []
    starts = [lambda n=n: _RecordedEngine(n, events) for n in ("e0", "e1", "e2")]
    started = start_engines(starts, [frozenset({"a"}), frozenset({"a"}), frozenset({"b"})])
    assert [e.name for e in started] == ["e0", "e1", "e2"]
    # e1 shares e0's GPU: it starts once e0 is ready; e2 has its own and starts beside e0.
    assert events == ["start e0", "start e2", "ready e0", "start e1", "ready e2", "ready e1"]
    events.clear()
    start_engines(starts[:2], [frozenset(), frozenset()])  # CPU engines: together, nothing waited for
    assert events == ["start e0", "start e1"]


@pytest.mark.parametrize(("overrides", "want"), [
    (["rollout.gpus_per_instance=1"], ["start rollout-0", "start rollout-1", "start rollout-2", "ready rollout-0", "ready rollout-1",
                                       "ready rollout-2"]),
    (["rollout.gpus_per_instance=2", "cluster.gpus_per_node=8"], ["start rollout-0", "start rollout-1", "start rollout-2",
                                                                  "ready rollout-0", "ready rollout-1", "ready rollout-2"]),
    (["rollout.gpus_per_instance=1", "rollout.instances_per_gpu=3"], ["start rollout-0", "ready rollout-0", "start rollout-1",
                                                                      "ready rollout-1", "start rollout-2", "ready rollout-2"]),
    (["rollout.gpus_per_instance=0"], ["start rollout-0", "start rollout-1", "start rollout-2"]),
])
def test_a_job_starts_its_rollout_instances_by_the_gpus_each_holds(overrides: list[str], want: list[str], tmp_path: Path) -> None:
    """The job's own start (:meth:`TrainingJob._start_engines`) with a fake placement: whole-GPU
    instances (one GPU, or a tensor-parallel group of bundles) start together; instances sharing
    GPUs (``rollout.instances_per_gpu``) one at a time; CPU instances together."""
    from staleflow.app.training_job import TrainingJob

    events: list[str] = []

    class Placement:
        def place_reserved(self, name: str, factory: object, *args: object, **kwargs: object) -> _RecordedEngine:
            return _RecordedEngine(name, events)

    job = object.__new__(TrainingJob)
    job.config = load_config(overrides=["rollout.instances=3", *overrides])
    job.tokens = types.SimpleNamespace(eos_id=1)
    job._placement = Placement()
    job.run_dir = tmp_path
    engines = job._start_engines(tmp_path, clock=None, weights_dir=tmp_path)  # type: ignore[arg-type]
    assert [e.instance_id for e in engines] == ["rollout-0", "rollout-1", "rollout-2"]
    assert events == want


_EXAMPLES = Path(__file__).resolve().parents[1] / "runtime" / "settings" / "configs" / "examples"


@pytest.mark.parametrize(
    ("example", "overrides", "bundle_0_cpus", "server_cpus"),
    [
        ("qwen2.5-1.5b-gsm8k-8gpu", [], 1.0, 0),  # transfer_backend auto with GPU instances: nccl
        ("qwen2.5-1.5b-gsm8k-8gpu", ["servers.transfer_backend=nccl"], 1.0, 0),
        ("qwen3-30b-a3b-multinode", [], 5.0, 4.0),  # servers.cpus=4
    ],
    ids=["8gpu-auto", "8gpu-nccl", "qwen3-two-nodes"],
)
def test_a_parameter_server_sending_over_nccl_shares_trainer_rank_0s_bundle_and_gpu(
    example: str, overrides: list[str], bundle_0_cpus: float, server_cpus: float
) -> None:
    """Issue 24, finding 3's open part: with servers.transfer_backend=nccl (or auto with GPU
    instances, whose vLLM workers receive over NCCL) the parameter server's actor sends from a GPU,
    and the plan gave it none (it refused to start). It now shares trainer rank 0's bundle and GPU,
    a tenth of it; the example jobs still fit their GPUs (8; 64)."""
    from staleflow.app.job_preparation import transfer_backend
    from staleflow.runtime.settings.placement_plan import trainer_rank_gpus

    config = load_config(_EXAMPLES / f"{example}.yaml", overrides)
    plan = plan_placement(config)
    assert config.parameter_server_needs_gpu and transfer_backend(config) == "nccl"
    rank_0 = plan.group("trainer").bundles[0]
    assert (rank_0.resources(), rank_0.used_by) == ({"CPU": bundle_0_cpus, "GPU": 1.0}, "trainer-0 and parameter-server")
    server, trainer_0 = plan.actor("parameter-server"), plan.actor("trainer-0")
    assert (server.group, server.bundle, server.num_cpus, server.num_gpus) == ("trainer", 0, server_cpus, 0.1)
    assert (trainer_0.group, trainer_0.bundle, trainer_0.num_cpus, trainer_0.num_gpus) == ("trainer", 0, 1.0, 0.9)
    assert trainer_rank_gpus(config) == (0.9,) + (1.0,) * (config.train.world_size - 1)
    assert [b.used_by for b in plan.group("servers").bundles] == ["trajectory-server"]
    in_bundle_0 = [a for a in plan.actors if (a.group, a.bundle) == ("trainer", 0)]
    assert sum(a.num_gpus for a in in_bundle_0) == rank_0.gpus and sum(a.num_cpus for a in in_bundle_0) == rank_0.cpus
    assert sum(a.gpus for a in plan.actors) == plan.total_gpus  # every GPU has its users, none is counted twice


def test_the_dry_run_names_the_parameter_server_in_trainer_rank_0s_bundle(capsys: pytest.CaptureFixture[str]) -> None:
    from staleflow.__main__ import main

    assert main(["train", "--config", str(_EXAMPLES / "qwen2.5-1.5b-gsm8k-8gpu.yaml"), "--dry-run", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    trainer = next(g for g in out["placement"]["groups"] if g["name"] == "trainer")
    assert [(b["used_by"], b["gpus"]) for b in trainer["bundles"]] == [("trainer-0 and parameter-server", 1.0), ("trainer-1", 1.0)]
    server = next(a for a in out["placement"]["actors"] if a["name"] == "parameter-server")
    assert (server["group"], server["bundle"], server["num_gpus"]) == ("trainer", 0, 0.1)
    assert (out["run"]["transfer_backend"], out["placement"]["total_gpus"]) == ("nccl", 8)


def test_a_gloo_or_cpu_parameter_server_keeps_its_cpu_bundle_and_a_cpu_trainer_gives_an_nccl_one_its_own_gpu() -> None:
    """The CPU default and gloo are unchanged: the servers' CPU-only group, no GPU, every trainer rank
    its whole GPU. With the trainer on CPU, a parameter server sending over NCCL gets a one-GPU bundle."""
    from staleflow.app.job_preparation import transfer_backend
    from staleflow.runtime.settings.placement_plan import trainer_rank_gpus

    gpu_trainer = ["train.backend=fsdp", "train.world_size=2", "train.gpus=1", "servers.placement=ray"]
    for overrides in (
        ["servers.placement=ray", "servers.weight_transfer=broadcast"],  # the CPU job: auto is gloo
        [*gpu_trainer, "servers.weight_transfer=broadcast", "servers.transfer_backend=gloo", "rollout.gpus_per_instance=1"],
        [*gpu_trainer, "servers.transfer_backend=nccl", "rollout.gpus_per_instance=1"],  # reference pulls: no broadcast
    ):
        config = load_config(overrides=overrides)
        plan = plan_placement(config)
        assert [(a.name, a.group, a.bundle, a.num_gpus) for a in plan.actors if a.role.endswith("server")] == [
            ("trajectory-server", "servers", 0, 0), ("parameter-server", "servers", 1, 0)], overrides
        assert all(b.gpus == 0 for b in plan.group("servers").bundles)
        assert trainer_rank_gpus(config) in ((), (1.0, 1.0))
        assert "parameter-server" not in {b.used_by for g in plan.groups if g.name != "servers" for b in g.bundles}
    assert transfer_backend(load_config(overrides=["servers.placement=ray", "servers.weight_transfer=broadcast"])) == "gloo"
    cpu_trainer = load_config(overrides=["servers.placement=ray", "servers.weight_transfer=broadcast", "rollout.gpus_per_instance=1"])
    plan = plan_placement(cpu_trainer)
    assert [b.resources() for b in plan.group("servers").bundles] == [{"CPU": 0.001}, {"GPU": 1.0}]
    assert (plan.actor("parameter-server").num_cpus, plan.actor("parameter-server").num_gpus, plan.total_gpus) == (0, 1.0, 3.0)


class _GpuProbe:
    """A trainer rank or a parameter server stand-in: the GPU ids Ray gave its process."""

    def gpus(self) -> tuple[list[str], str]:
        import ray

        return [str(i) for i in ray.get_gpu_ids()], os.environ.get("CUDA_VISIBLE_DEVICES", "")


@pytest.mark.ray
def test_the_parameter_server_actor_gets_trainer_rank_0s_gpu_on_a_real_ray_cluster(ray_cluster) -> None:  # type: ignore[no-untyped-def]
    """On the shared Ray cluster (4 logical GPUs): trainer rank 0 started as the trainer starts its
    ranks (RayWorkers in the trainer group, the plan's per-rank GPUs) and the parameter server
    started by the plan's actor options see the same GPU; the rollout instances see others."""
    import ray
    from staleflow.adapters.ray.placement import RayPlacement
    from staleflow.adapters.rlkit.worker_group import RayWorkers
    from staleflow.runtime.settings.placement_plan import trainer_rank_gpus

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import the tests folder
    config = load_config(overrides=[
        "train.backend=fsdp", "train.world_size=1", "train.gpus=1", "rollout.instances=2", "rollout.gpus_per_instance=1",
        "servers.placement=ray", "servers.weight_transfer=broadcast", "servers.transfer_backend=nccl",
    ])
    plan = plan_placement(config)
    placement = RayPlacement(attributes=())
    workers = None
    try:
        placement.reserve(plan)
        workers = RayWorkers(_GpuProbe, 1, num_gpus=trainer_rank_gpus(config), placement_group=placement.group_handle("trainer"),
                             timeout_s=300.0)
        [(rank_0_ids, rank_0_visible)] = workers.call_all("gpus")
        server_ids, server_visible = placement.place_reserved("parameter-server", _GpuProbe).gpus()
        engines = [placement.place_reserved(f"rollout-{i}", _GpuProbe).gpus()[0] for i in range(2)]
        assert len(rank_0_ids) == 1 and rank_0_visible == rank_0_ids[0]
        assert (server_ids, server_visible) == (rank_0_ids, rank_0_visible)
        assert all(len(ids) == 1 for ids in engines)
        assert len({rank_0_ids[0], engines[0][0], engines[1][0]}) == 3
    finally:
        if workers is not None:
            workers.close()
        placement.close()


@pytest.mark.parametrize(("gpus_per_instance", "events"), [(1, ["start eval", "ready eval"]), (0, ["start eval"])])
def test_the_evaluation_engine_is_ready_before_make_evaluator_returns_on_gpus(
    gpus_per_instance: int, events: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Finding 4's rest (issue 24): the evaluation engine was placed and not waited for, so the
    trainer (started right after make_evaluator, in TrainingJob.build) allocated GPU memory during
    its profiling. On GPUs it is now ready when make_evaluator returns; on CPU it starts in the
    background as before."""
    import types

    from staleflow.app import evaluation
    from staleflow.runtime.tasks import Prompt

    seen: list[str] = []

    class Engine:
        def idle(self) -> bool:
            seen.append("ready eval")
            return True

    class Placement:
        def place_reserved(self, name: str, factory: object, *args: object, **kwargs: object) -> Engine:
            seen.append(f"start {name}")
            return Engine()

    monkeypatch.setitem(sys.modules, "staleflow.adapters.vllm.engine", types.SimpleNamespace(VLLMEngine=object))
    data = types.SimpleNamespace(train=[Prompt("1+1=", "2")], held_out=[Prompt("2+2=", "4")])
    tokens = types.SimpleNamespace(eos_id=0, encode=lambda text: [1, 2], decode=lambda ids: "")
    config = load_config(overrides=[f"rollout.gpus_per_instance={gpus_per_instance}", "task.eval_engine=own"])
    evaluator = evaluation.make_evaluator(config, tokens, data, Placement(), tmp_path, None, tmp_path, [])  # type: ignore[arg-type]
    try:
        assert seen == events
    finally:
        evaluator.close()


def test_runs_started_in_the_same_second_get_folders_of_their_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default run folder is ``runs/<UTC second>``: a second command in the same second (a dry run
    after a refused start, two jobs launched together) was refused as "not empty"."""
    import datetime as dt

    from staleflow.app import job_preparation

    class SameSecond(dt.datetime):
        @classmethod
        def now(cls, tz: dt.tzinfo | None = None) -> dt.datetime:
            return dt.datetime(2026, 12, 6, 5, 0, 0, tzinfo=tz)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(job_preparation, "datetime", SameSecond)
    first = job_preparation.prepare_job(None, []).run_dir
    assert first == Path("runs") / "20261206-050000"
    first.mkdir(parents=True)
    (first / "metrics.jsonl").write_text("{}\n", encoding="utf-8")
    assert job_preparation.prepare_job(None, []).run_dir == Path("runs") / "20261206-050000-2"

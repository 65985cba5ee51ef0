"""Placement of a training job: the plan from the config, refusal naming what the cluster lacks,
and actors that each get their own (logical) GPUs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from staleflow.runtime.settings.config import load_config
from staleflow.runtime.settings.placement_plan import ActorPlan, PlacementPlan, missing_resources, plan_placement


def test_plan_has_one_actor_per_instance_with_its_tensor_parallel_gpus() -> None:
    plan = plan_placement(load_config(overrides=["rollout.instances=3", "rollout.gpus_per_instance=2", "rollout.cpus_per_instance=4"]))
    assert [(a.name, a.cpus, a.gpus) for a in plan.actors] == [("rollout-0", 4, 2), ("rollout-1", 4, 2), ("rollout-2", 4, 2)]
    assert (plan.total_cpus, plan.total_gpus) == (12, 6)
    assert plan.actors[0].bundle() == {"CPU": 4, "GPU": 2.0}


def test_the_built_in_cpu_job_reserves_nothing_but_token_bundles() -> None:
    plan = plan_placement(load_config())
    assert (plan.total_cpus, plan.total_gpus, len(plan.actors)) == (0, 0, 2)
    assert all(a.bundle() == {"CPU": 0.001} for a in plan.actors)
    assert missing_resources(plan, {"CPU": 2.0}) == []


def test_missing_resources_name_the_resource_the_need_and_the_actors() -> None:
    plan = PlacementPlan((ActorPlan("rollout-0", "rollout instance", 1, 4), ActorPlan("rollout-1", "rollout instance", 1, 4)), None)
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
        "max_num_batched_tokens": 8192,
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


@pytest.mark.ray
def test_each_actor_gets_its_own_gpus_and_a_short_cluster_is_refused_before_any_actor_starts(ray_cluster) -> None:  # type: ignore[no-untyped-def]
    import ray
    from staleflow.adapters.ray.placement import PlacementError, RayPlacement

    plan = plan_placement(load_config(overrides=["rollout.instances=2", "rollout.gpus_per_instance=2"]))
    placement = RayPlacement(attributes=())  # the shared cluster: 2 CPUs, 4 (logical) GPUs
    try:
        placement.reserve(plan)
        devices = [placement.place_reserved(a.name, os.getenv, "CUDA_VISIBLE_DEVICES").strip() for a in plan.actors]
        gpus = [set(d.split(",")) for d in devices]
        assert all(len(g) == 2 for g in gpus) and not gpus[0] & gpus[1], devices
        bigger = plan_placement(load_config(overrides=["rollout.instances=3", "rollout.gpus_per_instance=2"]))
        with pytest.raises(PlacementError, match="GPU: the job needs 6 .* the cluster has 4"):
            placement.reserve(bigger)
        assert len(ray.util.list_named_actors()) == 0 and len(placement._actors) == 2  # nothing more started
    finally:
        placement.close()
    assert ray.is_initialized()  # a placement on a cluster it did not start leaves the cluster running


@pytest.mark.ray
def test_train_exits_2_naming_the_missing_gpus_before_any_engine_starts(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm (cpu-infer extra) is not installed: train refuses earlier")
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
    assert [(a.name, a.cpus, a.gpus) for a in plan.actors][2:] == [("trajectory-server", 1, 0), ("parameter-server", 1, 0)]
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
    assert out.stdout.rstrip().endswith("total: 1 CPU, 1 GPU")
    assert "trainer-0         trainer rank      1 CPU, 0.5 GPU" in out.stdout


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

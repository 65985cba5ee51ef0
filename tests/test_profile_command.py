"""``staleflow profile`` (pooling, the command on real vLLM-CPU)."""

from __future__ import annotations

import argparse
import json

import pytest
from skips import needs
from staleflow.app.profile import pool_steps
from staleflow.cli.profile import add_arguments, run
from staleflow.runtime.coordination.cost_model import CostModel, ProfileRecord


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


def test_pool_steps_takes_the_lower_quartile_of_each_quarter():
    steps = [ProfileRecord(4, 100 + i, latency) for i, latency in enumerate([1, 2, 3, 9, 4, 4, 4, 4])]
    points = pool_steps(steps, groups=2)
    assert [(p.n, p.kv_tokens) for p in points] == [(4, 102), (4, 106)]  # mean K of 100..103, 104..107
    assert points[0].latency == pytest.approx(1.75)  # quartile of 1, 2, 3, 9: slow outliers do not count
    assert points[1].latency == pytest.approx(4.0)


def test_bad_grid_arguments_are_named(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--batch-sizes", "4,x"])
    assert "comma-separated integers" in capsys.readouterr().err
    args = _parser().parse_args(["--prompt-lengths", "500", "--decode-tokens", "64"])
    assert run(args) == 2
    assert "exceeds --max-model-len 512" in capsys.readouterr().err


@pytest.mark.vllm
@pytest.mark.slow
@needs("vllm", "cpu-infer")
def test_profile_measures_a_real_engine_and_writes_loadable_coefficients(tmp_path, capsys):
    from staleflow.app.tiny_model import ensure_tiny_model

    model = ensure_tiny_model(tmp_path / "model")
    out = tmp_path / "cost.json"
    args = _parser().parse_args(
        ["--model", str(model), "--out", str(out), "--json", "--batch-sizes", "1,8,32",
         "--prompt-lengths", "16,96", "--decode-tokens", "16"]
    )
    assert run(args) == 0
    result = json.loads(capsys.readouterr().out)
    points = result["points"]
    assert len(points) == 3 * 2 * 4  # grid x quarters
    assert sorted({p["n"] for p in points}) == [1, 8, 32]
    assert all(p["latency"] > 0 for p in points)
    # K grows within a batch: each batch's 4 points are in increasing K
    for batch in range(6):
        ks = [p["kv_tokens"] for p in points[4 * batch : 4 * batch + 4]]
        assert ks == sorted(ks) and ks[0] >= points[4 * batch]["n"] * 16
    assert result["fit"]["records"] == 24
    assert result["reload_ms"] > 0 and result["peak_tokens_per_s"] > 0
    assert CostModel.load(out).to_dict() == result["coefficients"]


class _EngineBuilt(Exception):
    """Raised by the stand-in engine once it has recorded the arguments it was built with."""


def _record_engine_arguments(monkeypatch: pytest.MonkeyPatch) -> dict:
    import staleflow.adapters.vllm.engine as engine_module

    seen: dict = {}

    def fake_engine(instance_id, model, **kwargs):
        seen.update(kwargs)
        raise _EngineBuilt

    monkeypatch.setattr(engine_module, "VLLMEngine", fake_engine)
    return seen


def test_profile_builds_the_engine_with_the_runs_rollout_dtype_and_cuda_graphs(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A GPU job's instances run bf16 with CUDA graphs: the profiled engine must too, not fp32 eager."""
    from staleflow.app.tiny_model import TinyModelSpec, ensure_tiny_model

    seen = _record_engine_arguments(monkeypatch)
    model = ensure_tiny_model(tmp_path / "tiny", TinyModelSpec())
    args = _parser().parse_args(["rollout.gpus_per_instance=1", "rollout.gpu_memory_utilization=0.5", "--model", str(model),
                                 "--out", str(tmp_path / "cm.json")])
    with pytest.raises(_EngineBuilt):
        run(args)
    assert seen["engine_kwargs"] == {"dtype": "bfloat16", "enforce_eager": False, "gpu_memory_utilization": 0.5, "tensor_parallel_size": 1}
    seen.clear()
    with pytest.raises(_EngineBuilt):  # the built-in (CPU) job: fp32 eager, as its instances run
        run(_parser().parse_args(["--model", str(model), "--out", str(tmp_path / "cm.json")]))
    assert seen["engine_kwargs"] == {"dtype": "float32", "enforce_eager": True}


def test_profile_refuses_a_config_that_does_not_load(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    assert run(_parser().parse_args(["rollout.dtype=int3", "--out", str(tmp_path / "cm.json")])) == 2
    assert "rollout.dtype" in capsys.readouterr().err

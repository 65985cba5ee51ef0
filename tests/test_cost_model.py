"""The cost model: latency formula, throughput, least-squares fit with its error report, files."""

from __future__ import annotations

import json

import numpy as np
import pytest
from staleflow.runtime.coordination.cost_model import (
    CostModel,
    fit_cost_model,
    fit_cost_model_file,
    load_profile_records,
)

QWEN7B = CostModel(thr=0.0064, o_b=0.0027, o_k=1.231e-4, a_b=0.0028, a_k=3.35e-8)


def test_latency_and_throughput_by_hand() -> None:
    # n = 10: max(0.0064, 0.0027 + 0.001231) = 0.0064 (memory-bound floor)
    assert QWEN7B.step_latency(10, 100_000) == pytest.approx(0.0028 + 0.00335 + 0.0064)
    # n = 100: 0.0027 + 0.01231 = 0.01501 > thr
    assert QWEN7B.step_latency(100, 0) == pytest.approx(0.0028 + 0.01501)
    assert QWEN7B.throughput(100, 0) == pytest.approx(100 / 0.01781)
    assert QWEN7B.throughput(0, 0) == 0.0


def sample_records(model: CostModel, noise: float, count: int = 300, seed: int = 0) -> list[tuple[int, int, float]]:
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(count):
        n = int(rng.integers(1, 256))
        kv = int(n * rng.uniform(200, 20_000))
        records.append((n, kv, model.step_latency(n, kv) * float(rng.lognormal(0, noise)) if noise else model.step_latency(n, kv)))
    return records


def test_fit_recovers_exact_coefficients_in_canonical_form() -> None:
    model, report = fit_cost_model(sample_records(QWEN7B, noise=0))
    assert report.records == 300 and report.mean_relative_error < 1e-6
    # only a_b + thr and a_b + o_b are identifiable: the fit puts the shared base in a_b
    assert min(model.thr, model.o_b) == 0.0
    assert model.a_b + model.thr == pytest.approx(QWEN7B.a_b + QWEN7B.thr, rel=1e-6)
    assert model.a_b + model.o_b == pytest.approx(QWEN7B.a_b + QWEN7B.o_b, rel=1e-6)
    assert model.o_k == pytest.approx(QWEN7B.o_k, rel=1e-6)
    assert model.a_k == pytest.approx(QWEN7B.a_k, rel=1e-6)


def test_fit_reports_the_error_of_noisy_profiles() -> None:
    model, report = fit_cost_model(sample_records(QWEN7B, noise=0.1))
    assert 0.05 < report.mean_relative_error < 0.12
    assert report.max_relative_error > report.mean_relative_error
    assert model.a_k == pytest.approx(QWEN7B.a_k, rel=0.1)


def test_fit_refuses_bad_records() -> None:
    with pytest.raises(ValueError, match="at least 5"):
        fit_cost_model([(1, 10, 0.01)] * 3)
    with pytest.raises(ValueError, match="record 1: need n >= 1"):
        fit_cost_model([(1, 10, 0.01), (0, 10, 0.01)] * 3)
    with pytest.raises(ValueError, match="missing key 'latency'"):
        fit_cost_model([{"n": 1, "kv_tokens": 3}] * 5)


def test_coefficients_must_be_finite_and_non_negative() -> None:
    with pytest.raises(ValueError, match="a_k must be >= 0"):
        CostModel(thr=0.01, o_b=0, o_k=0, a_b=0, a_k=-1)
    with pytest.raises(ValueError, match="thr must be a finite number"):
        CostModel(thr=float("nan"), o_b=0, o_k=0, a_b=0, a_k=0)


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_save_and_load_round_trip(tmp_path, suffix: str) -> None:
    path = tmp_path / f"cost{suffix}"
    QWEN7B.save(path)
    assert CostModel.load(path) == QWEN7B


def test_load_names_missing_and_unknown_keys(tmp_path) -> None:
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"thr": 0.01, "o_b": 0, "o_k": 0, "a_b": 0, "attn_k": 1}))
    with pytest.raises(ValueError, match=r"missing a_k; unknown key\(s\) attn_k"):
        CostModel.load(path)


def test_fit_from_jsonl_and_csv_files(tmp_path) -> None:
    records = sample_records(QWEN7B, noise=0.05, count=60)
    jsonl = tmp_path / "profile.jsonl"
    jsonl.write_text("".join(json.dumps({"n": n, "kv_tokens": k, "latency": latency}) + "\n" for n, k, latency in records))
    csv_path = tmp_path / "profile.csv"
    csv_path.write_text("n,kv_tokens,latency\n" + "".join(f"{n},{k},{latency}\n" for n, k, latency in records))
    assert len(load_profile_records(jsonl)) == 60
    _, report_a = fit_cost_model_file(jsonl)
    _, report_b = fit_cost_model_file(csv_path)
    assert report_a.mean_relative_error == pytest.approx(report_b.mean_relative_error, rel=1e-6)
    assert report_a.mean_relative_error < 0.06
    bad = tmp_path / "bad.csv"
    bad.write_text("n,kv\n1,2\n")
    with pytest.raises(ValueError, match="CSV header lacks kv_tokens, latency"):
        load_profile_records(bad)

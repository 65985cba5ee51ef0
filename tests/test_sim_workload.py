"""Workload files: the shipped ones load; bad files fail with the key named; lengths and the upper bound."""

from __future__ import annotations

import pytest
import yaml
from staleflow.cli.upper_bound import upper_bound
from staleflow.runtime.workload import (
    GROUP_LENGTHS_KEY,
    WorkloadError,
    load_workload,
    resolve_workload_path,
    shipped_workloads,
)

PAPER = [
    "deepseek-r1-distill-qwen-14b-64gpu",
    "deepseek-r1-distill-qwen-32b-128gpu",
    "qwen2.5-32b-128gpu",
    "qwen3-30b-a3b-128gpu",
]


def test_shipped_workloads_load_with_their_gpu_counts() -> None:
    assert set(PAPER) | {"small-ci"} <= set(shipped_workloads())
    gpus = {name: load_workload(name).gpus for name in PAPER}
    assert gpus == {PAPER[0]: 64, PAPER[1]: 128, PAPER[2]: 128, PAPER[3]: 128}
    qwen3 = load_workload("qwen3-30b-a3b-128gpu").build_cost_model()
    assert (qwen3.a_k, qwen3.a_b, qwen3.o_k, qwen3.thr) == (7.28e-8, 1.72e-3, 1.25e-4, 1.07e-2)


def test_paper_like_lengths_have_mean_9700_and_max_40960() -> None:
    stats = load_workload("qwen3-30b-a3b-128gpu").length_stats(seed=1)
    assert stats["mean"] == pytest.approx(9700, rel=0.02)
    assert stats["max"] == 40960
    assert stats["p50"] < stats["mean"] < stats["p99"]  # long-tailed


def test_prompt_groups_are_deterministic_and_carry_lengths() -> None:
    workload = load_workload("small-ci")
    first = next(workload.prompt_groups(seed=3))
    again = next(workload.prompt_groups(seed=3))
    assert first.group_id == "g0" and first.n_samples == workload.batch.group_size
    assert first.metadata[GROUP_LENGTHS_KEY] == again.metadata[GROUP_LENGTHS_KEY]
    assert len(first.metadata[GROUP_LENGTHS_KEY]) == workload.batch.group_size
    assert all(1 <= n <= workload.response_tokens.max for n in first.metadata[GROUP_LENGTHS_KEY])
    assert len(first.prompt_ids) == workload.prompt_tokens


def write(tmp_path, mutate) -> str:
    data = yaml.safe_load(resolve_workload_path("small-ci").read_text())
    mutate(data)
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["cluster"].pop("rollout_instances"), "cluster.rollout_instances: Field required"),
        (lambda d: d["cost_model"].update(a_k=-1), "cost_model.a_k: Input should be greater than or equal to 0"),
        (lambda d: d["batch"].update(groups=3), "batch.groups: Extra inputs are not permitted"),
        (lambda d: d["response_tokens"].update(distribution="pareto"), "response_tokens: Input tag 'pareto'"),
        (lambda d: d["response_tokens"].update(mean=5000), "need min < mean < max"),
        (lambda d: d["instance"].update(kv_capacity_tokens=1000), "cannot hold the longest request"),
    ],
)
def test_bad_workloads_name_the_key(tmp_path, mutate, message: str) -> None:
    with pytest.raises(WorkloadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_workload(write(tmp_path, mutate))


def test_unreadable_and_unknown_workloads(tmp_path) -> None:
    with pytest.raises(WorkloadError, match="no shipped workload by that name"):
        load_workload("nope")
    path = tmp_path / "x.yaml"
    path.write_text("a: [1")
    with pytest.raises(WorkloadError, match="not valid YAML"):
        load_workload(path)
    path.write_text("- 1\n")
    with pytest.raises(WorkloadError, match="expected a mapping"):
        load_workload(path)


def test_upper_bound_by_hand_on_fixed_lengths(tmp_path) -> None:
    def fixed(d: dict) -> None:
        d["response_tokens"] = {"distribution": "fixed", "tokens": 1000}
        d["instance"].update(prefill_s_per_token=0.0, max_running=32, kv_capacity_tokens=40_000)

    workload = load_workload(write(tmp_path, fixed))
    bound = upper_bound(workload)
    # k = P + E[R^2] / (2 E[R]) = 64 + 500; n* = min(32, 40000 / 564) = 32
    assert bound.mean_kv_per_request == pytest.approx(564)
    assert bound.best_running == 32
    per_instance = workload.build_cost_model().throughput(32, 32 * 564)
    assert bound.rollout_tokens_per_s == pytest.approx(4 * per_instance)
    train = 16 * 4 * 1000 / (0.2 + 2e-5 * 16 * 4 * 1064)
    assert bound.training_tokens_per_s == pytest.approx(train)
    assert bound.tokens_per_s == pytest.approx(min(train, 4 * per_instance))

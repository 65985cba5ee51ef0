"""Workload files: the shipped ones load; bad files fail with the key named; lengths and the upper bound."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from staleflow.app.upper_bound import upper_bound
from staleflow.runtime.settings.workload import (
    REQUEST_LENGTH_KEY,
    RETRIES,
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
#: Each paper workload: (GPUs, rollout GPUs, batch, group size, response cap) and where the batch,
#: the cap and the split come from (the authors' scripts, psrl commit 968b836; Fig. 25 for Qwen3's cap).
PAPER_SETTINGS = {
    "deepseek-r1-distill-qwen-14b-64gpu": ((64, 32, 128, 16, 20480), ("14b_ours.sh", "line 59", "line 53", "line 36")),
    "deepseek-r1-distill-qwen-32b-128gpu": ((128, 64, 128, 16, 20480), ("32b_greedy.sh", "line 62", "line 56", "lines 36-44")),
    "deepseek-r1-distill-qwen-32b-128gpu-b32": ((128, 64, 64, 16, 20480), ("setup.txt", "line 62", "line 56", "lines 36-44")),
    "qwen2.5-32b-128gpu": ((128, 64, 64, 16, 20480), ("setup.txt", "line 62", "line 56", "lines 36-44")),
    "qwen3-30b-a3b-128gpu": ((128, 64, 128, 16, 40960), ("moe_ours.sh", "lines 61, 63", "Fig. 25", "lines 35-43")),
    "qwen3-30b-a3b-128gpu-cap20k": ((128, 64, 128, 16, 20480), ("moe_ours.sh", "line 55")),
}

#: The authors' script each paper workload is drawn from (psrl 968b836): its GPUs and its prompts per
#: step (``train_prompt_bsz``; 16 responses each), for the shipped workloads and the held-out ones
#: that run a script as it is (docs/workloads/).
SCRIPT_BATCHES = {
    "deepseek-r1-distill-qwen-14b-64gpu": (64, 128),  # 14b_ours.sh
    "deepseek-r1-distill-qwen-32b-128gpu": (64, 64),  # 32b_greedy.sh
    "deepseek-r1-distill-qwen-32b-128gpu-b32": (64, 32),  # background/rl_workload/setup.txt
    "qwen2.5-32b-128gpu": (64, 32),  # setup.txt, its Qwen2.5-32B alternative
    "qwen3-30b-a3b-128gpu": (64, 64),  # moe_ours.sh
    "qwen3-30b-a3b-128gpu-cap20k": (64, 64),  # moe_ours.sh
    "docs/workloads/qwen3-30b-a3b-64gpu.yaml": (64, 64),  # moe_ours.sh
    "docs/workloads/deepseek-r1-distill-qwen-32b-64gpu.yaml": (64, 64),  # 32b_greedy.sh
}


def test_every_paper_workload_keeps_its_scripts_prompts_per_gpu() -> None:
    """One batch-scaling rule for every paper workload (docs/simulation.md): the batch of the script
    it is drawn from, scaled by its GPUs over the script's (Qwen3 and R1-Distill-32B alike run twice
    the script's prompts on 128 GPUs), with the script's 16 responses a prompt."""
    root = Path(__file__).resolve().parents[1]
    for name, (script_gpus, script_prompts) in SCRIPT_BATCHES.items():
        workload = load_workload(root / name if name.endswith(".yaml") else name)
        assert workload.batch.groups_per_step * script_gpus == script_prompts * workload.gpus, name
        assert workload.batch.group_size == 16, name
    assert set(PAPER_SETTINGS) <= set(SCRIPT_BATCHES)


def test_shipped_workloads_load_with_their_gpu_counts() -> None:
    assert set(PAPER) | {"small-ci"} <= set(shipped_workloads())
    gpus = {name: load_workload(name).gpus for name in PAPER}
    assert gpus == {PAPER[0]: 64, PAPER[1]: 128, PAPER[2]: 128, PAPER[3]: 128}


@pytest.mark.parametrize("name", sorted(PAPER_SETTINGS))
def test_paper_workloads_take_batch_cap_and_split_from_the_authors_scripts(name: str) -> None:
    """Every shipped paper workload loads with the batch, cap and split of the authors' scripts, and
    its header names the script (at psrl 968b836) and the lines each figure comes from."""
    workload = load_workload(name)
    shape, citations = PAPER_SETTINGS[name]
    split = workload.gpus - workload.cluster.trainer_gpus
    assert (workload.gpus, split, workload.batch.groups_per_step, workload.batch.group_size,
            workload.response_tokens.max) == shape
    assert workload.prompt_tokens + workload.response_tokens.max <= 32768 or name == "qwen3-30b-a3b-128gpu"
    header = " ".join(line for line in resolve_workload_path(name).read_text().splitlines() if line.startswith("#"))
    assert "968b836" in header and all(citation in header for citation in citations), header
    shipped_paper = {n for n in shipped_workloads() if not n.startswith("small-ci")}
    assert shipped_paper == set(PAPER_SETTINGS)
    qwen3 = load_workload("qwen3-30b-a3b-128gpu").build_cost_model()
    # the authors' qwen_moe_30b.json, TP1_PP1; the paper's Table 4 is k2 = thr - o_b, k4 = o_b + a_b
    assert (qwen3.thr, qwen3.o_b, qwen3.o_k, qwen3.a_b, qwen3.a_k) == (0.0115108, 0.0097899, 1.249e-4, 8.671926e-4, 7.28e-8)
    assert qwen3.thr - qwen3.o_b == pytest.approx(1.72e-3, rel=0.01) and qwen3.o_b + qwen3.a_b == pytest.approx(1.07e-2, rel=0.01)


def test_kv_capacity_is_derived_from_gpu_memory_minus_weights(tmp_path) -> None:
    """Qwen3-30B-A3B on one H20: 0.9 x 96 GB - 3 GB - 61.1 GB = 22.3 GB at 98,304 B/token (the
    reference note's ~224k); the 32B models on two GPUs: 2 x 83.4 - 65.5 = 101.3 GB at 262,144 B/token."""
    qwen3 = load_workload("qwen3-30b-a3b-128gpu")
    assert qwen3.cluster.gpus_per_instance == 1 and qwen3.cluster.rollout_instances == 64
    assert qwen3.instance.kv_capacity_tokens == int(22.3e9 // 98304) == 226_847
    assert load_workload("deepseek-r1-distill-qwen-32b-128gpu").instance.kv_capacity_tokens == int(101.3e9 // 262144)
    assert load_workload("deepseek-r1-distill-qwen-14b-64gpu").instance.kv_capacity_tokens == int(53.9e9 // 196608)
    data = yaml.safe_load(resolve_workload_path("qwen3-30b-a3b-128gpu").read_text())
    data["instance"]["kv_capacity_tokens"] = 1000
    path = tmp_path / "both.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(WorkloadError, match="kv_capacity_tokens or memory, not both"):
        load_workload(path)
    data["instance"].pop("kv_capacity_tokens")
    data["instance"]["memory"]["weights_gb"] = 80.0  # nothing left for the KV cache
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(WorkloadError, match="cannot hold the longest request"):
        load_workload(path)


def test_a_prompts_difficulty_is_shared_by_its_group() -> None:
    """With prompt_sigma, lengths correlate within a group (log-length variance between groups is
    prompt_sigma^2 of the total), while the marginal keeps its mean and its truncation share."""
    import numpy as np

    workload = load_workload("qwen3-30b-a3b-128gpu")
    spec = workload.response_tokens
    groups = workload.prompt_groups(seed=3)
    logs = np.log([_lengths(next(groups).sample_metadata) for _ in range(3000)])
    between = logs.mean(axis=1).var()
    assert between == pytest.approx(spec.prompt_sigma**2 + (spec.sigma**2 - spec.prompt_sigma**2) / 16, rel=0.15)
    stats = workload.length_stats(seed=1)
    assert stats["mean"] == pytest.approx(9700, rel=0.02)
    assert stats["truncated"] == pytest.approx(spec.truncated_share(), abs=0.002) and 0.01 < stats["truncated"] < 0.02


def test_paper_like_lengths_have_mean_9700_and_max_40960() -> None:
    stats = load_workload("qwen3-30b-a3b-128gpu").length_stats(seed=1)
    assert stats["mean"] == pytest.approx(9700, rel=0.02)
    assert stats["max"] == 40960
    assert stats["p50"] < stats["mean"] < stats["p99"]  # long-tailed


def _lengths(samples: list[dict]) -> list[int]:
    return [sample[REQUEST_LENGTH_KEY] for sample in samples]


def test_prompt_groups_are_deterministic_and_carry_lengths() -> None:
    """Each sample's drawn length is in its sample metadata, the retries' in ``resamples``; the
    group's own metadata holds only the response cap."""
    workload = load_workload("small-ci")
    first = next(workload.prompt_groups(seed=3))
    again = next(workload.prompt_groups(seed=3))
    assert first.group_id == "g0" and first.n_samples == workload.batch.group_size
    assert first.sample_metadata == again.sample_metadata and first.resamples == again.resamples
    assert first.metadata == {"max_new_tokens": workload.response_tokens.max}
    assert len(first.resamples) == RETRIES
    for samples in (first.sample_metadata, *first.resamples):
        assert len(samples) == workload.batch.group_size
        assert all(1 <= n <= workload.response_tokens.max for n in _lengths(samples))
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


def test_latency_aware_bound_by_hand_on_fixed_lengths(tmp_path) -> None:
    """Every response 1,000 tokens: the batch's longest decoded alone takes prefill(P) + 1,000 steps of
    L(1, P + t); eta + 1 periods hold it and a training step, so a period is at least
    (D + t_train) / (eta + 1). At eta 0 that is below the throughput bound; by eta 3 it is not."""
    from staleflow.app.upper_bound import latency_bound

    def fixed(d: dict) -> None:
        d["response_tokens"] = {"distribution": "fixed", "tokens": 1000}
        d["instance"].update(prefill_s_per_token=1e-4, max_running=32, kv_capacity_tokens=40_000)

    workload = load_workload(write(tmp_path, fixed))
    bound = upper_bound(workload)
    cost = workload.build_cost_model()
    alone = 64 * 1e-4 + sum(cost.step_latency(1, 64 + t) for t in range(1000))
    train = 0.2 + 2e-5 * 16 * 4 * 1064  # base + per token over 16 x 4 trajectories of 64 + 1000 tokens
    for eta in (0, 3):
        latency = latency_bound(workload, eta, bound)
        assert latency.longest_decode_s == pytest.approx(alone) and latency.training_s == pytest.approx(train)
        assert latency.latency_tokens_per_s == pytest.approx(16 * 4 * 1000 * (eta + 1) / (alone + train))
        assert latency.tokens_per_s == pytest.approx(min(bound.tokens_per_s, latency.latency_tokens_per_s))
    assert latency_bound(workload, 0, bound).tokens_per_s < bound.tokens_per_s == latency_bound(workload, 3, bound).tokens_per_s
    with pytest.raises(ValueError, match="eta must be >= 0"):
        latency_bound(workload, -1, bound)


def test_latency_aware_bound_of_the_paper_workloads() -> None:
    """docs/simulation.md's table: on Qwen3-30B-A3B at 40,960 the latency bound binds at eta 1
    (40,721 tokens/s against 48,894: a batch's longest response alone takes 570 s), at 20,480 it does
    not; on Qwen2.5-32B (64 x 16) it binds at eta 1 only."""
    from staleflow.app.upper_bound import latency_bound

    def figures(name: str, eta: int) -> tuple[float, float, float]:
        workload = load_workload(name)
        bound = upper_bound(workload)
        latency = latency_bound(workload, eta, bound)
        return bound.tokens_per_s, latency.latency_tokens_per_s, latency.longest_decode_s

    throughput, latency, longest = figures("qwen3-30b-a3b-128gpu", 1)
    assert (round(throughput, -1), round(latency, -1), round(longest)) == (48890, 40720, 570)
    throughput, latency, _ = figures("qwen3-30b-a3b-128gpu-cap20k", 1)
    assert latency > throughput
    throughput, latency, _ = figures("qwen2.5-32b-128gpu", 1)
    assert round(latency, -1) == 8110 < throughput
    throughput, latency, _ = figures("qwen2.5-32b-128gpu", 2)
    assert latency > throughput


def test_the_length_models_clip_ratio_and_icc() -> None:
    """docs/simulation.md's table of the length model's tail: the share cut at the cap and the
    prompt's share of the log-length variance, per paper workload."""
    expected = {"qwen3-30b-a3b-128gpu-cap20k": (0.096, 0.39), "qwen3-30b-a3b-128gpu": (0.015, 0.39),
                "qwen2.5-32b-128gpu": (0.008, 0.31), "deepseek-r1-distill-qwen-32b-128gpu": (0.096, 0.39),
                "deepseek-r1-distill-qwen-14b-64gpu": (0.063, 0.39)}
    for name, (clip, icc) in expected.items():
        lengths = load_workload(name).response_tokens
        assert round(load_workload(name).length_stats()["truncated"], 3) == clip, name
        assert round(lengths.prompt_sigma**2 / lengths.sigma**2, 2) == icc, name


def _flops_training(d: dict) -> None:
    d["training"] = {"base_s": 1.0, "active_params": 1e9, "mfu": 0.5, "gpu_tflops": 100, "attn_flops_per_token2": 1000}
    d["cluster"]["trainer_gpus"] = 2


def test_training_time_from_flops_by_hand(tmp_path) -> None:
    workload = load_workload(write(tmp_path, _flops_training))
    training = workload.training
    # 8 FLOPs per active parameter per token (forward 2, backward 4, log-prob recompute 2) over
    # 0.5 x 100 TFLOP/s x 2 GPUs = 1e14 FLOP/s: 8e9 / 1e14 = 8e-5 s per token
    assert training.seconds_per_token(2) == pytest.approx(8e-5)
    # attention: 4 passes x 1000 FLOPs per pair x c^2 / 2 pairs: 2000 c^2 / 1e14
    assert training.seconds_per_token2(2) == pytest.approx(2e-11)
    assert training.step_time(10_000, 2, 1e8) == pytest.approx(1.0 + 0.8 + 2e-3)
    # the simulated trainer times a batch on the workload's trainer GPUs, per trajectory length
    from staleflow.adapters.sim.trainer import SimTrainer
    from staleflow.runtime.run.clock import VirtualClock
    from staleflow.runtime.types import TrainingBatch, Trajectory

    trajectories = [Trajectory(f"r{k}", "g", [1] * 64, [2] * 936, [0.0] * 936, [0] * 936, "stop") for k in range(4)]
    clock = VirtualClock()
    trainer = SimTrainer.from_workload(workload, clock)
    trainer.start_step(TrainingBatch(0, {"g": trajectories}))
    clock.sleep_until(100.0)
    result = trainer.poll()
    assert result is not None and result.metrics["step_time_s"] == pytest.approx(1.0 + 8e-5 * 4000 + 2e-11 * 4 * 1000**2)
    # without the old log-prob recompute (verl fully async): 6 FLOPs per parameter, 3 attention passes
    assert training.seconds_per_token(2, recompute=False) == pytest.approx(6e-5)
    assert training.seconds_per_token2(2, recompute=False) == pytest.approx(1.5e-11)
    lean = SimTrainer.from_workload(workload, clock, recompute=False)
    lean.start_step(TrainingBatch(0, {"g": trajectories}))
    clock.sleep_until(200.0)
    result = lean.poll()
    assert result is not None and result.metrics["step_time_s"] == pytest.approx(1.0 + 6e-5 * 4000 + 1.5e-11 * 4 * 1000**2)
    # re-split: twice the trainer GPUs halve the FLOPs part; the total stays
    wide = load_workload("qwen3-30b-a3b-128gpu")
    narrow = wide.with_rollout_gpus(96)
    assert (narrow.cluster.rollout_instances, narrow.cluster.trainer_gpus, narrow.gpus) == (96, 32, 128)
    # named by its split, so results of another split never merge with the workload's own
    assert (narrow.name, wide.with_rollout_gpus(64) is wide) == ("qwen3-30b-a3b-128gpu@96", True)
    assert narrow.training.seconds_per_token(narrow.cluster.trainer_gpus) == pytest.approx(
        2 * wide.training.seconds_per_token(wide.cluster.trainer_gpus))
    with pytest.raises(WorkloadError, match="rollout GPUs must be a multiple of gpus_per_instance \\(2\\)"):
        load_workload("qwen2.5-32b-128gpu").with_rollout_gpus(33)
    with pytest.raises(WorkloadError, match="from 1 to 127"):
        wide.with_rollout_gpus(128)


@pytest.mark.parametrize(
    "training, message",
    [
        ({"active_params": 1e9, "mfu": 0.3}, "training: Value error, the FLOPs model needs gpu_tflops"),
        ({"per_token_s": 1e-5, "active_params": 1e9}, "give per_token_s or the FLOPs model .* not both"),
        ({"active_params": 1e9, "mfu": 1.5, "gpu_tflops": 148}, "training.mfu: Input should be less than or equal to 1"),
        ({"per_token_s": 1e-5, "attn_flops_per_token2": 10}, "attn_flops_per_token2 needs the FLOPs model"),
        ({"base_s": 1.0}, "the FLOPs model needs active_params, mfu, gpu_tflops"),
    ],
)
def test_a_bad_training_section_names_the_field(tmp_path, training: dict, message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        load_workload(write(tmp_path, lambda d: d.update(training=training)))


def test_paper_workloads_derive_training_from_flops_with_the_authors_half_split() -> None:
    for name in PAPER:
        workload = load_workload(name)
        assert workload.training.per_token_s is None and workload.training.mfu_source  # FLOPs model, MFU cited
        rollout = workload.cluster.rollout_instances * workload.cluster.gpus_per_instance
        assert rollout == workload.cluster.trainer_gpus == workload.gpus // 2  # 4 + 4 nodes (psrl e2e scripts)


def test_verl_async_trains_without_the_recompute_and_roll_pays_its_offload() -> None:
    """verl's fully-async recipe trains on the rollout's log-probs (``use_rollout_log_probs: True``):
    its step costs 6 of the 8 FLOPs per parameter; the same system forced to recompute pays all 8.
    ROLL offloads the trainer's states after every step: 16 B per parameter per trainer GPU, out and
    back over the host link."""
    from staleflow.adapters.sim.network import trainer_offload_seconds
    from staleflow.app.simulation import simulate_system
    from staleflow.runtime.settings.policies import make_policy

    assert make_policy("verl-async").recomputes_logprobs is False
    assert all(make_policy(name).recomputes_logprobs for name in ("staleflow", "areal", "one-step-off", "roll-flash"))
    workload = load_workload("small-ci")

    def trainer_seconds_per_token(**knobs: bool) -> float:
        figures = simulate_system(workload, "verl-async", 2, 6, 0, **knobs)
        return figures["trainer_busy"] * figures["virtual_s"] / sum(figures["step_tokens"])

    lean, full = trainer_seconds_per_token(), trainer_seconds_per_token(recomputes_logprobs=True)
    assert lean < 0.9 * full  # base_s 0.2 s per step stays; the per-token part is 3/4
    assert make_policy("roll-flash").offloads_trainer and not make_policy("staleflow").offloads_trainer
    qwen3 = load_workload("qwen3-30b-a3b-128gpu")
    # 8 x 61.1 GB of states over 64 trainer GPUs, out and back at 25 GB/s
    assert trainer_offload_seconds(qwen3.network, qwen3.cluster.trainer_gpus) == pytest.approx(2 * 8 * 61.1 / 64 / 25)


def test_roll_flash_as_the_paper_ran_it_pays_a_reference_forward_every_step(tmp_path) -> None:
    """ROLL's RLVR pipeline at aa6ad590 runs the reference model's forward pass over every batch of a
    full-parameter run: one more forward (2 FLOPs per active parameter per token, one attention
    pass) on top of training (6) and the old log-prob recompute (2). Its later code gates it: only
    ``roll-flash`` pays it."""
    from staleflow.adapters.sim.trainer import SimTrainer
    from staleflow.runtime.run.clock import VirtualClock
    from staleflow.runtime.settings.policies import POLICIES
    from staleflow.runtime.types import TrainingBatch, Trajectory

    training = load_workload(write(tmp_path, _flops_training)).training
    # 10 FLOPs per parameter over 1e14 FLOP/s; 5 attention passes x 1000 FLOPs per pair x c^2 / 2
    assert training.seconds_per_token(2, reference=True) == pytest.approx(1e-4)
    assert training.seconds_per_token2(2, reference=True) == pytest.approx(2.5e-11)
    assert training.seconds_per_token(2, recompute=False, reference=True) == pytest.approx(8e-5)
    clock = VirtualClock()
    trainer = SimTrainer(clock, training, trainer_gpus=2, reference=True)
    trainer.start_step(TrainingBatch(0, {"g": [Trajectory("r", "g", [1] * 64, [2] * 936, [0.0] * 936, [0] * 936, "stop")]}))
    assert trainer.next_event_time() == pytest.approx(1.0 + 1e-4 * 1000 + 2.5e-11 * 1000**2)
    # a measured per-token rate (recompute included) grows by a quarter
    rated = load_workload("small-ci").training
    assert rated.seconds_per_token(1, reference=True) == pytest.approx(1.25 * rated.seconds_per_token(1))
    # the simulated run charges it: tests/test_roll_flash.py times ROLL Flash's trainer exactly
    assert [name for name, policy in POLICIES.items() if policy.reference_forward] == ["roll-flash"]


def test_speculation_for_every_system_and_sibling_drafts_for_staleflow() -> None:
    """``--speculation request`` gives every system's engines drafts from the request's own tokens;
    ``siblings`` gives StaleFlow's the group's other responses too (a higher acceptance); the system
    that models speculation its own way keeps it. On small-ci StaleFlow with drafts is faster than
    without, faster with sibling drafts still, and keeps the bound."""
    from staleflow.adapters.sim.speculation import DRAFT_ACCEPTANCE
    from staleflow.app.simulation import simulate_system, speculation_knobs

    assert speculation_knobs("staleflow", "off") == speculation_knobs("staleflow-spec", "siblings") == {}
    assert speculation_knobs("roll-flash", "siblings") == {"draft_acceptance": DRAFT_ACCEPTANCE["request"]}
    assert speculation_knobs("staleflow", "request") == {"draft_acceptance": DRAFT_ACCEPTANCE["request"]}
    assert speculation_knobs("staleflow", "siblings") == {"draft_acceptance": DRAFT_ACCEPTANCE["siblings"]}
    with pytest.raises(ValueError, match="unknown speculation 'all'"):
        speculation_knobs("staleflow", "all")
    workload = load_workload("small-ci")
    runs = {mode: simulate_system(workload, "staleflow", 2, 4, 0, **speculation_knobs("staleflow", mode))
            for mode in ("off", "request", "siblings")}
    assert runs["off"]["tokens_per_s"] < runs["request"]["tokens_per_s"] < runs["siblings"]["tokens_per_s"]
    assert [runs[m]["draft_acceptance"] for m in ("off", "siblings")] == [0.0, DRAFT_ACCEPTANCE["siblings"]]
    assert all(r["max_staleness"] <= 2 and r["lost"] == r["duplicated"] == 0 for r in runs.values())
    with pytest.raises(ValueError, match=r"draft_acceptance must be in \[0, 1\), without speculative_speedup"):
        simulate_system(workload, "staleflow-spec", 2, 1, 0, draft_acceptance=0.5)


def test_speculating_on_small_batches_speeds_up_the_tail_and_keeps_the_bound() -> None:
    """``staleflow-spec`` (1.5x decode at 8 running requests or fewer) against ``staleflow`` on the
    same seed: the rollouts' last, lightly loaded stretch is faster, so the run is (3,487 ->
    3,917 tokens/s measured), and staleness stays within eta."""
    from staleflow.app.simulation import simulate_system
    from staleflow.runtime.settings.policies import make_policy

    assert make_policy("staleflow-spec").speculative_speedup == 1.5 and make_policy("staleflow").speculative_speedup == 1.0
    workload = load_workload("small-ci")
    plain, spec = (simulate_system(workload, name, 2, 6, seed=0) for name in ("staleflow", "staleflow-spec"))
    assert spec["tokens_per_s"] > 1.05 * plain["tokens_per_s"]
    assert spec["max_staleness"] <= 2
    with pytest.raises(ValueError, match="speculative_speedup must be >= 1"):
        make_policy("staleflow", speculative_speedup=0.5)

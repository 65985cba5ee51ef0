"""The length model's fits (``runtime/settings/length_fit.py``, ``staleflow bench response-lengths``) and
the figures of docs/simulation.md's "The length model's tail, per workload" they give."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest
from staleflow.runtime.settings.length_fit import fit_to_clipped_means, fit_to_samples, fit_to_targets, icc_anova, lognormal_lengths
from staleflow.runtime.settings.workload import clipped_lognormal_mean, load_workload

#: per-sample lengths of public samples: see the file's own header
SAMPLES = Path(__file__).parent / "data" / "rl_sft_response_lengths.json"
#: re-encoded, a response cut at the 3,072-token cap comes back at 3,070 tokens or more (the file's header)
SAMPLES_CAP = 3060
PAPER_WORKLOADS = ["qwen3-30b-a3b-128gpu-cap20k", "qwen3-30b-a3b-128gpu", "qwen2.5-32b-128gpu",
                   "deepseek-r1-distill-qwen-32b-128gpu", "deepseek-r1-distill-qwen-14b-64gpu"]


def _grouped(lengths, groups: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [lengths.sample(rng, size) for _ in range(groups)]


@pytest.mark.parametrize("name", PAPER_WORKLOADS)
def test_the_fit_to_a_workloads_own_figures_gives_back_its_spreads(name: str) -> None:
    shipped = load_workload(name).response_tokens
    fitted = fit_to_targets(shipped.mean, shipped.truncated_share(), shipped.max, shipped.prompt_sigma**2 / shipped.sigma**2, shipped.min)
    assert (fitted.sigma, fitted.prompt_sigma, fitted.mu) == pytest.approx((shipped.sigma, shipped.prompt_sigma, shipped.mu), abs=1e-8)


def test_a_fitted_model_draws_its_targets() -> None:
    fitted = fit_to_targets(8000, 0.2, 20480, 0.6)
    assert fitted.truncated_share() == pytest.approx(0.2, abs=1e-9)
    assert fitted.prompt_sigma**2 / fitted.sigma**2 == pytest.approx(0.6)
    draws = fitted.sample(np.random.default_rng(0), 400_000, shared=False)
    assert draws.mean() == pytest.approx(8000, rel=0.005)
    assert (draws >= 20480).mean() == pytest.approx(0.2, abs=0.003)


def test_a_clip_ratio_out_of_reach_is_refused_with_the_reachable_range() -> None:
    with pytest.raises(ValueError, match=r"cuts 0\.0000\.\.0\.\d+ of responses at the cap, not 0\.9"):
        fit_to_targets(3500, 0.9, 20480, 0.3)
    with pytest.raises(ValueError, match="ICC must be in"):
        fit_to_targets(3500, 0.01, 20480, 1.0)


def test_mean_lengths_under_two_caps_give_back_the_model() -> None:
    means = {cap: clipped_lognormal_mean(9.0, 1.1, 16, cap) for cap in (8192, 16384)}
    fitted = fit_to_clipped_means(means, 32768, icc=0.25)
    assert (fitted.mu, fitted.sigma, fitted.prompt_sigma) == pytest.approx((9.0, 1.1, 0.55), rel=1e-6)
    assert fitted.mean == pytest.approx(clipped_lognormal_mean(9.0, 1.1, 16, 32768))
    with pytest.raises(ValueError, match="two caps or more"):
        fit_to_clipped_means({8192: 5000.0}, 20480)


#: mean lengths of DeepSeek-R1-Distill-Qwen-14B and -7B under token budgets of 12,800 and 16,384
#: (64 traces per question, temperature 0.75): github.com/hav4ik/hav4ik.github.io at 0b892ba,
#: content/posts/improving-deepseek/index.md, the tables of "14B models" and "7B models"
R1_DISTILL_BUDGETS = {"14B": {12800: 9473.66, 16384: 10910.2}, "7B": {12800: 9553.74, 16384: 11104.1}}


def test_the_r1_distill_models_at_20480_from_their_published_budgets() -> None:
    """docs/simulation.md's "sourced" table: the R1-Distill rows."""
    at_20480 = {name: fit_to_clipped_means(means, 20480) for name, means in R1_DISTILL_BUDGETS.items()}
    assert {name: (round(m.sigma, 2), round(m.mean), round(m.truncated_share(), 3)) for name, m in at_20480.items()} == {
        "14B": (0.94, 12174, 0.269), "7B": (1.02, 12518, 0.307)}
    icc = [fit_to_samples(groups, cap=SAMPLES_CAP).icc for groups in (_sets()["qwen2.5-math-7b"], _sets()["qwen2.5-math-1.5b"])]
    assert [round(fit_to_clipped_means(R1_DISTILL_BUDGETS["14B"], 20480, i).prompt_sigma, 2) for i in icc] == [0.32, 0.47]
    shipped = load_workload("deepseek-r1-distill-qwen-14b-64gpu")
    assert round((shipped.length_stats()["mean"] / at_20480["14B"].mean - 1) * 100) == -37


def test_the_anova_icc_by_hand() -> None:
    # log lengths 1, 3 | 5, 7: group means 2, 6, grand mean 4; MSB = 2 (4 + 4) / 1 = 16, MSW = 4 / 2 = 2, n0 = 2
    estimate = icc_anova([[math.e, math.e**3], [math.e**5, math.e**7]])
    assert estimate.icc == pytest.approx(14 / 18)
    assert estimate.low < estimate.icc < estimate.high and (estimate.groups, estimate.responses) == (2, 4)
    with pytest.raises(ValueError, match="two groups or more"):
        icc_anova([[1, 2, 3]])


def test_the_anova_interval_holds_the_models_icc_on_unclipped_groups() -> None:
    lengths = lognormal_lengths(5000, 1.0, 10**9, prompt_sigma=0.6)
    estimate = icc_anova(_grouped(lengths, 400, 8, seed=3))
    assert estimate.low < 0.36 < estimate.high and estimate.high - estimate.low < 0.15


def test_the_likelihood_fit_sees_through_the_cap_where_the_anova_does_not() -> None:
    """A third of the responses cut at the cap: the ANOVA on the clipped lengths is biased low, the
    censored fit finds the model's own parameters."""
    lengths = fit_to_targets(6000, 0.33, 12000, 0.5)
    groups = _grouped(lengths, 1500, 8, seed=1)
    fit = fit_to_samples(groups, cap=12000)
    assert fit.censored / fit.responses == pytest.approx(0.33, abs=0.02)
    assert (fit.mu, fit.sigma, fit.icc) == pytest.approx((lengths.mu, lengths.sigma, 0.5), rel=0.06)
    assert icc_anova(groups).icc < 0.45
    assert fit.lengths(12000).truncated_share() == pytest.approx(0.33, abs=0.02)


def _sets() -> dict[str, list[list[int]]]:
    return {name: s["groups"] for name, s in json.loads(SAMPLES.read_text())["sets"].items()}


def test_the_recorded_samples_icc_and_fits() -> None:
    """docs/simulation.md's table of the recorded samples (70 prompts x 8, temperature 0.6, cap 3,072)."""
    expected = {  # mean, share at the cap, ANOVA ICC (interval), fit: sigma, prompt_sigma, ICC
        "qwen2.5-math-1.5b": (1439, 0.230, (0.250, 0.168, 0.353), (0.910, 0.460, 0.256)),
        "qwen2.5-math-7b": (1331, 0.189, (0.098, 0.040, 0.179), (1.263, 0.431, 0.116)),
        "qwen2.5-math-7b-offrlvr-20": (1448, 0.246, (0.138, 0.073, 0.226), (1.809, 0.660, 0.133)),
    }
    for name, groups in _sets().items():
        lengths = [n for group in groups for n in group]
        assert (len(groups), {len(g) for g in groups}) == (70, {8}), name
        mean, at_cap, anova, fitted = expected[name]
        assert (round(float(np.mean(lengths))), round(float(np.mean(np.array(lengths) >= SAMPLES_CAP)), 3)) == (mean, at_cap), name
        estimate = icc_anova(groups)
        assert tuple(round(x, 3) for x in (estimate.icc, estimate.low, estimate.high)) == anova, name
        fit = fit_to_samples(groups, cap=SAMPLES_CAP)
        assert tuple(round(x, 3) for x in (fit.sigma, fit.prompt_sigma, fit.icc)) == fitted, name


def test_the_sourced_fits_of_the_paper_workloads() -> None:
    """docs/simulation.md's "sourced" table: each workload's mean and clip ratio (no public clip ratio
    found: the shipped one) with the recorded samples' ICC, and Qwen2.5-32B with their spread too."""
    icc = {name: fit_to_samples(groups, cap=SAMPLES_CAP) for name, groups in _sets().items()}
    low, high = icc["qwen2.5-math-7b"], icc["qwen2.5-math-1.5b"]
    for name in PAPER_WORKLOADS:
        shipped = load_workload(name).response_tokens
        prompt_sigmas = [fit_to_targets(shipped.mean, shipped.truncated_share(), shipped.max, fit.icc, shipped.min).prompt_sigma
                         for fit in (low, high)]
        expected = (0.31, 0.46) if name == "qwen2.5-32b-128gpu" else (0.27, 0.40)
        assert tuple(round(x, 2) for x in prompt_sigmas) == expected, name
        shipped_icc = shipped.prompt_sigma**2 / shipped.sigma**2
        expected = (1.2, 2.7) if name == "qwen2.5-32b-128gpu" else (1.5, 3.4)
        assert (round(shipped_icc / high.icc, 1), round(shipped_icc / low.icc, 1)) == expected, name
    # Qwen2.5-32B at its mean 3,500 under 20,480 with the spread of Qwen2.5-Math-7B's samples
    assert round(lognormal_lengths(3500, low.sigma, 20480).truncated_share(), 3) == 0.026
    assert round(lognormal_lengths(3500, high.sigma, 20480).truncated_share(), 3) == 0.009
    # Qwen3-30B-A3B at the paper's mean (Fig. 25: 9,744 under 40,960) and the shipped clip ratio
    qwen3 = load_workload("qwen3-30b-a3b-128gpu")
    at_paper = [fit_to_targets(9744, qwen3.response_tokens.truncated_share(), 40960, fit.icc) for fit in (low, high)]
    assert [(round(m.sigma, 2), round(m.prompt_sigma, 2)) for m in at_paper] == [(0.80, 0.27), (0.80, 0.40)]
    assert round((qwen3.length_stats()["mean"] - 9744) / 9744 * 100, 1) == -0.4


def test_the_command_measures_samples_and_fits_targets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from staleflow.bench import response_lengths

    parser = argparse.ArgumentParser()
    response_lengths.add_arguments(parser)
    samples = tmp_path / "samples.jsonl"
    groups = _sets()["qwen2.5-math-7b"]
    samples.write_text("".join(json.dumps({"group": g, "tokens": [0] * n}) + "\n" for g, group in enumerate(groups) for n in group))
    assert response_lengths.run(parser.parse_args(["--samples", str(samples), "--cap", str(SAMPLES_CAP), "--json"])) == 0
    figures = json.loads(capsys.readouterr().out)
    assert (figures["groups"], figures["responses"], round(figures["fit"]["icc"], 3)) == (70, 560, 0.116)
    fit = ["--mean", "9700", "--cap", "40960", "--clip-ratio", "0.01497", "--icc", "0.390625"]
    assert response_lengths.run(parser.parse_args(fit)) == 0
    assert "sigma: 0.8000, prompt_sigma: 0.5000" in capsys.readouterr().out
    budgets = ["--clipped-means", "12800:9473.66", "16384:10910.2", "--cap", "20480", "--icc", "0", "--json"]
    assert response_lengths.run(parser.parse_args(budgets)) == 0
    assert round(json.loads(capsys.readouterr().out)["clip_ratio"], 3) == 0.269
    assert response_lengths.run(parser.parse_args(["--mean", "9700", "--cap", "40960"])) == 2
    assert "missing --icc, --clip-ratio" in capsys.readouterr().err
    assert response_lengths.run(parser.parse_args(["--clipped-means", "12800-9473", "--cap", "20480", "--icc", "0"])) == 2
    assert "CAP:MEAN pairs" in capsys.readouterr().err


def test_the_sensitivity_workloads_are_the_shipped_ones_with_the_sourced_lengths() -> None:
    """docs/workloads/*-icc-measured.yaml and *-budgets.yaml (docs/simulation.md, the sensitivity
    run): the shipped workload in every field but its response lengths, which are the fits of the
    sourced figures (the 1.5B samples' ICC; R1-Distill-14B's published budgets)."""
    root = Path(__file__).resolve().parents[1] / "docs" / "workloads"
    icc = round(fit_to_samples(_sets()["qwen2.5-math-1.5b"], cap=SAMPLES_CAP).icc, 3)
    assert icc == 0.256
    r1 = fit_to_clipped_means(R1_DISTILL_BUDGETS["14B"], 20480, icc)
    variants = {"qwen3-30b-a3b-128gpu-icc-measured": ("qwen3-30b-a3b-128gpu", None),
                "qwen3-30b-a3b-128gpu-cap20k-icc-measured": ("qwen3-30b-a3b-128gpu-cap20k", None),
                "deepseek-r1-distill-qwen-14b-64gpu-budgets": ("deepseek-r1-distill-qwen-14b-64gpu", r1)}
    for name, (shipped_name, fitted) in variants.items():
        variant, shipped = load_workload(root / f"{name}.yaml"), load_workload(shipped_name)
        lengths = variant.response_tokens
        if fitted is None:  # the shipped model but for the prompt's share
            fitted = shipped.response_tokens.model_copy(update={"prompt_sigma": math.sqrt(icc) * shipped.response_tokens.sigma})
        assert (lengths.mean, lengths.sigma, lengths.prompt_sigma, lengths.max) == pytest.approx(
            (fitted.mean, fitted.sigma, fitted.prompt_sigma, fitted.max), abs=5e-4, rel=5e-5), name
        same = {"name", "description", "response_tokens"}
        assert variant.model_dump(exclude=same) == shipped.model_dump(exclude=same), name

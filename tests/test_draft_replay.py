"""tau(k) measured by replaying recorded samples: what each draft source lets a proposer read."""

from __future__ import annotations

import pytest
from staleflow.app.draft_replay import measure


def test_each_source_reads_only_what_a_proposer_has_at_that_position() -> None:
    """The longest response [5, 1, 2, 3, 4] is replayed against its sibling [1, 2, 3, 4] with 3 drafts.
    Its own prefix never repeats: 5 tokens in 5 steps. Causally the sibling is as far as the
    response itself: at position 2 it has read [1, 2] (draft [2] after '1', accepted), at 4 its
    whole [1, 2, 3, 4] (draft [4] after '1 2 3', accepted): 5 tokens in 4 steps. Finished only, it
    is still running: nothing. Whole, '1' is followed by [2, 3, 4], all accepted: 3 steps."""
    result = measure({"g": [[1, 2, 3, 4], [5, 1, 2, 3, 4]]}, max_drafts=3)
    assert [result.tau[s][2] for s in ("request", "causal", "finished", "whole")] == [1.0, 1.25, 1.0, 5 / 3]
    assert (result.groups, result.tokens) == (1, 5)


def test_the_own_prefix_drafts_repeats_and_a_finished_sibling_whole() -> None:
    """[1, 2, 3] three times: after the first repeat of '1' the own prefix drafts [2, 3], accepted
    twice (9 tokens in 6 steps with 2 drafts); a finished sibling [1, 2, 3] drafts from position 1
    on in the whole-sibling bound (4 steps)."""
    group = {"g": [[1, 2, 3] * 3, [1, 2, 3]], "alone": [[7, 7, 7]]}  # a group of one has no siblings: left out
    result = measure(group, max_drafts=2)
    assert result.tau["request"] == pytest.approx([9 / 7, 9 / 6])
    assert result.tau["whole"][1] == pytest.approx(9 / 4)
    with pytest.raises(ValueError, match="unknown draft source"):
        measure(group, sources=["oracle"])
    with pytest.raises(ValueError, match="no group with two responses"):
        measure({"alone": [[1, 2]]})


def test_the_acceptance_is_the_geometric_fit_over_every_k_with_the_residual_it_leaves() -> None:
    """The geometric model recovers its own rate exactly; on replayed groups (688 tokens: three
    prompts, four responses each, built from four recurring 6-token phrases and random pairs) it is
    fitted to tau(1..4) in least squares, not read off tau(1), and says how far it misses."""
    import random

    from staleflow.adapters.sim.speculation import fit_acceptance, geometric_tau

    assert fit_acceptance(geometric_tau(0.55, 8)) == pytest.approx((0.55, 0.0), abs=1e-9)
    rng = random.Random(0)
    phrases = [[rng.randrange(40) for _ in range(6)] for _ in range(4)]

    def response(seed: int) -> list[int]:
        r = random.Random(seed)
        out: list[int] = []
        for _ in range(14):
            out += phrases[r.randrange(4)] if r.random() < 0.6 else [r.randrange(40), r.randrange(40)]
        return out

    result = measure({f"p{i}": [response(10 * i + j) for j in range(4)] for i in range(3)}, max_drafts=4)
    assert (result.groups, result.tokens) == (3, 192)
    assert result.tau["request"] == pytest.approx([1.3061, 1.4656, 1.4769, 1.5238], abs=1e-4)
    fits = {s: (round(result.acceptance(s), 4), round(result.residual(s), 4)) for s in result.tau}
    assert fits == {"request": (0.3385, 0.0211), "causal": (0.5032, 0.0393), "finished": (0.3584, 0.0244),
                    "whole": (0.6246, 0.0799)}
    assert result.acceptance("request") != pytest.approx(result.tau["request"][0] - 1, abs=0.01)


def test_the_simulators_acceptance_is_the_fit_of_the_measured_tau() -> None:
    """``staleflow simulate --speculation`` drafts at the geometric fits of tau(k) replayed from a
    math model's recorded samples (docs/simulation.md): sibling drafts above the own prefix, each
    fit within 0.05 tokens per step of the measurement."""
    from staleflow.adapters.sim.speculation import DRAFT_ACCEPTANCE, MEASURED_TAU, fit_acceptance

    assert DRAFT_ACCEPTANCE == {"request": 0.623, "siblings": 0.667}
    for mode, tau in MEASURED_TAU.items():
        rate, residual = fit_acceptance(tau)
        assert rate == pytest.approx(DRAFT_ACCEPTANCE[mode], abs=5e-4) and residual < 0.05
        assert all(1 < t <= k + 1 for k, t in enumerate(tau, start=1)) and list(tau) == sorted(tau)


def test_the_bench_reads_a_samples_file_and_names_a_bad_line(tmp_path, capsys) -> None:
    import argparse
    import json

    from staleflow.bench import draft_acceptance

    good = tmp_path / "samples.jsonl"
    good.write_text("".join(json.dumps({"group": "g", "tokens": t}) + "\n" for t in ([1, 2, 3, 4], [5, 1, 2, 3, 4])))
    parser = argparse.ArgumentParser()
    draft_acceptance.add_arguments(parser)
    assert draft_acceptance.run(parser.parse_args(["--samples", str(good), "--max-drafts", "3", "--json"])) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["tau"]["whole"][2] == pytest.approx(5 / 3) and figures["groups"] == 1
    assert set(figures["acceptance"]) == set(figures["residual"]) == {"request", "causal", "finished", "whole"}
    assert [(b["label"], b["tokens"]) for b in figures["by_position"] + figures["by_length"]] == [("0-256", 5), ("0-5", 5)]
    assert draft_acceptance.run(parser.parse_args(["--samples", str(good), "--max-drafts", "3", "--sources", "whole", "--json"])) == 0
    assert list(json.loads(capsys.readouterr().out)["tau"]) == ["whole"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"group": "g", "tokens": [1]}\n{"group": "g"}\n')
    assert draft_acceptance.run(parser.parse_args(["--samples", str(bad)])) == 2
    assert f"{bad}:2: expected" in capsys.readouterr().err


def test_tau_by_position_counts_the_steps_that_start_in_each_bucket() -> None:
    """[1, 2, 3] x 3 from its own prefix: positions 0-3 have nothing to draft from (a step each,
    tau 1); from position 4 on, 2 drafts emit 3 then 2 tokens (5 in 2 steps), 1 draft 2, 2, 1 (5 in
    3); the buckets' steps add up to the whole replay's 9 tokens in 6 (k = 2) and 7 (k = 1) steps."""
    result = measure({"g": [[1, 2, 3] * 3, [1, 2, 3]]}, max_drafts=2, sources=["request"], position_edges=(0, 4, 100))
    assert [(b.label, b.tokens) for b in result.by_position] == [("0-4", 4), ("4-100", 5)]  # the empty 100+ left out
    assert [b.tau["request"] for b in result.by_position] == [[1.0, 1.0], [5 / 3, 5 / 2]]
    assert result.tau["request"] == pytest.approx([9 / 7, 9 / 6])
    with pytest.raises(ValueError, match="position_edges must rise from 0"):
        measure({"g": [[1, 2], [1]]}, position_edges=(4, 0))


def test_tau_by_length_puts_each_replayed_response_in_its_quartile() -> None:
    """Every response replayed (``replayed="all"``): the 3-token [1, 2, 3] repeats nothing (tau 1);
    the 9-token one is the replay above; the quartiles of the lengths (3, 9) split them at 3."""
    result = measure({"g": [[1, 2, 3] * 3, [1, 2, 3]]}, max_drafts=2, sources=["request"], replayed="all")
    assert [(b.label, b.tokens, b.tau["request"]) for b in result.by_length] == [("0-3", 3, [1.0, 1.0]), ("4-9", 9, [9 / 7, 9 / 6])]
    assert (result.groups, result.tokens) == (1, 12)
    assert measure({"g": [[1, 2, 3] * 3, [1, 2, 3]]}, max_drafts=2, sources=["request"]).by_length[0].tokens == 9  # the longest only
    with pytest.raises(ValueError, match="replayed must be one of"):
        measure({"g": [[1, 2], [1]]}, replayed="some")


def test_the_acceptance_rises_along_a_response_as_replayed() -> None:
    """By where in its response a step starts (the same samples, docs/simulation.md): the geometric
    fits of each position bucket's tau(k) rise from 0.34 (own prefix) and 0.51 (with siblings) in
    the first 256 tokens to 0.72 from 2,048 on; siblings matter most early, when the own prefix is
    short. ``simulate --draft-positions`` drafts at these rates; off by default."""
    from staleflow.adapters.sim.speculation import ACCEPTANCE_BY_POSITION, DRAFT_ACCEPTANCE, MEASURED_TAU_BY_POSITION, fit_acceptance
    from staleflow.app.simulation import drafts_by_position

    assert ACCEPTANCE_BY_POSITION == {"request": ((0, 0.342), (256, 0.566), (1024, 0.683), (2048, 0.719)),
                                      "siblings": ((0, 0.508), (256, 0.637), (1024, 0.696), (2048, 0.722))}
    for mode, buckets in MEASURED_TAU_BY_POSITION.items():
        assert all(fit_acceptance(tau)[1] < 0.045 for _, tau in buckets)
        rates = [rate for _, rate in ACCEPTANCE_BY_POSITION[mode]]
        assert rates == sorted(rates) and rates[-1] - rates[0] > 0.2
    assert drafts_by_position(DRAFT_ACCEPTANCE["siblings"], "per-request") == {"by_position": ACCEPTANCE_BY_POSITION["siblings"],
                                                                              "budgets": True}
    assert drafts_by_position(DRAFT_ACCEPTANCE["request"], "off") == {}
    with pytest.raises(ValueError, match="needs a measured acceptance"):
        drafts_by_position(0.5, "uniform")

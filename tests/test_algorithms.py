"""GRPO advantages, batch packing and the three off-policy objectives, against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch
from staleflow.adapters.rlkit.algorithms import (
    Correction,
    LossSettings,
    PackedBatch,
    group_advantages,
    pack_batch,
    policy_loss,
    token_logprobs,
    token_staleness,
)
from staleflow.runtime.types import TrainingBatch, Trajectory


def _traj(
    rid: str, gid: str, prompt: list[int], out: list[int], versions: list[int], reward: float | None, logprobs: list[float] | None = None
) -> Trajectory:
    return Trajectory(
        request_id=rid,
        group_id=gid,
        prompt_ids=prompt,
        output_ids=out,
        logprobs=logprobs if logprobs is not None else [-0.5] * len(out),
        versions=versions,
        finish_reason="stop",
        reward=reward,
    )


def _one_row(behaviour: list[float], advantage: float) -> PackedBatch:
    """One trajectory: prompt of 1 token, response of len(behaviour) tokens."""
    n = len(behaviour)
    return PackedBatch(
        input_ids=torch.zeros((1, n + 1), dtype=torch.long),
        attention_mask=torch.ones((1, n + 1), dtype=torch.long),
        loss_mask=torch.ones((1, n)),
        behaviour_logprobs=torch.tensor([behaviour]),
        versions=torch.zeros((1, n), dtype=torch.long),
        advantages=torch.tensor([advantage]),
        rewards=torch.tensor([1.0]),
    )


def test_group_advantages_centre_and_scale_per_group() -> None:
    adv = group_advantages([[1.0, 0.0], [0.5, 0.5, 0.5], [1.0, 0.0, 0.0, 0.0]])
    # group 1: mean .5, std .5; group 2: no variance; group 3: mean .25, std sqrt(3)/4
    s3 = math.sqrt(3) / 4
    expected = [0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6), 0, 0, 0, 0.75 / (s3 + 1e-6)] + [-0.25 / (s3 + 1e-6)] * 3
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)
    unscaled = group_advantages([[1.0, 0.0, 0.0, 0.0]], scale=False)
    assert unscaled.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_group_advantages_reject_empty_and_non_finite() -> None:
    with pytest.raises(ValueError, match="group 1 has no rewards"):
        group_advantages([[1.0], []])
    with pytest.raises(ValueError, match="non-finite"):
        group_advantages([[1.0, float("nan")]])


def test_no_correction_clips_against_behaviour() -> None:
    packed = _one_row([math.log(0.5), math.log(0.25)], advantage=1.0)
    current = torch.tensor([[math.log(0.75), math.log(0.25)]], requires_grad=True)
    loss, m = policy_loss(current, packed, LossSettings(correction=Correction.NONE, clip_eps=0.2))
    # token 1: ratio 1.5 -> max(-1.5, -1.2) = -1.2; token 2: ratio 1 -> -1; mean -1.1
    assert loss.item() == pytest.approx(-1.1, abs=1e-6)
    assert m["clip_fraction"] == pytest.approx(0.5)
    loss.backward()
    # the clipped token gets no gradient; the other gets -A * ratio / tokens = -0.5
    assert current.grad is not None
    assert current.grad[0].tolist() == pytest.approx([0.0, -0.5], abs=1e-6)

    negative = _one_row([math.log(0.5), math.log(0.25)], advantage=-1.0)
    loss, _ = policy_loss(current.detach(), negative, LossSettings(correction=Correction.NONE))
    # A < 0: max(1.5, 1.2) = 1.5 (pessimistic side), token 2: 1 -> mean 1.25
    assert loss.item() == pytest.approx(1.25, abs=1e-6)


def test_decoupled_ppo_masks_tokens_over_the_weight_cap() -> None:
    packed = _one_row([math.log(0.5), math.log(0.05)], advantage=1.0)
    proximal = torch.tensor([[math.log(0.5), math.log(0.5)]])  # behaviour weights 1 and 10
    current = torch.tensor([[math.log(0.75), math.log(0.5)]])
    settings = LossSettings(correction=Correction.DECOUPLED_PPO, clip_eps=0.2, weight_cap=5.0)
    loss, m = policy_loss(current, packed, settings, proximal)
    # token 2 rejected (weight 10 > 5); token 1: ratio 1.5 clipped to 1.2, weight 1 -> -1.2
    assert loss.item() == pytest.approx(-1.2, abs=1e-6)
    assert m["rejected_fraction"] == pytest.approx(0.5)
    assert m["behaviour_weight_max"] == pytest.approx(10.0, rel=1e-5)
    assert m["behaviour_weight_mean"] == pytest.approx(5.5, rel=1e-5)

    # At the proximal point (first minibatch) the gradient is -A * w / kept tokens.
    at_prox = proximal.clone().requires_grad_(True)
    packed2 = _one_row([math.log(0.25), math.log(0.5)], advantage=2.0)  # weights 2 and 1
    loss, m = policy_loss(at_prox, packed2, settings, proximal)
    loss.backward()
    assert at_prox.grad is not None
    assert at_prox.grad[0].tolist() == pytest.approx([-2.0 * 2.0 / 2, -2.0 * 1.0 / 2], abs=1e-5)
    assert m["rejected_fraction"] == 0.0


def test_tis_truncates_the_weight_instead_of_masking() -> None:
    packed = _one_row([math.log(0.5), math.log(0.05)], advantage=1.0)
    proximal = torch.tensor([[math.log(0.5), math.log(0.5)]])
    current = torch.tensor([[math.log(0.75), math.log(0.5)]])
    loss, m = policy_loss(current, packed, LossSettings(correction=Correction.TIS, weight_cap=5.0), proximal)
    # token 1: -1.2 * 1; token 2: ratio 1, weight min(10, 5) = 5 -> -5; mean -3.1
    assert loss.item() == pytest.approx(-3.1, abs=1e-5)
    assert m["truncated_fraction"] == pytest.approx(0.5)


def test_corrections_that_need_the_proximal_policy_say_so() -> None:
    packed = _one_row([-1.0], advantage=1.0)
    with pytest.raises(ValueError, match="needs the proximal log-probs"):
        policy_loss(torch.tensor([[-1.0]]), packed, LossSettings(correction=Correction.TIS))
    with pytest.raises(ValueError, match="clip_eps"):
        LossSettings(clip_eps=1.5)
    with pytest.raises(ValueError, match="weight_cap"):
        LossSettings(weight_cap=0.5)


def test_pack_batch_aligns_response_tokens_with_targets() -> None:
    batch = TrainingBatch(
        version=3,
        groups={
            "g0": [
                _traj("a", "g0", [5, 6], [7, 8, 9], [1, 1, 3], 1.0, [-0.1, -0.2, -0.3]),
                _traj("b", "g0", [5, 6], [7], [2], 0.0, [-0.4]),
            ],
            "g1": [_traj("c", "g1", [4], [10, 11], [3, 3], 0.5, [-0.5, -0.6])],
        },
    )
    p = pack_batch(batch, pad_id=0)
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 0, 0], [4, 10, 11, 0, 0]]
    assert p.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0]]
    assert p.loss_mask.tolist() == [[0, 1, 1, 1], [0, 1, 0, 0], [1, 1, 0, 0]]
    assert p.behaviour_logprobs[0].tolist() == pytest.approx([0, -0.1, -0.2, -0.3])
    assert p.versions.tolist() == [[-1, 1, 1, 3], [-1, 2, -1, -1], [3, 3, -1, -1]]
    assert p.advantages.tolist() == pytest.approx([1.0, -1.0, 0.0], abs=1e-5)
    assert p.response_tokens == 6
    assert sorted(token_staleness(p, 3).tolist()) == [0, 0, 0, 1, 2, 2]


def test_pack_batch_rejects_bad_trajectories() -> None:
    def batch_of(t: Trajectory, version: int = 1) -> TrainingBatch:
        return TrainingBatch(version=version, groups={"g": [t]})

    with pytest.raises(ValueError, match="newer than the trainer's version 1"):
        pack_batch(batch_of(_traj("a", "g", [1], [2], [2], 1.0)), pad_id=0)
    with pytest.raises(ValueError, match="has no reward"):
        pack_batch(batch_of(_traj("a", "g", [1], [2], [0], None)), pad_id=0)
    with pytest.raises(ValueError, match="2 tokens but 1 log-probs"):
        pack_batch(batch_of(_traj("a", "g", [1], [2, 3], [0, 0], 1.0, [-1.0])), pad_id=0)
    with pytest.raises(ValueError, match="empty response"):
        pack_batch(batch_of(_traj("a", "g", [1], [], [], 1.0)), pad_id=0)
    with pytest.raises(ValueError, match="no groups"):
        pack_batch(TrainingBatch(version=0, groups={}), pad_id=0)


def test_token_logprobs_gathers_the_next_token() -> None:
    logits = torch.zeros((1, 3, 4))
    logits[0, 0, 2] = math.log(3.0)  # p(2) = 3/6 at position 0
    ids = torch.tensor([[1, 2, 3]])
    lp = token_logprobs(logits, ids)
    assert lp[0].tolist() == pytest.approx([math.log(0.5), math.log(0.25)], abs=1e-6)

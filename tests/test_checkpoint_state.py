"""A trainer state (``trainer_state.pt``) refused part by part before anything loads, each refusal
naming the file and the part (``staleflow.adapters.rlkit.checkpoint``)."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from staleflow.adapters.rlkit.checkpoint import check_trainer_state

PATH = Path("run/checkpoints/step-000003/trainer/trainer_state.pt")


def good_state() -> dict[str, Any]:
    return {
        "version": 3,
        "scheduler": {"last_epoch": 3, "base_lrs": [1e-5], "lr_lambdas": [None]},
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.Random(0).getstate(),
        "optimizer": {"state": {0: {"exp_avg": torch.zeros(4, 2), "step": torch.tensor(3.0)}}, "param_groups": [{"params": [0, 1]}]},
    }


def broken(change: dict[str, Any], drop: str | None = None) -> dict[str, Any]:
    state = good_state() | change
    if drop is not None:
        del state[drop]
    return state


@pytest.mark.parametrize(("state", "message"), [
    (broken({}, drop="optimizer"), r"lacks \['optimizer'\]"),
    (broken({}, drop="torch_rng"), r"lacks \['torch_rng'\]"),
    (broken({"version": -1}), "holds version -1, not a count >= 0"),
    (broken({"version": True}), "holds version True, not a count >= 0"),
    (broken({"version": "3"}), "holds version '3', not a count >= 0"),
    (broken({"scheduler": {"last_epoch": 3}}), r"holds no learning-rate schedule state \(last_epoch, base_lrs, lr_lambdas\)"),
    (broken({"scheduler": [3]}), "holds no learning-rate schedule state"),
    (broken({"torch_rng": torch.zeros(5, dtype=torch.uint8)}), r"holds no torch RNG state \(a uint8 tensor of \(5056,\)\)"),
    (broken({"torch_rng": torch.get_rng_state().float()}), "holds no torch RNG state"),
    (broken({"python_rng": (3, (1, 2), None)}), r"holds no Python RNG state \("),
    (broken({"optimizer": {"param_groups": [{"params": [0, 1]}]}}), r"holds no optimiser state \(state and param_groups\)"),
    (broken({"optimizer": {"state": {}, "param_groups": [{"lr": 1}]}}), "holds no optimiser state"),
    (broken({"optimizer": {"state": {}, "param_groups": [{"params": [0]}]}}),
     r"holds optimiser state of other parameters: groups of \[1\] parameters, this model's optimiser has \[2\]"),
    (broken({"optimizer": {"state": {0: {"exp_avg": torch.zeros(2, 4)}}, "param_groups": [{"params": [0, 1]}]}}),
     r"holds optimiser state of another model: \['0.exp_avg: \(2, 4\) in the file, \(4, 2\) in the model'\]"),
    (broken({"optimizer": {"state": {7: {}}, "param_groups": [{"params": [0, 1]}]}}), r"holds optimiser state of another model: \['7'\]"),
], ids=lambda value: value if isinstance(value, str) else "")
def test_each_broken_part_of_a_trainer_state_is_named_with_its_file(state: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=f"^checkpoint file {re.escape(str(PATH))} {message}"):
        check_trainer_state(state, PATH, groups=[[0, 1]], shapes={0: (4, 2), 1: (2,)})


def test_a_whole_trainer_state_passes() -> None:
    check_trainer_state(good_state(), PATH, groups=[[1, 0]], shapes={0: (4, 2), 1: (2,)})  # the order within a group is free

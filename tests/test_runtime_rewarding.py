"""Reward runner: values in order, exceptions and timeouts become failed outcomes, never a stall."""

from __future__ import annotations

import threading
import time

from staleflow.runtime.run.rewarding import RewardRunner
from staleflow.runtime.types import Trajectory


def _trajectories(group_id: str, lengths):
    return [Trajectory(f"{group_id}/{i}", group_id, [1], [0] * n, [0.0] * n, [0] * n, "stop") for i, n in enumerate(lengths)]


def test_rewards_in_trajectory_order_with_metadata():
    runner = RewardRunner(lambda t, meta: len(t.output_ids) * meta["scale"], timeout_s=10)
    runner.submit("g", _trajectories("g", [3, 1, 2]), {"scale": 2.0})
    (outcome,) = runner.poll(block=True)
    assert outcome.group_id == "g" and outcome.rewards == [6.0, 2.0, 4.0] and outcome.error is None
    assert runner.pending() == 0
    runner.close()


def test_exception_non_number_and_timeout_mark_the_group():
    release = threading.Event()

    def reward(t, meta):
        if t.group_id == "boom":
            raise KeyError("answer")
        if t.group_id == "text":
            return "1.0"
        release.wait(10)
        return 1.0

    now = [0.0]  # the timeout's clock, moved by the test: no wall-clock budget
    runner = RewardRunner(reward, timeout_s=5.0, clock=lambda: now[0])
    for gid in ("boom", "text", "hang"):
        runner.submit(gid, _trajectories(gid, [1]), {})
    outcomes = {}
    for _ in range(3000):  # the two quick groups finish in their threads (at most 30 s of wall time)
        outcomes.update((o.group_id, o) for o in runner.poll())
        if {"boom", "text"} <= outcomes.keys():
            break
        time.sleep(0.01)
    assert outcomes.keys() == {"boom", "text"}  # "hang" is neither done nor past its timeout yet
    now[0] = 4.9
    assert runner.poll() == [] and runner.pending() == 1
    now[0] = 5.0
    outcomes.update((o.group_id, o) for o in runner.poll())
    release.set()
    assert outcomes["boom"].rewards is None and outcomes["boom"].error.startswith("KeyError")
    assert "returned str, not a number" in outcomes["text"].error
    assert outcomes["hang"].error == "reward timed out after 5.0 s"
    assert runner.pending() == 0
    runner.close()


def test_without_a_reward_function_groups_complete_at_once():
    runner = RewardRunner(None)
    runner.submit("g", _trajectories("g", [2]), {})
    (outcome,) = runner.poll()
    assert outcome.rewards is None and outcome.error is None

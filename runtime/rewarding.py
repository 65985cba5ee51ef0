"""Rewards for finished groups, each group under a timeout, on a thread pool.

A reward function that raises, or that has not returned ``timeout_s`` seconds (wall clock) after
the group was submitted, marks the group failed; the run goes on (a hung reward must never stall
training; peers froze on exactly that). A thread running a hung function cannot be killed: it is
abandoned, and ``max_workers`` bounds how many can pile up.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from staleflow.runtime.types import Trajectory

#: ``reward_fn(trajectory, group_metadata) -> reward``
RewardFn = Callable[[Trajectory, dict[str, Any]], float]


@dataclass(frozen=True)
class RewardOutcome:
    """The rewards of one group (in trajectory order), or why there are none."""

    group_id: str
    rewards: list[float] | None
    error: str | None = None


def _reward_group(reward_fn: RewardFn, trajectories: Sequence[Trajectory], metadata: dict[str, Any]) -> list[float]:
    rewards = []
    for trajectory in trajectories:
        reward = reward_fn(trajectory, metadata)
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise TypeError(f"reward function returned {type(reward).__name__}, not a number")
        rewards.append(float(reward))
    return rewards


class RewardRunner:
    """Runs ``reward_fn`` over groups with a per-group timeout.

    ``reward_fn=None`` (simulation): every group completes at once with ``rewards=None``.
    """

    def __init__(self, reward_fn: RewardFn | None, timeout_s: float = 30.0, max_workers: int = 4) -> None:
        if timeout_s <= 0:
            raise ValueError(f"reward timeout must be > 0 seconds, got {timeout_s}")
        self._fn = reward_fn
        self._timeout = timeout_s
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="reward") if reward_fn else None
        self._running: dict[str, tuple[Future[list[float]], float]] = {}
        self._ready: list[RewardOutcome] = []

    def submit(self, group_id: str, trajectories: Sequence[Trajectory], metadata: dict[str, Any]) -> None:
        if self._pool is None or self._fn is None:
            self._ready.append(RewardOutcome(group_id, None))
            return
        future = self._pool.submit(_reward_group, self._fn, list(trajectories), dict(metadata))
        self._running[group_id] = (future, time.monotonic())

    def pending(self) -> int:
        return len(self._running) + len(self._ready)

    def poll(self, block: bool = False) -> list[RewardOutcome]:
        """Outcomes ready now; ``block``: wait until every submitted group is rewarded or timed out."""
        if block and self._running:
            deadline = max(start for _, start in self._running.values()) + self._timeout
            wait([f for f, _ in self._running.values()], timeout=max(0.0, deadline - time.monotonic()))
        now = time.monotonic()
        outcomes, self._ready = self._ready, []
        for group_id, (future, start) in list(self._running.items()):
            if future.done():
                error = future.exception()
                outcomes.append(
                    RewardOutcome(group_id, None, f"{type(error).__name__}: {error}")
                    if error is not None
                    else RewardOutcome(group_id, future.result())
                )
            elif now - start >= self._timeout:
                future.cancel()
                outcomes.append(RewardOutcome(group_id, None, f"reward timed out after {self._timeout} s"))
            else:
                continue
            del self._running[group_id]
        return outcomes

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

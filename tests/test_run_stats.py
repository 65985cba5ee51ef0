"""What the run loop counts per consumed batch, from the token lists as they are stored."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from staleflow.adapters.sim.tokens import RunLengthList
from staleflow.protocol import ConsumedBatch
from staleflow.runtime.run.run_stats import RunStats, mixed_versions
from staleflow.runtime.types import TrainingBatch, Trajectory


class UnwalkedRuns(RunLengthList):
    """A run-length list that fails when anything walks its items one by one."""

    def __iter__(self) -> Iterator[Any]:
        raise AssertionError("walked every token of a run-length list")


def trajectory(rid: str, versions: Any) -> Trajectory:
    tokens = RunLengthList([(0, len(versions))])
    return Trajectory(rid, "g", [1], tokens, RunLengthList([(-0.5, len(versions))]), versions, "length")


def test_mixed_version_trajectories_are_counted_from_the_runs_without_walking_the_tokens() -> None:
    """A 10^12-token response is counted at once: one run is one version, two or more runs are mixed
    (adjacent runs never hold the same value), a version that comes back still counts once."""
    batch = TrainingBatch(version=4, groups={"g": [
        trajectory("a", UnwalkedRuns([(3, 10**12)])),
        trajectory("b", UnwalkedRuns([(3, 10**12), (4, 2)])),
        trajectory("c", UnwalkedRuns([(2, 5), (4, 1), (2, 10**9)])),
    ]})
    stats = RunStats()
    stats.batch_consumed(ConsumedBatch(4, ("g",), (2,), ()), batch, cancelled=0)
    assert stats.counters["mixed_version_trajectories"] == 2
    assert stats.tokens_trained == (10**12) + (10**12 + 2) + (5 + 1 + 10**9)


def test_mixed_versions_reads_plain_lists_and_run_length_lists_alike() -> None:
    assert [mixed_versions(v) for v in ([], [1], [1, 1], [1, 2], [2, 1, 2])] == [False, False, False, True, True]
    assert RunLengthList([(1, 3), (2, 2), (1, 4)]).count(1) == 7 and RunLengthList().count(1) == 0

"""Run-length token lists read like lists."""

from __future__ import annotations

import pytest
from staleflow.adapters.sim.tokens import RunLengthList


def test_reads_like_the_list_it_encodes() -> None:
    plain = [0] * 3 + [1] * 2 + [0]
    runs = RunLengthList([(0, 3), (1, 2), (0, 1)])
    assert len(runs) == 6 and list(runs) == plain and runs == plain and plain == runs
    assert runs[0] == 0 and runs[3] == 1 and runs[-1] == 0 and runs[2:5] == plain[2:5]
    assert max(runs) == 1 and runs.count(0) == 4 and 1 in runs
    with pytest.raises(IndexError):
        runs[6]
    assert runs != [0] * 6


def test_concatenation_merges_runs_and_mixes_with_lists() -> None:
    joined = RunLengthList([(2, 4)]) + [2, 2, 3]
    assert joined.runs() == [(2, 6), (3, 1)]
    assert [1] + RunLengthList([(1, 2)]) == [1, 1, 1]
    assert RunLengthList.extended([], [(5, 0), (7, 2)]).runs() == [(7, 2)]
    assert RunLengthList.of([4, 4, 5]).runs() == [(4, 2), (5, 1)]
    assert len(RunLengthList()) == 0 and list(RunLengthList()) == []
    with pytest.raises(ValueError, match="run length must be >= 0"):
        RunLengthList([(1, -1)])

"""The test tiers of tests/conftest.py: every listed file exists, unknown files get the default tier,
and the markers of a test lift its tier (a Ray or vLLM test is end to end wherever it lives)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import DEFAULT_TIER, E2E, INTEGRATION, TIERS, UNIT, tier_of


def test_every_tiered_file_exists_and_every_test_file_is_tiered_or_defaulted() -> None:
    here = Path(__file__).parent
    files = {p.name for p in here.glob("test_*.py")}
    assert sorted(set(TIERS) - files) == []  # no stale rows
    assert DEFAULT_TIER == INTEGRATION and tier_of("test_new_file_of_another_helper.py", set()) == INTEGRATION


def test_markers_lift_the_tier() -> None:
    assert tier_of("test_protocol.py", set()) == UNIT
    assert tier_of("test_protocol.py", {"slow"}) == INTEGRATION
    assert tier_of("test_protocol.py", {"java"}) == INTEGRATION
    assert tier_of("test_protocol.py", {"ray"}) == E2E
    assert tier_of("test_chaos.py", {"vllm", "slow"}) == E2E
    assert tier_of("test_train_e2e.py", set()) == E2E  # never lowered


def test_the_longest_tier_runs_first(request: pytest.FixtureRequest) -> None:
    tiers = [next(t for t in (E2E, INTEGRATION, UNIT) if item.get_closest_marker(t)) for item in request.session.items]
    assert tiers == sorted(tiers, key=(E2E, INTEGRATION, UNIT).index)

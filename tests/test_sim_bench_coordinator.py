"""``staleflow bench coordinator`` at a tiny scale: the fleet is filled as the protocol allows."""

from __future__ import annotations

import gc

import pytest
from staleflow.bench.coordinator import _Timer, measure, parse_scale


def test_fills_the_protocol_and_times_every_tick() -> None:
    result = measure(instances=4, requests=160, ticks=2, seed=0)
    # batch size ceil(160 / (16 * 4)) = 3: eta + 1 = 4 buffers of 3 groups of 16 requests
    assert result["batch_size"] == 3
    assert result["in_flight_requests"] == 4 * 3 * 16
    assert result["on_instances"] + result["queued_after"] >= result["on_instances"] > 0
    for key in ("observe", "plan", "plan_rerouted_1pct"):
        assert 0 <= result[key]["median_ms"] <= result[key]["p95_ms"] <= result[key]["max_ms"]
        assert 0 <= result["cpu"][key]["median_ms"] <= result["cpu"][key]["p95_ms"] <= result["cpu"][key]["max_ms"]
    assert set(result["full_gc"]) == {"observe", "plan", "plan_rerouted_1pct"}


def test_timer_counts_the_full_collections_inside_a_timed_section() -> None:
    with _Timer(("collect", "idle")) as timer:
        assert timer.timed("collect", gc.collect) >= 0
        assert timer.timed("idle", lambda: "value") == "value"
        gc.collect()  # outside any timed section
    assert timer.full_gc == {"collect": 1, "idle": 0}
    assert len(timer.cpu["collect"]) == len(timer.wall["collect"]) == 1 and timer.cpu["collect"][0] >= 0
    assert timer._count not in gc.callbacks


def test_scale_syntax() -> None:
    assert parse_scale("128x10000") == (128, 10_000)
    with pytest.raises(ValueError, match="expected INSTANCESxREQUESTS"):
        parse_scale("128")

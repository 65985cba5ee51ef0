"""Decode steps for the cost model's fit when vLLM's engine core runs in another process (every GPU
instance, tensor-parallel CPU ones): no scheduler to read, so the engine's own requests say whether a
step is pure decode, and a step's time is the interval between two outputs received."""

from __future__ import annotations

import pytest
from staleflow.adapters.vllm import step_meter
from staleflow.adapters.vllm.step_meter import StepMeter
from staleflow.runtime.coordination.cost_fit import DecodeStepLog
from staleflow.runtime.types import RolloutRequest


def _live(*ids: str, output: int = 0) -> dict[str, RolloutRequest]:
    tokens = {"output_ids": [5] * output, "logprobs": [0.0] * output, "versions": [0] * output}
    return {i: RolloutRequest(i, "g", [1, 2, 3], 16, 0, **tokens) for i in ids}


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [0.0]
    monkeypatch.setattr(step_meter.time, "perf_counter", lambda: now[0])
    return now


def _step(meter: StepMeter, clock: list[float], live: dict, seconds: float, generated: int) -> None:
    meter.before(None, live)
    clock[0] += seconds
    meter.after(generated, in_process=False)


def test_a_step_counts_once_every_request_is_past_its_prefill_and_is_timed_between_outputs(clock: list[float]) -> None:
    meter = StepMeter(DecodeStepLog())
    live = _live("a", "b")
    meter.submitted(live)
    _step(meter, clock, live, 0.5, 2)  # prefill: not a decode step
    meter.produced("a")
    _step(meter, clock, live, 0.02, 1)  # "b" still prefilling
    meter.produced("b")
    _step(meter, clock, _live("a", "b", output=1), 0.03, 2)  # first decode step: no interval before it
    _step(meter, clock, _live("a", "b", output=2), 0.04, 2)
    _step(meter, clock, _live("a", "b", output=3), 0.0, 0)  # an output-less return is no step
    _step(meter, clock, _live("a", "b", output=3), 0.05, 2)
    assert [(s.n, s.kv_tokens, round(s.latency, 6)) for s in meter.log.drain()] == [(2, 10, 0.04), (2, 12, 0.05)]
    meter.submitted(["c"])  # a new request's prefill ends the run of decode steps
    live = {**_live("a", "b", output=4), **_live("c")}
    _step(meter, clock, live, 0.3, 3)
    meter.produced("c")
    _step(meter, clock, live, 0.04, 3)
    assert meter.log.drain() == []

"""The vLLM engine client's thread (``adapters/vllm/engine.py``) at GPU speed, on a stand-in for vLLM's
``LLMEngine`` with its engine core in another process (every GPU instance): the same thread, command
queue, output handling and step meter as a real instance, with the steps and pauses on a clock the
test sets.

* Issue 46, finding 3: each output's internal id was found by scanning every live request, and a
  finished request was forgotten by another scan: work per output grew with the live requests
  (1.8 ms per step at 256 live requests, 12.1 ms at 1,575, beside a 5-15 ms GPU decode step).
* Issue 46, finding 4: with the core elsewhere a step is the interval between two outputs; a weight
  load or a command between two steps was recorded as one decode step of its length.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from skips import needs
from staleflow.adapters.vllm import engine as engine_module
from staleflow.adapters.vllm import step_meter
from staleflow.adapters.vllm.engine import VLLMEngine
from staleflow.runtime.types import RolloutRequest

pytestmark = [pytest.mark.vllm, needs("vllm", "cpu-infer")]  # the client builds vLLM's SamplingParams
#: one decode step of the stand-in core, and a pause between two steps
STEP_S, PAUSE_S = 0.010, 1.0


class CountedId(str):
    """A request id that counts how often it is compared for equality (a scan compares every id it
    passes; a dict lookup of the same object compares none)."""

    comparisons = 0

    def __eq__(self, other: object) -> bool:
        CountedId.comparisons += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


class FakeCoreClient:
    """vLLM's ``LLMEngine`` as the engine client sees it with the core in another process: internal
    ids (ours with a suffix), the output processor's per-request state, one token per step for each
    request named in ``emit``; each step takes :data:`STEP_S` on ``clock``, an abort ``abort_s``."""

    def __init__(self, clock: list[float]) -> None:
        self.clock = clock
        self.engine_core = SimpleNamespace(engine_core=None, shutdown=lambda: None)  # no scheduler here
        self.renderer = SimpleNamespace(render_cmpl=lambda prompts: [prompts[0]])
        self.output_processor = SimpleNamespace(request_states={})
        self.emit: set[str] | None = None  # None: every live request
        self.abort_s = 0.0
        self.steps = 0
        self._live: dict[str, str] = {}  # ours -> internal

    def add_request(self, request_id: str, prompt: Any, params: Any) -> str:
        internal = CountedId(f"{request_id}-0a1b")
        self._live[request_id] = internal
        detokenizer = SimpleNamespace(tokens=0)
        detokenizer.num_output_tokens = lambda: detokenizer.tokens
        self.output_processor.request_states[internal] = SimpleNamespace(weight_version_starts=[("0", 0)], detokenizer=detokenizer)
        return internal

    def abort_request(self, request_ids: list[str]) -> None:
        self.clock[0] += self.abort_s
        for request_id in request_ids:
            self.output_processor.request_states.pop(self._live.pop(request_id), None)

    def step(self) -> list[Any]:
        time.sleep(0.001)  # the thread's pace, not the measured time
        self.clock[0] += STEP_S
        self.steps += 1
        outputs = []
        for request_id in [r for r in self._live if self.emit is None or r in self.emit]:
            state = self.output_processor.request_states[self._live[request_id]]
            state.detokenizer.tokens += 1
            completion = SimpleNamespace(token_ids=[7], logprobs=[{7: SimpleNamespace(logprob=-0.5)}], weight_versions=None,
                                         finish_reason=None)
            outputs.append(SimpleNamespace(request_id=request_id, outputs=[completion], finished=False))
        return outputs


@pytest.fixture
def client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A :class:`VLLMEngine` whose thread drives a :class:`FakeCoreClient`; ``clock[0]`` is the meter's time."""
    clock = [0.0]
    fake = FakeCoreClient(clock)
    monkeypatch.setattr(step_meter.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(engine_module, "with_weight_transfer", lambda args: (dict(args), "gloo"))
    monkeypatch.setattr(engine_module, "make_llm_engine", lambda args: fake)
    monkeypatch.setattr(engine_module, "InstanceWeightSync", lambda *args, **kwargs: None)

    def load(llm: Any, path: Path, version: int) -> None:  # a weight load: the core paused for PAUSE_S
        clock[0] += PAUSE_S

    monkeypatch.setattr(engine_module, "reload_weights_file", load)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    engine = VLLMEngine("rollout-0", tmp_path / "model", max_model_len=4096, weights_dir=tmp_path / "weights")
    engine.fake = fake
    yield engine
    engine.close()


def _requests(count: int, max_new_tokens: int = 2000) -> list[RolloutRequest]:
    return [RolloutRequest(CountedId(f"r{i}"), f"g{i}", [1, 2, 3], max_new_tokens, 0) for i in range(count)]


def _comparisons(engine: VLLMEngine, work: Any) -> int:
    """Id comparisons made by ``work`` run on the engine thread between two steps."""

    def counted() -> int:
        CountedId.comparisons = 0
        work()
        return CountedId.comparisons

    return engine._call(counted)


def _per_output_work(engine: VLLMEngine, live: int) -> tuple[int, int]:
    """Id comparisons for absorbing one output of a running request, and for one request leaving,
    with ``live`` requests in the engine."""
    engine.fake.emit = set()
    requests = _requests(live)
    engine.submit(requests)
    last = requests[-1].request_id  # a scan from the oldest request passes every other id
    internal = engine.fake._live[last]
    completion = SimpleNamespace(token_ids=[7], logprobs=[{7: SimpleNamespace(logprob=-0.5)}], weight_versions=None, finish_reason=None)
    output = SimpleNamespace(request_id=last, outputs=[completion], finished=False)

    def absorb() -> None:
        engine.fake.output_processor.request_states[internal].detokenizer.tokens += 1
        assert engine._absorb(output) == 1

    absorbed = _comparisons(engine, absorb)
    left = _comparisons(engine, lambda: engine._do_stop([last]))
    engine.abort([r.request_id for r in requests])
    return absorbed, left


def test_the_engine_client_does_the_same_work_per_output_at_10_and_5000_live_requests(client: VLLMEngine) -> None:
    """Before: 5,000 id comparisons per output absorbed at 5,000 live requests (a scan for its internal
    id) and as many for a request leaving; now a dict lookup each, whatever the live requests."""
    few = _per_output_work(client, 10)
    many = _per_output_work(client, 5000)
    assert many == few, f"per-output id comparisons at 10 live requests {few}, at 5,000 {many}"
    assert max(many) <= 2


def _wait_for_steps(engine: VLLMEngine, steps: int) -> None:
    target = engine.fake.steps + steps
    deadline = time.monotonic() + 30
    while engine.fake.steps < target:
        assert time.monotonic() < deadline, "the engine thread stopped stepping"
        time.sleep(0.002)


def test_a_weight_load_or_a_command_between_two_steps_is_not_a_decode_step(client: VLLMEngine) -> None:
    """Before: with the core elsewhere the interval after a 1 s weight load (or a 1 s command, here an
    abort) was recorded as a 1.01 s decode step, once per instance per version."""
    client.submit(_requests(3))
    _wait_for_steps(client, 5)
    client.load_weights(1, {"w": torch.zeros(2)})  # a state dict: written to a file, then loaded
    _wait_for_steps(client, 5)
    client.fake.abort_s = PAUSE_S
    client.abort(["r2"])
    _wait_for_steps(client, 5)
    steps = client.decode_steps()
    assert len(steps) >= 8, steps  # the decode steps are still measured
    assert {s.n for s in steps} <= {2, 3}
    assert max(s.latency for s in steps) == pytest.approx(STEP_S), [round(s.latency, 3) for s in steps]


"""A vLLM engine whose engine thread dies mid-run: an instance failure the run loop recovers from.

Its own module: the engine it kills is its own (one in-process vLLM engine at a time).
"""

from __future__ import annotations

import pytest
from skips import needs

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    needs("vllm", "cpu-infer"),
]


def test_a_crashed_engine_thread_is_an_instance_failure_the_run_loop_recovers_from(tiny_model):
    """The vLLM binding raises only the seam's failure contract: when its engine thread dies, every
    call raises ``EngineFailed`` (an ``InstanceLostError``), and the run loop re-queues the requests
    it had placed there and finishes on the other instance."""
    from runtime_fakes import FakeEngine, FakeTrainer, prompt_groups
    from staleflow.adapters.vllm.engine import EngineFailed, SamplingConfig, VLLMEngine
    from staleflow.runtime.coordination.cost_model import CostModel
    from staleflow.runtime.interfaces import InstanceLostError
    from staleflow.runtime.run.assembly import assemble_run
    from staleflow.runtime.run.clock import RealClock
    from staleflow.runtime.run.loop import RunParts
    from staleflow.runtime.run.run_spec import RunSpec
    from staleflow.runtime.settings.policies import make_policy

    def crash() -> None:
        raise RuntimeError("injected: the engine thread dies on its next step")

    class ModelFolderTrainer(FakeTrainer):
        """Every version's weights are the model folder, which the vLLM engine can load."""

        def weights(self) -> str:
            return str(model_dir)

    model_dir = tiny_model  # the session's (read only)
    engine = VLLMEngine("local", model_dir, sampling=SamplingConfig(temperature=0.0))
    engine._llm.step = crash  # the engine thread calls it as soon as it has a request
    clock = RealClock()
    other = FakeEngine("fake", clock, tokens_per_s=4000, load_s=0.002, announce_events=False)
    parts = RunParts(engines=[engine, other], trainer=ModelFolderTrainer(clock, 0.01), prompts=prompt_groups(2, lengths=(8, 12, 20)),
                     cost_model=CostModel(0.0064, 0.0027, 1.231e-4, 0.0028, 3.35e-8), clock=clock)
    loop = assemble_run(RunSpec(make_policy("staleflow"), eta=1, batch_size=2, tick_s=0.002), parts)
    try:
        metrics = loop.run(3)
        loop.state_dict()  # quiesce: the audit is exact afterwards
        report = loop.audit()
    finally:
        loop.close()  # closing the dead engine is skipped as an instance failure
    with pytest.raises(EngineFailed) as failure:
        engine.collect()
    assert isinstance(failure.value, InstanceLostError) and isinstance(failure.value, ConnectionError)
    assert metrics.steps == 3 and metrics.max_staleness <= 1 and metrics.lost == 0 and metrics.duplicated == 0
    assert report.ok, report
    counters = loop.stats.counters
    assert counters["instance_failures"] >= 1 and counters["requests_recovered"] >= 1, dict(counters)
    assert loop.instances.down == {"local"}


def test_an_engine_that_does_not_start_in_time_is_an_error_naming_it_and_its_setting(tiny_model, monkeypatch):
    """A model that takes longer to load than ``start_timeout_s`` (here a loader held back) stops the
    constructor with an error naming the instance, the model and the setting to raise."""
    import threading

    from staleflow.adapters.vllm import engine as binding

    release = threading.Event()
    ended = threading.Event()

    def slow_loader(engine_args):  # type: ignore[no-untyped-def]
        release.wait(60)
        ended.set()
        raise RuntimeError("loader released")

    monkeypatch.setattr(binding, "make_llm_engine", slow_loader)
    named = rf"vLLM engine rollout-7 \(model {tiny_model}\) did not start within 0.2 s \(rollout.start_timeout_s"
    with pytest.raises(TimeoutError, match=named):
        binding.VLLMEngine("rollout-7", str(tiny_model), start_timeout_s=0.2)
    release.set()
    assert ended.wait(10)  # the engine thread ends too (the loader's failure is reported to no one)

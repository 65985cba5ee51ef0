"""The simulated trainer: step time from the training model, version advance, refusals."""

from __future__ import annotations

import pytest
from staleflow.adapters.sim.trainer import SimTrainer, SimWeights
from staleflow.runtime.interfaces import Trainer
from staleflow.runtime.run.clock import VirtualClock
from staleflow.runtime.settings.workload import TrainingSpec
from staleflow.runtime.types import TrainingBatch, Trajectory


def batch(version: int, lengths: list[int], prompt: int = 10) -> TrainingBatch:
    groups = {
        f"g{i}": [Trajectory(f"g{i}-0", f"g{i}", [1] * prompt, [0] * n, [-1.0] * n, [version] * n, "stop")]
        for i, n in enumerate(lengths)
    }
    return TrainingBatch(version=version, groups=groups)


def test_step_time_grows_with_batch_tokens_and_versions_advance() -> None:
    clock = VirtualClock()
    trainer = SimTrainer(clock, TrainingSpec(base_s=2.0, per_token_s=0.01))
    assert isinstance(trainer, Trainer)
    trainer.start_step(batch(0, [90, 190]))  # 20 prompt + 280 response tokens
    assert trainer.next_event_time() == pytest.approx(5.0)
    clock.sleep_until(4.9)
    assert trainer.poll() is None
    clock.sleep_until(trainer.next_event_time())
    result = trainer.poll()
    assert result is not None and result.version == 1
    assert result.metrics["step_time_s"] == pytest.approx(5.0)
    assert result.metrics["response_tokens"] == 280 and result.metrics["batch_tokens"] == 300
    assert trainer.weights() == SimWeights(1) and trainer.next_event_time() is None
    assert trainer.poll() is None

    trainer.start_step(batch(1, [10]))  # a smaller batch trains faster
    assert trainer.next_event_time() == pytest.approx(5.0 + 2.0 + 0.2)


def test_refuses_a_second_step_and_a_wrong_buffer() -> None:
    trainer = SimTrainer(VirtualClock(), TrainingSpec(base_s=1.0, per_token_s=0.0))
    with pytest.raises(ValueError, match="at version 0, cannot train on buffer 1"):
        trainer.start_step(batch(1, [5]))
    trainer.start_step(batch(0, [5]))
    with pytest.raises(RuntimeError, match="busy with buffer 0"):
        trainer.start_step(batch(0, [5]))

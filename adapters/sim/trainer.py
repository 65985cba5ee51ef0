"""A simulated trainer: each step takes the workload's training time for its batch, in virtual time.

Step time is the workload's training model over the batch: ``tokens`` counts the prompt and response
tokens of every trajectory, and with attention FLOPs the squared length of each trajectory adds its
share (:class:`~staleflow.runtime.settings.workload.TrainingSpec`, on the workload's trainer GPUs).
Weights are a version token (:class:`SimWeights`): the simulator moves versions, not tensors.
``scale`` multiplies the step time (a colocated system trains on every GPU: ``trainer_gpus / gpus``);
``after_step_s`` keeps the trainer busy after each step (a blocking weight broadcast, ROLL's offload
of the trainer's states); ``recompute``: the step includes the old log-prob recompute (a system that
trains on the rollout's log-probs skips it); ``reference``: and a reference model's forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from staleflow.runtime.interfaces import Clock
from staleflow.runtime.settings.workload import TrainingSpec, Workload
from staleflow.runtime.types import TrainingBatch, TrainResult


@dataclass(frozen=True)
class SimWeights:
    """The simulated model at ``version``."""

    version: int


@dataclass(frozen=True)
class _Step:
    version: int
    start: float
    end: float
    tokens: int
    response_tokens: int
    groups: int
    trajectories: int


class SimTrainer:
    """The :class:`~staleflow.runtime.interfaces.Trainer` seam, timed by a training-time model.

    Training on buffer ``b`` turns version ``b`` into ``b + 1``; a batch for any other buffer than
    the trainer's current version is refused (it would skip or repeat a version).
    """

    def __init__(
        self, clock: Clock, training: TrainingSpec, version: int = 0, scale: float = 1.0, after_step_s: float = 0.0,
        trainer_gpus: int = 1, recompute: bool = True, reference: bool = False,
    ) -> None:
        if scale <= 0 or after_step_s < 0:
            raise ValueError(f"need scale > 0 and after_step_s >= 0, got {scale} and {after_step_s}")
        self._clock = clock
        self._training = training
        self._trainer_gpus = trainer_gpus
        self._scale = scale
        self._after = after_step_s
        self._recompute = recompute
        self._reference = reference
        self._version = version
        self._step: _Step | None = None

    @classmethod
    def from_workload(
        cls, workload: Workload, clock: Clock, version: int = 0, scale: float = 1.0, after_step_s: float = 0.0,
        recompute: bool = True, reference: bool = False,
    ) -> SimTrainer:
        return cls(clock, workload.training, version, scale, after_step_s, workload.cluster.trainer_gpus, recompute, reference)

    @property
    def version(self) -> int:
        return self._version

    def start_step(self, batch: TrainingBatch) -> None:
        if self._step is not None:
            raise RuntimeError(f"trainer is busy with buffer {self._step.version}; poll() it first")
        if batch.version != self._version:
            raise ValueError(f"trainer is at version {self._version}, cannot train on buffer {batch.version}")
        prompt = response = trajectories = squares = 0
        for group in batch.groups.values():
            for trajectory in group:
                prompt += len(trajectory.prompt_ids)
                response += len(trajectory.output_ids)
                squares += (len(trajectory.prompt_ids) + len(trajectory.output_ids)) ** 2
                trajectories += 1
        start = self._clock.now()
        self._step = _Step(
            version=batch.version,
            start=start,
            end=start + self._scale * self._training.step_time(
                prompt + response, self._trainer_gpus, squares, self._recompute, self._reference)
            + self._after,
            tokens=prompt + response,
            response_tokens=response,
            groups=len(batch.groups),
            trajectories=trajectories,
        )

    def poll(self) -> TrainResult | None:
        step = self._step
        if step is None or self._clock.now() < step.end:
            return None
        self._step = None
        self._version = step.version + 1
        return TrainResult(
            version=self._version,
            metrics={
                "step_time_s": step.end - step.start,
                "start_time": step.start,
                "end_time": step.end,
                "batch_tokens": float(step.tokens),
                "response_tokens": float(step.response_tokens),
                "groups": float(step.groups),
                "trajectories": float(step.trajectories),
            },
        )

    def weights(self) -> Any:
        return SimWeights(self._version)

    def next_event_time(self) -> float | None:
        return None if self._step is None else self._step.end

    def close(self) -> None:
        self._step = None

"""Small deterministic rollout engine and trainer for the runtime tests (not the simulator).

:class:`FakeEngine` decodes every running request at ``tokens_per_s`` (no cost model), runs at most
``max_running`` requests (the rest wait), and stops generating for ``load_s`` seconds while it
loads weights; each token records the version it was generated with. :class:`FakeTrainer` takes
``step_s`` seconds per step. Both follow a :class:`~staleflow.runtime.interfaces.Clock`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from staleflow.runtime.interfaces import Clock, WeightsReference
from staleflow.runtime.types import (
    InstanceSnapshot,
    PromptGroup,
    RolloutRequest,
    TrainingBatch,
    TrainResult,
    Trajectory,
)

_EPS = 1e-9


class FakeEngine:
    def __init__(
        self,
        instance_id: str,
        clock: Clock,
        tokens_per_s: float = 100.0,
        max_running: int = 8,
        load_s: float = 0.5,
        announce_events: bool = True,
    ) -> None:
        self.instance_id = instance_id
        self.clock = clock
        self.rate = tokens_per_s
        self.max_running = max_running
        self.load_s = load_s
        self.announce = announce_events
        self.version = 0
        self.weights: Any = None
        self.loads: list[int] = []
        self._loading_until = clock.now()
        self._last = clock.now()
        self._running: dict[str, list[Any]] = {}  # rid -> [request, progress]
        self._waiting: dict[str, RolloutRequest] = {}
        self._finished: list[Trajectory] = []

    # the interface -------------------------------------------------------------
    def submit(self, requests: Sequence[RolloutRequest]) -> None:
        self._advance()
        for request in requests:
            if request.request_id in self._running or request.request_id in self._waiting:
                raise ValueError(f"{self.instance_id}: request {request.request_id} submitted twice")
            if self.version < request.group_version:
                raise ValueError(f"{self.instance_id}: version {self.version} < group version {request.group_version}")
            self._waiting[request.request_id] = replace(
                request, output_ids=list(request.output_ids), logprobs=list(request.logprobs), versions=list(request.versions)
            )
        self._schedule()

    def interrupt(self, request_ids: Sequence[str]) -> list[RolloutRequest]:
        self._advance()
        partials = []
        for rid in request_ids:
            if rid in self._running:
                partials.append(self._running.pop(rid)[0])
            elif rid in self._waiting:
                partials.append(self._waiting.pop(rid))
        self._schedule()
        return partials

    def abort(self, request_ids: Sequence[str]) -> None:
        self.interrupt(request_ids)

    def load_weights(self, version: int, weights: Any) -> None:
        self._advance()
        if isinstance(weights, WeightsReference):  # as a real engine: fetched from the server here
            weights = weights.fetch()
        self.version = version
        self.weights = weights
        self.loads.append(version)
        self._loading_until = self.clock.now() + self.load_s

    def loaded_weights(self) -> Any:
        """The weights of the last load (what a remote caller cannot read as an attribute)."""
        return self.weights

    def snapshot(self) -> InstanceSnapshot:
        self._advance()
        kv = sum(len(r.prompt_ids) + len(r.output_ids) for r, _ in self._running.values())
        return InstanceSnapshot(
            instance_id=self.instance_id,
            version=self.version,
            running=tuple(self._running),
            waiting=tuple(self._waiting),
            kv_tokens=kv,
            kv_capacity=self.max_running * 64,
            tokens_per_s=self.rate * len(self._running),
            time=self.clock.now(),
            loading=self.clock.now() < self._loading_until,
        )

    def collect(self) -> list[Trajectory]:
        self._advance()
        finished, self._finished = self._finished, []
        return finished

    def next_event_time(self) -> float | None:
        if not self.announce:
            return None
        times = [
            max(self._last, self._loading_until) + (self._target(r) - p) / self.rate for r, p in self._running.values()
        ]
        if self._loading_until > self.clock.now():
            times.append(self._loading_until)
        return min(times) if times else None

    def close(self) -> None:
        pass

    def held(self) -> set[str]:
        return set(self._running) | set(self._waiting)

    # internals -----------------------------------------------------------------
    @staticmethod
    def _target(request: RolloutRequest) -> int:
        return request.max_new_tokens

    def _advance(self) -> None:
        now = self.clock.now()
        start = max(self._last, min(self._loading_until, now))
        dt = max(0.0, now - start)
        self._last = now
        if dt <= 0:
            return
        for rid, entry in list(self._running.items()):
            request, progress = entry
            target = self._target(request)
            progress = min(target, progress + dt * self.rate)
            entry[1] = progress
            while len(request.output_ids) < int(progress + _EPS):
                request.output_ids.append(len(request.output_ids) % 7)
                request.logprobs.append(-0.5)
                request.versions.append(self.version)
            if len(request.output_ids) >= target:
                del self._running[rid]
                self._finished.append(
                    Trajectory(
                        request.request_id, request.group_id, request.prompt_ids, request.output_ids,
                        request.logprobs, request.versions, "length", metadata=dict(request.metadata),
                    )
                )
        self._schedule()

    def _schedule(self) -> None:
        while self._waiting and len(self._running) < self.max_running:
            rid = next(iter(self._waiting))
            request = self._waiting.pop(rid)
            self._running[rid] = [request, float(len(request.output_ids))]


class FakeTrainer:
    def __init__(self, clock: Clock, step_s: float = 1.0) -> None:
        self.clock = clock
        self.step_s = step_s
        self.version = 0
        self.batches: list[TrainingBatch] = []
        self._done_at: float | None = None

    def start_step(self, batch: TrainingBatch) -> None:
        if self._done_at is not None:
            raise RuntimeError("a step is already running")
        if batch.version != self.version:
            raise RuntimeError(f"batch for buffer {batch.version} given to a trainer at version {self.version}")
        self.batches.append(batch)
        self._done_at = self.clock.now() + self.step_s

    def poll(self) -> TrainResult | None:
        if self._done_at is None or self.clock.now() < self._done_at:
            return None
        self._done_at = None
        self.version += 1
        return TrainResult(self.version, {"groups": float(len(self.batches[-1].groups))})

    def weights(self) -> Any:
        return {"version": self.version}

    def next_event_time(self) -> float | None:
        return self._done_at

    def close(self) -> None:
        pass


def prompt_groups(n_samples: int = 2, n_extra: int = 0, lengths: Sequence[int] = (20, 35, 50, 80, 10, 120)) -> Iterator[PromptGroup]:
    """Endless groups with deterministic response lengths cycling through ``lengths``."""
    index = 0
    while True:
        count = n_samples + n_extra
        drawn = [lengths[(index + i) % len(lengths)] for i in range(count)]
        yield PromptGroup(f"g{index}", [1, 2, 3, 4], n_samples, n_extra, sample_metadata=[{"max_new_tokens": n} for n in drawn])
        index += 1

"""The part of the Trainer seam that every real trainer shares: one training step at a time on a
background thread, a published copy of the newest weights, and the checkpoint guard."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from staleflow.runtime.types import TrainingBatch, TrainResult


class BackgroundStepTrainer:
    """Runs :meth:`_step` (a subclass's training step) on one worker thread.

    Subclasses call :meth:`_start_background` at the end of ``__init__`` with the version their
    weights hold and a copy of those weights, implement ``_step(batch) -> TrainResult`` (which
    updates ``_version`` and ``_published`` under ``_lock``), and may use
    :meth:`_checkpoint_folder` to create a checkpoint folder while no step runs.
    """

    _version: int
    _published: Any
    _lock: threading.Lock
    _executor: ThreadPoolExecutor
    _running: Future[TrainResult] | None

    def _start_background(self, version: int, published: Any, thread_name: str) -> None:
        self._version = version
        self._lock = threading.Lock()  # guards the model between the step thread and callers
        self._published = published
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)
        self._running = None

    def _step(self, batch: TrainingBatch) -> TrainResult:
        raise NotImplementedError

    @property
    def version(self) -> int:
        """The newest finished version (the one :meth:`weights` returns)."""
        return self._version

    def start_step(self, batch: TrainingBatch) -> None:
        if self._running is not None:
            raise RuntimeError("a training step is already running; poll() it first")
        if batch.version != self._version:
            raise ValueError(
                f"batch is buffer {batch.version} but the trainer holds version {self._version}; "
                "buffer v trains version v into v + 1"
            )
        self._running = self._executor.submit(self._step, batch)

    def poll(self) -> TrainResult | None:
        if self._running is None or not self._running.done():
            return None
        future, self._running = self._running, None
        return future.result()  # re-raises a failed step's exception

    def wait(self, timeout: float | None = None) -> TrainResult:
        """Block until the running step finishes and return its result."""
        if self._running is None:
            raise RuntimeError("no training step is running")
        self._running.result(timeout=timeout)
        result = self.poll()
        assert result is not None
        return result

    def weights(self) -> Any:
        """The weights of version :attr:`version` (a CPU copy; safe to hand to other threads)."""
        return self._published

    def next_event_time(self) -> float | None:
        return None

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _checkpoint_folder(self, folder: str | os.PathLike[str]) -> Path:
        """Create ``folder`` for a checkpoint; refused while a step runs (its state is in flux)."""
        if self._running is not None:
            raise RuntimeError("cannot checkpoint while a training step is running")
        target = Path(folder)
        target.mkdir(parents=True, exist_ok=True)
        return target

    def _restore_folder(self, folder: str | os.PathLike[str]) -> Path:
        """``folder`` as a path to restore from; refused while a step runs (it would race the step)."""
        if self._running is not None:
            raise RuntimeError("cannot restore while a training step is running")
        return Path(folder)

"""The parameter server (PS): versioned model weights, one writer and many readers.

The trainer pushes version ``v + 1`` after each step (the run loop does it in the background so it
overlaps the next step); rollout instances pull when the coordinator says so, and a pull holds up
only the instance that pulls. A readers-writer lock makes a version visible only once it is
completely written: a reader sees the previous newest version until the push has finished. The last
``keep`` versions are kept, since instances may sit on older versions.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from staleflow.runtime.interfaces import TransferFailedError


class ReadWriteLock:
    """Many readers or one writer; a waiting writer goes before new readers (no writer starvation)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0

    @contextmanager
    def reading(self) -> Iterator[None]:
        with self._cond:
            while self._writing or self._writers_waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @contextmanager
    def writing(self) -> Iterator[None]:
        with self._cond:
            self._writers_waiting += 1
            while self._writing or self._readers:
                self._cond.wait()
            self._writers_waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()


class VersionNotAvailableError(TransferFailedError, LookupError):
    """A pull asked for a version the PS does not hold (not pushed yet, or evicted)."""


class ParameterServer:
    """Versioned weights.

    Args:
        keep: how many of the newest versions to keep (>= 1).
        copy_weights: how a pushed value is copied into the server, so the trainer may go on
            changing its own weights (default ``copy.deepcopy``; a torch state dict is cloned).
    """

    def __init__(self, keep: int = 3, copy_weights: Callable[[Any], Any] = copy.deepcopy) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        self._keep = keep
        self._copy = copy_weights
        self._lock = ReadWriteLock()
        self._push_lock = threading.Lock()  # one writer: pushes are serialised
        self._versions: dict[int, Any] = {}
        self._latest: int | None = None

    def push(self, version: int, weights: Any) -> None:
        """Store ``weights`` as ``version`` (newer than every stored one); evicts the oldest beyond ``keep``.

        The copy is made before the write lock is taken, so readers are held up only for the
        moment the new version is published.
        """
        with self._push_lock:
            if isinstance(version, bool) or not isinstance(version, int) or version < 0:
                raise ValueError(f"version must be an int >= 0, got {version!r}")
            if self._latest is not None and version <= self._latest:
                raise ValueError(f"cannot push version {version}: version {self._latest} is already stored")
            stored = self._copy(weights)
            with self._lock.writing():
                self._versions[version] = stored
                self._latest = version
                for old in sorted(self._versions)[: -self._keep]:
                    del self._versions[old]

    def latest_version(self) -> int | None:
        """The newest completely written version (None before the first push)."""
        with self._lock.reading():
            return self._latest

    def versions(self) -> tuple[int, ...]:
        with self._lock.reading():
            return tuple(sorted(self._versions))

    def pull(self, version: int | None = None) -> tuple[int, Any]:
        """The weights of ``version`` (default: the newest) as ``(version, weights)``."""
        with self._lock.reading():
            if version is None:
                version = self._latest
            if version is None or version not in self._versions:
                raise VersionNotAvailableError(
                    f"version {version} is not on the parameter server (it holds {sorted(self._versions)})"
                )
            return version, self._versions[version]

    def state_dict(self) -> dict[str, Any]:
        """The newest version number (the weights themselves are the trainer's checkpoint)."""
        return {"latest_version": self.latest_version()}

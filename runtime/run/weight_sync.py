"""Publishing the trainer's weights: each new version is pushed to the parameter server.

With a real clock a push runs in a background thread so that it overlaps the next training step
(one writer at a time: a push waits for the previous one); in simulation it runs inline. A push
that fails with the failure contract's errors (:data:`~staleflow.runtime.interfaces.INSTANCE_FAILURES`)
is kept and retried in order, oldest first, on every later iteration; :meth:`WeightPublisher.flush`
insists (up to :data:`PUSH_ATTEMPTS` rounds) where the run cannot go on without it.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from staleflow.runtime.interfaces import INSTANCE_FAILURES
from staleflow.runtime.servers.parameter_server import ParameterServer

#: Attempts at a push the loop cannot go on without (the first one; any left before a checkpoint).
PUSH_ATTEMPTS = 10


class PushFailedError(RuntimeError):
    """A version could not be pushed in :data:`PUSH_ATTEMPTS` attempts where the run needs it."""


class WeightPublisher:
    """Pushes versions to ``parameter_server``; ``background``: in a thread (real clock).

    Failed pushes are counted in ``counters["push_failures"]``.
    """

    def __init__(self, parameter_server: ParameterServer, background: bool, counters: Counter[str]) -> None:
        self.ps = parameter_server
        self._counters = counters
        self._pusher = ThreadPoolExecutor(1, thread_name_prefix="push") if background else None
        self._future: Future[None] | None = None
        self._unpushed: list[tuple[int, Any]] = []  # failed pushes, retried in order

    @property
    def behind(self) -> bool:
        """Some version failed to push and waits for a retry."""
        return bool(self._unpushed)

    def push(self, version: int, weights: Any) -> None:
        """Publish ``version`` (in the background, or inline and retried later if it fails)."""
        if self._pusher is None:
            self._unpushed.append((version, weights))
            self.retry()
            return
        self.wait()  # one writer: the previous push finishes first
        self._future = self._pusher.submit(self.ps.push, version, weights)

    def retry(self) -> bool:
        """Push what failed to push before, oldest first; True if something was pushed."""
        pushed = False
        while self._unpushed:
            try:
                self.ps.push(*self._unpushed[0])
            except INSTANCE_FAILURES:
                self._counters["push_failures"] += 1
                return pushed
            self._unpushed.pop(0)
            pushed = True
        return pushed

    def push_now(self, version: int, weights: Any, needed_by: str) -> None:
        """Push ``version`` before going on (:meth:`flush` after queueing it)."""
        self._unpushed.append((version, weights))
        self.flush(needed_by)

    def flush(self, needed_by: str) -> None:
        """Retry the failed pushes until none is left; raise after :data:`PUSH_ATTEMPTS` rounds."""
        for _ in range(PUSH_ATTEMPTS):
            if not self._unpushed:
                return
            self.retry()
        if self._unpushed:
            raise PushFailedError(
                f"version {self._unpushed[0][0]} could not be pushed in {PUSH_ATTEMPTS} attempts ({needed_by} needs it)"
            )

    def pull(self, version: int) -> tuple[int, Any]:
        """``version`` as a rollout instance's Pull gets it from the parameter server (the weights, a
        reference or a transfer: whatever the server hands out), once every push has finished (the
        evaluation engine loads its versions so)."""
        self.wait()
        self.flush(f"a pull of version {version}")
        return self.ps.pull(version)

    def wait(self) -> None:
        """Wait for the background push in flight, if any (its error, if any, is raised here)."""
        if self._future is not None:
            self._future.result()

    def close(self) -> None:
        self.wait()
        if self._pusher is not None:
            self._pusher.shutdown()

"""Real and virtual clocks (the :class:`~staleflow.runtime.interfaces.Clock` seam)."""

from __future__ import annotations

import time


class RealClock:
    """Wall-clock seconds since construction."""

    simulated = False

    def __init__(self) -> None:
        self._start = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self._start

    def sleep_until(self, deadline: float) -> None:
        delay = deadline - self.now()
        if delay > 0:
            time.sleep(delay)


class VirtualClock:
    """Simulated seconds: ``sleep_until`` jumps at once. Deterministic; used by the simulator."""

    simulated = True

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def sleep_until(self, deadline: float) -> None:
        if deadline > self._now:
            self._now = deadline

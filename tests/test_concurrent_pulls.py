"""Pulls to several instances run concurrently with a real clock (the instance driver), and one that
fails loses only its own instance.

Each fake engine's ``load_weights`` waits at a barrier that opens only once every load of the batch
has started: pulls carried out one after another break it (the first waits alone until the timeout).
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest
from staleflow.runtime.coordination.commands import Abort, Pull
from staleflow.runtime.coordination.observations import InstanceLost
from staleflow.runtime.interfaces import InstanceLostError
from staleflow.runtime.run.clock import RealClock
from staleflow.runtime.run.instance_driver import InstanceDriver
from staleflow.runtime.servers.parameter_server import ParameterServer
from staleflow.runtime.servers.trajectory_server import TrajectoryServer

BARRIER_TIMEOUT_S = 5.0


class BarrierEngine:
    """Loads only once ``barrier`` has every party; ``fails``: then raises it instead of loading."""

    def __init__(self, instance_id: str, barrier: threading.Barrier, fails: Exception | None = None) -> None:
        self.instance_id = instance_id
        self.version = 0
        self.weights: Any = None
        self.version_at_abort: int | None = None
        self._barrier = barrier
        self._fails = fails

    def load_weights(self, version: int, weights: Any) -> None:
        self._barrier.wait()
        if self._fails is not None:
            raise self._fails
        self.version, self.weights = version, weights

    def abort(self, request_ids: Any) -> None:
        self.version_at_abort = self.version

    def next_event_time(self) -> float | None:
        return None

    def close(self) -> None:
        pass


def _driver(engines: list[BarrierEngine]) -> InstanceDriver:
    ps = ParameterServer()
    ps.push(1, {"w": 1})
    return InstanceDriver(engines, TrajectoryServer(), ps, RealClock(), Counter())


def test_pulls_to_several_instances_take_about_one_transfer_not_one_each() -> None:
    barrier = threading.Barrier(4, timeout=BARRIER_TIMEOUT_S)
    engines = [BarrierEngine(f"i{k}", barrier) for k in range(4)]
    driver = _driver(engines)
    try:
        lost = driver.execute([Pull(e.instance_id, 1) for e in engines])
    finally:
        driver.close()
    assert lost == []
    assert [(e.version, e.weights) for e in engines] == [(1, {"w": 1})] * 4
    assert driver.counters["command_pull"] == 4
    assert driver.take_touched() == {e.instance_id for e in engines}


def test_a_failed_pull_loses_only_its_instance_and_a_later_command_waits_for_the_pull() -> None:
    barrier = threading.Barrier(3, timeout=BARRIER_TIMEOUT_S)
    a, b = BarrierEngine("a", barrier), BarrierEngine("b", barrier)
    c = BarrierEngine("c", barrier, fails=InstanceLostError("c died while loading"))
    driver = _driver([a, b, c])
    try:
        lost = driver.execute([Pull("a", 1), Pull("b", 1), Pull("c", 1), Abort("a", ()), Abort("c", ())])
    finally:
        driver.close()
    assert lost == [InstanceLost("c")]
    assert driver.down == {"c"}
    assert (a.version, b.version, c.version) == (1, 1, 0)
    assert a.version_at_abort == 1  # the Abort to a came after its pull had ended
    assert c.version_at_abort is None  # a lost instance's later commands are skipped
    assert driver.counters["command_pull"] == 2 and driver.counters["instance_failures"] == 1


def test_a_bug_in_one_pull_is_raised_after_the_other_pulls_are_recorded() -> None:
    barrier = threading.Barrier(3, timeout=BARRIER_TIMEOUT_S)
    engines = [BarrierEngine("a", barrier), BarrierEngine("b", barrier, fails=ValueError("bad weights")), BarrierEngine("c", barrier)]
    driver = _driver(engines)
    try:
        with pytest.raises(ValueError, match="bad weights"):
            driver.execute([Pull(e.instance_id, 1) for e in engines])
    finally:
        driver.close()
    assert [e.version for e in engines] == [1, 0, 1]
    assert driver.counters["command_pull"] == 2
    assert driver.down == set()

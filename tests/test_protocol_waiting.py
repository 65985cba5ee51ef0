"""Waiting for the protocol (issue 26): the documented wake-up sets are right, AsyncWaiter with real
asyncio tasks (and a locked manager driven from another thread), and the locked wrapper's blocking
waits with real threads and timeouts."""

from __future__ import annotations

import asyncio
import queue
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest
from staleflow.protocol import (
    ADMISSIBLE_AFTER,
    CONSUMABLE_AFTER,
    AsyncWaiter,
    ConsumedBatch,
    LockedStalenessManager,
    StalenessManager,
    StaleVersionError,
)
from staleflow.protocol.waiting import admissible_now


def _slacks(manager: StalenessManager) -> list[int]:
    return [manager.reserve_slack(v) for v in range(manager.version + 1)]


@pytest.mark.parametrize("eta, batch_size, redundancy", [(0, 1, 0), (1, 2, 1), (2, 3, 0), (3, 2, 2)])
def test_only_the_documented_operations_enable_consume_or_widen_admission(eta: int, batch_size: int, redundancy: int) -> None:
    """On random runs: an operation outside CONSUMABLE_AFTER never turns can_consume() true, one
    outside ADMISSIBLE_AFTER never raises any version's reserve slack; and the listed ones do sometimes."""
    rng = random.Random(eta * 100 + batch_size)
    manager = StalenessManager(eta, batch_size, redundancy)
    enabled: set[str] = set()
    widened: set[str] = set()
    for n in range(3000):
        consumable, slacks = manager.can_consume(), _slacks(manager)
        running = [g.group_id for g in manager.groups() if g.status.value == "running"]
        roll = rng.random()
        if roll < 0.45:
            op = "reserve"
            manager.reserve(n, max(0, manager.version - rng.randint(0, eta + 1)))
        elif roll < 0.75 and running:
            op = "occupy"
            manager.occupy(rng.choice(running))
        elif roll < 0.85 and len(manager):
            op = "abort"
            manager.abort(rng.choice(list(manager.groups())).group_id)
        elif consumable:
            op = "consume"
            manager.consume()
        else:
            continue
        if manager.can_consume() and not consumable:
            enabled.add(op)
        after = _slacks(manager)
        if any(a > b for a, b in zip(after, slacks)) or len(after) > len(slacks):
            widened.add(op)
    assert enabled <= CONSUMABLE_AFTER and widened <= ADMISSIBLE_AFTER
    assert "occupy" in enabled and "consume" in widened and "abort" in widened


# ----------------------------------------------------------------------------- asyncio


def test_async_rollout_loop_awaits_admission_and_batches() -> None:
    """4 producer tasks await admission when refused; the trainer task awaits a batch. Every group
    is trained within its bound and nobody polls."""

    async def main() -> tuple[list[ConsumedBatch], int]:
        manager = StalenessManager(eta=1, batch_size=4)
        waiter = AsyncWaiter(manager)
        batches: list[ConsumedBatch] = []
        waits = 0

        async def producer(k: int) -> None:
            nonlocal waits
            rng = random.Random(k)
            for n in range(40):
                group, version = f"w{k}-{n}", manager.version
                while not manager.reserve(group, version):
                    waits += 1
                    try:
                        await waiter.wait_admissible(version)
                    except StaleVersionError:
                        version = manager.version  # sync to the newest model
                await asyncio.sleep(rng.random() / 1000)  # generate
                manager.occupy(group)

        async def trainer() -> None:
            while len(batches) < 40:
                assert await waiter.wait_consumable(timeout=10)
                batches.append(manager.consume())
                await asyncio.sleep(0)

        await asyncio.gather(trainer(), *(producer(k) for k in range(4)))
        waiter.close()
        return batches, waits

    batches, waits = asyncio.run(main())
    assert [b.version for b in batches] == list(range(40)) and waits > 0
    assert all(v <= b.version <= v + 1 for b in batches for v in b.group_versions)
    assert len({g for b in batches for g in b.group_ids}) == 160


def test_async_waits_time_out_and_refuse_a_stale_version() -> None:
    async def main() -> None:
        manager = StalenessManager(eta=0, batch_size=1)
        with AsyncWaiter(manager) as waiter:
            started = time.monotonic()
            assert await waiter.wait_consumable(timeout=0.05) is False
            assert time.monotonic() - started >= 0.04
            manager.reserve("a", 0)
            assert await waiter.wait_admissible(0, timeout=0.05) is False  # buffer 0 is full
            waiting = asyncio.ensure_future(waiter.wait_admissible(0))
            await asyncio.sleep(0.01)
            manager.occupy("a")
            manager.consume()  # version 1: version 0's deadline passed while the task waited
            with pytest.raises(StaleVersionError, match="can never be admitted again"):
                await waiting
            assert await waiter.wait_admissible(1) is True
        assert manager.snapshot()["groups"] == []

    asyncio.run(main())


def test_async_waiter_is_woken_by_a_locked_manager_driven_from_a_thread() -> None:
    async def main() -> ConsumedBatch | None:
        locked = LockedStalenessManager.create(eta=1, batch_size=2)
        waiter = AsyncWaiter(locked)

        def worker() -> None:
            for g in ("a", "b"):
                time.sleep(0.02)
                locked.reserve(g, 0)
                locked.occupy(g)

        thread = threading.Thread(target=worker)
        thread.start()
        ready = await waiter.wait_consumable(timeout=10)
        thread.join()
        waiter.close()
        return locked.try_consume() if ready else None

    batch = asyncio.run(main())
    assert batch is not None and batch.group_ids == ("a", "b")


def test_a_version_at_its_deadline_is_still_waited_for() -> None:
    """``version + eta == manager.version``: the version's last buffer is the current one, so the
    wait goes on (False at its timeout), never ``StaleVersionError`` (a mutation-testing survivor of
    ``protocol/waiting.py``: ``version | eta`` for ``version + eta`` called version 1 stale at 2 with eta 1)."""
    async def main() -> None:
        manager = StalenessManager(eta=1, batch_size=1)
        for step, group in enumerate(("a", "b")):
            manager.reserve(group, step)
            manager.occupy(group)
            manager.consume()
        assert manager.version == 2
        manager.reserve("c", 1)  # buffer 2 full: version 1 has no room left, but is not past its deadline
        with AsyncWaiter(manager) as waiter:
            assert await waiter.wait_admissible(1, timeout=0.05) is False
        with pytest.raises(StaleVersionError):
            admissible_now(manager, 0)()

    asyncio.run(main())


class _Worker:
    """A thread that stays alive and runs the callables it is given (so that several threads with
    distinct idents exist at once)."""

    def __init__(self) -> None:
        self._tasks: queue.Queue[tuple[Callable[[], Any], Future[Any]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        self.ident = self._thread.ident

    def _serve(self) -> None:
        while (item := self._tasks.get()) is not None:
            task, done = item
            try:
                done.set_result(task())
            except BaseException as error:  # noqa: BLE001 - handed to the caller
                done.set_exception(error)

    def run(self, task: Callable[[], Any]) -> Any:
        done: Future[Any] = Future()
        self._tasks.put((task, done))
        return done.result(timeout=60)

    def stop(self) -> None:
        self._tasks.put(None)
        self._thread.join()


def test_wakes_from_another_thread_go_through_the_loop_and_those_from_its_own_thread_do_not() -> None:
    """A hook called on the loop's thread wakes the waiters at once; from any other thread it hands
    the wake to the loop (``call_soon_threadsafe``: an asyncio future may be completed only on its
    loop's thread, and a loop asleep in ``select`` would not see it). Mutation-testing survivors of
    ``protocol/waiting.py`` swapped or reordered the test of the thread (``!=``, ``<``, ``>=``, ...);
    the wakes still happened, late. The loop runs on the thread of middle ident and the other threads'
    operations come from a lower and a higher ident, so no ordering of idents passes for equality."""
    workers = [_Worker() for _ in range(5)]
    lowest, loop_thread, highest = (sorted(workers, key=lambda w: w.ident or 0)[i] for i in (0, 2, 4))

    async def main() -> tuple[int, int]:
        locked = LockedStalenessManager.create(eta=1, batch_size=4)
        loop = asyncio.get_running_loop()
        handed: list[object] = []
        original = loop.call_soon_threadsafe

        def counting(callback: Any, *args: Any) -> Any:
            handed.append(args)
            return original(callback, *args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        with AsyncWaiter(locked):
            locked.reserve("a", 0)
            locked.occupy("a")  # on the loop's thread: woken at once
            on_loop = len(handed)
            for worker, group in ((lowest, "b"), (highest, "c")):
                worker.run(lambda g=group: (locked.reserve(g, 0), locked.occupy(g)))
        return on_loop, len(handed)

    try:
        assert loop_thread.run(lambda: asyncio.run(main())) == (0, 2)  # each other thread's occupy (a reserve wakes nobody)
    finally:
        for worker in workers:
            worker.stop()


def test_an_event_after_the_waiters_loop_closed_is_ignored() -> None:
    """An operation from another thread after the loop that built the waiter has closed: the wake has
    nobody to reach and the operation succeeds (a mutation-testing survivor of ``protocol/waiting.py``
    let the closed loop's ``RuntimeError`` out of the hook, failing the operation)."""
    locked = LockedStalenessManager.create(eta=0, batch_size=1)

    async def main() -> None:
        AsyncWaiter(locked)  # never closed: its hook outlives the loop

    asyncio.run(main())
    errors: list[BaseException] = []

    def operate() -> None:
        try:
            locked.reserve("a", 0)
            locked.occupy("a")
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    thread = threading.Thread(target=operate)
    thread.start()
    thread.join()
    assert errors == [] and locked.can_consume()


# ----------------------------------------------------------------------------- threads


class _CountingCondition(threading.Condition):
    """The locked wrapper's condition, instrumented: the timeout of every ``wait`` (a thread going to
    sleep: once when it blocks, again after each wake-up that found its wait not over), every
    ``notify_all``, and ``sleeping``, set when a thread goes to sleep."""

    def __init__(self, lock: threading.RLock) -> None:
        super().__init__(lock)
        self.waits: list[float | None] = []
        self.notifies = 0
        self.sleeping = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        self.sleeping.set()
        return super().wait(timeout)

    def notify_all(self) -> None:
        self.notifies += 1
        super().notify_all()


def _instrumented(locked: LockedStalenessManager) -> _CountingCondition:
    """Put a counting condition (over the wrapper's own lock) in place of the wrapper's condition."""
    condition = _CountingCondition(locked._lock)
    locked._changed = condition
    return condition


def test_operations_notify_waiting_threads_only_while_one_waits() -> None:
    """The locked wrapper counts the threads inside a wait and notifies only while one is there
    (mutation-testing survivors of ``protocol/locked.py``: a count that starts at 1, or that a wait
    leaves above 0 or below it, made every later operation notify nobody)."""
    locked = LockedStalenessManager.create(eta=1, batch_size=1)
    condition = _instrumented(locked)
    assert locked.reserve("a", 0) and condition.notifies == 0  # nobody waits: no notify
    woken: list[bool] = []
    thread = threading.Thread(target=lambda: woken.append(locked.wait_consumable(timeout=30)))
    thread.start()
    assert condition.sleeping.wait(30)
    locked.occupy("a")
    thread.join(30)
    assert woken == [True] and condition.notifies >= 1
    after = condition.notifies
    locked.consume()
    assert locked.reserve("b", 1) and condition.notifies == after  # the wait is over: no notify again


def test_blocking_waits_with_real_threads() -> None:
    """Producer threads block in wait_admissible when refused, the trainer thread in
    consume_when_ready; no thread polls, and every group trained is within its bound."""
    locked = LockedStalenessManager.create(eta=1, batch_size=4)
    batches: list[ConsumedBatch] = []
    errors: list[BaseException] = []
    blocked = [0]

    def producer(k: int) -> None:
        try:
            for n in range(40):  # 4 x 40 groups: exactly the 40 batches the trainer takes
                group, version = f"t{k}-{n}", locked.version
                while not locked.reserve(group, version):
                    blocked[0] += 1
                    try:
                        locked.wait_admissible(version, timeout=10)
                    except StaleVersionError:
                        version = locked.version
                time.sleep(0.0005)
                locked.occupy(group)
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    def trainer() -> None:
        while len(batches) < 40:
            batch = locked.consume_when_ready(timeout=10)
            if batch is None:
                errors.append(TimeoutError("no batch within 10 s"))
                return
            batches.append(batch)
            time.sleep(0.005)  # train: the producers fill the buffers meanwhile and must wait

    condition = _instrumented(locked)
    # daemon: a failed assertion must not leave the run waiting for them
    threads = [threading.Thread(target=producer, args=(k,), daemon=True) for k in range(4)]
    consumer = threading.Thread(target=trainer, daemon=True)
    for t in (consumer, *threads):
        t.start()
    for t in (consumer, *threads):
        t.join(timeout=300)
    assert not errors and not consumer.is_alive() and len(batches) == 40 and blocked[0] > 0
    assert all(v <= b.version <= v + 1 for b in batches for v in b.group_versions)
    # Nobody polls: a thread sleeps until notified, for what is left of its own 10 s (no short
    # re-check interval), and wakes only on a notify: at most one sleep per blocked call (the producers'
    # blocked[0], the trainer's 40) plus one per waiting thread (5) and notify.
    assert condition.waits and all(timeout is not None and timeout > 1.0 for timeout in condition.waits)
    assert len(condition.waits) <= blocked[0] + 40 + 5 * condition.notifies


def test_blocking_waits_time_out_and_wake_on_a_stale_version() -> None:
    locked = LockedStalenessManager.create(eta=0, batch_size=1)
    started = time.monotonic()
    assert locked.wait_consumable(timeout=0.05) is False and locked.consume_when_ready(timeout=0.01) is None
    assert time.monotonic() - started >= 0.05
    locked.reserve("a", 0)
    outcome: list[object] = []

    def wait_for_room() -> None:
        try:
            outcome.append(locked.wait_admissible(0))
        except StaleVersionError as error:
            outcome.append(error)

    condition = _instrumented(locked)
    waiting = threading.Thread(target=wait_for_room, daemon=True)  # a failed assertion must not leave it blocked
    waiting.start()
    assert condition.sleeping.wait(timeout=300), "the thread never went to sleep in wait_admissible"
    assert outcome == [] and condition.waits == [None]  # blocked (buffer 0 is full), with no timeout: no polling
    locked.occupy("a")  # wakes it (occupy may enable a consume), but admission is no wider: it sleeps again
    assert locked.wait_consumable(timeout=1) is True
    with locked.locked() as manager:  # a compound step wakes waiters when the block ends
        manager.consume()
    waiting.join(timeout=300)
    assert len(outcome) == 1 and isinstance(outcome[0], StaleVersionError)
    # one sleep, then at most one more per notify (occupy's, the block's): woken only by them
    assert condition.notifies == 2 and condition.waits in ([None], [None, None])

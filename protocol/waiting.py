"""Awaitable readiness for an asyncio host: ``await waiter.wait_consumable()``,
``await waiter.wait_admissible(version)``.

:class:`AsyncWaiter` registers an event hook on a :class:`~.manager.StalenessManager` (operated from
the event loop's thread only) or a :class:`~.locked.LockedStalenessManager` (operated from any
thread, e.g. rollout threads next to the loop). The hook wakes the waiters after the operations
that can make them true, and they re-check under the manager's own query:

- ``can_consume()`` may turn true after ``occupy``, ``abort`` or ``consume``
  (:data:`~.events.CONSUMABLE_AFTER`; never after a ``reserve``);
- the admission room at a version may grow after ``abort`` or ``consume``
  (:data:`~.events.ADMISSIBLE_AFTER`; ``occupy`` leaves it unchanged, a ``reserve`` only shrinks it).

Both waits take an optional ``timeout`` in seconds and return ``True`` when ready, ``False`` when
the timeout passed. ``wait_admissible`` raises :class:`~.errors.StaleVersionError` once the version
is past every deadline (``version + eta < manager.version``). A readiness may be taken by another
task before the waiter runs: ``reserve`` and ``consume`` still decide (``try_consume`` on the
locked wrapper). Threads (a Ray actor's) use the blocking waits of the locked wrapper instead.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Callable, Protocol

from .errors import StaleVersionError
from .events import ADMISSIBLE_AFTER, CONSUMABLE_AFTER, EventHook, ProtocolEvent

__all__ = ["AsyncWaiter", "Waitable", "admissible_now"]


class Waitable(Protocol):
    """What :class:`AsyncWaiter` needs: a manager or its locked wrapper."""

    @property
    def eta(self) -> int: ...
    @property
    def version(self) -> int: ...
    def can_consume(self) -> bool: ...
    def reserve_slack(self, version: int) -> int: ...
    def add_event_hook(self, hook: EventHook) -> None: ...
    def remove_event_hook(self, hook: EventHook) -> None: ...


def admissible_now(manager: Waitable, version: int) -> Callable[[], bool]:
    """The predicate both waits test: a group from ``version`` would be admitted now. It raises
    :class:`~.errors.StaleVersionError` once ``version`` is past every deadline (waiting longer would
    never succeed)."""

    def admissible() -> bool:
        if version + manager.eta < manager.version:
            raise StaleVersionError(
                f"version {version} can never be admitted again: the trainer is at {manager.version} "
                f"and eta is {manager.eta}; sync the engine"
            )
        return manager.reserve_slack(version) > 0

    return admissible


class AsyncWaiter:
    """Awaitable ``can_consume()`` and admission for one manager; build it inside the running loop.

    >>> waiter = AsyncWaiter(manager)                      # doctest: +SKIP
    >>> if await waiter.wait_consumable(timeout=5.0):      # doctest: +SKIP
    ...     batch = manager.consume()

    :meth:`close` (or ``async with``/``with``) removes the hook.
    """

    def __init__(self, manager: Waitable) -> None:
        self._manager = manager
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._consumable: list[asyncio.Future[None]] = []
        self._admissible: list[asyncio.Future[None]] = []
        self._hook: EventHook = self._on_event
        manager.add_event_hook(self._hook)

    def close(self) -> None:
        self._manager.remove_event_hook(self._hook)

    def __enter__(self) -> AsyncWaiter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def wait_consumable(self, timeout: float | None = None) -> bool:
        """True once ``can_consume()`` holds; False if ``timeout`` seconds pass first."""
        return await self._wait(self._consumable, self._manager.can_consume, timeout)

    async def wait_admissible(self, version: int, timeout: float | None = None) -> bool:
        """True once a group from ``version`` would be admitted; False if ``timeout`` seconds pass
        first; :class:`~.errors.StaleVersionError` when ``version`` can never be admitted again."""
        return await self._wait(self._admissible, admissible_now(self._manager, version), timeout)

    async def _wait(self, waiters: list[asyncio.Future[None]], ready: Callable[[], bool], timeout: float | None) -> bool:
        async def until_ready() -> None:
            while not ready():
                # created before yielding to the loop: a wake scheduled from another thread after
                # the check runs on the loop later and finds this future
                future = self._loop.create_future()
                waiters.append(future)
                try:
                    await future
                finally:
                    if future in waiters:
                        waiters.remove(future)

        try:
            await asyncio.wait_for(until_ready(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def _on_event(self, event: ProtocolEvent) -> None:
        if event.op not in CONSUMABLE_AFTER:  # ADMISSIBLE_AFTER is a subset
            return
        if threading.get_ident() == self._loop_thread:
            self._wake(event.op)
        else:
            try:
                self._loop.call_soon_threadsafe(self._wake, event.op)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass

    def _wake(self, op: str) -> None:
        lists = (self._consumable, self._admissible) if op in ADMISSIBLE_AFTER else (self._consumable,)
        for waiters in lists:
            for future in waiters:
                if not future.done():
                    future.set_result(None)
            waiters.clear()

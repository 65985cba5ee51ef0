"""The event hooks of the staleness manager: registration, and the call after every operation.

After an operation is applied, each hook receives a :class:`~.events.ProtocolEvent`; a hook that is
an :class:`~.events.EventRecorder` and the only one receives the event's fields instead (no event is
built: the trace writer's fast path). Failures follow :mod:`.errors` (:class:`~.errors.HookError`).
"""

from __future__ import annotations

from typing import Callable, cast

from .errors import HookError, UnknownHookError
from .events import ConsumedBatch, CounterState, EventHook, EventRecorder, GroupId, ProtocolEvent


class EventEmitter:
    """The hook half of :class:`~.manager.StalenessManager`.

    The manager keeps its counters in ``_counts``, a list whose tuple is the flat state
    ``(*running, *done, version)`` (:meth:`~.events.CounterState.flat`), calls :meth:`_init_hooks`
    once it has them and :meth:`_emit` after every applied operation while it has hooks.
    """

    _counts: list[int]

    def _init_hooks(self, hooks: list[EventHook]) -> None:
        self._seq = 0
        # with hooks: the state now, which is the last event's after-state and the next one's before
        self._last_state: tuple[int, ...] = ()
        self._last_counts = CounterState(0, (), ())  # the CounterState of ``_last_counted`` (a cache)
        self._last_counted: tuple[int, ...] = ()
        self._record: Callable[..., None] | None = None  # the only hook's record_event, if it has one
        self._set_hooks(hooks)

    def add_event_hook(self, hook: EventHook) -> None:
        """Call ``hook`` after every operation (each hook runs even if an earlier one raises)."""
        self._set_hooks([*self._hooks, hook])

    def remove_event_hook(self, hook: EventHook) -> None:
        """Stop calling ``hook``; :class:`~.errors.UnknownHookError` if it is not registered."""
        hooks = list(self._hooks)
        try:
            hooks.remove(hook)
        except ValueError:
            raise UnknownHookError(f"event hook {hook!r} is not registered") from None
        self._set_hooks(hooks)

    def _set_hooks(self, hooks: list[EventHook]) -> None:
        """Register ``hooks``; a single hook that is an :class:`EventRecorder` receives the fields."""
        self._hooks = hooks
        self._last_state = tuple(self._counts)  # operations without hooks did not record their after-state
        record = getattr(type(hooks[0]), "record_event", None) if len(hooks) == 1 else None
        # looked up on the type: an object that makes up attributes (a mock) stays a plain hook
        self._record = cast(EventRecorder, hooks[0]).record_event if callable(record) else None

    def _counter_state(self, state: tuple[int, ...]) -> CounterState:
        """``CounterState.from_flat(state)``, built once per state: an event's before-state is the last
        event's after-state (the same tuple), so events share CounterState objects as before."""
        if state is not self._last_counted:
            self._last_counts, self._last_counted = CounterState.from_flat(state), state
        return self._last_counts

    def _emit(self, op: str, group_id: GroupId | None, version: int, accepted: bool | None,
              batch: ConsumedBatch | None) -> None:
        """Tell the hooks about the operation just applied (called only when there are hooks)."""
        before = self._last_state
        # a refused reserve changes nothing: its after-state is its before-state (the same object)
        after = before if accepted is False else tuple(self._counts)
        seq = self._seq
        self._seq = seq + 1
        self._last_state = after
        record = self._record
        if record is not None:  # the only hook takes the fields: no ProtocolEvent is built
            try:
                record(seq, op, group_id, version, accepted, batch, before, after)
            except Exception as error:  # noqa: BLE001 - reported like any failing hook
                raise HookError(self._event(seq, op, group_id, version, accepted, batch, before, after),
                                [(self._hooks[0], error)]) from error
            return
        event = self._event(seq, op, group_id, version, accepted, batch, before, after)
        failures: list[tuple[EventHook, BaseException]] = []
        for hook in tuple(self._hooks):  # a copy: a hook may remove itself (a trace writer closing)
            try:
                hook(event)
            except Exception as error:  # noqa: BLE001 - the other hooks must still see the event
                failures.append((hook, error))
        if failures:
            raise HookError(event, failures) from failures[0][1]

    def _event(self, seq: int, op: str, group_id: GroupId | None, version: int, accepted: bool | None,
               batch: ConsumedBatch | None, before: tuple[int, ...], after: tuple[int, ...]) -> ProtocolEvent:
        return ProtocolEvent(seq, op, group_id, version, accepted, batch,
                             self._counter_state(before), self._counter_state(after))

"""Errors raised by the staleness protocol; every one is a :class:`ProtocolError`.

The contract (every operation: ``reserve``, ``occupy``, ``abort``, ``consume``):

- An operation either raises **before any state change** (every error below except
  :class:`HookError`), so a caller that catches one can go on using the manager as if the call had
  not been made, or it is **fully applied**.
- Once applied, **every** event hook runs, in registration order, even if an earlier one raises.
  If any hook raised (an ``Exception``; ``KeyboardInterrupt`` and ``SystemExit`` are not caught),
  the operation raises :class:`HookError` after the last hook: the operation *was* applied
  (``error.result`` is what it would have returned) and must not be retried.

Errors that callers of earlier versions caught as ``ValueError``, ``KeyError``, ``TypeError`` or
``RuntimeError`` keep those bases.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence, Tuple

if TYPE_CHECKING:
    from .events import ConsumedBatch, EventHook, ProtocolEvent


class ProtocolError(Exception):
    """Base class of every error the staleness protocol raises."""


class InvalidParameterError(ProtocolError, ValueError):
    """A protocol parameter (``eta``, ``batch_size``, ``redundancy``, ``max_in_flight``) or an option is
    not an integer in range, or not one of the allowed values."""


class InvalidGroupIdError(ProtocolError, TypeError):
    """A group id is not a ``str`` or an ``int`` (``bool`` is refused too)."""


class UnknownGroupError(ProtocolError, KeyError):
    """An operation named a group id that is not active (never reserved, consumed, dropped or aborted)."""

    def __str__(self) -> str:  # KeyError would print the repr of its argument only
        return str(self.args[0]) if self.args else "unknown group"


class DuplicateGroupError(ProtocolError, ValueError):
    """``reserve`` was called with an id that is already active."""


class InvalidVersionError(ProtocolError, ValueError):
    """A model version is not an integer, negative, or ahead of the trainer (``version > manager.version``)."""


class StaleVersionError(InvalidVersionError):
    """A wait for admission at a version whose deadline has passed (``version + eta < manager.version``):
    no group generated from it can ever be admitted again; sync the engine to a newer model."""


class InvalidTransitionError(ProtocolError, ValueError):
    """The group is in a state that does not allow the operation (e.g. ``occupy`` of a finished group)."""


class ConsumeNotReadyError(ProtocolError, RuntimeError):
    """``consume`` was called while ``can_consume()`` is false."""


class SnapshotError(ProtocolError, ValueError):
    """A snapshot given to ``restore`` is malformed or violates the invariant; the message names the field."""


class UnknownHookError(ProtocolError, ValueError):
    """``remove_event_hook`` was given a hook that is not registered."""


class TraceClosedError(ProtocolError, ValueError):
    """An event reached a trace writer after :meth:`~.trace.JsonlTraceWriter.close`."""


HookFailure = Tuple["EventHook", BaseException]


class HookError(ProtocolError):
    """The operation **was applied**; afterwards one or more event hooks raised.

    Every hook ran. ``event`` is the operation's :class:`~.events.ProtocolEvent`, ``failures`` the
    ``(hook, exception)`` pairs in hook order (the first exception is also ``__cause__``), and
    ``result`` what the operation returned to hooks and would have returned to the caller: the
    ``accepted`` flag of a reserve, the :class:`~.events.ConsumedBatch` of a consume, else ``None``.
    Do not retry the operation: a retried reserve would raise :class:`DuplicateGroupError`, a
    retried consume would take the next batch.
    """

    def __init__(self, event: ProtocolEvent, failures: Sequence[HookFailure]) -> None:
        self.event = event
        self.failures: tuple[HookFailure, ...] = tuple(failures)
        what = event.op if event.group_id is None else f"{event.op}({event.group_id!r})"
        if event.op == "consume":
            what = f"consume(buffer {event.version})"
        failed = "; ".join(f"{hook!r} raised {type(error).__name__}: {error}" for hook, error in self.failures)
        super().__init__(
            f"{what} was applied (event seq {event.seq}), but {len(self.failures)} event hook(s) failed "
            f"(every hook ran; do not retry the operation): {failed}"
        )

    @property
    def result(self) -> bool | ConsumedBatch | None:
        if self.event.op == "consume":
            return self.event.batch
        return self.event.accepted

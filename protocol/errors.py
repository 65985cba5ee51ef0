"""Errors raised by the staleness protocol.

Every error is raised *before* any state changes, so a caller that catches one can go on using the
manager: a refused or malformed operation never corrupts the protocol state.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Base class of every error the staleness protocol raises."""


class UnknownGroupError(ProtocolError, KeyError):
    """An operation named a group id that is not active (never reserved, consumed, dropped or aborted)."""

    def __str__(self) -> str:  # KeyError would print the repr of its argument only
        return str(self.args[0]) if self.args else "unknown group"


class DuplicateGroupError(ProtocolError, ValueError):
    """``reserve`` was called with an id that is already active."""


class InvalidVersionError(ProtocolError, ValueError):
    """A model version is negative or ahead of the trainer (``version > manager.version``)."""


class InvalidTransitionError(ProtocolError, ValueError):
    """The group is in a state that does not allow the operation (e.g. ``occupy`` of a finished group)."""


class ConsumeNotReadyError(ProtocolError, RuntimeError):
    """``consume`` was called while ``can_consume()`` is false."""


class SnapshotError(ProtocolError, ValueError):
    """A snapshot given to ``restore`` is malformed or violates the invariant."""

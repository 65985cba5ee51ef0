"""The coordinator's commands to rollout instances (paper Fig. 9): Route, Interrupt, Pull, Abort.

The coordinator decides them and updates its speculative state at once; the run loop carries them
out against the engines, the trajectory server and the parameter server.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Route:
    """Start or resume these queued requests on ``instance_id``."""

    instance_id: str
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class Interrupt:
    """Stop these requests on ``instance_id``; their partials go back to the trajectory server queue."""

    instance_id: str
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class Pull:
    """Load model ``version`` from the parameter server into ``instance_id`` (running requests stay)."""

    instance_id: str
    version: int


@dataclass(frozen=True)
class Abort:
    """Stop these requests on ``instance_id`` and discard their output (cancelled or aborted groups)."""

    instance_id: str
    request_ids: tuple[str, ...]


Command = Route | Interrupt | Pull | Abort

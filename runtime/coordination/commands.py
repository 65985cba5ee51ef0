"""What the coordinator hands out: commands to rollout instances (paper Fig. 9: Route, Interrupt,
Pull, Abort) and, in a :class:`Ready`, the group changes a decision needs.

The coordinator decides commands and updates its speculative state at once; the run loop carries
them out against the engines, the trajectory server and the parameter server, and makes the group
changes through :class:`~staleflow.runtime.run.group_life.GroupLife`.
"""

from __future__ import annotations

from dataclasses import dataclass

from staleflow.runtime.types import GroupId


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
    """Load model ``version`` from the parameter server into ``instance_id`` (running requests stay).

    ``broadcast``: one of the loads of a global broadcast, the version going to every instance behind
    at once (the ``adaptive`` sync, :mod:`~staleflow.runtime.coordination.sync`); the engine is told
    so (``load_weights(..., broadcast=True)``: a simulated one times it as a broadcast).
    """

    instance_id: str
    version: int
    broadcast: bool = False


@dataclass(frozen=True)
class Abort:
    """Stop these requests on ``instance_id`` and discard their output (cancelled or aborted groups)."""

    instance_id: str
    request_ids: tuple[str, ...]


Command = Route | Interrupt | Pull | Abort


@dataclass(frozen=True)
class Admission:
    """A decision to admit ``group_id`` at ``version`` on the instance at ``instance_index``."""

    group_id: GroupId
    version: int
    instance_index: int


@dataclass(frozen=True)
class Ready:
    """What the coordinator wants done now (:meth:`~staleflow.runtime.coordination.coordinator.Coordinator.ready`).

    ``commands``: for the instances, in order. A decision in progress may also ask for one group
    change: ``requeue`` (groups to re-queue; step :class:`~staleflow.runtime.coordination.observations.Cancelled`
    with the requests that cancelled) or ``admit`` (a group to admit; step
    :class:`~staleflow.runtime.coordination.observations.Admitted` with its requests). The decision
    goes on only once that outcome is stepped; it is over when a Ready asks for neither.
    """

    commands: tuple[Command, ...] = ()
    requeue: tuple[GroupId, ...] = ()
    admit: Admission | None = None

    @property
    def waits(self) -> bool:
        """Whether it asks for a group change whose outcome the coordinator waits for."""
        return bool(self.requeue) or self.admit is not None

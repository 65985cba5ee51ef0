"""What the run loop tells the coordinator (:meth:`~staleflow.runtime.coordination.coordinator.Coordinator.step`).

Each record is something that happened: on an instance (a snapshot taken, requests collected, the
instance lost or back), to groups (requests cancelled, a group admitted, as the coordinator asked),
to the trainer (a step started) or to the run (a decision is due, the run started, a checkpoint
is being taken, the cost model was refitted). The coordinator answers with :class:`~staleflow.runtime.coordination.commands.Ready`.
"""

from __future__ import annotations

from dataclasses import dataclass

from staleflow.runtime.coordination.commands import Admission
from staleflow.runtime.coordination.cost_model import CostModel
from staleflow.runtime.types import Cancellations, InstanceSnapshot, RolloutRequest


@dataclass(frozen=True)
class RequestsLeft:
    """These requests no longer run on ``instance_id`` (they finished and were collected), with
    ``lengths``, their output lengths (the coordinator learns the lengths of responses from them)."""

    instance_id: str
    request_ids: tuple[str, ...]
    lengths: tuple[int, ...] = ()


@dataclass(frozen=True)
class InstanceLost:
    """A call to ``instance_id`` failed: it holds nothing the coordinator may count on, and gets no
    work until it is back."""

    instance_id: str


@dataclass(frozen=True)
class InstanceBack:
    """A lost instance answers again, empty, as ``snapshot`` shows."""

    snapshot: InstanceSnapshot


@dataclass(frozen=True)
class Cancelled:
    """A group change cancelled these running requests: they are to be aborted where they run."""

    requests: Cancellations


@dataclass(frozen=True)
class Admitted:
    """The group of ``admission`` was reserved; ``requests`` are its requests, to route."""

    admission: Admission
    requests: tuple[RolloutRequest, ...]


@dataclass(frozen=True)
class StepStarted:
    """A training step started; ``trainer_waited``: the trainer sat idle for data before it."""

    trainer_waited: bool


@dataclass(frozen=True)
class Tick:
    """A decision is due. ``ps_version``: the newest version on the parameter server; ``full``: a
    periodic tick (migration is considered only then); ``trainer_waits``: the trainer is idle and
    cannot consume (proactive abort may act)."""

    ps_version: int | None
    full: bool
    trainer_waits: bool = False


@dataclass(frozen=True)
class RunStarted:
    """The run starts with ``version`` on the parameter server: every instance elsewhere loads it."""

    version: int


@dataclass(frozen=True)
class CheckpointStarted:
    """A checkpoint is being taken: every request is interrupted, so its partial is in the trajectory server."""


@dataclass(frozen=True)
class CostModelFitted:
    """The online fit has a new cost model (:mod:`~staleflow.runtime.coordination.cost_fit`): routing
    and migration plan with it from now on."""

    model: CostModel


Observation = (
    InstanceSnapshot | RequestsLeft | InstanceLost | InstanceBack | Cancelled | Admitted | StepStarted | Tick | RunStarted
    | CheckpointStarted | CostModelFitted
)

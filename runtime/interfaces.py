"""The seams between the runtime and the parts it drives: rollout engines, trainers and clocks.

The same coordinator, servers and protocol drive real parts (vLLM, torch, Ray) and simulated ones
(virtual time, cost model). Simulated parts advance lazily: whenever they are called they first
bring their state up to ``clock.now()``; ``next_event_time`` tells the run loop how far a virtual
clock may jump. Real parts work in the background and return ``None`` there.

**Failure contract.** A binding raises only these for an operating failure (anything else is a
bug and ends the run):

- :class:`InstanceLostError` (or any ``ConnectionError``, e.g. a dead Ray actor) and
  ``TimeoutError``: the instance stopped answering or lost its state (a crashed engine thread, a
  killed process). The run loop then presumes everything the instance held lost: its requests go
  back to the queue from their last partial in the trajectory server, and it gets no work until a
  probe finds it answering and empty.
- :class:`TransferFailedError`: a weight transfer (a push to, or a pull from, the parameter server)
  did not complete. A failed pull is handled like a lost instance; a failed push is retried.

Bad arguments (a caller's bug) raise ``ValueError``/``TypeError`` as usual.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from staleflow.runtime.types import InstanceSnapshot, RolloutRequest, TrainingBatch, TrainResult, Trajectory


class InstanceLostError(ConnectionError):
    """A rollout instance failed in a way that loses its state (see the failure contract)."""


class TransferFailedError(ConnectionError):
    """A weight transfer to or from the parameter server did not complete."""


#: The exceptions of the failure contract: what the run loop recovers from.
INSTANCE_FAILURES: tuple[type[Exception], ...] = (ConnectionError, TimeoutError)


@runtime_checkable
class Clock(Protocol):
    """Time for the runtime: seconds since the run started, real or virtual.

    ``simulated`` is True for virtual time: it moves only when the loop jumps it, every part
    announces its next event (``next_event_time``), and so an iteration with nothing due and no
    work left is a stall, not a wait.
    """

    simulated: bool

    def now(self) -> float: ...

    def sleep_until(self, deadline: float) -> None:
        """Wait (real clock) or jump (virtual clock) to ``deadline``; never goes backwards."""


@runtime_checkable
class WeightsReference(Protocol):
    """Weights that stay where they are until the instance loading them fetches them (a parameter
    server in another process): a Pull hands the instance this reference, not the weights, so they
    never travel through the driver. ``fetch`` raises :class:`TransferFailedError` if it fails."""

    version: int

    def fetch(self) -> Any: ...


@runtime_checkable
class CollectiveReference(Protocol):
    """A reference whose version can reach several instances in one collective, sent once for all
    of them (a global broadcast's loads): ``in_collective(members)`` is the reference each member
    loads then; every member must load it at the same time."""

    def in_collective(self, members: Sequence[str]) -> Any: ...


def resolve_weights(weights: Any) -> Any:
    """``weights`` itself, or, for a :class:`WeightsReference`, what it refers to, fetched into this
    process (a parameter server in another process may hold a reference to the trainer's copy)."""
    while isinstance(weights, WeightsReference):
        weights = weights.fetch()
    return weights


@runtime_checkable
class RolloutEngine(Protocol):
    """One rollout instance (a vLLM engine, or a simulated one).

    Every method may raise the failure contract's :class:`InstanceLostError` (or another
    ``ConnectionError``) or ``TimeoutError``; ``load_weights`` may also raise
    :class:`TransferFailedError`.
    """

    instance_id: str

    def submit(self, requests: Sequence[RolloutRequest]) -> None:
        """Route: start (or resume, if ``output_ids`` is not empty) these requests."""

    def interrupt(self, request_ids: Sequence[str]) -> list[RolloutRequest]:
        """Stop these requests and return them as partials that can resume on any instance whose
        version is at least their ``group_version``. Ids that already finished are skipped (their
        trajectory comes from ``collect``)."""

    def abort(self, request_ids: Sequence[str]) -> None:
        """Stop these requests and discard their output."""

    def load_weights(self, version: int, weights: Any, broadcast: bool = False) -> None:
        """Pull: switch to model ``version``. Running requests keep their tokens and continue on
        the new weights (their per-token versions record the switch). ``weights`` may be a
        :class:`WeightsReference`, which the engine fetches itself. ``broadcast``: the load is one of
        a global broadcast to every instance behind (a simulated engine times it so; a real one
        receives it through the parameter server's transfer, as a pull). The run loop passes it
        only when true."""

    def snapshot(self) -> InstanceSnapshot: ...

    def collect(self) -> list[Trajectory]:
        """Trajectories finished since the last call (rewards not yet computed)."""

    def next_event_time(self) -> float | None:
        """Simulated engines: the next time a request finishes. Real engines: None."""

    def close(self) -> None: ...


@runtime_checkable
class Trainer(Protocol):
    """The training side: one step at a time, in the background.

    A trainer has no failure contract: an exception from it ends the run (the last checkpoint
    resumes it).
    """

    def start_step(self, batch: TrainingBatch) -> None:
        """Begin training on ``batch`` (buffer ``batch.version``); returns at once."""

    def poll(self) -> TrainResult | None:
        """The result of the running step once it has finished (then the trainer is idle), else None."""

    def weights(self) -> Any:
        """The current weights, for the parameter server (a state dict, a path, or a sim token)."""

    def next_event_time(self) -> float | None:
        """Simulated trainers: when the running step finishes. Real trainers: None."""

    def close(self) -> None: ...

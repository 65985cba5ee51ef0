"""One coordinator decision carried out: the coordinator decides, GroupLife makes the group changes
it asks for, and their outcomes go back to the coordinator."""

from __future__ import annotations

from staleflow.runtime.coordination.commands import Command
from staleflow.runtime.coordination.coordinator import Coordinator
from staleflow.runtime.coordination.observations import Admitted, Cancelled, Tick
from staleflow.runtime.run.group_life import GroupLife


def decide(coordinator: Coordinator, groups: GroupLife, tick: Tick) -> list[Command]:
    """Step ``tick`` into the coordinator and answer its Readys until the decision is over: each
    re-queue and admission asked for is made through ``groups`` and its outcome stepped back.
    Returns the decision's commands for the instances, in order (not carried out yet)."""
    coordinator.step(tick)
    commands: list[Command] = []
    while True:
        ready = coordinator.ready()
        commands += ready.commands
        if ready.requeue:
            coordinator.step(Cancelled(groups.requeue(ready.requeue)))
        elif ready.admit is not None:
            admission = ready.admit
            coordinator.step(Admitted(admission, tuple(groups.admit(admission.group_id, admission.version))))
        else:
            return commands

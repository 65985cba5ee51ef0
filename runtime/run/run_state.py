"""The run loop's checkpoint: its format, its sections, and the checks before anything is restored.

A checkpoint is taken between steps, after every running request was interrupted (its partial is
in the trajectory server) and every pending push went through. It holds the protocol (every active
group with its version, so the bound holds across a resume), the trajectory server, the parameter
server's latest version, the owner of groups' life, the coordinator's counters, the instances found
down with the requests placed on each when it failed (``instances_down``, optional: a resumed run
keeps them down until a probe aborted those requests there) and the run's statistics. The
trainer's weights and optimizer are the trainer's own checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from staleflow.protocol import StalenessManager

STATE_FORMAT = "staleflow.run_loop/2"
#: the sections of a checkpoint; ``steps_done``, ``counters``, ``tokens`` and ``staleness`` are the
#: run's statistics (:meth:`~staleflow.runtime.run.run_stats.RunStats.state_dict`)
SECTIONS = (
    "protocol", "trajectory_server", "parameter_server", "groups", "coordinator", "prompts_drawn",
    "steps_done", "counters", "tokens", "staleness",
)


def check_run_state(state: Mapping[str, Any], manager: StalenessManager) -> None:
    """Refuse, naming the problem and before anything changes, a checkpoint this run cannot continue."""
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"not a run-loop checkpoint (expected format {STATE_FORMAT!r}, got {state.get('format')!r})")
    missing = [name for name in SECTIONS if name not in state]
    if missing:
        raise ValueError(f"run-loop checkpoint lacks {', '.join(missing)}")
    protocol = state["protocol"]
    for name in ("eta", "batch_size", "redundancy"):
        if protocol.get(name) != getattr(manager, name):
            raise ValueError(
                f"checkpoint has protocol {name}={protocol.get(name)!r}, this run {name}={getattr(manager, name)}"
            )
    pushed = state["parameter_server"].get("latest_version")
    if pushed is not None and pushed > protocol.get("version", -1):
        raise ValueError(
            f"checkpoint is inconsistent: parameter-server version {pushed} is ahead of protocol version "
            f"{protocol.get('version')}"
        )

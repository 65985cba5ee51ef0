"""Assembling a run: the one function that turns a run's description and its parts into a
:class:`~staleflow.runtime.run.loop.RunLoop`, for ``staleflow train``, ``staleflow simulate`` and the
chaos tester alike.

A :class:`~staleflow.runtime.run.run_spec.RunSpec` says what to run (the system's policy, the bound,
the batch, the tick, the reward timeout); :class:`~staleflow.runtime.run.loop.RunParts` are the
engines, the trainer, the prompts, the clock and the servers, which the caller builds from real or
simulated bindings.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from staleflow.protocol.events import EventHook
from staleflow.runtime.run.loop import RunLoop, RunParts
from staleflow.runtime.run.run_spec import RunSpec


def assemble_run(
    spec: RunSpec,
    parts: RunParts,
    event_hooks: Sequence[EventHook] = (),
    trace_path: str | Path | None = None,
    trace_refusals: bool = False,
) -> RunLoop:
    """The run loop for ``spec`` over ``parts``; with ``trace_path`` it writes the protocol trace
    there (a resumed run appends a segment that starts from the restored protocol state), refused
    reserves included with ``trace_refusals``."""
    return RunLoop(parts, spec, event_hooks=event_hooks, trace_path=trace_path, trace_refusals=trace_refusals)

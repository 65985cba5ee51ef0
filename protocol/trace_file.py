"""The trace a host binding (:mod:`.areal`, :mod:`.verl`) keeps of its protocol across a recover."""

from __future__ import annotations

from pathlib import Path
from typing import Union

from .trace import JsonlTraceWriter, Traceable


class TraceFile:
    """The trace a host binding keeps of its protocol at ``path`` (``None``: none), opened on first
    use rather than when the binding is built: :meth:`start` (a new file, unless it is open) before
    the first operation, :meth:`resume` (a segment appended) once a restored manager takes the place
    of the first. A recovered process builds its binding before it loads its checkpoint, and a file
    opened then would erase the trace of the process before it."""

    def __init__(self, path: Union[str, Path, None]) -> None:
        self.path = path
        self.writer: JsonlTraceWriter | None = None

    def start(self, manager: Traceable, mode: str = "w") -> None:
        if self.path is None or self.writer is not None:
            return
        attach_trace = getattr(manager, "attach_trace", None)  # a LockedStalenessManager's: under its lock
        if attach_trace is not None:
            self.writer = attach_trace(self.path, mode)
        else:
            self.writer = JsonlTraceWriter.attach(manager, self.path, mode)

    def resume(self, manager: Traceable) -> None:
        """Trace ``manager`` (just restored) as a new segment of the same file."""
        self.close()
        self.start(manager, "a")

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

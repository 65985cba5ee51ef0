"""vLLM's internal request ids and the runtime's, both ways.

``LLMEngine.add_request`` returns an internal id of its own (the runtime's id with a suffix); its
outputs carry the runtime's id, and its output processor keeps each running request's state under
the internal one. The engine thread looks one up for every output it absorbs and drops one for every
request that leaves, so both directions are a dict each: one lookup per output, whatever the number
of live requests (a scan of every live request per output costs milliseconds per step at a few
hundred requests, as long as a GPU decode step).
"""

from __future__ import annotations


class RequestIds:
    """A one-to-one map between vLLM's internal request ids and ours (module docstring)."""

    def __init__(self) -> None:
        self._ours: dict[str, str] = {}  # internal -> ours
        self._internal: dict[str, str] = {}  # ours -> internal

    def add(self, internal: str, ours: str) -> None:
        """vLLM calls our request ``ours`` ``internal`` (replacing what it called it before)."""
        self.forget(ours)
        self._ours[internal] = ours
        self._internal[ours] = internal

    def internal(self, ours: str) -> str:
        """vLLM's id of our request ``ours`` (``ours`` itself when vLLM gave it none)."""
        return self._internal.get(ours, ours)

    def ours(self, internal: str) -> str:
        """Our id of vLLM's request ``internal`` (``internal`` itself when it is not one of ours)."""
        return self._ours.get(internal, internal)

    def forget(self, ours: str) -> None:
        """Our request ``ours`` left the engine."""
        internal = self._internal.pop(ours, None)
        if internal is not None:
            del self._ours[internal]

    def __len__(self) -> int:
        return len(self._internal)

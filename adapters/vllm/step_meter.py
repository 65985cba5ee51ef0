"""Which engine steps are pure decode steps, and how long each took: the points the online cost model
fits (:class:`~staleflow.runtime.coordination.cost_fit.DecodeStepLog`).

With the engine core in this process the scheduler is read before the step (its running requests,
their KV tokens, nothing waiting or prefilling) and the step is timed by the call. With the core in a
process of its own (tensor parallelism, and every GPU instance, :mod:`staleflow.runtime.settings.placement_plan`)
there is no scheduler to read: the engine's own requests stand for it (a step is pure decode when
every live request has had a token since it was submitted, so none is prefilling), and since that core
steps by itself, a step's time is the interval between two outputs received, counted only when the
step before was pure decode too (the interval then spans one decode step of the core) and nothing ran
in between (:meth:`StepMeter.paused`): a weight load pauses the core, and a command delays the
thread that reads the outputs, so the interval after either is a pause, not a step.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from staleflow.adapters.vllm.llm import kv_tokens, pure_decode
from staleflow.runtime.coordination.cost_fit import DecodeStepLog
from staleflow.runtime.types import RolloutRequest


class StepMeter:
    """Records an engine's pure decode steps into ``log`` (module docstring)."""

    def __init__(self, log: DecodeStepLog) -> None:
        self.log = log
        self._prefilling: set[str] = set()  # submitted, no token since (core in another process)
        self._last_decode_end: float | None = None
        self._step: tuple[int, int, float] | None = None  # (requests, KV tokens, start) of the step under way

    def submitted(self, request_ids: Iterable[str]) -> None:
        self._prefilling.update(request_ids)

    def produced(self, request_id: str) -> None:
        """``request_id`` got a token (or left the engine): it is past its prefill."""
        self._prefilling.discard(request_id)

    def paused(self) -> None:
        """Something ran between two steps (a weight load, a command): the next interval is no step."""
        self._last_decode_end = None

    def before(self, scheduler: Any, live: Mapping[str, RolloutRequest]) -> None:
        """Call right before ``LLMEngine.step()``; ``scheduler``: vLLM's, or None (core elsewhere)."""
        if scheduler is not None:
            decode = pure_decode(scheduler)
            n, kv = (len(scheduler.running), kv_tokens(scheduler)) if decode else (0, 0)
        else:
            decode = bool(live) and not (self._prefilling & live.keys())
            n, kv = len(live), sum(len(r.prompt_ids) + len(r.output_ids) for r in live.values())
        self._step = (n, kv, time.perf_counter()) if decode and n else None
        if scheduler is None and self._step is None:
            self._last_decode_end = None

    def after(self, generated: int, in_process: bool) -> None:
        """Call right after the step with the tokens it produced; records the step if pure decode."""
        end = time.perf_counter()
        if self._step is None:
            return
        n, kv, start = self._step
        if in_process:
            seconds: float | None = end - start
        else:
            seconds = None if self._last_decode_end is None else end - self._last_decode_end
            self._last_decode_end = end
        # an output-less return of a core elsewhere is no step; seconds per token of each request: a
        # speculative step makes more than one
        if seconds is not None and (in_process or generated):
            self.log.record(n, kv, seconds * n / max(generated, n))

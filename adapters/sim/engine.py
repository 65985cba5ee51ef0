"""A simulated rollout instance: continuous-batching decode timed by the cost model, in virtual time.

The engine behaves like one vLLM instance seen from outside (the
:class:`~staleflow.runtime.interfaces.RolloutEngine` seam) and advances lazily: every call first
brings it up to ``clock.now()``.

Model of execution:

* Decode runs in steps. A step of the ``n`` running requests holding ``K`` KV tokens takes
  ``L(n, K)`` seconds (:class:`~staleflow.runtime.coordination.cost_model.CostModel`); each running request
  gains one token, so ``K`` grows by ``n`` per step. The running set changes only at step
  boundaries: a command that arrives mid-step lets the step in progress finish first.
* Admission is first-come first-served from the waiting queue: a request starts when fewer than
  ``max_running`` requests run and its context (prompt + tokens already generated) plus one more
  token for every running request fits in ``kv_capacity``. Admitted requests first (re)build their
  KV cache: the instance stalls for a chunked prefill of their context, linear plus an attention
  term (:func:`~staleflow.adapters.sim.network.prefill_seconds`). When the next step would
  overflow the KV cache, the most recently admitted request is preempted back to the head of the
  queue (it keeps its tokens), as vLLM does.
* A request finishes after ``metadata[REQUEST_LENGTH_KEY]`` tokens, capped by ``max_new_tokens``
  (finish reason ``"length"``); without the key it runs to the cap.
* ``load_weights`` switches the version at once and blocks this instance for ``weight_load_s`` plus
  the transfer (``weight_link``: a parameter-server pull sharing its bandwidth, or a broadcast: ``broadcast=True``);
  running requests keep their tokens and go on with the new weights. With ``reload_recomputes_kv``
  their KV cache is rebuilt first (a prefill of every resident request), as when a sync interrupts
  and resumes them (the reference) or an engine discards stale KV (AReaL); without it the stale KV
  is kept (vLLM's in-place reload).

Between two events (a finish, a KV overflow, a command) the running set is fixed, so ``s`` steps take
``s*(a_b + a_k*K + M(n)) + a_k*n*s*(s-1)/2`` seconds: the engine jumps over them in closed form, O(events * log n)
(token lists are :class:`~staleflow.adapters.sim.tokens.RunLengthList` runs; token ids ``0``, log-probs ``FAKE_LOGPROB``).
``event_quantum_s`` > 0 rounds the announced event times up to its multiples, so that events of
many instances share one loop iteration; the state and each ``metadata["finish_time"]`` stay exact.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from staleflow.adapters.sim.network import WeightTransfer, prefill_seconds
from staleflow.adapters.sim.speculation import Decode, DraftVerification
from staleflow.adapters.sim.tokens import RunLengthList
from staleflow.runtime.coordination.cost_fit import DecodeStepLog
from staleflow.runtime.coordination.cost_model import CostModel, ProfileRecord
from staleflow.runtime.interfaces import Clock
from staleflow.runtime.settings.workload import REQUEST_LENGTH_KEY, Workload
from staleflow.runtime.types import InstanceSnapshot, RolloutRequest, Trajectory

FAKE_TOKEN = 0
FAKE_LOGPROB = -1.0


@dataclass
class _Live:
    """A request on this instance: what it came with, and what it generated here so far."""

    request: RolloutRequest
    target: int  # total output tokens at which it finishes
    context: int  # prompt + output tokens resident when running (as of ``base_step``)
    produced: int  # output tokens as of ``base_step``
    base_step: int = 0  # engine step count when it was last admitted
    runs: list[list[int]] = field(default_factory=list)  # [version, count] of tokens generated here


class SimEngine:
    """One simulated rollout instance (see the module docstring for the execution model).

    Args:
        instance_id: the instance's name.
        clock: the run's clock (a :class:`~staleflow.runtime.run.clock.VirtualClock`).
        cost_model: decode latency of this instance (a speculating one if it speculates: :data:`Decode`).
        kv_capacity: KV-cache capacity in tokens.
        max_running: most requests decoding at once.
        prefill_s_per_token: stall per context token when a request is admitted.
        weight_load_s: how long ``load_weights`` blocks the instance.
        version: the model version it starts with.
        event_quantum_s: granularity of the event times it announces (0: exact).
        reload_recomputes_kv: a weight load also re-prefills the resident KV cache.
        prefill_attn_s_per_token2: the attention term of a prefill (per token pair).
        weight_link: what a weight load spends receiving the weights (None: nothing).
    """

    def __init__(
        self,
        instance_id: str,
        clock: Clock,
        cost_model: Decode,
        kv_capacity: int,
        *,
        max_running: int = 256,
        prefill_s_per_token: float = 0.0,
        weight_load_s: float = 0.0,
        version: int = 0,
        event_quantum_s: float = 0.0,
        reload_recomputes_kv: bool = False,
        prefill_attn_s_per_token2: float = 0.0,
        weight_link: WeightTransfer | None = None,
    ) -> None:
        for name, value, low in (("kv_capacity", kv_capacity, 2), ("max_running", max_running, 1), ("event_quantum_s", event_quantum_s, 0)):
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        self._quantum = event_quantum_s
        self.instance_id = instance_id
        self._clock = clock
        self._cost = cost_model
        self._capacity = kv_capacity
        self._max_running = max_running
        self._prefill = prefill_s_per_token
        self._prefill_attn = prefill_attn_s_per_token2
        self._link = weight_link
        self._load_s = weight_load_s
        self._reload_recomputes_kv = reload_recomputes_kv
        self._version = version
        self._version_marks: list[tuple[int, int]] = [(0, version)]  # (step, version from that step)
        self._t = clock.now()  # the state below is exact at this time (a step boundary)
        self._busy_until = self._t  # end of a weight load or prefill stall
        self._load_until = self._t  # end of the last weight load
        self._steps = 0  # decode steps done
        self._kv = 0
        self._running: dict[str, _Live] = {}  # in admission order
        self._waiting: OrderedDict[str, _Live] = OrderedDict()
        self._finish_heap: list[tuple[int, int, str]] = []  # (finish step, admission seq, id)
        self._seq = 0
        self._finished: list[Trajectory] = []
        self._tokens = 0  # tokens generated so far
        self._trajectories = 0  # trajectories finished so far
        self._last_snapshot = (self._t, 0)
        self._last_rate = 0.0
        self._changes = 0  # bumped whenever the running or waiting set changes
        self._quiet = -1  # ``_changes`` when :meth:`_advance` last stopped inside a cached segment
        self._seg: tuple[int, float] | None = None  # cached :meth:`_segment`
        self._positioned: tuple[tuple[int, int], Decode] = ((-1, -1), cost_model)  # cached :meth:`_decode`
        self._ids: tuple[int, tuple[str, ...], tuple[str, ...]] = (0, (), ())
        self._decode_steps = DecodeStepLog()
        self._closed = False

    @classmethod
    def from_workload(
        cls, workload: Workload, instance_id: str, clock: Clock, version: int = 0, event_quantum_s: float = 0.0,
        weight_link: WeightTransfer | None = None, speculate: Callable[[CostModel], Decode] | None = None,
    ) -> SimEngine:
        """An instance of ``workload``; ``speculate`` wraps its cost model in a speculating one."""
        spec, cost = workload.instance, workload.build_cost_model()
        return cls(
            instance_id, clock, cost if speculate is None else speculate(cost),
            spec.kv_capacity_tokens, max_running=spec.max_running, prefill_s_per_token=spec.prefill_s_per_token,
            weight_load_s=spec.weight_load_s, version=version, event_quantum_s=event_quantum_s, weight_link=weight_link,
            reload_recomputes_kv=spec.reload_recomputes_kv, prefill_attn_s_per_token2=spec.prefill_attn_s_per_token2,
        )

    # ------------------------------------------------------------------ the RolloutEngine seam
    def submit(self, requests: Sequence[RolloutRequest]) -> None:
        self._settle()
        for request in requests:
            if request.request_id in self._running or request.request_id in self._waiting:
                raise ValueError(f"{self.instance_id}: request {request.request_id!r} is already on this instance")
            if request.group_version > self._version:
                raise ValueError(
                    f"{self.instance_id}: request {request.request_id!r} needs version >= "
                    f"{request.group_version}, instance is at {self._version}"
                )
            live = self._live(request)
            if live.produced >= live.target:
                self._finished.append(self._trajectory(live))
            else:
                self._waiting[request.request_id] = live
                self._changes += 1
        self._advance(self._clock.now())

    def interrupt(self, request_ids: Sequence[str]) -> list[RolloutRequest]:
        self._settle()
        partials = []
        for request_id in request_ids:
            live = self._remove(request_id)
            if live is not None:
                partials.append(self._partial(live))
        self._advance(self._clock.now())
        return partials

    def abort(self, request_ids: Sequence[str]) -> None:
        self._settle()
        ids = set(request_ids)
        for request_id in ids:
            self._remove(request_id)
        if any(t.request_id in ids for t in self._finished):
            self._finished = [t for t in self._finished if t.request_id not in ids]
        self._advance(self._clock.now())

    def load_weights(self, version: int, weights: Any = None, broadcast: bool = False) -> None:
        if version < self._version:
            raise ValueError(f"{self.instance_id}: cannot go back from version {self._version} to {version}")
        self._settle()
        self._version = version
        self._version_marks.append((self._steps, version))
        start = max(self._t, self._busy_until)
        stall = self._load_s + (self._link.transfer_s(start, broadcast) if self._link is not None else 0.0)
        if self._reload_recomputes_kv:
            stall += sum(self._prefill_s(live.context + self._steps - live.base_step) for live in self._running.values())
        self._busy_until = self._load_until = start + stall
        self._advance(self._clock.now())

    def snapshot(self) -> InstanceSnapshot:
        now = self._clock.now()
        self._advance(now)
        done = len(self._running) * self._steps_done_in_segment(now)  # mid-segment: count the steps done
        kv, tokens = self._kv + done, self._tokens + done
        last_time, last_tokens = self._last_snapshot
        if now > last_time:
            self._last_rate = (tokens - last_tokens) / (now - last_time)
            self._last_snapshot = (now, tokens)
        if self._ids[0] != self._changes:  # the same tuples while the sets are unchanged
            self._ids = (self._changes, tuple(self._running), tuple(self._waiting))
        return InstanceSnapshot(instance_id=self.instance_id, version=self._version, running=self._ids[1], waiting=self._ids[2],
                                kv_tokens=kv, kv_capacity=self._capacity, tokens_per_s=self._last_rate, time=now,
                                loading=self._load_until > now)

    def collect(self) -> list[Trajectory]:
        self._advance(self._clock.now())
        done, self._finished = self._finished, []
        return done

    def next_event_time(self) -> float | None:
        self._advance(self._clock.now())
        if self._busy_until > self._t:
            event = self._busy_until
        elif self._running:
            event = self._segment()[1]
        else:
            return None
        if self._quantum:
            event = math.ceil(event / self._quantum) * self._quantum
        return event

    def close(self) -> None:
        self._running.clear()
        self._waiting.clear()
        self._finish_heap.clear()
        self._closed = True

    # ------------------------------------------------------------------ figures for reports
    @property
    def version(self) -> int:
        return self._version

    def decode_steps(self) -> list[ProfileRecord]:
        """The decode steps since the last call, one record per run of steps of a fixed running set."""
        return self._decode_steps.drain()

    def progress(self) -> tuple[int, int]:
        """Decode tokens made here by now (of interrupted requests too, a segment in progress counted), trajectories finished."""
        self._advance(now := self._clock.now())
        return self._tokens + len(self._running) * self._steps_done_in_segment(now), self._trajectories

    def _steps_done_in_segment(self, now: float) -> int:
        """Whole decode steps of the segment in progress done by ``now`` (0 outside a segment)."""
        if self._running and self._busy_until <= self._t < now:
            return self._decode().steps_within(now - self._t, len(self._running), self._kv, self._segment()[0])
        return 0

    # ------------------------------------------------------------------ execution
    def _live(self, request: RolloutRequest) -> _Live:
        wanted = int(request.metadata.get(REQUEST_LENGTH_KEY, request.max_new_tokens))
        produced = len(request.output_ids)
        target = min(wanted, request.max_new_tokens)
        if len(request.prompt_ids) + target + 1 > self._capacity:
            raise ValueError(
                f"{self.instance_id}: request {request.request_id!r} needs {len(request.prompt_ids) + target + 1} "
                f"KV tokens at its longest, more than this instance's capacity {self._capacity}"
            )
        return _Live(
            request=request,
            target=target,
            context=len(request.prompt_ids) + produced,
            produced=produced,
        )

    def _steps_to_finish(self) -> int:
        heap = self._finish_heap
        while heap:
            step, _, request_id = heap[0]
            live = self._running.get(request_id)
            if live is not None and live.base_step + live.target - live.produced == step:
                return step - self._steps
            heapq.heappop(heap)  # stale: the request left the running set since
        raise AssertionError("running requests but no finish scheduled")

    def _steps_to_overflow(self, n: int) -> int:
        return (self._capacity - self._kv) // n

    def _decode(self) -> Decode:
        """What times the running set's steps from now: the cost model, or with an acceptance that varies
        along a response, the drafts chosen for the running requests' positions (kept until a step or a change)."""
        if not isinstance(self._cost, DraftVerification) or not self._cost.by_position:
            return self._cost
        if self._positioned[0] != (self._changes, self._steps):
            positions = [live.produced + self._steps - live.base_step for live in self._running.values()]
            self._positioned = ((self._changes, self._steps), self._cost.at_positions(positions, self._kv))
        return self._positioned[1]

    def _segment(self) -> tuple[int, float]:
        """Steps of the running set until its next event (a finish or a KV overflow), and the time
        they end; cached until the state changes."""
        if self._seg is None:
            n = len(self._running)
            steps = min(self._steps_to_finish(), self._steps_to_overflow(n))
            self._seg = (steps, self._t + self._decode().decode_seconds(steps, n, self._kv))
        return self._seg

    def _do_steps(self, steps: int) -> None:
        self._seg = None
        n = len(self._running)
        elapsed = self._decode().decode_seconds(steps, n, self._kv)
        if steps and n:  # one record of the segment's mean step (exact: L is linear in K along it)
            self._decode_steps.record(n, self._kv + n * (steps - 1) // 2, elapsed / steps)
        self._t += elapsed
        self._steps += steps
        self._kv += n * steps
        self._tokens += n * steps

    def _advance(self, now: float) -> None:
        """Bring the state to the last event at or before ``now``. Inside a segment (fixed running
        set) the state stays at the segment's start; :meth:`snapshot` and :meth:`_settle` count the
        steps done since in closed form."""
        seg = self._seg
        if seg is not None and seg[1] > now and self._quiet == self._changes and self._busy_until <= self._t:
            return  # still inside the segment it stopped in, nothing changed since: nothing to do
        while True:
            if self._busy_until > self._t:
                if self._busy_until > now:
                    return
                self._t = self._busy_until
                self._seg = None
            self._finish_due()
            self._admit()
            if self._busy_until > self._t:
                continue  # an admission started a prefill stall
            if not self._running:
                self._t = max(self._t, now)
                return
            while self._steps_to_overflow(len(self._running)) == 0:
                self._preempt_last()
            steps, end = self._segment()
            if end > now:
                self._quiet = self._changes
                return
            self._do_steps(steps)

    def _settle(self) -> None:
        """Advance to now, then let a decode step in progress finish, so that a command applies at
        a step boundary (never retroactively)."""
        if self._closed:
            raise RuntimeError(f"{self.instance_id}: engine is closed")
        now = self._clock.now()
        self._advance(now)
        if self._running and self._busy_until <= self._t < now:
            self._do_steps(self._steps_done_in_segment(now) + 1)  # <= the segment's steps: it ends after now
            self._finish_due()

    def _finish_due(self) -> None:
        heap = self._finish_heap
        while heap and heap[0][0] <= self._steps:
            step, _, request_id = heapq.heappop(heap)
            live = self._running.get(request_id)
            if live is None or live.base_step + live.target - live.produced != step:
                continue
            self._stop(request_id)
            self._finished.append(self._trajectory(live))

    def _admit(self) -> None:
        stall = 0.0
        while self._waiting and len(self._running) < self._max_running:
            request_id, live = next(iter(self._waiting.items()))
            if self._kv + live.context + len(self._running) + 1 > self._capacity:
                break
            del self._waiting[request_id]
            live.base_step = self._steps
            self._running[request_id] = live
            self._changes += 1
            self._seg = None
            self._kv += live.context
            self._seq += 1
            heapq.heappush(self._finish_heap, (self._steps + live.target - live.produced, self._seq, request_id))
            stall += self._prefill_s(live.context)
        if stall > 0:
            self._busy_until = self._t + stall

    def _prefill_s(self, context: int) -> float:
        return prefill_seconds(context, self._prefill, self._prefill_attn)

    def _stop(self, request_id: str) -> _Live:
        """Take a running request out of the batch, folding the tokens it generated into its record."""
        live = self._running.pop(request_id)
        self._changes += 1
        self._seg = None
        new = self._steps - live.base_step
        if new:
            self._record_runs(live, live.base_step, self._steps)
        live.produced += new
        live.context += new
        self._kv -= live.context
        live.base_step = self._steps
        return live

    def _record_runs(self, live: _Live, start: int, end: int) -> None:
        """Append the versions of the tokens made in steps ``start..end-1`` to ``live.runs``."""
        marks = self._version_marks
        first = max(0, bisect.bisect_right(marks, (start, math.inf)) - 1)
        for i in range(first, len(marks)):
            mark_step, version = marks[i]
            if mark_step >= end:
                break
            next_step = marks[i + 1][0] if i + 1 < len(marks) else end
            lo, hi = max(start, mark_step), min(end, next_step)
            if hi > lo:
                if live.runs and live.runs[-1][0] == version:
                    live.runs[-1][1] += hi - lo
                else:
                    live.runs.append([version, hi - lo])

    def _preempt_last(self) -> None:
        request_id = next(reversed(self._running))
        live = self._stop(request_id)
        self._waiting[request_id] = live
        self._waiting.move_to_end(request_id, last=False)

    def _remove(self, request_id: str) -> _Live | None:
        if request_id in self._running:
            return self._stop(request_id)
        live = self._waiting.pop(request_id, None)
        self._changes += 1
        return live

    # ------------------------------------------------------------------ records
    def _outputs(self, live: _Live) -> tuple[Any, Any, Any]:
        """Token ids, log-probs and versions so far, as run-length lists (read-only, O(1) ``len``)."""
        request = live.request
        added = live.produced - len(request.output_ids)
        return (
            RunLengthList.extended(request.output_ids, [(FAKE_TOKEN, added)]),
            RunLengthList.extended(request.logprobs, [(FAKE_LOGPROB, added)]),
            RunLengthList.extended(request.versions, [(v, c) for v, c in live.runs]),
        )

    def _partial(self, live: _Live) -> RolloutRequest:
        output_ids, logprobs, versions = self._outputs(live)
        return replace(live.request, output_ids=output_ids, logprobs=logprobs, versions=versions)

    def _trajectory(self, live: _Live) -> Trajectory:
        self._trajectories += 1  # called once per finished request
        request = live.request
        output_ids, logprobs, versions = self._outputs(live)
        reason = "length" if live.target >= request.max_new_tokens else "stop"
        return Trajectory(request_id=request.request_id, group_id=request.group_id, prompt_ids=request.prompt_ids, output_ids=output_ids,
                          logprobs=logprobs, versions=versions, finish_reason=reason,
                          metadata={**request.metadata, "instance_id": self.instance_id, "finish_time": self._t})

"""What a run measures: tokens, step times, staleness per buffer, instance utilisation, counters.

:class:`RunStats` is fed by the run loop as things happen and turns into :class:`RunMetrics` at the
end. Times are the run clock's seconds (virtual in simulation).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from staleflow.protocol import ConsumedBatch
from staleflow.runtime.servers.audit import AuditReport
from staleflow.runtime.types import TrainingBatch


@dataclass
class RunMetrics:
    """What a run measured. Times are the clock's seconds (virtual in simulation).

    ``tokens_generated``: response tokens of every finished trajectory (kept or not);
    ``tokens_trained``: response tokens of the trajectories in consumed batches; ``tokens_per_s``:
    trained tokens per second of the run (start-up included: :func:`steady_state` leaves it out);
    ``step_tokens``: the response tokens each step trained. ``staleness_per_buffer[b][s]``: groups of batch ``b``
    generated ``s`` versions before it; ``staleness_histogram`` sums them over batches.
    ``staleness_p99``: the 99th percentile of the trained groups' staleness; ``past_eta_share``: the
    share of trained groups older than the bound ``eta`` the run was asked for (only systems that do
    not keep the bound have any). ``dropped``: groups dropped at consume (redundancy waste, or a
    peer system's staleness filter); ``proactive_aborted``: groups proactive abort re-queued;
    ``wasted_tokens``: response tokens of finished trajectories of groups dropped or aborted;
    ``reward_failures``: groups whose reward raised or timed out; ``mixed_version_trajectories``:
    trained trajectories whose tokens more than one version sampled (a weight update reached them in
    flight and they went on in place);
    ``cancelled_requests``: group-level redundancy siblings cancelled. ``lost`` and ``duplicated``
    come from the trajectory-server audit at the end of the run and must be zero. ``cost_fit``: the
    cost model the coordinator planned with at the end, its error and age
    (:meth:`~staleflow.runtime.coordination.cost_fit.OnlineCostModel.figures`).
    """

    system: str
    steps: int
    elapsed_s: float
    tokens_generated: int
    tokens_trained: int
    tokens_per_s: float
    step_times_s: list[float]
    step_tokens: list[int]
    step_time_s: float
    utilisation: float
    instance_busy_fraction: dict[str, float]
    staleness_per_buffer: dict[int, dict[int, int]]
    staleness_histogram: dict[int, int]
    max_staleness: int
    staleness_p99: int
    past_eta_share: float
    dropped: int
    proactive_aborted: int
    wasted_tokens: int
    reward_failures: int
    cancelled_requests: int
    late_discards: int
    lost: int
    duplicated: int
    audit_ok: bool
    coordinator: dict[str, float]
    mixed_version_trajectories: int = 0
    train_metrics: list[dict[str, float]] = field(default_factory=list)
    cost_fit: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def steady_state(step_times: Sequence[float], step_tokens: Sequence[int], skip: int) -> tuple[float, float] | None:
    """Trained tokens per second and mean step time over the steps after the first ``skip`` (the
    run's start-up: the pipeline is still filling), or None when no step is left."""
    times, tokens = step_times[skip:], step_tokens[skip:]
    if not times or sum(times) <= 0:
        return None
    return sum(tokens) / sum(times), sum(times) / len(times)


def staleness_quantile(histogram: Mapping[int, int], q: float) -> int:
    """The smallest staleness ``s`` with at least a share ``q`` of the groups at ``s`` or below."""
    total = sum(histogram.values())
    seen = 0
    for staleness in sorted(histogram):
        seen += histogram[staleness]
        if seen >= q * total:
            return staleness
    return 0


def mixed_versions(versions: Sequence[int]) -> bool:
    """Whether more than one model version sampled these tokens: not all of them the first one's.
    ``count`` is the sequence's own (a simulated trajectory's run-length list counts from its runs,
    never walking a 40,000-token response)."""
    return bool(versions) and versions.count(versions[0]) != len(versions)


class RunStats:
    """Counts a run as it goes (see :class:`RunMetrics` for the meaning of each figure).

    ``counters`` is shared with the loop's helpers (command counts, failures, recoveries); the
    tokens, the staleness per buffer and the counters are part of a checkpoint.
    """

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()
        self.steps_done = 0
        self.tokens_generated = 0
        self.tokens_trained = 0
        self.step_times: list[float] = []
        self.step_tokens: list[int] = []
        self._trained_at_step_end = 0
        self.train_metrics: list[dict[str, float]] = []
        self.staleness: dict[int, Counter[int]] = {}
        self.run_start = 0.0
        self.last_step_end = 0.0
        self._busy_since: dict[str, float] = {}
        self._busy_total: dict[str, float] = {}

    def start(self, now: float) -> None:
        self.run_start = now
        self.last_step_end = now

    def batch_consumed(self, consumed: ConsumedBatch, batch: TrainingBatch, cancelled: int) -> None:
        self.counters["dropped"] += len(consumed.dropped)
        self.counters["cancelled_requests"] += cancelled
        self.staleness[consumed.version] = Counter(consumed.version - v for v in consumed.group_versions)
        self.tokens_trained += sum(len(t.output_ids) for ts in batch.groups.values() for t in ts)
        self.counters["mixed_version_trajectories"] += sum(mixed_versions(t.versions) for ts in batch.groups.values() for t in ts)

    def step_finished(self, now: float, metrics: Mapping[str, float]) -> None:
        self.steps_done += 1
        self.step_times.append(now - self.last_step_end)
        self.step_tokens.append(self.tokens_trained - self._trained_at_step_end)
        self._trained_at_step_end = self.tokens_trained
        self.last_step_end = now
        self.train_metrics.append(dict(metrics))

    def instances_busy(self, now: float, busy: Mapping[str, bool]) -> None:
        """Record which of these instances hold requests from ``now`` on (utilisation)."""
        for iid, is_busy in busy.items():
            since = self._busy_since.get(iid)
            if is_busy and since is None:
                self._busy_since[iid] = now
            elif not is_busy and since is not None:
                self._busy_total[iid] = self._busy_total.get(iid, 0.0) + (now - since)
                del self._busy_since[iid]

    def busy_seconds(self, now: float) -> dict[str, float]:
        """Seconds each instance held requests from the start up to ``now`` (nothing is changed)."""
        busy = dict(self._busy_total)
        for iid, since in self._busy_since.items():
            busy[iid] = busy.get(iid, 0.0) + now - since
        return busy

    def metrics(
        self,
        now: float,
        system: str,
        instance_ids: Iterable[str],
        audit: AuditReport,
        coordinator: dict[str, float],
        late_discards: int,
        groups: Any,
        eta: int,
    ) -> RunMetrics:
        """``groups``: the run's :class:`~staleflow.runtime.run.group_life.GroupLife`; ``eta``: the bound asked for."""
        elapsed = max(now - self.run_start, 1e-12)
        busy = self.busy_seconds(now)
        busy_fraction = {iid: busy.get(iid, 0.0) / elapsed for iid in instance_ids}
        histogram: Counter[int] = Counter()
        for counts in self.staleness.values():
            histogram.update(counts)
        counters = self.counters
        return RunMetrics(
            system=system,
            steps=self.steps_done,
            elapsed_s=elapsed,
            tokens_generated=self.tokens_generated,
            tokens_trained=self.tokens_trained,
            tokens_per_s=self.tokens_trained / elapsed,
            step_times_s=list(self.step_times),
            step_tokens=list(self.step_tokens),
            step_time_s=sum(self.step_times) / len(self.step_times) if self.step_times else 0.0,
            utilisation=sum(busy_fraction.values()) / len(busy_fraction),
            instance_busy_fraction=busy_fraction,
            staleness_per_buffer={b: dict(sorted(c.items())) for b, c in sorted(self.staleness.items())},
            staleness_histogram=dict(sorted(histogram.items())),
            max_staleness=max(histogram, default=0),
            staleness_p99=staleness_quantile(histogram, 0.99),
            past_eta_share=sum(n for s, n in histogram.items() if s > eta) / max(1, sum(histogram.values())),
            dropped=counters["dropped"],
            proactive_aborted=groups.requeued,
            wasted_tokens=groups.wasted_tokens,
            reward_failures=counters["reward_failures"],
            cancelled_requests=counters["cancelled_requests"],
            late_discards=late_discards,
            lost=len(audit.lost),
            duplicated=len(audit.duplicated),
            audit_ok=audit.ok,
            mixed_version_trajectories=counters["mixed_version_trajectories"],
            coordinator={**coordinator, **{k: float(v) for k, v in counters.items() if k.startswith(("command_", "collective_"))}},
            train_metrics=list(self.train_metrics),
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "steps_done": self.steps_done,
            "counters": dict(self.counters),
            "tokens": [self.tokens_generated, self.tokens_trained],
            "staleness": {str(b): {str(s): n for s, n in c.items()} for b, c in self.staleness.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.steps_done = int(state["steps_done"])
        self.counters.clear()  # in place: the loop's helpers hold this counter
        self.counters.update(state["counters"])
        self.tokens_generated, self.tokens_trained = state["tokens"]
        self._trained_at_step_end = self.tokens_trained
        self.staleness = {int(b): Counter({int(s): n for s, n in c.items()}) for b, c in state["staleness"].items()}

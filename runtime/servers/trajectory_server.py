"""The trajectory server (TS): prompt groups, partial trajectories and finished, rewarded groups.

Every request and every group is in exactly one state at any time, and each state change checks
the state it leaves, so nothing is lost or duplicated across route, interrupt, re-route, abort and
consume. :meth:`TrajectoryServer.audit` recounts everything and compares it with what the engines
hold.

Group life: ``pending`` (drawn from the dataset, not admitted) -> ``generating`` (admitted by the
protocol at a version) -> ``rewarding`` (its first ``n_samples`` responses finished) -> ``done``
(rewarded) -> ``consumed``; or it ends ``dropped`` (redundancy waste at consume), ``aborted``
(staleness GC, cancellation) or ``failed`` (the reward raised or timed out).

Request life: ``queued`` (waiting for a route; fresh or a partial) <-> ``running`` (on one
instance) -> ``finished`` (kept: one of the group's first ``n_samples``) or ``cancelled``
(group-level redundancy: a sibling the group no longer needs, or its group ended).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from staleflow.runtime.servers.audit import AuditReport, placement_mismatches
from staleflow.runtime.servers.request_queue import QueueView, RequestQueue
from staleflow.runtime.types import (
    Cancellations,
    GroupId,
    PromptGroup,
    RolloutRequest,
    TrainingBatch,
    Trajectory,
)

STATE_FORMAT = "staleflow.trajectory_server/1"


class GroupState(str, enum.Enum):
    PENDING = "pending"
    GENERATING = "generating"
    REWARDING = "rewarding"
    DONE = "done"
    CONSUMED = "consumed"
    DROPPED = "dropped"
    ABORTED = "aborted"
    FAILED = "failed"


class RequestState(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"


#: Group states a group can be aborted from (the protocol still holds it).
_ABORTABLE = (GroupState.GENERATING, GroupState.REWARDING, GroupState.DONE)


class TrajectoryServerError(RuntimeError):
    """A state change that would lose or duplicate a request or group (a caller bug)."""


@dataclass
class _Group:
    group: PromptGroup
    state: GroupState = GroupState.PENDING
    version: int | None = None
    kept: list[Trajectory] = field(default_factory=list)


@dataclass
class _Request:
    request: RolloutRequest
    state: RequestState = RequestState.QUEUED
    instance_id: str | None = None


@dataclass(frozen=True)
class CompletedGroup:
    """A group whose ``n_samples`` responses are in (it is rewarding now): what its reward needs."""

    group: PromptGroup
    trajectories: tuple[Trajectory, ...]


@dataclass(frozen=True)
class FinishOutcome:
    """What :meth:`TrajectoryServer.finish` did with one trajectory.

    ``kept``: it is one of its group's first ``n_samples``. ``completed``: the group has its
    ``n_samples`` responses now (reward it), with them. ``cancel``: sibling requests to abort on
    their instances. ``late``: the request had been cancelled already (its group ended or no longer
    needed it); ``duplicate``: the request was not running on that instance (counted; the
    trajectory is ignored).
    """

    kept: bool
    completed: CompletedGroup | None = None
    cancel: Cancellations = ()
    late: bool = False
    duplicate: bool = False

    @property
    def group_complete(self) -> bool:
        return self.completed is not None


def request_id(group_id: GroupId, index: int) -> str:
    return f"{group_id}/{index}"


class TrajectoryServer:
    """Holds every prompt group, request (with its partial output) and finished trajectory of a run."""

    def __init__(self) -> None:
        self._groups: dict[GroupId, _Group] = {}
        self._requests: dict[str, _Request] = {}
        self._pending: dict[GroupId, None] = {}
        self._queue = RequestQueue()
        self._duplicates: list[str] = []
        self._late = 0

    # ----------------------------------------------------------------- prompts and admission
    def add_groups(self, groups: Iterable[PromptGroup]) -> None:
        """Add prompt groups drawn from the dataset; they wait ``pending`` until admitted."""
        for group in groups:
            if group.group_id in self._groups:
                raise TrajectoryServerError(f"group {group.group_id!r} was added already")
            if group.n_samples < 1 or group.n_extra < 0:
                raise ValueError(
                    f"group {group.group_id!r}: n_samples must be >= 1 and n_extra >= 0, "
                    f"got {group.n_samples} and {group.n_extra}"
                )
            requests = group.n_samples + group.n_extra
            for name, samples in (("sample_metadata", group.sample_metadata), *(("a resample", r) for r in group.resamples)):
                if samples and len(samples) < requests:
                    raise ValueError(
                        f"group {group.group_id!r}: {name} has {len(samples)} entries, "
                        f"need n_samples + n_extra = {requests}"
                    )
            self._groups[group.group_id] = _Group(group)
            self._pending[group.group_id] = None

    def pending_count(self) -> int:
        return len(self._pending)

    def next_pending(self) -> PromptGroup | None:
        """The oldest pending group (not removed; :meth:`admit` does that)."""
        for group_id in self._pending:
            return self._groups[group_id].group
        return None

    def admit(self, group_id: GroupId, version: int) -> list[RolloutRequest]:
        """The protocol admitted ``group_id`` at ``version``: create and queue its requests."""
        entry = self._group(group_id, (GroupState.PENDING,), "admit")
        del self._pending[group_id]
        entry.state = GroupState.GENERATING
        entry.version = version
        group = entry.group
        created = []
        for index in range(group.n_samples + group.n_extra):
            metadata = _request_metadata(group, index)
            request = RolloutRequest(
                request_id=request_id(group_id, index),
                group_id=group_id,
                prompt_ids=group.prompt_ids,  # shared by the group's requests; nobody mutates a prompt
                max_new_tokens=_max_tokens(group, metadata),
                group_version=version,
                metadata=metadata,
            )
            self._requests[request.request_id] = _Request(request)
            self._queue.add(request)
            created.append(request)
        return created

    # ----------------------------------------------------------------- routing
    def queued(self) -> list[RolloutRequest]:
        """Requests waiting for a route, most urgent first: oldest group version, then most output
        tokens, then the earliest queued (see :mod:`~staleflow.runtime.servers.request_queue`)."""
        return self._queue.in_order()

    def queue_view(self) -> QueueView:
        """The queue in the order of :meth:`queued`, with each request's version and KV tokens as arrays."""
        return self._queue.view()

    def queued_count(self) -> int:
        return len(self._queue)

    def request(self, request_id: str) -> RolloutRequest:
        return self._requests[request_id].request

    def mark_routed(self, request_ids: Iterable[str], instance_id: str) -> list[RolloutRequest]:
        """Queued -> running on ``instance_id``; returns the requests to submit."""
        routed = []
        for rid in request_ids:
            entry = self._request(rid, RequestState.QUEUED, "route")
            self._queue.remove(rid)
            entry.state = RequestState.RUNNING
            entry.instance_id = instance_id
            routed.append(entry.request)
        return routed

    def requeue(self, partials: Iterable[RolloutRequest], instance_id: str) -> int:
        """Interrupted partials from ``instance_id`` go back to the queue, keeping their version.

        Partials of requests cancelled meanwhile are discarded; returns how many were queued.
        """
        queued = 0
        for partial in partials:
            entry = self._requests.get(partial.request_id)
            if entry is not None and entry.state is RequestState.CANCELLED:
                self._late += 1
                continue
            entry = self._request(partial.request_id, RequestState.RUNNING, "requeue")
            if entry.instance_id != instance_id:
                raise TrajectoryServerError(
                    f"request {partial.request_id!r} came back from {instance_id!r} "
                    f"but runs on {entry.instance_id!r}"
                )
            if partial.group_version != entry.request.group_version:
                raise TrajectoryServerError(
                    f"request {partial.request_id!r} came back with group version "
                    f"{partial.group_version}, admitted at {entry.request.group_version}"
                )
            entry.request = partial
            entry.state = RequestState.QUEUED
            entry.instance_id = None
            self._queue.add(partial)
            queued += 1
        return queued

    # ----------------------------------------------------------------- finishing and rewards
    def finish(self, instance_id: str, trajectory: Trajectory) -> FinishOutcome:
        """A request finished on ``instance_id``; keep it if its group still needs it."""
        entry = self._requests.get(trajectory.request_id)
        if entry is not None and entry.state is RequestState.CANCELLED:
            self._late += 1
            return FinishOutcome(kept=False, late=True)
        if entry is None or entry.state is not RequestState.RUNNING or entry.instance_id != instance_id:
            self._duplicates.append(trajectory.request_id)
            return FinishOutcome(kept=False, duplicate=True)
        group = self._groups[trajectory.group_id]
        entry.state = RequestState.FINISHED
        entry.instance_id = None
        group.kept.append(trajectory)
        if len(group.kept) < group.group.n_samples:
            return FinishOutcome(kept=True)
        group.state = GroupState.REWARDING
        completed = CompletedGroup(group.group, tuple(group.kept))
        return FinishOutcome(kept=True, completed=completed, cancel=self._cancel_requests(group))

    def trajectories(self, group_id: GroupId) -> list[Trajectory]:
        """The kept trajectories of a group (``n_samples`` of them once it is complete)."""
        return list(self._groups[group_id].kept)

    def group(self, group_id: GroupId) -> PromptGroup:
        return self._groups[group_id].group

    def group_state(self, group_id: GroupId) -> GroupState:
        return self._groups[group_id].state

    def group_version(self, group_id: GroupId) -> int | None:
        return self._groups[group_id].version

    def set_rewards(self, group_id: GroupId, rewards: list[float] | None) -> None:
        """Rewards are in (``None``: the run has no reward function): rewarding -> done."""
        entry = self._group(group_id, (GroupState.REWARDING,), "reward")
        if rewards is not None:
            if len(rewards) != len(entry.kept):
                raise ValueError(
                    f"group {group_id!r}: {len(rewards)} rewards for {len(entry.kept)} trajectories"
                )
            for trajectory, reward in zip(entry.kept, rewards):
                trajectory.reward = reward
        entry.state = GroupState.DONE

    def fail_group(self, group_id: GroupId, reason: str) -> None:
        """The reward raised or timed out: rewarding -> failed (the caller aborts it in the protocol)."""
        entry = self._group(group_id, (GroupState.REWARDING,), "fail")
        entry.state = GroupState.FAILED
        entry.group.metadata["failure"] = reason

    def abort_group(self, group_id: GroupId) -> Cancellations:
        """End a group that never reaches a batch; returns its running requests to abort."""
        entry = self._group(group_id, _ABORTABLE, "abort")
        entry.state = GroupState.ABORTED
        return self._cancel_requests(entry)

    # ----------------------------------------------------------------- consumption
    def take_batch(
        self, version: int, group_ids: Iterable[GroupId], dropped: Iterable[GroupId]
    ) -> tuple[TrainingBatch, Cancellations]:
        """Hand the consumed groups to the trainer; dropped groups end here.

        Returns the batch and the running requests of dropped groups, to abort on their instances.
        """
        groups: dict[GroupId, list[Trajectory]] = {}
        for group_id in group_ids:
            entry = self._group(group_id, (GroupState.DONE,), "consume")
            entry.state = GroupState.CONSUMED
            groups[group_id] = entry.kept
            entry.kept = []
        cancel: list[tuple[str, str]] = []
        for group_id in dropped:
            entry = self._group(group_id, _ABORTABLE, "drop")
            entry.state = GroupState.DROPPED
            cancel.extend(self._cancel_requests(entry))
            entry.kept = []
        return TrainingBatch(version=version, groups=groups), tuple(cancel)

    # ----------------------------------------------------------------- accounting
    def running_on(self) -> dict[str, set[str]]:
        """Request ids the TS places on each instance."""
        placed: dict[str, set[str]] = {}
        for rid, entry in self._requests.items():
            if entry.state is RequestState.RUNNING:
                assert entry.instance_id is not None
                placed.setdefault(entry.instance_id, set()).add(rid)
        return placed

    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """Groups and requests per state."""
        groups = {state.value: 0 for state in GroupState}
        for entry in self._groups.values():
            groups[entry.state.value] += 1
        requests = {state.value: 0 for state in RequestState}
        for request in self._requests.values():
            requests[request.state.value] += 1
        return groups, requests

    def late_discards(self) -> int:
        """Outputs of cancelled requests that arrived after the cancellation (ignored)."""
        return self._late

    def audit(self, engine_requests: Mapping[str, Iterable[str]] | None = None) -> AuditReport:
        """Recount every group and request; compare placements with what the engines hold.

        ``engine_requests`` maps instance id to the request ids it holds (running or waiting); call
        after collecting finished trajectories, so that a finished request is not counted lost.
        """
        groups, requests = self.counts()
        problems: list[str] = []
        if sum(groups.values()) != len(self._groups):
            problems.append("group states do not add up")
        if set(self._pending) != {g for g, e in self._groups.items() if e.state is GroupState.PENDING}:
            problems.append("pending list disagrees with group states")
        if set(self._queue) != {r for r, e in self._requests.items() if e.state is RequestState.QUEUED}:
            problems.append("queue disagrees with request states")
        for group_id, entry in self._groups.items():
            n = entry.group.n_samples + entry.group.n_extra
            if entry.state is not GroupState.PENDING:
                ids = [request_id(group_id, i) for i in range(n)]
                if any(rid not in self._requests for rid in ids):
                    problems.append(f"group {group_id!r} is missing requests")
                finished = sum(self._requests[r].state is RequestState.FINISHED for r in ids if r in self._requests)
                if entry.state in (GroupState.REWARDING, GroupState.DONE, GroupState.CONSUMED) and finished != entry.group.n_samples:
                    problems.append(f"group {group_id!r} is {entry.state.value} with {finished} finished responses")
                if entry.state is not GroupState.GENERATING and any(
                    self._requests[r].state in (RequestState.QUEUED, RequestState.RUNNING) for r in ids
                ):
                    problems.append(f"group {group_id!r} is {entry.state.value} with live requests")
        lost: tuple[str, ...] = ()
        orphaned: tuple[str, ...] = ()
        duplicated = tuple(self._duplicates)
        if engine_requests is not None:
            lost, orphaned, held_twice = placement_mismatches(self.running_on(), engine_requests)
            duplicated += held_twice
        return AuditReport(groups, requests, lost, orphaned, duplicated, tuple(problems))

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything the TS holds, JSON-serialisable. No request may be running (interrupt first)."""
        running = [rid for rid, e in self._requests.items() if e.state is RequestState.RUNNING]
        if running:
            raise TrajectoryServerError(
                f"{len(running)} requests are running (e.g. {running[0]!r}): interrupt every instance "
                "before taking a checkpoint, so their partials are in the trajectory server"
            )
        return {
            "format": STATE_FORMAT,
            "groups": [
                {
                    "group": asdict(e.group),
                    "state": e.state.value,
                    "version": e.version,
                    "kept": [_plain(asdict(t)) for t in e.kept],
                }
                for e in self._groups.values()
            ],
            "requests": [{"request": _plain(asdict(e.request)), "state": e.state.value} for e in self._requests.values()],
            "pending": list(self._pending),
            "queue": list(self._queue),
            "duplicates": list(self._duplicates),
            "late": self._late,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the contents with a :meth:`state_dict`."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a trajectory-server state (expected format {STATE_FORMAT!r})")
        self.__init__()  # type: ignore[misc]
        for item in state["groups"]:
            entry = _Group(PromptGroup(**item["group"]), GroupState(item["state"]), item["version"])
            entry.kept = [Trajectory(**t) for t in item["kept"]]
            self._groups[entry.group.group_id] = entry
        for item in state["requests"]:
            request = RolloutRequest(**item["request"])
            self._requests[request.request_id] = _Request(request, RequestState(item["state"]))
        self._pending = dict.fromkeys(state["pending"])
        for rid in state["queue"]:
            self._queue.add(self._requests[rid].request)
        self._duplicates = list(state["duplicates"])
        self._late = int(state["late"])

    # ----------------------------------------------------------------- internals
    def _group(self, group_id: GroupId, allowed: tuple[GroupState, ...], op: str) -> _Group:
        entry = self._groups.get(group_id)
        if entry is None:
            raise TrajectoryServerError(f"cannot {op} unknown group {group_id!r}")
        if entry.state not in allowed:
            raise TrajectoryServerError(
                f"cannot {op} group {group_id!r}: it is {entry.state.value}, "
                f"not {' or '.join(s.value for s in allowed)}"
            )
        return entry

    def _request(self, rid: str, required: RequestState, op: str) -> _Request:
        entry = self._requests.get(rid)
        if entry is None:
            raise TrajectoryServerError(f"cannot {op} unknown request {rid!r}")
        if entry.state is not required:
            raise TrajectoryServerError(f"cannot {op} request {rid!r}: it is {entry.state.value}, not {required.value}")
        return entry

    def _cancel_requests(self, group: _Group) -> Cancellations:
        """Cancel a group's queued and running requests; returns the running ones to abort."""
        group_id = group.group.group_id
        cancel = []
        for index in range(group.group.n_samples + group.group.n_extra):
            entry = self._requests.get(request_id(group_id, index))
            if entry is None:
                continue
            if entry.state is RequestState.QUEUED:
                self._queue.remove(entry.request.request_id)
            elif entry.state is RequestState.RUNNING:
                assert entry.instance_id is not None
                cancel.append((entry.instance_id, entry.request.request_id))
            else:
                continue
            entry.state = RequestState.CANCELLED
            entry.instance_id = None
        return tuple(cancel)


def _plain(record: dict[str, Any]) -> dict[str, Any]:
    """A request or trajectory as JSON data: token sequences (run-length lists in simulation) as lists."""
    for key in ("prompt_ids", "output_ids", "logprobs", "versions"):
        record[key] = list(record[key])
    return record


def _max_tokens(group: PromptGroup, metadata: Mapping[str, Any]) -> int:
    """A request's token budget: ``max_new_tokens`` of its metadata (the group's or its sample's)."""
    if "max_new_tokens" not in metadata:
        raise ValueError(f"group {group.group_id!r} needs 'max_new_tokens' in its metadata or its sample_metadata")
    return int(metadata["max_new_tokens"])


def _request_metadata(group: PromptGroup, index: int) -> dict[str, Any]:
    """Request ``index``'s metadata: a copy of the group's, with its sample's entries if it has any."""
    if not group.sample_metadata:
        return dict(group.metadata)
    return {**group.metadata, **group.sample_metadata[index]}

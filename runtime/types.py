"""Records that flow through the runtime: prompt groups, rollout requests, trajectories, snapshots."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: A prompt group's id everywhere in the runtime. The protocol takes any ``str`` or ``int`` id
#: (:data:`staleflow.protocol.GroupId`); the runtime reserves ``str`` ids only, so every id the
#: protocol hands back is one (:mod:`~staleflow.runtime.run.group_life` reads them back as such).
GroupId = str
#: ``(instance_id, request_id)`` of running requests that a group's state change cancelled (to abort).
Cancellations = tuple[tuple[str, str], ...]


@dataclass
class PromptGroup:
    """A prompt and how many responses to sample for it (one GRPO group).

    ``n_samples`` responses are trained; ``n_extra`` more may be sampled for group-level redundancy
    (the first ``n_samples`` to finish are kept). ``metadata`` carries what the reward needs (the
    reference answer) and ``max_new_tokens``; every request of the group gets a copy.
    ``sample_metadata`` (empty, or one dict per request) adds to request ``i``'s copy its own
    entries (a simulated workload puts each response's drawn length there); ``resamples`` are
    further ``sample_metadata`` lists, taken in turn each time the prompt is sampled again
    (proactive abort re-queues it). The runtime reads none of their keys.
    """

    group_id: GroupId
    prompt_ids: list[int]
    n_samples: int
    n_extra: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    sample_metadata: list[dict[str, Any]] = field(default_factory=list)
    resamples: list[list[dict[str, Any]]] = field(default_factory=list)


#: a :class:`RolloutRequest`'s ``metadata`` key whose value overrides the engine's sampling temperature
#: (0: greedy; the evaluation's requests on a rollout instance)
TEMPERATURE_KEY = "temperature"


@dataclass
class RolloutRequest:
    """One response being generated; resumable: ``output_ids`` may already hold a partial response.

    ``versions[i]`` is the model version that generated ``output_ids[i]`` and ``logprobs[i]`` its
    behaviour log-prob; a partial response keeps both when it is interrupted and re-routed.
    ``group_version`` is the protocol version of the group (the version it was reserved with):
    an instance may serve the request only if its own version is ``>= group_version``.
    """

    request_id: str
    group_id: GroupId
    prompt_ids: list[int]
    max_new_tokens: int
    group_version: int
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def remaining_tokens(self) -> int:
        return self.max_new_tokens - len(self.output_ids)


@dataclass
class Trajectory:
    """A finished response with its per-token behaviour log-probs and versions, and its reward."""

    request_id: str
    group_id: GroupId
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    reward: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class InstanceSnapshot:
    """What the coordinator sees of one rollout instance at ``time``.

    ``kv_tokens`` are the tokens resident in the KV cache (prompt + generated, running requests);
    ``tokens_per_s`` is the decode throughput measured over the last interval.
    """

    instance_id: str
    version: int
    running: tuple[str, ...]
    waiting: tuple[str, ...]
    kv_tokens: int
    kv_capacity: int
    tokens_per_s: float
    time: float
    loading: bool = False


@dataclass
class TrainingBatch:
    """What the trainer gets for one step: the buffer index and its groups' trajectories."""

    version: int
    groups: dict[GroupId, list[Trajectory]]


@dataclass(frozen=True)
class TrainResult:
    """The outcome of one training step: the new model version and its metrics."""

    version: int
    metrics: dict[str, float]

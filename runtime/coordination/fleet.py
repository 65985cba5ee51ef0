"""The coordinator's speculative view of the rollout instances (paper Fig. 12a).

Each :class:`InstanceView` holds what the coordinator believes an instance runs: the requests it
routed there (minus those it interrupted, aborted or saw finish), the model version it told the
instance to load, and the KV tokens and waiting queue from the last snapshot it accepted. A snapshot
that contradicts the view (an older version than the pull issued, or a request the coordinator took
away or never sent) is stale and is rejected. :class:`FleetArrays` lays the views out as numpy
arrays so a routing decision over many instances is a few vector operations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from staleflow.runtime.types import InstanceSnapshot


class InstanceView:
    """Speculative state of one instance."""

    __slots__ = (
        "_checked",
        "_removals",
        "accepted",
        "instance_id",
        "kv_capacity",
        "kv_tokens",
        "loading",
        "rejected",
        "requests",
        "tokens_per_s",
        "version",
        "waiting",
    )

    def __init__(self, snapshot: InstanceSnapshot) -> None:
        self.instance_id = snapshot.instance_id
        self.version = snapshot.version
        self.loading = snapshot.loading
        self.kv_tokens = snapshot.kv_tokens
        self.kv_capacity = snapshot.kv_capacity
        self.tokens_per_s = snapshot.tokens_per_s
        #: request id -> (tokens in KV when routed, group version)
        self.requests: dict[str, tuple[int, int]] = {}
        self.waiting: tuple[str, ...] = snapshot.waiting
        self.accepted = 0
        self.rejected = 0
        self._removals = 0  # requests removed so far
        #: (running, waiting, removals) of the last snapshot found consistent: the same id tuples
        #: are consistent again while no request was removed (adding requests cannot contradict)
        self._checked: tuple[tuple[str, ...], tuple[str, ...], int] | None = None
        if snapshot.running or snapshot.waiting:
            raise ValueError(
                f"instance {snapshot.instance_id!r} already holds requests the coordinator did not route"
            )

    def observe(self, snapshot: InstanceSnapshot) -> bool:
        """Take a snapshot unless it contradicts the speculative state; returns whether it was taken."""
        checked = self._checked
        if snapshot.version != self.version:
            contradicts = True
        elif (
            checked is not None
            and checked[0] is snapshot.running
            and checked[1] is snapshot.waiting
            and checked[2] == self._removals
        ):
            contradicts = False
        else:
            held = self.requests.__contains__
            contradicts = not all(map(held, snapshot.running)) or not all(map(held, snapshot.waiting))
            if not contradicts:
                self._checked = (snapshot.running, snapshot.waiting, self._removals)
        if contradicts:
            self.rejected += 1
            return False
        self.accepted += 1
        self.loading = snapshot.loading
        self.kv_tokens = snapshot.kv_tokens
        self.kv_capacity = snapshot.kv_capacity
        self.tokens_per_s = snapshot.tokens_per_s
        self.waiting = snapshot.waiting
        return True

    def add(self, request_id: str, tokens: int, group_version: int) -> None:
        self.requests[request_id] = (tokens, group_version)
        self.kv_tokens += tokens

    def remove(self, request_id: str) -> None:
        """The request left (finished, interrupted or aborted); unknown ids are ignored."""
        entry = self.requests.pop(request_id, None)
        if entry is not None:
            self._removals += 1
            self.kv_tokens = max(0, self.kv_tokens - entry[0])
            if request_id in self.waiting:
                self.waiting = tuple(r for r in self.waiting if r != request_id)


@dataclass
class FleetArrays:
    """The views as arrays, index-aligned with the coordinator's instance list; updated as it routes."""

    n: np.ndarray
    kv: np.ndarray
    cap: np.ndarray
    version: np.ndarray
    waiting: np.ndarray
    loading: np.ndarray

    @classmethod
    def of(cls, views: Sequence[InstanceView]) -> FleetArrays:
        return cls(
            n=np.array([len(v.requests) for v in views], dtype=np.float64),
            kv=np.array([v.kv_tokens for v in views], dtype=np.float64),
            cap=np.array([v.kv_capacity for v in views], dtype=np.float64),
            version=np.array([v.version for v in views], dtype=np.int64),
            waiting=np.array([len(v.waiting) for v in views], dtype=np.int64),
            loading=np.array([v.loading for v in views], dtype=bool),
        )

    def add(self, index: int, tokens: int) -> None:
        self.n[index] += 1
        self.kv[index] += tokens

    def update(self, index: int, view: InstanceView) -> None:
        """Copy one view's state into the arrays."""
        self.n[index] = len(view.requests)
        self.kv[index] = view.kv_tokens
        self.cap[index] = view.kv_capacity
        self.version[index] = view.version
        self.waiting[index] = len(view.waiting)
        self.loading[index] = view.loading

"""The coordinator's speculative view of the rollout instances (paper Fig. 12a).

Each :class:`InstanceView` holds what the coordinator believes an instance runs: the requests it
routed there (minus those it interrupted, aborted or saw finish), the model version it told the
instance to load, and the KV tokens and waiting queue from the last snapshot it accepted. A snapshot
that contradicts the view (an older version than the pull issued, or a request the coordinator took
away or never sent) is stale and is rejected.

A view also estimates each request's progress, which the engine does not report: every running
request gains one token per decode step, so the instance's decode steps are its measured tokens per
second over its running requests (:attr:`InstanceView.steps`, summed over the snapshots it takes);
a request has generated what it came with plus the steps made since it was routed (its time in the
engine's waiting queue counted as progress). :class:`FleetArrays` lays the views out as numpy
arrays so a routing decision over many instances is a few vector operations; :class:`Fleet` holds
both and keeps the arrays in step with the views.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from staleflow.runtime.coordination.lengths import LengthModel
from staleflow.runtime.types import GroupId, InstanceSnapshot


class InstanceView:
    """Speculative state of one instance."""

    __slots__ = (
        "_checked",
        "_held",
        "_removals",
        "accepted",
        "down",
        "groups",
        "instance_id",
        "kv_capacity",
        "kv_tokens",
        "loading",
        "offsets",
        "prompts",
        "rejected",
        "requests",
        "seen_at",
        "steps",
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
        self.down = False  # lost (:meth:`Fleet.lose`) until it is back
        #: request id -> (tokens in KV when routed, group version)
        self.requests: dict[str, tuple[int, int]] = {}
        #: request id -> output tokens when routed less :attr:`steps` then; its prompt tokens; its group
        self.offsets: dict[str, float] = {}
        self.prompts: dict[str, int] = {}
        self.groups: dict[str, GroupId] = {}
        self.steps = 0.0  # decode steps estimated since the view started (module docstring)
        self.seen_at = snapshot.time  # the time of the last snapshot taken
        self.waiting: tuple[str, ...] = snapshot.waiting
        self.accepted = 0
        self.rejected = 0
        self._removals = 0  # requests removed so far
        #: (:attr:`offsets`, :attr:`prompts`) of every request held, in order, as arrays; None: to rebuild (a request came or went)
        self._held: tuple[np.ndarray, np.ndarray] | None = None
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
        if snapshot.running and snapshot.time > self.seen_at:
            self.steps += (snapshot.time - self.seen_at) * snapshot.tokens_per_s / len(snapshot.running)
        self.seen_at = max(self.seen_at, snapshot.time)
        self.loading = snapshot.loading
        self.kv_tokens = snapshot.kv_tokens
        self.kv_capacity = snapshot.kv_capacity
        self.tokens_per_s = snapshot.tokens_per_s
        self.waiting = snapshot.waiting
        return True

    def add(self, request_id: str, tokens: int, group_version: int, generated: int = 0, group: GroupId = "") -> None:
        """A request routed here with ``tokens`` in KV, ``generated`` of them output, of ``group``."""
        self.requests[request_id] = (tokens, group_version)
        self.offsets[request_id] = generated - self.steps
        self.prompts[request_id] = tokens - generated
        self.groups[request_id] = group
        self.kv_tokens += tokens
        self._held = None

    def progress(self) -> tuple[np.ndarray, np.ndarray]:
        """The estimated output tokens and the prompt tokens of every request held, in the order of
        :attr:`requests` (:meth:`generated` of them all, from :meth:`held`)."""
        offsets, prompts = self.held()
        return offsets + self.steps, prompts

    def held(self) -> tuple[np.ndarray, np.ndarray]:
        """:attr:`offsets` and :attr:`prompts` of every request held, in the order of :attr:`requests`:
        arrays kept while no request comes or goes."""
        if self._held is None:
            count = len(self.offsets)
            self._held = (np.fromiter(self.offsets.values(), dtype=np.float64, count=count),
                          np.fromiter(self.prompts.values(), dtype=np.float64, count=count))
        return self._held

    def generated(self, request_ids: Iterable[str]) -> np.ndarray:
        """The estimated output tokens of these requests (module docstring)."""
        offsets = self.offsets
        return np.fromiter((offsets[rid] for rid in request_ids), dtype=np.float64) + self.steps

    def remove(self, request_id: str) -> None:
        """The request left (finished, interrupted or aborted); unknown ids are ignored."""
        entry = self.requests.pop(request_id, None)
        if entry is not None:
            del self.offsets[request_id], self.prompts[request_id], self.groups[request_id]
            self._held = None
            self._removals += 1
            self.kv_tokens = max(0, self.kv_tokens - entry[0])
            if request_id in self.waiting:
                self.waiting = tuple(r for r in self.waiting if r != request_id)


@dataclass
class FleetArrays:
    """The views as arrays, index-aligned with the coordinator's instance list; updated as it routes.
    ``growth``: the KV tokens each instance's requests are expected to add until they finish (0
    unless the coordinator plans for growth)."""

    n: np.ndarray
    kv: np.ndarray
    cap: np.ndarray
    version: np.ndarray
    waiting: np.ndarray
    loading: np.ndarray
    down: np.ndarray
    growth: np.ndarray

    @classmethod
    def of(cls, views: Sequence[InstanceView]) -> FleetArrays:
        return cls(
            n=np.array([len(v.requests) for v in views], dtype=np.float64),
            kv=np.array([v.kv_tokens for v in views], dtype=np.float64),
            cap=np.array([v.kv_capacity for v in views], dtype=np.float64),
            version=np.array([v.version for v in views], dtype=np.int64),
            waiting=np.array([len(v.waiting) for v in views], dtype=np.int64),
            loading=np.array([v.loading for v in views], dtype=bool),
            down=np.array([v.down for v in views], dtype=bool),
            growth=np.zeros(len(views)),
        )

    def add(self, index: int, tokens: int, growth: float = 0.0) -> None:
        self.n[index] += 1
        self.kv[index] += tokens
        self.growth[index] += growth

    def update(self, index: int, view: InstanceView, growth: float = 0.0) -> None:
        """Copy one view's state into the arrays, with its expected ``growth``."""
        self.n[index] = len(view.requests)
        self.kv[index] = view.kv_tokens
        self.cap[index] = view.kv_capacity
        self.version[index] = view.version
        self.waiting[index] = len(view.waiting)
        self.loading[index] = view.loading
        self.down[index] = view.down
        self.growth[index] = growth


def kv_peak_growth(kv: np.ndarray, remaining: np.ndarray) -> float:
    """The most the KV of requests holding ``kv`` tokens each grows above ``kv.sum()`` while they
    decode, each for its ``remaining`` steps (one token a step) and then gone: at ``t`` the requests
    still running hold ``kv + t`` each, so the peak is just before one of them finishes,
    ``max_k sum_{i: r_i >= r_k} (kv_i + r_k)``. Requests do not all peak together: planning for every
    request's final size at once would hold back more room than the cache ever needs."""
    return float(kv_peak_growths(kv, np.array([len(kv)]), remaining)[0])


def kv_peak_growths(kv: np.ndarray, counts: np.ndarray, remaining: np.ndarray) -> np.ndarray:
    """:func:`kv_peak_growth` of several sets of requests at once, laid end to end: set ``j`` the next
    ``counts[j]`` entries of ``kv`` (KV tokens) and ``remaining`` (remaining steps). One pass over a
    table of a row per set (padded past its requests): each row sorted by remaining steps (ties kept
    in their order), the KV of the requests finishing at ``r_k`` or later summed from the last to
    finish down; each set's figure comes from the same additions, in the same order, as the set alone
    would give (its own ``kv.sum()`` included)."""
    growth = np.zeros(len(counts))
    width = int(counts.max(initial=0))
    if width == 0:
        return growth
    width = -(-max(width, 8) // 8) * 8  # whole blocks of eight (:func:`row_sums`)
    # each request's place in the table (row-major): its set's row, its rank within the set
    place = np.arange(len(kv)) + np.repeat(np.arange(len(counts)) * width - (np.cumsum(counts) - counts), counts)
    steps = np.full((len(counts), width), np.inf)  # the padding sorts last
    steps.flat[place] = remaining
    held_kv = np.zeros((len(counts), width))
    held_kv.flat[place] = kv
    totals = row_sums(held_kv, counts)  # each set's own ``kv.sum()``
    order = (np.argsort(steps, axis=1, kind="stable") + np.arange(0, steps.size, width)[:, None]).ravel()
    steps, held_kv = steps.ravel()[order].reshape(steps.shape), held_kv.ravel()[order].reshape(steps.shape)
    # KV of the requests finishing at r_k or later (the padding's zeros come first: they change no sum)
    alive_kv = np.cumsum(held_kv[:, ::-1], axis=1)[:, ::-1]
    alive = counts[:, None] - np.arange(width)  # requests finishing at r_k or later
    real = alive > 0
    steps[~real] = 0.0
    peaks = np.where(real, alive_kv + alive * steps, -np.inf)
    held = np.flatnonzero(counts)
    growth[held] = np.maximum(0.0, peaks[held].max(axis=1) - totals[held])
    return growth


#: numpy adds a 1-D float array of up to this many entries in eight running sums (longer ones are halved first)
PAIRWISE_BLOCK = 128


def row_sums(table: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``table[j, :counts[j]].sum()`` for every row, bit for bit: the entries past ``counts[j]`` are
    zeros and the width whole blocks of eight. Many rows are added at once, each in numpy's own
    order for a 1-D array of its length (its pairwise sum: under eight entries one after the other;
    up to :data:`PAIRWISE_BLOCK`, eight running sums over whole blocks of eight, combined in pairs,
    then the rest one after the other; a longer row, which numpy halves first, alone);
    ``tests/test_growth_and_tail.py`` checks them against numpy on rows of every length to 300."""
    if len(counts) < 16:  # a few rows: numpy itself, a row at a time, costs less
        return np.array([table[j, :n].sum() for j, n in enumerate(counts.tolist())])
    rows, width = table.shape
    blocked = counts - counts % 8  # each row's entries in whole blocks of eight (none under eight)
    upto = min(width, PAIRWISE_BLOCK)
    blocks = np.where(np.arange(upto) < blocked[:, None], table[:, :upto], 0.0).reshape(rows, upto // 8, 8)
    lanes = blocks[:, 0].copy()  # the eight running sums
    for block in range(1, upto // 8):
        lanes += blocks[:, block]  # (adding the zeros past a row's blocks changes nothing)
    sums = ((lanes[:, 0] + lanes[:, 1]) + (lanes[:, 2] + lanes[:, 3])) + ((lanes[:, 4] + lanes[:, 5]) + (lanes[:, 6] + lanes[:, 7]))
    # the rest one after the other (a row under eight entries: all of them, from 0)
    rest = table[np.arange(rows)[:, None], np.minimum(blocked[:, None] + np.arange(7), width - 1)]
    rest = np.where(np.arange(7) < (counts % 8)[:, None], rest, 0.0)
    for j in range(7):
        sums += rest[:, j]
    sums = 0.0 + sums
    for j in np.flatnonzero(counts > PAIRWISE_BLOCK).tolist():
        sums[j] = table[j, : counts[j]].sum()
    return sums


class Fleet:
    """The views of a fleet by instance id, and their arrays.

    Every change a view takes from outside a decision goes through here and marks it changed;
    :meth:`synced` copies changed views into the arrays before a decision reads them (a decision
    then keeps both up to date itself as it routes). Given ``lengths``, a view's expected growth
    (:attr:`FleetArrays.growth`) is computed from its requests' progress when it is copied.
    """

    def __init__(self, snapshots: Sequence[InstanceSnapshot], lengths: LengthModel | None = None) -> None:
        self.views = [InstanceView(s) for s in snapshots]
        self._index = {v.instance_id: i for i, v in enumerate(self.views)}
        if len(self._index) != len(self.views):
            raise ValueError("instance ids must be unique")
        self.arrays = FleetArrays.of(self.views)
        self._changed: set[int] = set()
        self.lengths = lengths

    def index(self, instance_id: str) -> int:
        return self._index[instance_id]

    def view(self, instance_id: str) -> InstanceView:
        return self.views[self._index[instance_id]]

    def observe(self, snapshot: InstanceSnapshot) -> bool:
        """Take an instance snapshot unless it contradicts the view; returns whether it was taken."""
        index = self._index[snapshot.instance_id]
        accepted = self.views[index].observe(snapshot)
        if accepted:
            self._changed.add(index)
        return accepted

    def forget(self, instance_id: str, request_ids: Iterable[str]) -> None:
        """These requests left the instance (finished and collected, interrupted or cancelled)."""
        index = self._index[instance_id]
        for rid in request_ids:
            self.views[index].remove(rid)
        self._changed.add(index)

    def lose(self, instance_id: str) -> int:
        """The instance holds nothing to count on and takes no work (a loading view is skipped by
        routing, sync and migration) until :meth:`back`; returns its index."""
        index = self._index[instance_id]
        view = self.views[index]
        for rid in list(view.requests):
            view.remove(rid)
        view.loading = True
        view.down = True
        self._changed.add(index)
        return index

    def back(self, snapshot: InstanceSnapshot) -> None:
        """A lost instance answers again, empty: its view starts afresh from ``snapshot``."""
        index = self._index[snapshot.instance_id]
        self.views[index] = InstanceView(snapshot)
        self._changed.add(index)

    def pull(self, instance_id: str, version: int) -> None:
        """The instance was told to load ``version``: the view takes it at once (older snapshots are stale)."""
        index = self._index[instance_id]
        self.views[index].version = version
        self.views[index].loading = True
        self._changed.add(index)

    def synced(self) -> FleetArrays:
        """The arrays, with every view changed since the last call copied in (their growth estimated together)."""
        changed = [self.views[i] for i in self._changed]
        for i, growth in zip(self._changed, self._growths(changed)):
            self.arrays.update(i, self.views[i], growth)
        self._changed.clear()
        return self.arrays

    def _growths(self, views: Sequence[InstanceView]) -> list[float]:
        """How far above its KV in use now each view's KV is expected to peak before its requests are
        done (0 without ``lengths``): :func:`kv_peak_growth` of its requests' expected remaining
        lengths, for all the views' requests in one pass (their :meth:`InstanceView.progress`, laid
        end to end: the same additions as view by view)."""
        if self.lengths is None or not views:
            return [0.0] * len(views)
        held = [view.held() for view in views]
        counts = np.fromiter((len(offsets) for offsets, _ in held), dtype=np.intp, count=len(held))
        steps = np.fromiter((view.steps for view in views), dtype=np.float64, count=len(views))
        generated = np.concatenate([offsets for offsets, _ in held]) + np.repeat(steps, counts)
        remaining = self.lengths.expected_remaining(generated)
        return kv_peak_growths(np.concatenate([prompts for _, prompts in held]) + generated, counts, remaining).tolist()

    def planned_growth(self, generated: Iterable[int]) -> float:
        """The KV growth to plan for each of some requests that generated so many tokens so far: the
        most any of them is expected to add (0 without ``lengths``)."""
        if self.lengths is None:
            return 0.0
        return float(self.lengths.expected_remaining(np.fromiter(generated, dtype=np.float64)).max(initial=0.0))

"""The trajectory server's queue of requests waiting for a route, kept in routing order.

Routing order: the oldest group version first, then the request with the most output tokens so
far (the longest partial), then arrival (the order in which requests were queued; a re-queued
request arrives again). The order is kept incrementally, so that a decision at 1,024 instances and
thousands of queued requests touches no request it does not place:

* each request's sort key, group version and KV tokens are computed once, when it is queued, into
  numpy arrays indexed by arrival (*slots*);
* the sorted order is cached; when requests came or left since it was last read, the departed are
  filtered out and the arrivals, sorted among themselves, are merged in (a stable merge: an arrival
  goes after every queued request with an equal key), instead of sorting the whole queue again;
* slots of departed requests are reclaimed once they outnumber the queued ones (amortised O(1)).

:meth:`RequestQueue.view` hands a decision the queue's versions and tokens as arrays in routing
order and the requests themselves on demand. A queued request is not changed in place (the
trajectory server replaces a partial when it is re-queued).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from staleflow.runtime.types import RolloutRequest

#: Slots of departed requests tolerated before they are reclaimed (and at least as many as queued).
_RECLAIM_AFTER = 1024


def request_tokens(request: RolloutRequest) -> int:
    """Tokens a request puts in the KV cache when it (re)starts: prompt and output so far."""
    return len(request.prompt_ids) + len(request.output_ids)


class QueueView:
    """The queued requests in routing order as of one :meth:`RequestQueue.view` (valid until the
    queue changes): ``versions`` and ``tokens`` are arrays, :meth:`requests` a slice of requests."""

    __slots__ = ("_requests", "_runs", "_slots", "tokens", "versions")

    def __init__(self, versions: np.ndarray, tokens: np.ndarray, slots: np.ndarray, requests: list[RolloutRequest]) -> None:
        self.versions = versions
        self.tokens = tokens
        self._slots = slots
        self._requests = requests
        self._runs: dict[int, list[tuple[int, int, int]]] = {}

    def __len__(self) -> int:
        return len(self._slots)

    def runs(self, budget: int) -> list[tuple[int, int, int]]:
        """``(start, stop, largest tokens)`` of each run of consecutive requests of one group version
        whose tokens fall in one bucket of ``budget`` tokens (exact sizes with a budget of 0 or 1)."""
        if budget not in self._runs:
            versions, tokens = self.versions, self.tokens
            buckets = tokens if budget <= 1 else -(-tokens // budget)
            starts = np.flatnonzero(np.concatenate(([True], (versions[1:] != versions[:-1]) | (buckets[1:] != buckets[:-1]))))
            largest = np.maximum.reduceat(tokens, starts).tolist() if len(tokens) else []
            starts_list = starts.tolist()
            self._runs[budget] = list(zip(starts_list, [*starts_list[1:], len(tokens)], largest))
        return self._runs[budget]

    def requests(self, start: int, stop: int) -> list[RolloutRequest]:
        """The queued requests at positions ``start`` to ``stop`` (exclusive) of the routing order."""
        requests = self._requests
        return [requests[s] for s in self._slots[start:stop].tolist()]


class RequestQueue:
    """Queued requests by id, in arrival order when iterated, in routing order through :meth:`view`."""

    def __init__(self) -> None:
        self._slot: dict[str, int] = {}  # request id -> slot; insertion order is arrival order
        self._requests: list[RolloutRequest] = []  # by slot (departed ones too, until reclaimed)
        self._key = np.zeros(64, dtype=np.int64)  # by slot: group version * 2**32 - output tokens
        self._version = np.zeros(64, dtype=np.int64)
        self._tokens = np.zeros(64, dtype=np.int64)
        self._queued = np.zeros(64, dtype=bool)
        self._order = np.zeros(0, dtype=np.int64)  # slots in routing order, as of the last view
        self._merged = 0  # slots below this were queued before the last view
        self._departed_merged = False  # a request in ``_order`` left since the last view
        self._view: QueueView | None = None  # the last view, while the queue has not changed

    def __len__(self) -> int:
        return len(self._slot)

    def __iter__(self) -> Iterator[str]:
        return iter(self._slot)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._slot

    def add(self, request: RolloutRequest) -> None:
        """Queue ``request`` (it arrives last)."""
        if request.request_id in self._slot:
            raise ValueError(f"request {request.request_id!r} is queued already")
        slot = len(self._requests)
        if slot == len(self._key):
            self._resize(2 * slot)
        self._key[slot] = (request.group_version << 32) - len(request.output_ids)
        self._version[slot] = request.group_version
        self._tokens[slot] = request_tokens(request)
        self._queued[slot] = True
        self._requests.append(request)
        self._slot[request.request_id] = slot
        self._view = None

    def remove(self, request_id: str) -> None:
        """Take ``request_id`` out of the queue (KeyError if it is not queued)."""
        slot = self._slot.pop(request_id)
        self._queued[slot] = False
        self._view = None
        if slot < self._merged:
            self._departed_merged = True
        departed = len(self._requests) - len(self._slot)
        if departed >= max(_RECLAIM_AFTER, len(self._slot)):
            self._reclaim()

    def view(self) -> QueueView:
        """The queue in routing order (see the module docstring)."""
        if self._view is not None:
            return self._view
        order = self._order
        if self._departed_merged:
            order = order[self._queued[order]]
            self._departed_merged = False
        end = len(self._requests)
        if self._merged < end:
            arrivals = self._merged + np.flatnonzero(self._queued[self._merged:end])
            arrivals = arrivals[np.argsort(self._key[arrivals], kind="stable")]
            order = np.insert(order, np.searchsorted(self._key[order], self._key[arrivals], side="right"), arrivals)
            self._merged = end
        self._order = order
        self._view = QueueView(self._version[order], self._tokens[order], order, self._requests)
        return self._view

    def in_order(self) -> list[RolloutRequest]:
        """The queued requests in routing order."""
        return self.view().requests(0, len(self))

    def _resize(self, capacity: int) -> None:
        for name in ("_key", "_version", "_tokens", "_queued"):
            old = getattr(self, name)
            new = np.zeros(capacity, dtype=old.dtype)
            size = min(len(old), capacity)
            new[:size] = old[:size]
            setattr(self, name, new)

    def _reclaim(self) -> None:
        """Drop the slots of departed requests, keeping the arrival order and the cached order."""
        end = len(self._requests)
        kept = np.flatnonzero(self._queued[:end])
        renumber = np.full(end, -1, dtype=np.int64)
        renumber[kept] = np.arange(len(kept))
        order = self._order[self._queued[self._order]] if self._departed_merged else self._order
        self._order = renumber[order]
        self._departed_merged = False
        self._merged = int(np.count_nonzero(self._queued[: self._merged]))
        for name in ("_key", "_version", "_tokens", "_queued"):
            getattr(self, name)[: len(kept)] = getattr(self, name)[kept]
        self._queued[len(kept):] = False
        self._requests = [self._requests[s] for s in kept.tolist()]
        new_slot = renumber.tolist()
        self._slot = {rid: new_slot[slot] for rid, slot in self._slot.items()}
        if len(self._key) > 4 * max(len(kept), 16):
            self._resize(2 * max(len(kept), 32))

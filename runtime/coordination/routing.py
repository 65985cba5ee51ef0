"""Routing strategies: where a request goes (design 3.2; paper section 5, "waterfall").

:class:`ThroughputRouter` (StaleFlow): among eligible instances whose KV cache can hold the request
and that have no waiting queue, go through them by version tier and pick, in the first tier where
one qualifies, the instance with the largest marginal throughput gain
``T_i(S + r) - T_i(S)``; it qualifies if the gain is at least ``mu`` times the throughput of an
empty instance running the request alone, or the gain of the request that fills an instance through
its memory-bound regime, if less (:func:`~staleflow.runtime.coordination.cost_fit.gain_threshold`).
Otherwise the request stays queued. The KV cache can hold a request if it holds, besides what is
resident now, the growth expected of the requests there and of this one until they finish
(``FleetArrays.growth`` and ``growth``: zero unless the coordinator plans for growth, when the fit is
on the KV in use now). Requests of groups already reserved (partials, a group's members) try the
*oldest* version tier first, which keeps the newest instances for new groups; a new group tries the
newest first (the reference router orders candidates by ``(reserve indicator, version)``, which
gives exactly these two orders).

:class:`RoundRobinRouter` (AReaL's only policy): the next eligible instance in turn.

:class:`LeastLoadedRouter` (the vanilla counterpart and the baselines): the eligible instance with
the fewest requests, up to ``max_running``, preferring instances with no waiting queue; the engine
queues what it cannot run yet. A new group is admitted only on an instance no more loaded than the
least loaded of the fleet (:meth:`LeastLoadedRouter.admissible`): otherwise it waits for that one.

:class:`PromptAffinityRouter` (ROLL Flash): every request of a group goes to the instance its group
was pinned to, and the pins are cleared at every weight update. ROLL's 2026 ``PromptAffinityRouter``
(``pick="fewest"``, routing ``prompt_affinity``) pins a group on its first request to the instance
with the fewest requests in flight among those below ``max_running`` (count only: no KV-cache or
waiting-queue awareness), and a request waits while its instance holds ``max_running``. ROLL's
December 2025 scheduler (``pick="round_robin"``, routing ``prompt_round_robin``) pins it to the next
instance in turn below ``max_running`` and sends the whole group there at once.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Literal, Protocol

import numpy as np
from staleflow.runtime.coordination.cost_fit import gain_threshold
from staleflow.runtime.coordination.cost_model import CostModel
from staleflow.runtime.coordination.fleet import FleetArrays
from staleflow.runtime.types import GroupId, RolloutRequest


class Router(Protocol):
    """What the coordinator asks of a routing strategy. ``choose`` places up to ``count`` requests of
    ``tokens`` tokens each among the ``eligible`` instances and updates ``fleet``; ``oldest_first``:
    the requests belong to reserved groups (the waterfall's order); ``group``: their group (only
    prompt affinity routes by it); ``growth``: the KV tokens each is expected to add until it finishes
    (only throughput routing plans for it)."""

    def has_room(self, fleet: FleetArrays, tokens: int, eligible: np.ndarray) -> bool: ...

    def choose(
        self, fleet: FleetArrays, tokens: int, eligible: np.ndarray, count: int = 1, oldest_first: bool = False,
        group: Hashable | None = None, growth: float = 0.0,
    ) -> list[int]: ...

    def for_new_group(self, fleet: FleetArrays, tokens: int, eligible: np.ndarray) -> tuple[np.ndarray, bool]:
        """The ``eligible`` instances a *new* group may be admitted on, and whether narrowing them held
        back an instance that had room (the coordinator counts it). All of them, unless a router says
        otherwise."""
        return eligible, False


def make_router(routing: str, cost_model: CostModel, mu: float, max_running: int) -> Router:
    """The router of a policy's ``routing`` rule (:class:`~staleflow.runtime.settings.policies.SystemPolicy`)."""
    if routing == "throughput":
        return ThroughputRouter(cost_model, mu, max_running)
    if routing == "round_robin":
        return RoundRobinRouter(max_running)
    if routing == "prompt_affinity":
        return PromptAffinityRouter(max_running)
    if routing == "prompt_round_robin":
        return PromptAffinityRouter(max_running, pick="round_robin")
    return LeastLoadedRouter(max_running)


def route_interrupted(
    fleet: FleetArrays, requests: Sequence[RolloutRequest], tokens: Sequence[int], interrupted: dict[str, int],
    resend_turn: RoundRobinRouter | None, choose: Callable[[FleetArrays, int, int, int, GroupId], list[int]],
) -> tuple[list[tuple[int, RolloutRequest, int]], bool]:
    """Queued requests, some of them interrupted by a pull (``interrupted``: request id -> the
    instance it ran on), placed one at a time in order: ``(instance, request, tokens)`` of those
    placed, and whether all were. ``interrupted`` is updated: the placed and the cancelled leave it.

    An interrupted request goes back to the instance it ran on once that instance has loaded the
    new weights, whatever its load, and waits until then (AReaL's ``resubmit_same_instance``); or,
    given a ``resend_turn``, to the next instance in turn below its cap, whatever its group's pin
    (ROLL aa6ad590's ``send_paused_requests``). The others go through ``choose(fleet, version, tokens,
    1, group)``; a request that cannot be placed holds back the rest, except those waiting for their
    own instance.
    """
    queued = {request.request_id for request in requests}
    for rid in [rid for rid in interrupted if rid not in queued]:  # cancelled meanwhile
        del interrupted[rid]
    placed: list[tuple[int, RolloutRequest, int]] = []
    placed_all = True
    for request, size in zip(requests, tokens):
        rid, version = request.request_id, request.group_version
        home = interrupted.get(rid)
        if home is not None and resend_turn is None:
            if fleet.loading[home] or fleet.version[home] < version:
                placed_all = False
                continue
            fleet.add(home, size)
            chosen = [home]
        elif not placed_all:
            continue
        else:
            if home is not None and resend_turn is not None:
                chosen = resend_turn.choose(fleet, size, fleet.version >= version)
            else:
                chosen = choose(fleet, version, size, 1, request.group_id)
            if not chosen:
                placed_all = False
                continue
        interrupted.pop(rid, None)
        placed.append((chosen[0], request, size))
    return placed, placed_all


def fleet_throughput(model: CostModel, n: np.ndarray, kv: np.ndarray) -> np.ndarray:
    """``T(n, K) = n / L(n, K)`` for arrays (the cost model's formula, vectorised)."""
    latency = model.a_b + model.a_k * kv + np.maximum(model.thr, model.o_b + model.o_k * n)
    throughput: np.ndarray = n / latency
    return throughput


class ThroughputRouter(Router):
    """Cost-model routing with the waterfall over version tiers and the threshold ``mu``; an
    instance holding ``max_running`` requests takes no more (the reference's
    ``max_concurrent_seqs_per_instance``)."""

    def __init__(self, cost_model: CostModel, mu: float, max_running: int = 1_000_000) -> None:
        self.cost_model = cost_model
        self.mu = mu
        self.max_running = max_running
        #: :func:`gain_threshold` by (tokens, the candidates' capacities) for ``_threshold_model``
        self._thresholds: dict[tuple[int, bytes], np.ndarray] = {}
        self._threshold_model = cost_model

    def choose(
        self, fleet: FleetArrays, tokens: int, eligible: np.ndarray, count: int = 1, oldest_first: bool = False,
        group: Hashable | None = None, growth: float = 0.0,
    ) -> list[int]:
        """Instances for up to ``count`` requests of ``tokens`` tokens each, one decision per request
        (the fleet is updated after each); stops at the first request that stays queued.
        ``oldest_first``: the waterfall goes from the oldest version tier up (reserved groups)."""
        candidates, score, threshold = self._scores(fleet, tokens, eligible, growth)
        if candidates.size == 0:
            return []
        model = self.cost_model
        n, kv, cap = fleet.n[candidates], fleet.kv[candidates], fleet.cap[candidates]
        planned = kv + fleet.growth[candidates]  # the KV each holds once its requests are done
        versions = fleet.version[candidates]
        order = sorted(set(versions.tolist()), reverse=not oldest_first)
        tiers = [np.flatnonzero(versions == v) for v in order] if len(order) > 1 else None
        chosen: list[int] = []
        for _ in range(count):
            pick = self._best(score, tiers)
            if pick is None:
                break
            index = int(candidates[pick])
            fleet.add(index, tokens, growth)
            chosen.append(index)
            n[pick] += 1
            kv[pick] += tokens
            planned[pick] += tokens + growth
            running, resident = int(n[pick]), int(kv[pick])
            new_gain = model.throughput(running + 1, resident + tokens) - model.throughput(running, resident)
            fits = new_gain >= threshold[pick] and planned[pick] + tokens + growth <= cap[pick] and running < self.max_running
            score[pick] = new_gain if fits else -np.inf
        return chosen

    def has_room(self, fleet: FleetArrays, tokens: int, eligible: np.ndarray) -> bool:
        """Whether :meth:`choose` would place one request of ``tokens`` tokens now (the fleet is not changed)."""
        candidates, score, _ = self._scores(fleet, tokens, eligible)
        return bool(candidates.size) and bool(np.any(score > -np.inf))

    def _scores(
        self, fleet: FleetArrays, tokens: int, eligible: np.ndarray, growth: float = 0.0
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The candidate instances, each one's score (the marginal gain where it qualifies: mu, KV
        room for the request and the growth planned; else -inf) and its gain threshold."""
        candidates = np.flatnonzero(eligible & ~fleet.loading & (fleet.waiting == 0))
        n, kv, cap = fleet.n[candidates], fleet.kv[candidates], fleet.cap[candidates]
        model = self.cost_model
        gain = fleet_throughput(model, n + 1, kv + tokens) - fleet_throughput(model, n, kv)
        threshold = self._threshold(tokens, cap)
        fits = (gain >= threshold) & (kv + fleet.growth[candidates] + tokens + growth <= cap) & (n < self.max_running)
        return candidates, np.where(fits, gain, -np.inf), threshold

    def _threshold(self, tokens: int, cap: np.ndarray) -> np.ndarray:
        """:func:`gain_threshold` of the model in use, kept for each request size and set of
        capacities met (read-only; forgotten when the model changes, or when many were kept)."""
        if self._threshold_model is not self.cost_model or len(self._thresholds) >= 4096:
            self._thresholds, self._threshold_model = {}, self.cost_model
        key = (tokens, cap.tobytes())
        threshold = self._thresholds.get(key)
        if threshold is None:
            threshold = self._thresholds[key] = gain_threshold(self.cost_model, self.mu, tokens, cap, self.max_running)
            threshold.flags.writeable = False
        return threshold

    @staticmethod
    def _best(score: np.ndarray, tiers: list[np.ndarray] | None) -> int | None:
        """The best qualifying instance of the newest tier that has one (the waterfall)."""
        if tiers is None:
            best = int(np.argmax(score))
            return best if score[best] > -np.inf else None
        for members in tiers:
            best = int(members[np.argmax(score[members])])
            if score[best] > -np.inf:
                return best
        return None


class LeastLoadedRouter(Router):
    """The eligible instance with the fewest requests (below ``max_running``), instances without a
    waiting queue first (a waiting queue means the engine is already full)."""

    def __init__(self, max_running: int) -> None:
        self.max_running = max_running

    def has_room(self, fleet: FleetArrays, tokens: int, eligible: np.ndarray) -> bool:
        """Whether :meth:`choose` would place one request now (the fleet is not changed)."""
        return bool(np.any(fleet.n[np.flatnonzero(eligible & ~fleet.loading)] < self.max_running))

    @staticmethod
    def admissible(fleet: FleetArrays, eligible: np.ndarray) -> np.ndarray:
        """The ``eligible`` instances a *new* group may be admitted on: those holding no more requests
        than the least loaded instance of the fleet that is up, whether or not that one is at an
        admissible version or loading one.

        Least-requests balances load over the whole fleet; only the version gate narrows the choice.
        When few instances have the admissible version (the first to finish a pull from the parameter
        server, or the one that pulled alone), placing every admissible group on them would pile the
        protocol's whole allowance onto one engine while the others drain (its queue, far beyond its
        KV cache, is then worked off alone). A new group can wait instead: it stays pending (the
        coordinator reports the fleet starved, so a per-instance sync brings another instance up)
        and goes wherever the load is least once that instance has the version.
        """
        up = ~fleet.down
        if not up.any():
            return eligible
        return eligible & (fleet.n <= fleet.n[up].min())

    def for_new_group(self, fleet: FleetArrays, tokens: int, eligible: np.ndarray) -> tuple[np.ndarray, bool]:
        """:meth:`admissible`, and whether it held back an instance with room."""
        balanced = self.admissible(fleet, eligible)
        return balanced, not self.has_room(fleet, tokens, balanced) and self.has_room(fleet, tokens, eligible)

    def choose(
        self, fleet: FleetArrays, tokens: int, eligible: np.ndarray, count: int = 1, oldest_first: bool = False,
        group: Hashable | None = None, growth: float = 0.0,
    ) -> list[int]:
        """Instances for up to ``count`` requests, the least loaded first (the fleet is updated)."""
        candidates = np.flatnonzero(eligible & ~fleet.loading)
        chosen: list[int] = []
        if candidates.size == 0:
            return chosen
        n = fleet.n[candidates]
        load = n + np.where(fleet.waiting[candidates] > 0, self.max_running, 0)
        for _ in range(count):
            pick = int(np.argmin(load))
            if n[pick] >= self.max_running:
                break
            index = int(candidates[pick])
            fleet.add(index, tokens)
            chosen.append(index)
            n[pick] += 1
            load[pick] += 1
        return chosen


#: No cap on an instance's requests (a bare turn: ROLL aa6ad590's ``get_available_dp_rank``).
UNCAPPED = 1_000_000


def below_cap(fleet: FleetArrays, eligible: np.ndarray, max_running: int) -> np.ndarray:
    """The eligible instances not loading weights and holding fewer than ``max_running`` requests."""
    return eligible & ~fleet.loading & (fleet.n < max_running)


class RoundRobinRouter(Router):
    """The next eligible instance in turn, up to ``max_running`` requests each (AReaL's
    ``round_robin``, ``areal/core/remote_inf_engine.py``)."""

    def __init__(self, max_running: int) -> None:
        self.max_running = max_running
        self._next = 0

    def has_room(self, fleet: FleetArrays, tokens: int, eligible: np.ndarray) -> bool:
        """Whether :meth:`choose` would place one request now (the fleet is not changed)."""
        return bool(np.any(below_cap(fleet, eligible, self.max_running)))

    def choose(
        self, fleet: FleetArrays, tokens: int, eligible: np.ndarray, count: int = 1, oldest_first: bool = False,
        group: Hashable | None = None, growth: float = 0.0,
    ) -> list[int]:
        """Instances for up to ``count`` requests, each the next eligible one after the last chosen."""
        open_ = below_cap(fleet, eligible, self.max_running)
        chosen: list[int] = []
        for _ in range(count):
            index = self.next_in_turn(open_)
            if index is None:
                break
            fleet.add(index, tokens)
            chosen.append(index)
            if fleet.n[index] >= self.max_running:
                open_[index] = False
        return chosen

    def next_in_turn(self, open_: np.ndarray) -> int | None:
        """The first instance of the mask ``open_`` at or after the turn (wrapping round), which
        passes the turn to the instance after it; None if ``open_`` is empty."""
        candidates = np.flatnonzero(open_)
        if candidates.size == 0:
            return None
        after = candidates[candidates >= self._next % len(open_)]
        index = int(after[0] if after.size else candidates[0])
        self._next = index + 1
        return index


class PromptAffinityRouter(Router):
    """ROLL Flash's placement of a prompt's requests on one instance: the group of a request is its prompt.

    ``pick="fewest"``: ROLL's ``PromptAffinityRouter`` (alibaba/ROLL
    ``roll/distributed/scheduler/router.py``, commit 8eb27cc2). A group without a pin takes the
    instance with the fewest requests in flight among those below ``max_running`` (the first such
    instance on a tie, as ROLL's linear scan in ``acquire``) and is pinned there; every later request
    of the group goes to that instance once it holds fewer than ``max_running`` (``reacquire``),
    whatever its KV cache or waiting queue.

    ``pick="round_robin"``: ROLL's December 2025 ``AsyncDynamicSamplingScheduler`` (commit aa6ad590,
    ``roll/distributed/scheduler/async_generate_scheduler.py``): ``send_query_items`` takes
    ``next(get_available_dp_rank())`` once per prompt, a bare turn over every instance
    (``pre_send_dp_rank = (pre_send_dp_rank + 1) % dp_size``: :attr:`turn`, a :class:`RoundRobinRouter`
    without a cap), whatever its load, and sends all the group's requests there together. The cap
    is the fleet's: ``sending_request`` sends no new prompt while the requests in flight are at least
    ``max_running_requests x dp_size`` (here ``max_running`` times the instances).

    :meth:`clear_pins` is ROLL's ``abort_all``, which clears ``id_to_dp_rank`` at every weight update
    (with ``round_robin`` a pin only joins a group's requests at admission).
    """

    def __init__(self, max_running: int, pick: Literal["fewest", "round_robin"] = "fewest") -> None:
        self.max_running = max_running
        self.pins: dict[Hashable, int] = {}
        #: the turn of ``pick="round_robin"``, over every instance (None with ``fewest``)
        self.turn = RoundRobinRouter(UNCAPPED) if pick == "round_robin" else None

    def has_room(self, fleet: FleetArrays, tokens: int, eligible: np.ndarray) -> bool:
        """Whether a new group could be pinned now (the fleet is not changed)."""
        return bool(np.any(self._open(fleet, eligible)))

    def _open(self, fleet: FleetArrays, eligible: np.ndarray) -> np.ndarray:
        """The instances a new group may be pinned to: below ``max_running`` each (``fewest``), or
        every eligible one while the fleet holds fewer than ``max_running`` per instance in all
        (``round_robin``)."""
        if self.turn is None:
            return below_cap(fleet, eligible, self.max_running)
        if int(fleet.n.sum()) >= self.max_running * len(fleet.n):
            return np.zeros(len(fleet.n), bool)
        return eligible & ~fleet.loading

    def choose(
        self, fleet: FleetArrays, tokens: int, eligible: np.ndarray, count: int = 1, oldest_first: bool = False,
        group: Hashable | None = None, growth: float = 0.0,
    ) -> list[int]:
        """Instances for up to ``count`` requests of ``group`` (all the same one: its pin, made now if
        it has none); with ``pick="fewest"``, fewer while the pinned instance is at ``max_running``
        (the fleet is updated)."""
        pin = self.pins.get(group) if group is not None else None
        if pin is None:
            pin = self._pick(fleet, self._open(fleet, eligible))
            if pin is None:
                return []
            if group is not None:
                self.pins[group] = pin
        elif not eligible[pin] or fleet.loading[pin]:
            return []
        chosen: list[int] = []
        for _ in range(count):
            if self.turn is None and fleet.n[pin] >= self.max_running:
                break
            fleet.add(pin, tokens)
            chosen.append(pin)
        return chosen

    def _pick(self, fleet: FleetArrays, open_: np.ndarray) -> int | None:
        """The instance a new group is pinned to among the mask ``open_``, or None if it is empty."""
        if self.turn is not None:
            return self.turn.next_in_turn(open_)
        candidates = np.flatnonzero(open_)
        return int(candidates[np.argmin(fleet.n[candidates])]) if candidates.size else None

    def route_each(
        self, fleet: FleetArrays, requests: Sequence[RolloutRequest], tokens: Sequence[int]
    ) -> tuple[list[tuple[int, RolloutRequest, int]], bool]:
        """Queued requests one at a time, in order: ``(instance, request, tokens)`` of those placed,
        and whether a new group is left waiting. A request of a pinned group waits only for its own
        instance (ROLL's ``reacquire``); the first request of an unpinned group that finds no
        instance holds back the other unpinned ones (ROLL's ``acquire`` runs under one lock)."""
        placed: list[tuple[int, RolloutRequest, int]] = []
        new_groups_wait = False
        for request, size in zip(requests, tokens):
            pinned = request.group_id in self.pins
            if pinned or not new_groups_wait:
                chosen = self.choose(fleet, size, fleet.version >= request.group_version, group=request.group_id)
                placed += [(chosen[0], request, size)] if chosen else []
                new_groups_wait |= not chosen and not pinned
        return placed, new_groups_wait

    def clear_pins(self) -> None:
        """Forget every pin (ROLL's ``abort_all`` at a weight update)."""
        self.pins.clear()

    def unpin_instance(self, index: int) -> None:
        """Forget the pins to instance ``index`` (it failed: its groups are pinned afresh)."""
        self.pins = {group: i for group, i in self.pins.items() if i != index}

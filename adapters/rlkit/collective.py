"""One collective from the sender to the workers of several instances: a version sent once to a
whole broadcast set, as OpenRLHF and verl send it, instead of once per instance.

A *collective* is a group of the parameter server's process (rank 0) and the workers of every
instance of a set (``members``, sorted), each instance's workers at consecutive ranks; it lives
beside the instances' own groups (:mod:`~staleflow.adapters.rlkit.weight_sender`) and is kept for
every later broadcast to the same set (the whole fleet, in steady state). A transfer of version
``v`` to the set goes in three steps, each member making its calls from its own process:

1. **seat** (:meth:`CollectiveParameterServer.seat`, polled): every member announces its workers
   and the collective it holds (its generation, or None); once all have, the server decides for
   all at once: the group they all hold, or a new one (a first broadcast to this set, a member that
   lost its group, or a new member), which replaces every collective sharing a member;
2. **join** (a new group only): the members' workers join (``init_weight_transfer_engine`` with
   ``channel="collective"``: the workers keep it beside their own group) while the server makes
   its end (:meth:`CollectiveParameterServer.join_collective`, made once however many members call);
3. **send**: each member pauses and calls ``update_weights`` while calling
   :meth:`CollectiveParameterServer.send_collective`: the first call broadcasts the staged
   version's chunks once over the group, the others wait for its outcome. Each member's pause
   covers the collective (which ends when its slowest member has received).

Deadlines are those of the instance's own transfer (:mod:`~staleflow.adapters.rlkit.bounded_calls`):
a member that does not arrive within :data:`~staleflow.adapters.rlkit.bounded_calls.CONTROL_CALL_S`
of the first fails the seat; a collective that fails or passes its deadline (a member's worker
blocked or dead) fails every member (each instance is then lost: its requests recovered) and the
group is torn down; the next broadcast to the set makes a new one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from staleflow.adapters.rlkit import bounded_calls
from staleflow.adapters.rlkit.rendezvous import transfer_host
from staleflow.adapters.rlkit.weight_sender import (
    TransferParameterServer,
    TransferWeights,
    WeightChannel,
    WeightSyncClient,
    check_backend,
)
from staleflow.runtime.interfaces import TransferFailedError

#: The worker-side name of a collective's group (an instance's own group is ``instance``).
COLLECTIVE = "collective"
#: How many seating rounds (a broadcast set and version each) the server remembers.
ROUNDS_KEPT = 8


class Collective:
    """The sender's end of one collective: ``members`` (sorted), its ``generation`` (a new group
    gets a new one), the channel (rank 0 of ``1 + every member's workers``) and the members' first
    ranks. :meth:`once` runs an action on the group once, however many members ask for it."""

    def __init__(self, members: tuple[str, ...], generation: int, channel: WeightChannel, receivers: dict[str, int]) -> None:
        self.members = members
        self.generation = generation
        self.channel = channel
        self.rank_offsets: dict[str, int] = {}
        rank = 1
        for member in members:
            self.rank_offsets[member] = rank
            rank += receivers[member]
        self._outcomes: dict[object, Future[Any]] = {}
        self._lock = threading.Lock()

    def once(self, key: object, action: Callable[[], Any], wait_s: float, what: str) -> Any:
        """``action()``'s result, run by the first caller with ``key``; the others wait for it, no
        longer than ``wait_s`` (:class:`TransferFailedError` after that, or if it failed)."""
        with self._lock:
            outcome = self._outcomes.get(key)
            first = outcome is None
            if outcome is None:
                outcome = self._outcomes[key] = Future()
                for old in list(self._outcomes)[:-ROUNDS_KEPT]:
                    del self._outcomes[old]
        if first:
            try:
                outcome.set_result(action())
            except Exception as error:  # noqa: BLE001 - every caller gets it
                outcome.set_exception(error)
        try:
            return outcome.result(timeout=wait_s)
        except TimeoutError as error:
            raise TransferFailedError(f"{what} over the collective of {list(self.members)} did not end within {wait_s:g} s") from error

    def close(self) -> None:
        with self.channel.lock:
            self.channel.close()


class CollectiveParameterServer(TransferParameterServer):
    """A :class:`~staleflow.adapters.rlkit.weight_sender.TransferParameterServer` that also sends a
    version once to a set of instances over a collective (module docstring). ``collectives_made``
    counts the groups made; ``bytes_sent`` counts a collective's bytes once."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.collectives_made = 0
        self._collectives: dict[tuple[str, ...], Collective] = {}
        self._rounds: dict[tuple[tuple[str, ...], int], dict[str, tuple[int, int | None]]] = {}
        self._answers: dict[tuple[tuple[str, ...], int], dict[str, dict[str, Any]]] = {}
        self._collective_lock = threading.Lock()

    def sent_bytes(self) -> int:
        """The weight bytes sent so far by every transfer (a collective's once, whatever its members)."""
        return self.bytes_sent

    def seat(self, members: Sequence[str], version: int, instance_id: str, receivers: int, held: int | None) -> dict[str, Any] | None:
        """``instance_id`` (``receivers`` workers, holding collective generation ``held`` or None)
        takes its seat for ``version``'s broadcast to ``members``; None until every member has, then
        its answer: ``generation`` and ``join`` (a new group: its init info and ``deadline_s``)."""
        key = tuple(sorted(members))
        if instance_id not in key:
            raise ValueError(f"instance {instance_id!r} is not a member of the collective of {list(key)}")
        with self._collective_lock:
            seats = self._rounds.setdefault((key, version), {})
            seats[instance_id] = (receivers, held)
            if len(seats) < len(key):
                return None
            if (key, version) not in self._answers:
                self._answers[(key, version)] = self._decide(key, seats)
            answer = self._answers[(key, version)][instance_id]
            for old in list(self._rounds)[:-ROUNDS_KEPT]:  # rounds answered long ago, or never completed
                del self._rounds[old]
                self._answers.pop(old, None)
            return answer

    def _decide(self, key: tuple[str, ...], seats: dict[str, tuple[int, int | None]]) -> dict[str, dict[str, Any]]:
        """The answers of a full round (under the lock): the collective every member holds, or a new one."""
        current = self._collectives.get(key)
        if current is not None and all(held == current.generation for _, held in seats.values()):
            return {member: {"generation": current.generation, "join": False} for member in key}
        for other in [k for k in self._collectives if set(k) & set(key)]:
            self._collectives.pop(other).close()
        receivers = {member: seats[member][0] for member in key}
        channel = WeightChannel(self.transfer, sum(receivers.values()), self.backend, transfer_host(self.transfer.host), stage=self._stage)
        self.collectives_made += 1
        collective = self._collectives[key] = Collective(key, self.collectives_made, channel, receivers)
        info = {**channel.init_info(), "channel": COLLECTIVE, "deadline_s": self.transfer.deadline_s()}
        return {member: {"generation": collective.generation, "join": True, **info, "rank_offset": collective.rank_offsets[member]}
                for member in key}

    def join_collective(self, members: Sequence[str], generation: int) -> None:
        """Make the server's end of collective ``generation`` (once; every member's call waits for it)."""
        collective = self._collective(members, generation)
        wait_s = self.transfer.deadline_s() + bounded_calls.SENDER_GRACE_S
        collective.once("join", lambda: self._guarded_collective(collective, "joining", lambda: collective.channel.join()),
                        wait_s, "joining")

    def send_collective(self, members: Sequence[str], generation: int, version: int, deadline_s: float) -> int:
        """Broadcast ``version`` once over collective ``generation`` by ``deadline_s``; the bytes sent
        (every member's call returns them once it is done). A failure or a passed deadline tears the
        collective down and raises :class:`TransferFailedError` in every member's call."""
        staged = self._staged_version(version)
        collective = self._collective(members, generation)
        what = f"sending version {version}"
        return int(collective.once(("send", version), lambda: self._counted(self._guarded_collective(
            collective, what, lambda: collective.channel.send(staged, deadline_s))), deadline_s + bounded_calls.SENDER_GRACE_S, what))

    def _collective(self, members: Sequence[str], generation: int) -> Collective:
        with self._collective_lock:
            collective = self._collectives.get(tuple(sorted(members)))
        if collective is None or collective.generation != generation:
            raise TransferFailedError(f"collective {generation} of {sorted(members)} is no longer open")
        return collective

    def _guarded_collective(self, collective: Collective, what: str, action: Callable[[], Any]) -> Any:
        """``action`` under the collective's channel lock; on any failure the collective is dropped
        and torn down, and :class:`TransferFailedError` raised."""
        with collective.channel.lock:
            try:
                return action()
            except Exception as error:  # noqa: BLE001 - every transport failure ends the group
                with self._collective_lock:
                    if self._collectives.get(collective.members) is collective:
                        del self._collectives[collective.members]
                collective.channel.close()
                raise TransferFailedError(f"{what} over the collective of {list(collective.members)} failed; "
                                          f"it was torn down: {error}") from error


class BroadcastWeights(TransferWeights):
    """What a broadcasting parameter server's pull hands out: a version sent to one instance over
    its own group, or (:meth:`in_collective`, a
    :class:`~staleflow.runtime.interfaces.CollectiveReference`) to several in one collective."""

    def in_collective(self, members: Sequence[str]) -> CollectiveWeights:
        """This version sent once, in one collective, to the workers of every instance of ``members``."""
        return CollectiveWeights(self._server, self.version, tuple(members))


class CollectiveWeights(TransferWeights):
    """A version that reaches the workers of every instance of ``members`` in one collective
    (:class:`CollectiveParameterServer`); each member loads it as it would a
    :class:`~staleflow.adapters.rlkit.weight_sender.TransferWeights`, its workers receiving on
    their ``collective`` group."""

    channel = COLLECTIVE

    def __init__(self, server: Any, version: int, members: tuple[str, ...]) -> None:
        super().__init__(server, version)
        self.members = tuple(sorted(members))

    def connect(self, instance_id: str, receivers: int, client: WeightSyncClient, backend: str, held: object = None) -> object:
        """Take ``instance_id``'s seat (waiting for every member, no longer than
        :data:`~staleflow.adapters.rlkit.bounded_calls.CONTROL_CALL_S`) and join a new group if the
        server made one; the generation of the collective the instance now holds."""
        end = time.monotonic() + bounded_calls.CONTROL_CALL_S
        holding = held if isinstance(held, int) else None
        while (answer := self._server.seat(self.members, self.version, instance_id, receivers, holding)) is None:
            if time.monotonic() >= end:
                raise TransferFailedError(f"the collective of {list(self.members)} for version {self.version}: not every member "
                                          f"took its seat within {bounded_calls.CONTROL_CALL_S:g} s")
            time.sleep(0.005)
        generation = int(answer.pop("generation"))
        if answer.pop("join"):
            check_backend(answer.pop("backend"), backend, instance_id)
            deadline = answer.pop("deadline_s")
            bounded_calls.together(lambda: self._server.join_collective(self.members, generation),
                                   lambda: client.init_weight_transfer_engine(answer),
                                   f"joining the collective of {list(self.members)}", deadline)
        return generation

    def prepare(self) -> dict[str, Any]:
        """The update's info on the ``collective`` group; its deadline that of one transfer while
        every member's workers receive it."""
        try:
            info = dict(self._server.stage(self.version, len(self.members)))
        except ConnectionError as error:
            raise TransferFailedError(f"staging version {self.version}: {error}") from error
        return {**info, "channel": COLLECTIVE}

    def _send(self, instance_id: str, deadline_s: float, group: object = None) -> int:
        return int(self._server.send_collective(self.members, group, self.version, deadline_s))

    def __repr__(self) -> str:
        return f"CollectiveWeights(version={self.version}, members={list(self.members)})"

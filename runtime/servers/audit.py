"""The trajectory server's audit: every request and group counted once, and compared with what the
engines say they hold (:meth:`~staleflow.runtime.servers.trajectory_server.TrajectoryServer.audit`)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class AuditReport:
    """Every request and group counted once, and their agreement with the engines.

    ``lost``: requests the TS places on an instance that the instance does not hold.
    ``orphaned``: requests an instance holds that the TS does not place there.
    ``duplicated``: trajectories reported finished while their request was not running there,
    plus requests held by more than one instance.
    """

    groups: dict[str, int]
    requests: dict[str, int]
    lost: tuple[str, ...]
    orphaned: tuple[str, ...]
    duplicated: tuple[str, ...]
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not (self.lost or self.orphaned or self.duplicated or self.problems)


def placement_mismatches(
    placed: Mapping[str, Iterable[str]], engine_requests: Mapping[str, Iterable[str]]
) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """``(lost, orphaned, held_twice)``: requests the trajectory server places on an instance that
    does not hold them, requests an instance holds that are not placed there, and requests held by
    more than one instance. ``placed`` and ``engine_requests`` map instance ids to request ids."""
    held: dict[str, str] = {}
    held_twice: list[str] = []
    for instance_id, rids in engine_requests.items():
        for rid in rids:
            if rid in held:
                held_twice.append(rid)
            held[rid] = instance_id
    placed_sets = {instance_id: set(rids) for instance_id, rids in placed.items()}
    lost: list[str] = []
    for instance_id, rids in placed_sets.items():
        lost.extend(sorted(r for r in rids if held.get(r) != instance_id))
    orphaned = [rid for rid, instance_id in held.items() if rid not in placed_sets.get(instance_id, ())]
    return tuple(lost), tuple(sorted(orphaned)), tuple(held_twice)


def held_at_last_collect(
    held: Mapping[str, set[str]], placed_at_snapshot: Mapping[str, set[str]], placed_now: Mapping[str, set[str]],
    down: Collection[str] = (),
) -> dict[str, set[str]]:
    """What each instance still up (not in ``down``) holds, as of the audit's last collect. Engines
    decode on while they are asked: a request held at the snapshot (``held``) that the trajectory
    server placed there then and no longer places (finished, or cancelled as its group's extra, by
    the collect after the snapshot) was held rightly, and is not an orphan. A request never placed
    there still is."""
    return {iid: rids - (placed_at_snapshot.get(iid, set()) - placed_now.get(iid, set()))
            for iid, rids in held.items() if iid not in down}

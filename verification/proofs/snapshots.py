"""Restore and snapshots: every invalid snapshot is refused, every valid one is rebuilt exactly.

``restore()`` is how a resumed run gets its protocol state back, so a snapshot that is not a state
the protocol could be in (a group past its deadline, too many groups due by some buffer, a field of
the wrong type, a duplicate id) must be refused with :class:`~staleflow.protocol.SnapshotError` and
never turned into a manager. :func:`fuzz_restore` draws seeded random snapshots, most of them with
exactly one defect of a known kind, decides validity with its own oracle (field checks written
here, Inv by ``spec/mirror.py``), and requires:

- an invalid snapshot raises ``SnapshotError`` (any other exception, or none, is an escape);
- a valid snapshot is restored into the mirror's state (same groups, head and counters), its
  ``snapshot()`` restores to the same state again, and ``buffers()`` is the earliest-deadline-first
  placement of the proved model (``z3_proofs.edf_placement``).

Defect kinds: the format tag, each top-level field (missing, negative, bool, float, string), the
group list and its entries (shape, id type, duplicate id, status), a version that is negative,
ahead of the head, exactly one buffer past its deadline (the case a negative index would wrap into
the newest bucket) or further past it, and invariant violations (one group too many due by some
buffer).
"""

from __future__ import annotations

import copy
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from staleflow.protocol import SNAPSHOT_FORMAT, InvalidVersionError, SnapshotError, StalenessManager, UnknownGroupError
from staleflow.spec import mirror
from staleflow.spec.mirror import DONE, RUNNING, MirrorState, SpecParams
from staleflow.verification.checks import CheckResult

KINDS = (
    "valid", "format", "param-field", "version-field", "groups-field", "entry-shape", "id-type",
    "duplicate-id", "status", "version-negative", "version-ahead", "one-past-deadline",
    "far-past-deadline", "inv-capacity",
)
QUICK_COUNT = 3_000
FULL_COUNT = 12_000
BAD_VALUES: tuple[Any, ...] = (-1, True, 1.5, "2", None, [1])


@dataclass
class FuzzStats:
    snapshots: int = 0
    kinds: Counter[str] = field(default_factory=Counter)

    def describe(self) -> str:
        refused = self.snapshots - self.kinds["valid"]
        return f"{self.snapshots:,} snapshots ({refused:,} invalid, {len(self.kinds)} kinds)"


def _valid_state(rng: random.Random, p: SpecParams, c: int) -> list[list[Any]]:
    """A random Inv state at head ``c`` as snapshot entries, in a random (arrival) order."""
    entries: list[list[Any]] = []
    prefix = 0
    for offset in range(p.eta + 1):
        version = c - p.eta + offset
        room = (offset + 1) * p.batch_size + p.redundancy - prefix
        n = rng.randint(0, room) if version >= 0 else 0
        prefix += n
        entries += [[f"g{len(entries) + k}", version, rng.choice((RUNNING, DONE))] for k in range(n)]
    rng.shuffle(entries)
    return entries


def _defect(rng: random.Random, snap: dict[str, Any], p: SpecParams, c: int) -> str:
    """Plant one defect of a random kind in ``snap``; returns the kind ("valid" if none)."""
    groups: list[list[Any]] = snap["groups"]
    kind = rng.choice(KINDS)
    if kind == "format":
        snap.pop("format") if rng.random() < 0.5 else snap.update(format="staleflow.protocol/0")
    elif kind == "param-field":
        name = rng.choice(("eta", "batch_size", "redundancy"))
        if rng.random() < 0.2:
            del snap[name]
        else:
            snap[name] = rng.choice(BAD_VALUES + ((0,) if name == "batch_size" else ()))
    elif kind == "version-field":
        snap.pop("version") if rng.random() < 0.2 else snap.update(version=rng.choice(BAD_VALUES))
    elif kind == "groups-field":
        snap.pop("groups") if rng.random() < 0.3 else snap.update(groups=rng.choice(({}, "g1", None, 3)))
    elif kind == "entry-shape":
        shapes: tuple[Any, ...] = (["x", c], ["x", c, RUNNING, 0], "x", {"id": "x"}, None)
        groups.insert(rng.randint(0, len(groups)), rng.choice(shapes))
    elif kind == "id-type":
        groups.insert(rng.randint(0, len(groups)), [rng.choice((1.0, None, True, ["x"], ("x",))), c, RUNNING])
    elif kind == "duplicate-id" and groups:
        g = rng.choice(groups)
        groups.insert(rng.randint(0, len(groups)), [g[0], c, rng.choice((RUNNING, DONE))])
    elif kind == "status":
        groups.insert(rng.randint(0, len(groups)), ["x", c, rng.choice(("idle", "RUNNING", 1, None, ["done"]))])
    elif kind == "version-negative":
        groups.insert(rng.randint(0, len(groups)), ["x", rng.choice((-1, -2, -c - 1)), RUNNING])
    elif kind == "version-ahead":
        groups.insert(rng.randint(0, len(groups)), ["x", c + rng.randint(1, 2), DONE])
    elif kind == "one-past-deadline" and c - p.eta - 1 >= 0:
        groups.insert(rng.randint(0, len(groups)), ["x", c - p.eta - 1, rng.choice((RUNNING, DONE))])
    elif kind == "far-past-deadline" and c - p.eta - 2 >= 0:
        groups.insert(rng.randint(0, len(groups)), ["x", rng.randint(0, c - p.eta - 2), RUNNING])
    elif kind == "inv-capacity":
        k = rng.randint(0, p.eta)
        due = sum(1 for _, v, _ in groups if v + p.eta - c <= k)
        offset_versions = [c - p.eta + i for i in range(k + 1) if c - p.eta + i >= 0]
        if not offset_versions:
            return "valid"
        for n in range((k + 1) * p.batch_size + p.redundancy - due + 1):
            groups.insert(rng.randint(0, len(groups)), [f"extra{n}", rng.choice(offset_versions), RUNNING])
    else:
        return "valid"
    return kind


def oracle(snap: Any) -> tuple[SpecParams, MirrorState] | None:
    """The spec state a snapshot denotes, or None if it is not a valid one (written independently
    of ``restore``: field checks here, Inv by the mirror)."""

    def is_int(v: Any, least: int) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= least

    if not isinstance(snap, dict) or snap.get("format") != SNAPSHOT_FORMAT:
        return None
    keys = ("eta", "batch_size", "redundancy", "version", "groups")
    if any(key not in snap for key in keys):
        return None
    eta, b, x, c, entries = (snap[key] for key in keys)
    if not (is_int(eta, 0) and is_int(b, 1) and is_int(x, 0) and is_int(c, 0) and isinstance(entries, list)):
        return None
    groups = []
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 3):
            return None
        g, v, status = entry
        if not (isinstance(g, (str, int)) and not isinstance(g, bool)):
            return None
        if not (is_int(v, 0) and v <= c and status in (RUNNING, DONE)):
            return None
        groups.append((g, v, status))
    if len({g for g, _, _ in groups}) != len(groups):
        return None
    p, state = SpecParams(eta, b, x), MirrorState(c, frozenset(groups))
    return (p, state) if mirror.invariant(p, state) else None


def check_buffers(manager: StalenessManager) -> None:
    """``buffers()`` equals the EDF placement of the proved model, view by view."""
    from staleflow.verification.proofs import z3_proofs as zp

    counts = manager.counts()
    p = zp.Params(manager.eta, manager.batch_size, manager.redundancy)
    placement = zp.edf_placement(p, zp.Counters(counts.running, counts.done))
    views = manager.buffers()
    assert len(views) == manager.eta + 1, f"buffers() has {len(views)} views, eta + 1 = {manager.eta + 1}"
    for k, view in enumerate(views):
        assert view.index == manager.version + k, f"view {k} has index {view.index}"
        assert view.capacity == p.buffer_capacity(k), f"view {k} has capacity {view.capacity}"
        expected = sum(placement[i, k] for i in range(manager.eta + 1))
        assert view.running + view.done == expected, (
            f"buffer {view.index} holds {view.running + view.done} groups, the EDF placement {expected}")
        assert view.running >= 0 and view.done >= 0 and view.free >= 0, repr(view)
    assert sum(v.running for v in views) == sum(counts.running), "buffers() loses running groups"
    assert sum(v.done for v in views) == sum(counts.done), "buffers() loses done groups"


def fuzz_restore(
    manager_cls: type[StalenessManager] = StalenessManager, count: int = QUICK_COUNT, seed: int = 0
) -> FuzzStats:
    """Draw ``count`` snapshots and check ``manager_cls.restore`` on each; raises AssertionError
    at the first escape (naming the snapshot)."""
    from staleflow.verification.proofs.conformance_compare import assert_same_state

    default = manager_cls(1, 2)
    assert (default.redundancy, default.capacity(0)) == (0, 2), "the default redundancy is not 0"
    rng = random.Random(seed)
    stats = FuzzStats()
    for _ in range(count):
        p = SpecParams(rng.randint(0, 3), rng.randint(1, 3), rng.randint(0, 2))
        c = rng.randint(0, 7)
        snap: dict[str, Any] = {
            "format": SNAPSHOT_FORMAT, "eta": p.eta, "batch_size": p.batch_size,
            "redundancy": p.redundancy, "version": c, "groups": _valid_state(rng, p, c),
        }
        kind = _defect(rng, snap, p, c)
        expected = oracle(snap)
        if kind != "valid":
            assert expected is None, f"the fuzzer planted {kind} but the oracle accepts {snap}"
        stats.snapshots += 1
        stats.kinds[kind] += 1
        given = copy.deepcopy(snap)
        try:
            manager = manager_cls.restore(given)
        except SnapshotError as error:
            assert expected is None, f"restore refused a valid snapshot: {snap}"
            if kind == "inv-capacity":  # the error names the first buffer whose constraint fails
                failed = mirror.invariant_failures(p, MirrorState(c, frozenset(tuple(g) for g in snap["groups"])))
                first = min(int(f[3:]) for f in failed if f.startswith("cap"))
                assert f"due by buffer {c + first}, at most {(first + 1) * p.batch_size + p.redundancy} allowed" in str(error), (
                    f"restore's error {str(error)!r} does not name buffer {c + first} for {snap}")
            continue
        except Exception as error:  # noqa: BLE001 - anything but SnapshotError is an escape
            raise AssertionError(f"restore raised {type(error).__name__} ({error}), not SnapshotError, for {snap}") from None
        assert expected is not None, f"restore accepted an invalid snapshot ({kind}): {snap}"
        assert given == snap, "restore changed the snapshot it was given"
        ps, state = expected
        assert_same_state(manager, ps, state)
        again = manager_cls.restore(manager.snapshot())
        assert_same_state(again, ps, state)
        assert list(again.groups()) == list(manager.groups()), "restore(snapshot()) reorders groups"
        check_buffers(manager)
        check_bad_arguments(manager)
    missing = [k for k in KINDS if not stats.kinds[k]]
    assert not missing, f"the fuzzer never produced {missing}"
    return stats


#: Arguments a restored manager must refuse: group ids that are not a str or an int (a bool is
#: not an id), and versions that are not an int, negative, or ahead of the head buffer.
BAD_GROUP_IDS: tuple[Any, ...] = (True, 1.5, None, [1])
BAD_VERSIONS: tuple[Any, ...] = (True, 1.0, "0", None, -1)


def check_bad_arguments(manager: StalenessManager) -> None:
    """``reserve`` refuses a bad group id with TypeError; ``reserve``, ``reserve_slack`` and
    ``can_reserve`` refuse a bad version with InvalidVersionError; ``occupy``, ``abort`` and
    ``group`` refuse an unknown or unhashable id with UnknownGroupError; the state does not change."""
    before = manager.snapshot()
    for group_id in ("fuzz-unknown", [1]):
        for call in (manager.occupy, manager.abort, manager.group):
            try:
                call(group_id)
            except UnknownGroupError:
                pass
            else:
                raise AssertionError(f"{call.__name__}({group_id!r}) was not refused with UnknownGroupError")
    for group_id in BAD_GROUP_IDS:
        try:
            manager.reserve(group_id, manager.version)
        except TypeError:
            pass
        else:
            raise AssertionError(f"reserve accepted the group id {group_id!r}")
    for version in (*BAD_VERSIONS, manager.version + 1):
        for call in (lambda v: manager.reserve("fuzz-new", v), manager.reserve_slack, manager.can_reserve):
            try:
                call(version)
            except InvalidVersionError:
                pass
            else:
                raise AssertionError(f"a version of {version!r} was not refused with InvalidVersionError")
    assert manager.snapshot() == before, "a refused call changed the state"


def checks(quick: bool) -> list[CheckResult]:
    count = QUICK_COUNT if quick else FULL_COUNT
    started = time.perf_counter()
    try:
        stats = fuzz_restore(StalenessManager, count)
        result, explored, detail = "pass", stats.describe(), ", ".join(f"{k} {n}" for k, n in sorted(stats.kinds.items()))
    except Exception as error:  # noqa: BLE001 - an escape or a crash is a failed check
        result, explored, detail = "fail", "stopped at the first escape", f"{type(error).__name__}: {error}"[:500]
    return [CheckResult(
        name="restore-fuzz",
        property="restore refuses every invalid snapshot with SnapshotError; valid ones round-trip; "
                 "buffers() = the proved EDF placement; bad group ids and versions are refused",
        method="seeded fuzzing against an independent oracle (field checks + mirror Inv)",
        bounds=f"eta 0..3, B 1..3, X 0..2, head 0..7, {len(KINDS) - 1} defect kinds, seed 0",
        explored=explored,
        result=result,
        seconds=round(time.perf_counter() - started, 3),
        detail=detail,
    )]

"""The thread-safe wrapper answers every query and operation exactly as the manager it wraps.

Method: the same random operations drive a plain :class:`StalenessManager` and a
:class:`LockedStalenessManager`; after each one, every query of the wrapper (counts, slack,
admission, buffers, groups, membership, snapshot, ...) equals the plain manager's, and the
operations return and raise the same. (Concurrent use: tests/test_protocol_package.py.)
"""

from __future__ import annotations

import random

import pytest
from staleflow.protocol import LockedStalenessManager, ProtocolError, StalenessManager


def _queries(m: StalenessManager | LockedStalenessManager, ids: list[str]) -> tuple:
    v = m.version
    return (
        m.eta, m.batch_size, m.redundancy, v, len(m), [g in m for g in ids], m.counts(),
        [m.reserve_slack(x) for x in range(max(0, v - m.eta), v + 1)], [m.can_reserve(x) for x in range(max(0, v - m.eta), v + 1)],
        m.oldest_admissible_version(), [(b.index, b.capacity, b.running, b.done) for b in m.buffers()], m.can_consume(),
        [m.capacity(k) for k in range(m.eta + 1)],
        [(g.group_id, g.version, g.status) for g in m.groups()], [m.group(g).version for g in ids if g in m], m.snapshot(),
    )


@pytest.mark.parametrize("seed", range(3))
def test_the_locked_wrapper_matches_the_plain_manager(seed: int) -> None:
    rng = random.Random(seed)
    plain = StalenessManager(eta=2, batch_size=2, redundancy=1)
    locked = LockedStalenessManager.create(eta=2, batch_size=2, redundancy=1)
    seen_plain, seen_locked = [], []
    plain.add_event_hook(seen_plain.append)
    locked.add_event_hook(seen_locked.append)
    ids: list[str] = []
    for step in range(300):
        op = rng.choice(["reserve", "reserve", "occupy", "abort", "abort_if_active", "consume", "try_consume"])
        gid = f"g{step}" if op == "reserve" else (rng.choice(ids) if ids else "none")
        back = rng.randint(0, 3)  # how many versions behind the trainer a reserve asks for (3: past the bound)
        outcomes = []
        for m in (plain, locked):
            try:
                if op == "reserve":
                    outcomes.append(m.reserve(gid, max(0, m.version - back)))
                elif op == "abort_if_active":
                    outcomes.append(locked.abort_if_active(gid) if m is locked else gid in plain and (plain.abort(gid) or True))
                elif op == "try_consume":
                    outcomes.append(locked.try_consume() if m is locked else (plain.consume() if plain.can_consume() else None))
                elif op == "consume":
                    outcomes.append(m.consume())
                else:
                    outcomes.append(getattr(m, op)(gid))
            except ProtocolError as error:
                outcomes.append(type(error))
        assert outcomes[0] == outcomes[1], (step, op, gid, outcomes)
        ids = [g.group_id for g in plain.groups()]
        assert _queries(plain, ids + ["none"]) == _queries(locked, ids + ["none"]), (step, op)
    assert len(seen_plain) == len(seen_locked) > 100
    assert [(e.op, e.group_id, e.after) for e in seen_plain] == [(e.op, e.group_id, e.after) for e in seen_locked]
    restored = LockedStalenessManager.restore(plain.snapshot())
    assert restored.snapshot() == plain.snapshot()
    with locked.locked() as inner:
        assert inner.snapshot() == plain.snapshot()


def test_a_locked_managers_trace_counts_refused_reserves_unless_asked_to_trace_them(tmp_path) -> None:
    """``attach_trace`` follows the writer's default: a refused reserve is counted, not traced
    (a mutation-testing survivor of ``protocol/locked.py``: the default flipped to tracing them)."""
    from staleflow.protocol.trace import read_trace

    for refusals, traced in ((None, 0), (True, 1)):
        locked = LockedStalenessManager.create(eta=0, batch_size=1)
        path = tmp_path / f"trace-{refusals}.jsonl"
        writer = locked.attach_trace(path) if refusals is None else locked.attach_trace(path, refusals=refusals)
        assert locked.reserve("a", 0) and not locked.reserve("b", 0)  # the buffer is full: refused
        writer.close()
        events = read_trace(path)[0].events
        assert [e.op for e in events if e.op == "reserve" and not e.accepted] == ["reserve"] * traced
        assert writer.refusals_skipped == 1 - traced

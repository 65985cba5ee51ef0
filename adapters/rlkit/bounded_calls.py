"""Calls an instance makes during a weight transfer, each waited for no longer than a bound.

A call runs in a daemon thread of its own and is waited for until its bound; one still running
then is left behind (it ends by its own deadline, or never: a worker that hangs) and the caller
gets :class:`~staleflow.runtime.interfaces.TransferFailedError`, an instance failure. The bounds:
the transfer's two halves its deadline and :data:`SENDER_GRACE_S`; each control-plane call of an
update :data:`CONTROL_CALL_S`; so a pull takes at most its deadline and :func:`transfer_margin_s`
once the version is staged. (Tests shorten the bounds by setting this module's constants.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from staleflow.runtime.interfaces import TransferFailedError

#: How much longer than the sender's deadline the instance side waits for it (a remote call's latency).
SENDER_GRACE_S = 5.0
#: The longest one control-plane call of an update may take (starting or finishing vLLM's update,
#: pausing or resuming the scheduler); the instance is given up after it.
CONTROL_CALL_S = 30.0


def transfer_margin_s() -> float:
    """How much longer than its transfer deadline an instance's pull may take in all: the sender's
    grace and four control calls (pause, start, finish, resume), 125 s. The run loop waits no longer
    on a pull once the version is staged."""
    return SENDER_GRACE_S + 4 * CONTROL_CALL_S


def bounded(call: Callable[[], Any], what: str, wait_s: float) -> Any:
    """``call()`` in a thread of its own, waited for no longer than ``wait_s``; its result, or
    :class:`TransferFailedError` if it fails or is still running then (left behind, a daemon thread)."""
    return _in_threads({"instance": call}, what, wait_s)["instance"]


def together(sender: Callable[[], Any], receiver: Callable[[], Any], what: str, deadline_s: float) -> Any:
    """Run ``sender`` and ``receiver`` (both meet in one collective) and wait for both, no longer
    than ``deadline_s`` (the sender's own deadline) plus :data:`SENDER_GRACE_S`; the sender's result.
    The sender ends by its own deadline."""
    return _in_threads({"sending": sender, "receiving": receiver}, what, deadline_s + SENDER_GRACE_S)["sending"]


def _in_threads(calls: Mapping[str, Callable[[], Any]], what: str, wait_s: float) -> dict[str, Any]:
    """Run each call in a daemon thread of its own and wait for all, no longer than ``wait_s`` in
    all; their results by side, or :class:`TransferFailedError` naming the side that failed or did
    not finish (a call still running then is left behind)."""
    outcome: dict[str, Any] = {}

    def run(side: str, call: Callable[[], Any]) -> None:
        try:
            outcome[side] = call()
        except Exception as error:  # noqa: BLE001 - reported below
            outcome[side] = error

    threads = {side: threading.Thread(target=run, args=(side, call), name=f"{what} ({side})", daemon=True)
               for side, call in calls.items()}
    for thread in threads.values():
        thread.start()
    end = time.monotonic() + wait_s
    for thread in threads.values():
        thread.join(max(0.0, end - time.monotonic()))
    for side in threads:
        result = outcome.get(side)
        if isinstance(result, BaseException):
            raise TransferFailedError(f"{what} failed on the {side} side: {result}") from result
    late = [side for side, thread in threads.items() if thread.is_alive()]
    if late:
        raise TransferFailedError(f"{what}: the {' and the '.join(late)} side did not finish within {wait_s:g} s")
    return outcome

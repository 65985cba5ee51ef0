"""System policies: StaleFlow with switchable strategies, and the baselines, in one runtime.

Every policy runs through the same :class:`~staleflow.protocol.StalenessManager`, which alone
decides consumption, so each system's staleness is measured the same way and the bound ``eta`` is
kept by all of them. How each baseline maps onto the runtime (design section 3.3):

``sync`` (VeRL)
    Protocol bound 0: a batch is generated on the current version; the trainer trains; then every
    instance pulls together once all are drained. Least-loaded routing, no migration.
``one-step-off`` (VeRL-Pipeline)
    Protocol bound 1 (the next batch is generated on the previous version while training); global
    weight update once every instance is drained. Least-loaded routing.
``inflight-cap`` (VeRL-Async, AReaL, SkyRL)
    Admission ``accepted + running <= (eta + version + 1) * B`` (``version``: the newest trained
    model), partial rollout, a global weight update as soon as a version is pushed (in-flight
    requests are interrupted and resubmitted with their tokens so far), least-loaded routing. The
    group must also be admitted by the protocol; where the cap lets a
    group through that the bound cannot place, it waits (counted as ``admission_blocked_by_protocol``), and a
    straggler past its deadline holds the trainer back instead of being trained stale.
``start-version-gc`` (ROLL Flash)
    As ``inflight-cap``, plus: when the trainer waits for buffer ``c``, running groups whose
    deadline is ``c`` (started ``eta`` versions ago) are aborted, as ROLL's GC aborts prompts older
    than the bound.
``staleflow``
    Protocol admission at each instance's version, cost-model routing with the waterfall and
    ``mu``, per-instance synchronization, migration with ``phi_wait`` and ``phi_throughput``;
    an instance that pulls keeps its running requests (in-place reload, as the engine seam
    provides). The baselines interrupt and resubmit in-flight requests around a weight update, as
    the peer systems do; ``pull_keeps_requests=True`` gives them in-place reloads too, to separate
    that mechanism from the strategies.
    ``staleflow-no-routing`` / ``-no-sync`` / ``-no-migration`` switch one strategy to its vanilla
    counterpart (least-loaded routing, global immediate update, no migration) for the ablation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

Routing = Literal["throughput", "least_loaded"]
Sync = Literal["per_instance", "global_immediate", "global_drained"]
Admission = Literal["protocol", "inflight_cap"]


@dataclass(frozen=True)
class SystemPolicy:
    """How the runtime admits, routes, synchronises and migrates.

    Args:
        name: the system's name in reports.
        routing: ``throughput`` (marginal gain of the cost model, waterfall over versions, ``mu``)
            or ``least_loaded`` (fewest requests, at most ``max_running`` per instance).
        sync: ``per_instance`` (pull one instance when it is nearly drained or can no longer
            admit), ``global_immediate`` (every instance as soon as a version is pushed), or
            ``global_drained`` (every instance together once all are drained).
        migration: interrupt and re-route waiting and excess requests.
        admission: ``protocol`` (reserve only) or ``inflight_cap`` (also the AReaL cap).
        fixed_eta: the bound this system runs with whatever the user asks (sync: 0, one-step-off: 1).
        gc_stale: abort running groups due in the buffer the trainer waits for.
        batch_redundancy: protocol redundancy ``X`` (extra groups beyond the batches).
        group_redundancy: ``n_extra`` responses sampled per group (the first ``n_samples`` kept).
        mu: routing threshold, a fraction of an empty instance's throughput.
        phi_wait: migrate an instance's waiting requests beyond this many.
        phi_throughput: migrate when one instance's throughput is this many times another's.
        sync_kv_fraction: per-instance sync pulls an instance whose KV cache is at most this full.
        max_running: least-loaded routing's per-instance cap on requests.
        freshness: freshness-aware admission: admit work for later buffers only when the trainer
            would otherwise wait. Admission stops once the active groups fill the head buffer and
            ``lookahead`` more (starting at ``eta``, the protocol's own limit, and never above it); the lookahead
            grows by one after a step the trainer waited for when the hold kept work from an
            instance with room (see :meth:`Coordinator.step_started`), and shrinks by one after
            ``freshness_patience`` steps in a row without that; instances pull a new version as soon
            as it is pushed (``per_instance`` sync made eager) and new groups go first to instances at
            the newest admissible version. It only chooses when to reserve, never what the
            protocol allows.
        freshness_patience: steps without a costly wait before the lookahead shrinks.
        pull_keeps_requests: an instance that pulls keeps its running requests, which go on with
            the new weights (in-place reload, vLLM ``pause_generation(mode="keep")``); by default
            they are interrupted first and re-routed as partials (abort-and-resubmit, as the
            reference coordinator's SYNC command and the peer systems do), which costs a prefill
            of their tokens so far.
    """

    name: str
    routing: Routing = "throughput"
    sync: Sync = "per_instance"
    migration: bool = True
    admission: Admission = "protocol"
    fixed_eta: int | None = None
    gc_stale: bool = False
    batch_redundancy: int = 0
    group_redundancy: int = 0
    mu: float = 0.3
    phi_wait: int = 3
    phi_throughput: float = 5.0
    sync_kv_fraction: float = 0.1
    max_running: int = 1_000_000
    freshness: bool = False
    freshness_patience: int = 3
    pull_keeps_requests: bool = False

    def __post_init__(self) -> None:
        _choice("routing", self.routing, ("throughput", "least_loaded"))
        _choice("sync", self.sync, ("per_instance", "global_immediate", "global_drained"))
        _choice("admission", self.admission, ("protocol", "inflight_cap"))
        for name in ("batch_redundancy", "group_redundancy", "phi_wait", "max_running", "freshness_patience"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"policy {self.name!r}: {name} must be an int >= 0, got {value!r}")
        if self.fixed_eta is not None and (not isinstance(self.fixed_eta, int) or self.fixed_eta < 0):
            raise ValueError(f"policy {self.name!r}: fixed_eta must be None or an int >= 0")
        for name in ("mu", "phi_throughput", "sync_kv_fraction"):
            if not isinstance(getattr(self, name), (int, float)) or getattr(self, name) < 0:
                raise ValueError(f"policy {self.name!r}: {name} must be a number >= 0")

    def protocol_eta(self, eta: int) -> int:
        """The bound the protocol runs with: the user's, or the system's own if smaller (sync: 0)."""
        return eta if self.fixed_eta is None else min(self.fixed_eta, eta)


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


_BASELINE: dict[str, Any] = {"routing": "least_loaded", "migration": False}

#: StaleFlow's engines reload weights in place (the RolloutEngine seam); the peers abort and
#: resubmit in-flight requests around a weight update, and so do their policies here.
_STALEFLOW: dict[str, Any] = {"pull_keeps_requests": True}

POLICIES: dict[str, SystemPolicy] = {
    "staleflow": SystemPolicy("staleflow", **_STALEFLOW),
    "staleflow-no-routing": SystemPolicy("staleflow-no-routing", routing="least_loaded", **_STALEFLOW),
    "staleflow-no-sync": SystemPolicy("staleflow-no-sync", sync="global_immediate", **_STALEFLOW),
    "staleflow-no-migration": SystemPolicy("staleflow-no-migration", migration=False, **_STALEFLOW),
    "staleflow-fresh": SystemPolicy("staleflow-fresh", freshness=True, **_STALEFLOW),
    "sync": SystemPolicy("sync", sync="global_drained", fixed_eta=0, **_BASELINE),
    "one-step-off": SystemPolicy("one-step-off", sync="global_drained", fixed_eta=1, **_BASELINE),
    "inflight-cap": SystemPolicy("inflight-cap", sync="global_immediate", admission="inflight_cap", **_BASELINE),
    "start-version-gc": SystemPolicy("start-version-gc", sync="global_immediate", admission="inflight_cap", gc_stale=True, **_BASELINE),
}


def make_policy(name: str, **overrides: Any) -> SystemPolicy:
    """The named policy, with knobs overridden (``make_policy("staleflow", mu=0.2)``)."""
    try:
        policy = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown system {name!r}; known: {', '.join(POLICIES)}") from None
    unknown = set(overrides) - set(SystemPolicy.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown policy knob(s) {', '.join(sorted(unknown))} for system {name!r}")
    return replace(policy, **overrides)

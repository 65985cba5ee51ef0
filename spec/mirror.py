"""The executable Python mirror of ``StalenessBuffer.tla`` (see :mod:`staleflow.protocol.mirror`).

The mirror's code lives in ``protocol/mirror.py`` so that the protocol's dependency-free
distribution ships it with its trace checker; this module is the spec folder's name for it. The
mirror is written from the spec, not from the implementation, and is checked against TLC's state
graph (``verification/proofs/graph_equivalence.py``).
"""

from staleflow.protocol import check
from staleflow.protocol.mirror import (
    DONE,
    RUNNING,
    ConsumeStep,
    Group,
    MirrorState,
    SpecParams,
    abort,
    can_consume,
    consume,
    consume_taking,
    init,
    invariant,
    occupy,
    reserve,
)

__all__ = [
    "DONE",
    "RUNNING",
    "ConsumeStep",
    "Group",
    "MirrorState",
    "SpecParams",
    "abort",
    "can_consume",
    "consume",
    "consume_taking",
    "init",
    "invariant",
    "occupy",
    "reserve",
    "consume_failures",
    "invariant_failures",
    "refusal_reasons",
    "reserve_failures",
    "sole_refusal_reasons",
]


# --------------------------------------------------------------------------- refusal reasons
# Names of the conjuncts of Inv and of the Consume guard, for coverage: which conjunct made the
# spec refuse an action. ``deadline`` is "no group past its deadline", ``cap<k>`` is the k-th
# capacity conjunct ``#{d <= c+k} <= (k+1)B + X``; ``batch`` is "B done groups", ``drops`` is
# "at most X groups due at c are left", ``next-<conjunct>`` is a conjunct of Inv at c + 1.


def invariant_failures(p: SpecParams, s: MirrorState) -> tuple[str, ...]:
    """The conjuncts of Inv that ``s`` violates (empty iff ``invariant(p, s)``)."""
    return tuple(check.invariant_failures(p, s))


def reserve_failures(p: SpecParams, s: MirrorState, version: int) -> tuple[str, ...]:
    """Why Reserve of a fresh group at ``0 <= version <= c`` is disabled: the Inv conjuncts that
    fail with the group added (empty iff Reserve is enabled)."""
    return invariant_failures(p, MirrorState(s.version, s.groups | {("reason-probe", version, RUNNING)}))


def consume_failures(p: SpecParams, s: MirrorState) -> tuple[str, ...]:
    """Why Consume is disabled, read on the earliest-deadline choice of B done groups (if that
    choice fails, every choice does: the z3 ``p2-eager`` row). Empty iff that choice is valid."""
    done = sorted((g for g in s.groups if g[2] == DONE), key=lambda g: (g[1], repr(g)))
    if len(done) < p.batch_size:
        return ("batch",)
    chosen = frozenset(done[: p.batch_size])
    dropped = frozenset(g for g in s.groups - chosen if g[1] + p.eta == s.version)
    failed = ["drops"] if len(dropped) > p.redundancy else []
    after = MirrorState(s.version + 1, s.groups - chosen - dropped)
    return (*failed, *(f"next-{name}" for name in invariant_failures(p, after)))


def refusal_reasons(p: SpecParams) -> tuple[str, ...]:
    """Every conjunct that can be the only reason for a refusal at ``p`` (what coverage expects).

    Not listed, because they can never fail alone: ``next-deadline`` (the groups due at c are taken
    or dropped), ``next-cap<k>`` for ``k >= eta - 1`` (what remains after taking B is at most
    ``cap(eta) - B = cap(eta - 1)``) and, at ``eta = 0``, ``drops`` (at most ``B + X`` groups are
    active, all due at c)."""
    reserve = ("deadline", *(f"cap{k}" for k in range(p.eta + 1)))
    consume = ("batch", *(("drops",) if p.eta else ()), *(f"next-cap{k}" for k in range(p.eta - 1)))
    return (*(f"reserve:{r}" for r in reserve), *(f"consume:{r}" for r in consume))


def sole_refusal_reasons(p: SpecParams, s: MirrorState, idle_group: bool = True) -> set[str]:
    """The refusals in ``s`` that have exactly one failing conjunct, as ``action:conjunct``
    (Reserve only if ``idle_group``: a model with a fixed set of ids has one to reserve)."""
    out: set[str] = set()
    for version in range(s.version + 1 if idle_group else 0):
        failed = reserve_failures(p, s, version)
        if len(failed) == 1:
            out.add(f"reserve:{failed[0]}")
    failed = consume_failures(p, s)
    if len(failed) == 1:
        out.add(f"consume:{failed[0]}")
    return out

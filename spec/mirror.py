"""The executable Python mirror of ``StalenessBuffer.tla`` (see :mod:`staleflow.protocol.mirror`).

The mirror's code lives in ``protocol/mirror.py`` so that the protocol's dependency-free
distribution ships it with its trace checker; this module is the spec folder's name for it. The
mirror is written from the spec, not from the implementation, and is checked against TLC's state
graph (``verification/graph_equivalence.py``).
"""

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
]

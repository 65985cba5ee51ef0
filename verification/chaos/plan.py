"""What faults a chaos run injects and when: the fault kinds, their rates, and the seeded plan that
draws them and records every injected fault (used by the injectors in
:mod:`staleflow.verification.chaos.faults`).
"""

from __future__ import annotations

import enum
import random
from collections import Counter
from dataclasses import dataclass, field, replace

from staleflow.runtime.interfaces import Clock


class FaultKind(str, enum.Enum):
    INSTANCE_CRASH = "instance_crash"
    INSTANCE_STALL = "instance_stall"
    PULL_FAIL = "pull_fail"
    PULL_SLOW = "pull_slow"
    PUSH_FAIL = "push_fail"
    PUSH_SLOW = "push_slow"
    REWARD_RAISE = "reward_raise"
    REWARD_HANG = "reward_hang"
    FINISH_DELAY = "finish_delay"
    SNAPSHOT_STALE = "snapshot_stale"
    TRAIN_SLOW = "train_slow"
    COORDINATOR_RESTART = "coordinator_restart"


#: The :class:`FaultRates` field that sets how often each kind happens.
RATE_OF: dict[FaultKind, str] = {
    FaultKind.INSTANCE_CRASH: "crash_per_s",
    FaultKind.INSTANCE_STALL: "stall_per_s",
    FaultKind.PULL_FAIL: "pull_fail",
    FaultKind.PULL_SLOW: "pull_slow",
    FaultKind.PUSH_FAIL: "push_fail",
    FaultKind.PUSH_SLOW: "push_slow",
    FaultKind.REWARD_RAISE: "reward_raise",
    FaultKind.REWARD_HANG: "reward_hang",
    FaultKind.FINISH_DELAY: "finish_delay",
    FaultKind.SNAPSHOT_STALE: "snapshot_stale",
    FaultKind.TRAIN_SLOW: "train_slow",
    FaultKind.COORDINATOR_RESTART: "restart",
}


@dataclass(frozen=True)
class FaultRates:
    """How often each fault happens and how long the slow ones last (virtual seconds).

    ``crash_per_s`` and ``stall_per_s`` are rates per instance per virtual second (the gaps are
    exponential); the others are probabilities per opportunity: per Pull, per Push, per reward
    call, per finished trajectory, per snapshot, per training step, per step boundary (restart).
    """

    crash_per_s: float = 0.0
    stall_per_s: float = 0.0
    pull_fail: float = 0.0
    pull_slow: float = 0.0
    push_fail: float = 0.0
    push_slow: float = 0.0
    reward_raise: float = 0.0
    reward_hang: float = 0.0
    finish_delay: float = 0.0
    snapshot_stale: float = 0.0
    train_slow: float = 0.0
    restart: float = 0.0
    delay_s_max: float = 2.0
    restart_s: float = 1.0

    def only(self, kinds: frozenset[FaultKind]) -> FaultRates:
        """These rates with every fault kind not in ``kinds`` switched off."""
        return replace(self, **{RATE_OF[kind]: 0.0 for kind in FaultKind if kind not in kinds})

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"fault rate {name} must be a number >= 0, got {value!r}")
            if name not in ("crash_per_s", "stall_per_s", "delay_s_max", "restart_s") and value > 1:
                raise ValueError(f"fault probability {name} must be <= 1, got {value}")


@dataclass(frozen=True)
class FaultRecord:
    kind: FaultKind
    time: float
    target: str
    detail: str = ""


@dataclass
class FaultPlan:
    """The faults of one run: the seed, the rates, whether faults are on, and what was injected.

    ``active`` is switched off for the liveness phase (and while the tester audits), so the system
    must then recover and make progress on its own.
    """

    seed: int
    rates: FaultRates
    clock: Clock
    active: bool = True
    log: list[FaultRecord] = field(default_factory=list)

    def rng(self, name: str) -> random.Random:
        """An independent, reproducible random stream for the injector ``name``."""
        return random.Random(f"staleflow-chaos/{self.seed}/{name}")

    def happens(self, rng: random.Random, probability: float) -> bool:
        """One draw; always made (so the stream does not depend on ``active``), true only if active."""
        return rng.random() < probability and self.active

    def delay(self, rng: random.Random) -> float:
        return rng.uniform(0.1, self.rates.delay_s_max)

    def record(self, kind: FaultKind, target: str, detail: str = "") -> None:
        self.log.append(FaultRecord(kind, self.clock.now(), target, detail))

    def counts(self) -> dict[str, int]:
        counts = Counter(record.kind.value for record in self.log)
        return {kind.value: counts.get(kind.value, 0) for kind in FaultKind}

"""Deterministic simulation testing (TigerBeetle's VOPR, for StaleFlow): seeded faults, checked often.

One seed picks a whole scenario, "swarm" style: the cluster (instances, batch and group sizes, the
bound ``eta``, redundancy, the system policy) and the fault rates of every kind in
:mod:`staleflow.verification.chaos.faults`. The unchanged runtime (protocol, trajectory and parameter
servers, coordinator, run loop, reward runner) then drives simulated instances and a simulated
trainer on a virtual clock, through the fault injectors:

1. **safety phase**: faults on for ``steps_faulty`` training steps; the coordinator may restart
   from its checkpoint between steps;
2. **liveness phase**: faults off (the cluster heals) for ``steps_healed`` more steps.

Checked after **every protocol event**: a consumed batch only holds groups within ``eta`` of it and
drops at most the redundancy; the trajectory server's own audit (every group and request in
exactly one state, nothing finished twice). After **every training step**: the trajectory server
agrees with every instance on which requests run where (nothing lost, orphaned or duplicated,
in-flight results included), the protocol and the trajectory server hold the same live groups,
every trajectory trained on carries token versions within ``eta`` of its batch, and the step
finished within the liveness budget of virtual time. **At the end**: the JSONL protocol trace of
the whole run (restarts append segments) is accepted by the spec (mirror replay; TLC on request).

A failing seed prints the one command that replays it: ``staleflow bench chaos --seed N``.
"""

from __future__ import annotations

import random
import tempfile
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from staleflow.protocol.errors import HookError
from staleflow.protocol.events import ProtocolEvent
from staleflow.runtime.run.clock import VirtualClock
from staleflow.runtime.types import PromptGroup
from staleflow.verification.chaos.faults import (
    FaultyEngine,
    FaultyParameterServer,
    FaultyTrainer,
    HungRewards,
    faulty_reward,
    restart_loop,
)
from staleflow.verification.chaos.plan import FaultKind, FaultPlan, FaultRates

#: Wall-clock seconds the reward runner waits for a group. Injected hangs are released as soon as
#: the runtime gives up on their group, so each costs this much wall time; a healthy reward returns
#: in microseconds, far inside it even on a loaded machine (the outcome must not depend on speed).
REWARD_TIMEOUT_S = 1.0
#: The trajectory server's audit after a protocol event reads every group it ever held; it runs
#: after every event until twice this many groups were admitted, then after every k-th event
#: (k = admitted // this), so a long run's checks stay linear in its events.
AUDIT_GROUPS_PER_EVENT = 100
#: Trajectory-server group states in which the protocol still holds the group.
_LIVE_GROUP_STATES = ("generating", "rewarding", "done")
#: Virtual seconds a training step may take before the run counts as not live. A healthy step of
#: the chaos workloads takes a few seconds; every injected delay lasts at most ``delay_s_max``.
STEP_BUDGET_S = 120.0
#: Protocol events a training step may take before the run counts as not live (a livelock: groups
#: admitted and aborted over and over without a batch).
STEP_BUDGET_EVENTS = 50_000


class LivenessViolation(RuntimeError):
    """The trainer did not advance within the virtual-time budget."""


class SafetyViolation(AssertionError):
    """A checked property failed (lost or duplicated data, staleness above eta, a rejected trace)."""


def _violation_in(error: Exception) -> SafetyViolation | LivenessViolation | None:
    """The violation ``error`` reports: itself, or the one a check hook raised inside a protocol
    operation (the operation was applied and then raised ``HookError`` carrying it)."""
    if isinstance(error, (SafetyViolation, LivenessViolation)):
        return error
    if isinstance(error, HookError):
        return next((e for _, e in error.failures if isinstance(e, (SafetyViolation, LivenessViolation))), None)
    return None


class BudgetClock(VirtualClock):
    """A virtual clock that refuses to pass a deadline: the liveness budget of the current step."""

    def __init__(self) -> None:
        super().__init__()
        self.deadline = float("inf")

    def sleep_until(self, deadline: float) -> None:
        if deadline > self.deadline:
            raise LivenessViolation(
                f"no training step finished by t={self.deadline:.2f} (virtual s): the trainer stopped advancing"
            )
        super().sleep_until(deadline)


@dataclass(frozen=True)
class Scenario:
    """Everything a seed decides; ``command`` replays it."""

    seed: int
    system: str
    instances: int
    group_size: int
    batch_size: int
    eta: int
    batch_redundancy: int
    group_redundancy: int
    steps_faulty: int
    steps_healed: int
    rates: FaultRates
    kinds: tuple[str, ...] | None = None
    forced_system: bool = False

    @property
    def command(self) -> str:
        kinds = "" if self.kinds is None else " --faults " + " ".join(self.kinds)
        system = f" --system {self.system}" if self.forced_system else ""
        return f"staleflow bench chaos --seed {self.seed}{kinds}{system}"


#: The systems a seed draws from. The chaos tester checks the staleness protocol under faults, so it
#: runs the systems that keep the bound (the completion-order peers, ``areal`` and ``verl-async``,
#: have no protocol to check; their runs are covered by the run-loop tests).
CHAOS_SYSTEMS = ["staleflow"] * 5 + ["staleflow-no-sync", "inflight-cap", "roll-flash", "one-step-off", "sync"]


def draw_scenario(
    seed: int, steps_faulty: int = 8, steps_healed: int = 4, kinds: Sequence[str] | None = None, system: str | None = None
) -> Scenario:
    """The scenario of ``seed``: cluster shape, policy and fault rates (some kinds off, "swarm").

    ``kinds`` keeps only those fault kinds (:class:`~staleflow.verification.chaos.faults.FaultKind` values);
    ``system`` runs that system instead of the one drawn; the rest of the scenario is the same as
    without them.
    """
    rng = random.Random(f"staleflow-chaos/{seed}/scenario")
    drawn = rng.choice(CHAOS_SYSTEMS)

    def maybe(probability: float) -> float:
        return probability * rng.choice([0.0, 0.5, 1.0, 2.0])

    rates = FaultRates(
        crash_per_s=maybe(0.01),
        stall_per_s=maybe(0.05),
        pull_fail=maybe(0.1),
        pull_slow=maybe(0.1),
        push_fail=maybe(0.1),
        push_slow=maybe(0.15),
        reward_raise=maybe(0.005),
        reward_hang=maybe(0.003),
        finish_delay=maybe(0.05),
        snapshot_stale=maybe(0.1),
        train_slow=maybe(0.15),
        restart=maybe(0.15),
        delay_s_max=rng.choice([0.5, 2.0, 5.0]),
        restart_s=rng.choice([0.5, 2.0]),
    )
    if kinds is not None:
        rates = rates.only(frozenset(FaultKind(kind) for kind in kinds))
    return Scenario(
        seed=seed,
        system=drawn if system is None else system,
        instances=rng.randint(2, 4),
        group_size=rng.randint(2, 4),
        batch_size=rng.randint(2, 6),
        # (the old start-version-gc never trained at eta 0, found by seed 148: roll-flash waits instead)
        eta=rng.randint(1 if drawn == "roll-flash" else 0, 3),
        batch_redundancy=rng.choice([0, 0, 1, 2]),
        group_redundancy=rng.choice([0, 0, 1]),
        steps_faulty=steps_faulty,
        steps_healed=steps_healed,
        rates=rates,
        kinds=None if kinds is None else tuple(kinds),
        forced_system=system is not None,
    )


def workload_for(scenario: Scenario) -> Any:
    """A small simulated job (short long-tailed responses) shaped by the scenario."""
    from staleflow.runtime.settings.workload import parse_workload

    return parse_workload(
        {
            "name": f"chaos-{scenario.seed}",
            "model": "tiny",
            "cost_model": {"thr": 6.4e-3, "o_b": 2.7e-3, "o_k": 1.231e-4, "a_b": 2.8e-3, "a_k": 3.35e-8},
            "cluster": {"rollout_instances": scenario.instances, "gpus_per_instance": 1, "trainer_gpus": 1},
            "instance": {"kv_capacity_tokens": 3000, "max_running": 8, "prefill_s_per_token": 2.0e-5,
                         "weight_load_s": 0.2},
            "prompt_tokens": 16,
            "response_tokens": {"distribution": "lognormal", "mean": 60, "sigma": 0.9, "min": 2, "max": 400},
            "batch": {"groups_per_step": scenario.batch_size, "group_size": scenario.group_size},
            "training": {"base_s": 0.2, "per_token_s": 2.0e-5},
            "simulation": {"tick_s": 0.05, "event_quantum_s": 0.0},
        },
        source=f"chaos scenario {scenario.seed}",
    )


@dataclass
class ChaosResult:
    """What one seed did and found."""

    seed: int
    scenario: dict[str, Any]
    steps: int
    faults: dict[str, int]
    events_checked: int
    ts_audits: int
    audits: int
    trace_events: int
    violation: str | None
    wall_s: float
    command: str
    fault_log: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.violation is None


class ChaosRun:
    """One seed: build the scenario's cluster, run both phases, check everything (see the module)."""

    def __init__(self, scenario: Scenario, trace_path: Path, use_tlc: bool = False) -> None:
        from staleflow.adapters.sim.engine import SimEngine
        from staleflow.adapters.sim.trainer import SimTrainer
        from staleflow.runtime.run.run_spec import RunSpec
        from staleflow.runtime.servers.parameter_server import ParameterServer
        from staleflow.runtime.settings.policies import make_policy

        self.scenario = scenario
        self.trace_path = trace_path
        self.use_tlc = use_tlc
        self.workload = workload = workload_for(scenario)
        self.spec = RunSpec.from_workload(
            workload, scenario.system, scenario.eta,
            batch_redundancy=scenario.batch_redundancy if make_policy(scenario.system).takes_redundancy else 0,
            group_redundancy=scenario.group_redundancy,
        )
        self.spec = replace(self.spec, reward_timeout_s=REWARD_TIMEOUT_S)
        self.policy = self.spec.policy
        self.clock = BudgetClock()
        self.plan = FaultPlan(scenario.seed, scenario.rates, self.clock)
        self.engines = [
            FaultyEngine(
                f"i{i}", self.clock,
                lambda iid, clock, version: SimEngine.from_workload(workload, iid, clock, version=version),
                self.plan,
            )
            for i in range(scenario.instances)
        ]
        self.trainer = FaultyTrainer(SimTrainer.from_workload(workload, self.clock), self.clock, self.plan)
        self.ps = FaultyParameterServer(ParameterServer(keep=scenario.eta + 2), self.clock, self.plan)
        self.hung = HungRewards()
        self._restart_rng = self.plan.rng("restart")
        self.reward = faulty_reward(self.plan, self.hung)
        self.prompts: Iterator[PromptGroup] = workload.prompt_groups(scenario.seed, n_extra=self.policy.group_redundancy)
        self.events_checked = 0
        self.audits = 0
        self.ts_audits = 0
        self._admitted = 0
        self._event_deadline = STEP_BUDGET_EVENTS
        self.steps = 0
        self.loop: Any = None

    # ------------------------------------------------------------------ building
    def make_loop(self) -> Any:
        from staleflow.runtime.run.assembly import assemble_run
        from staleflow.runtime.run.loop import RunParts

        active, self.plan.active = self.plan.active, False  # the first snapshots are the truth
        try:
            parts = RunParts(
                engines=self.engines,
                trainer=self.trainer,
                prompts=self.prompts,
                cost_model=self.workload.build_cost_model(),
                clock=self.clock,
                parameter_server=self.ps,  # type: ignore[arg-type]
                reward_fn=self.reward,
            )
            return assemble_run(
                self.spec, parts, event_hooks=[self.check_event], trace_path=self.trace_path, trace_refusals=True)  # validate every refusal
        finally:
            self.plan.active = active

    # ------------------------------------------------------------------ the run
    def run(self) -> ChaosResult:
        started = time.perf_counter()
        violation: str | None = None
        try:
            self.loop = self.make_loop()
            for phase_steps, faults_on in ((self.scenario.steps_faulty, True), (self.scenario.steps_healed, False)):
                self.plan.active = faults_on
                for _ in range(phase_steps):
                    self.step()
            self.plan.active = False
            self.loop.close()
            self.loop = None
            self.check_trace()
        except Exception as error:  # noqa: BLE001 - any crash of the runtime under a fault is a finding
            found = _violation_in(error)
            if found is not None:
                violation = f"{type(found).__name__}: {found}"
            else:
                frame = traceback.extract_tb(error.__traceback__)[-1]
                violation = (
                    f"run crashed: {type(error).__name__}: {error} "
                    f"(at {Path(frame.filename).name}:{frame.lineno} in {frame.name})"
                )
        finally:
            self.hung.release()
            self._close()
        return ChaosResult(
            seed=self.scenario.seed,
            scenario={k: v for k, v in asdict(self.scenario).items() if k != "rates"} | {"rates": asdict(self.scenario.rates)},
            steps=self.steps,
            faults=self.plan.counts(),
            events_checked=self.events_checked,
            ts_audits=self.ts_audits,
            audits=self.audits,
            trace_events=_count_events(self.trace_path),
            violation=violation,
            wall_s=time.perf_counter() - started,
            command=self.scenario.command,
            fault_log=[f"t={r.time:.3f} {r.kind.value} {r.target} {r.detail}" for r in self.plan.log],
        )

    def step(self) -> None:
        """One training step under the liveness budget, then the step-boundary checks."""
        self.clock.deadline = self.clock.now() + STEP_BUDGET_S
        self._event_deadline = self.events_checked + STEP_BUDGET_EVENTS
        trained = len(self.trainer.batches)
        self.loop.run(1)
        self.clock.deadline = float("inf")
        self._event_deadline = float("inf")
        self.hung.release()
        self.steps += 1
        self.check_batches(self.trainer.batches[trained:])
        self.check_audit()
        if self.plan.happens(self._restart_rng, self.scenario.rates.restart):
            old = self.loop
            self.loop = restart_loop(old, self.make_loop, self.plan)
            old.rewards.close()

    # ------------------------------------------------------------------ checks
    def check_event(self, event: ProtocolEvent) -> None:
        """After every protocol operation: the bound and the drops; and the trajectory server's own
        bookkeeping (its audit reads every group: after every event while it holds few groups,
        then after every k-th event, k growing with the groups, so the checks cost linear time)."""
        self.events_checked += 1
        if self.events_checked > self._event_deadline:
            raise LivenessViolation(f"no training step finished within {STEP_BUDGET_EVENTS} protocol events (livelock)")
        loop = self.loop
        if loop is None:
            return
        eta = loop.manager.eta
        if event.op == "consume":
            batch = event.batch
            assert batch is not None
            for group_id, version in zip(batch.group_ids, batch.group_versions):
                if not version <= batch.version <= version + eta:
                    raise SafetyViolation(f"group {group_id!r} of version {version} consumed in buffer {batch.version}, eta={eta}")
            if len(batch.dropped) > loop.manager.redundancy:
                raise SafetyViolation(f"buffer {batch.version} dropped {len(batch.dropped)} groups, redundancy {loop.manager.redundancy}")
        if event.op in ("abort", "consume"):
            for group_id in (event.group_id,) if event.batch is None else event.batch.dropped:
                self.hung.release(str(group_id))
        self._admitted += bool(event.op == "reserve" and event.accepted)
        if self.events_checked % max(1, self._admitted // AUDIT_GROUPS_PER_EVENT):
            return
        self.ts_audits += 1
        report = loop.ts.audit()
        if report.duplicated or report.problems:
            raise SafetyViolation(f"after event {event.seq} ({event.op}): trajectory server audit: "
                                  f"duplicated {list(report.duplicated)[:5]}, problems {list(report.problems)[:5]}")

    def check_batches(self, batches: list[Any]) -> None:
        """Every trajectory trained on: token versions within ``[buffer - eta, buffer]``."""
        eta = self.loop.manager.eta
        for batch in batches:
            for group_id, trajectories in batch.groups.items():
                for trajectory in trajectories:
                    versions = list(dict.fromkeys(trajectory.versions))
                    if not versions or min(versions) < batch.version - eta or max(versions) > batch.version:
                        raise SafetyViolation(
                            f"buffer {batch.version} trains {trajectory.request_id} with token versions "
                            f"{versions} (eta={eta})"
                        )
                if len(trajectories) != self.scenario.group_size:
                    raise SafetyViolation(f"buffer {batch.version}: group {group_id} has {len(trajectories)} trajectories")

    def check_audit(self) -> None:
        """Between steps: the TS agrees with every instance, and with the protocol's live groups."""
        self.audits += 1
        active, self.plan.active = self.plan.active, False
        try:
            report = self.loop.audit()
        finally:
            self.plan.active = active
        if not report.ok:
            raise SafetyViolation(
                f"audit after step {self.steps}: lost {list(report.lost)[:5]}, orphaned {list(report.orphaned)[:5]}, "
                f"duplicated {list(report.duplicated)[:5]}, problems {list(report.problems)[:5]}"
            )
        # Same count, and every protocol group live in the TS: the same set of live groups.
        in_protocol = [str(g.group_id) for g in self.loop.manager.groups()]
        not_live = [g for g in in_protocol if not self._live_in_ts(g)]
        live_in_ts = sum(report.groups[state] for state in _LIVE_GROUP_STATES)
        if not_live or live_in_ts != len(in_protocol):
            raise SafetyViolation(
                f"protocol and trajectory server disagree on live groups: the protocol holds {len(in_protocol)} "
                f"(not live in the TS: {not_live[:5]}), the TS {live_in_ts}"
            )

    def _live_in_ts(self, group_id: str) -> bool:
        try:
            return self.loop.ts.group_state(group_id).value in _LIVE_GROUP_STATES
        except KeyError:  # a group the trajectory server never saw: a disagreement, not a crash of the check
            return False

    def check_trace(self) -> None:
        from staleflow.verification.proofs.trace_validation import validate_trace

        result = validate_trace(self.trace_path, use_tlc=self.use_tlc)
        if not result.ok:
            raise SafetyViolation(f"trace rejected by the spec: {result.detail}")

    # ------------------------------------------------------------------ teardown
    def _close(self) -> None:
        if self.loop is not None:
            self.loop.close()
            self.loop = None


def _count_events(path: Path) -> int:
    if not path.exists():
        return 0
    with open(path, encoding="utf-8") as stream:
        return sum(1 for line in stream if line.strip() and not line.startswith('{"type": "header"'))


def run_seed(
    seed: int,
    trace_dir: Path | None = None,
    use_tlc: bool = False,
    steps_faulty: int = 8,
    steps_healed: int = 4,
    kinds: Sequence[str] | None = None,
    system: str | None = None,
) -> ChaosResult:
    """Run one seed (``system``: instead of the drawn one); its trace goes to
    ``trace_dir/chaos-<seed>.jsonl`` (a temporary folder by default)."""
    scenario = draw_scenario(seed, steps_faulty, steps_healed, kinds, system)
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        return ChaosRun(scenario, trace_dir / f"chaos-{seed}.jsonl", use_tlc).run()
    with tempfile.TemporaryDirectory(prefix="staleflow-chaos-") as tmp:
        return ChaosRun(scenario, Path(tmp) / f"chaos-{seed}.jsonl", use_tlc).run()

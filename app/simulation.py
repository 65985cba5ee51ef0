"""StaleFlow and the baselines side by side on a simulated cluster (``staleflow simulate``, ``cli/simulate.py``).

Every system runs the same runtime (protocol, trajectory and parameter servers, coordinator, run
loop) against simulated rollout instances and a simulated trainer in virtual time, on the same
prompts and response lengths (same seed). The table reports throughput (trained response tokens per
second), time per step, instance utilisation, staleness and drops, and StaleFlow's ratio to each
baseline and to the workload's upper bound (:mod:`staleflow.app.upper_bound`).

:func:`compare_systems` runs the grid (every system at every ``eta``) and returns the report with
its exit code: 1 when a run stalled or broke a guarantee (staleness above ``eta``, a lost or
duplicated trajectory), else 0.
"""

from __future__ import annotations

import gc
import json
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from staleflow.runtime.settings.workload import Workload

#: The systems the paper ran (VeRL, VeRL-Pipeline, VeRL-Async, AReaL, ROLL Flash), as each runs
#: (runtime/settings/policies.py says which peer code each follows): the paper's comparison basis.
PAPER_SYSTEMS = ("verl-sync", "one-step-off", "verl-async", "areal", "roll-flash")
#: Every baseline: the paper's systems, the variants a careful user would run (drop groups past
#: ``eta``; AReaL at a tighter bound) and ROLL Flash as its later code runs (``roll-flash-2026``),
#: which the paper did not run.
BASELINES = (*PAPER_SYSTEMS, "areal-filter", "areal-tight", "roll-flash-2026")
ABLATIONS = (
    "staleflow-no-routing", "staleflow-no-sync", "staleflow-no-migration", "staleflow-no-proactive-abort", "staleflow-fresh",
    "staleflow-no-growth", "staleflow-tail", "staleflow-spec",
)
#: Baselines run with one of their mechanisms idealised: what that mechanism alone is worth (never the best bound-keeping one).
BASELINE_ABLATIONS = ("roll-flash-ideal-routing",)
DEFAULT_SYSTEMS = ("staleflow", *BASELINES)
UPPER_BOUND = "upper-bound"
#: The bound-keeping basis: the fastest baseline whose p99 staleness is within ``eta`` (variants included).
BEST = "best-bound-keeping"
#: The paper's basis: the fastest of :data:`PAPER_SYSTEMS` as it runs, whatever it trains past ``eta``.
BEST_PAPER = "best-paper-system"
#: Steady state leaves out the first ``eta + STEADY_SKIP_AFTER_ETA`` steps (the pipeline filling up).
STEADY_SKIP_AFTER_ETA = 2
#: AReaL run with the largest admission bound below ``eta`` whose p99 staleness is within ``eta``.
TIGHT = "areal-tight"


def expand_systems(requested: list[str]) -> list[str]:
    """The systems named on the command line, ``all`` and ``ablation`` expanded, aliases resolved, in order."""
    from staleflow.runtime.settings.policies import ALIASES, POLICIES

    names: list[str] = []
    for name in requested:
        expanded = {"all": [*POLICIES, TIGHT], "ablation": ["staleflow", *ABLATIONS]}.get(name, [name])
        for item in expanded:
            if item == UPPER_BOUND:
                continue
            item = ALIASES.get(item, item)
            if item not in POLICIES and item != TIGHT:
                known = ", ".join([*POLICIES, TIGHT, *ALIASES, UPPER_BOUND, "ablation", "all"])
                raise ValueError(f"unknown system {item!r}; known: {known}")
            if item not in names:
                names.append(item)
    return names


#: the cyclic collector's thresholds during a simulated run (Python's default: 700, 10, 10)
RUN_GC_THRESHOLDS = (100_000, 20, 100)


@contextmanager
def fewer_collections() -> Iterator[None]:
    """Python's cyclic garbage collector runs less often while a simulated run goes (its thresholds
    :data:`RUN_GC_THRESHOLDS`, then back as they were). A run allocates millions of short-lived
    objects (requests, snapshots, token lists) and makes few reference cycles: at the default
    thresholds the collector took about 15% of the CPU of a Qwen3 run, its peak memory unchanged
    (docs/simulation.md, "Speed of the simulator"); nothing a run computes depends on it."""
    before = gc.get_threshold()
    gc.set_threshold(*RUN_GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def simulate_system(
    workload: Workload,
    system: str,
    eta: int,
    steps: int,
    seed: int,
    tick_s: float | None = None,
    event_quantum_s: float | None = None,
    on_step: Any = None,
    trace_path: Path | None = None,
    estimation_error: float = 0.0,
    admission_eta: int | None = None,
    cost_refit_s: float | None = None,
    draft_positions: str = "off",
    **knobs: Any,
) -> dict[str, Any]:
    """Run one system for ``steps`` training steps; returns its figures (the JSON entry).

    With ``trace_path`` the run's protocol trace is written there (JSONL, for ``verify --trace``).
    ``estimation_error``: the coordinator plans with the cost model off by this much (the engines
    run the exact one); ``cost_refit_s``: the coordinator refits that model to the engines' decode
    steps every so many simulated seconds, as a training job does (None: it plans with it as it is).
    ``admission_eta``: a system that does not keep the bound admits with this
    bound instead of ``eta`` (its staleness is still measured against ``eta``). ``draft_positions``:
    how engines that verify drafts accept them along a response (:data:`DRAFT_POSITIONS`). ``knobs``
    override the policy's.
    """
    from staleflow.adapters.sim.engine import SimEngine
    from staleflow.adapters.sim.network import Broadcast, ParameterServerLink, WeightTransfer, prefill_seconds, trainer_offload_seconds
    from staleflow.adapters.sim.speculation import DraftVerification, SpeculativeDecoding, geometric_tau
    from staleflow.adapters.sim.trainer import SimTrainer
    from staleflow.app.instance_skew import SkewRecorder
    from staleflow.runtime.coordination.cost_fit import OnlineCostModel
    from staleflow.runtime.run.assembly import assemble_run
    from staleflow.runtime.run.clock import VirtualClock
    from staleflow.runtime.run.loop import RunParts
    from staleflow.runtime.run.run_spec import RunSpec

    spec = RunSpec.from_workload(workload, system, eta, tick_s=tick_s, **knobs)
    policy = spec.policy
    if admission_eta is not None:
        spec = replace(spec, eta=admission_eta)
    clock = VirtualClock()
    quantum = workload.simulation.event_quantum_s if event_quantum_s is None else event_quantum_s
    cluster = workload.cluster
    instances = cluster.rollout_instances
    scale, after_step = 1.0, 0.0
    link: WeightTransfer | None = None
    if policy.colocated:  # every GPU rolls out, then every GPU trains
        instances = workload.gpus // cluster.gpus_per_instance
        scale = cluster.trainer_gpus / workload.gpus if cluster.trainer_gpus else 1.0
    elif policy.weight_transfer == "broadcast":
        link = Broadcast(workload.network, pause_s=policy.update_pause_s)
        # with a pause (ROLL) the trainer also waits for the instances' load_states before going on
        after_step = link.seconds + (workload.instance.weight_load_s if policy.update_pause_s else 0.0)
    elif policy.weight_transfer == "ps_pull":
        link = ParameterServerLink(workload.network)
    if policy.offloads_trainer:
        after_step += trainer_offload_seconds(workload.network, cluster.trainer_gpus)
    estimate = workload.build_cost_model().with_error(estimation_error, seed)
    speculate = None
    if policy.speculative_speedup > 1:
        speculate = partial(SpeculativeDecoding, speedup=policy.speculative_speedup, max_batch=policy.speculative_max_batch)
    elif policy.draft_acceptance:
        speculate = partial(DraftVerification, tau=geometric_tau(policy.draft_acceptance, policy.max_drafts),
                            **drafts_by_position(policy.draft_acceptance, draft_positions))
    engines = [
        SimEngine.from_workload(workload, f"i{i}", clock, event_quantum_s=quantum, weight_link=link, speculate=speculate)
        for i in range(instances)
    ]
    parts = RunParts(
        engines=list(engines),
        trainer=SimTrainer.from_workload(workload, clock, scale=scale, after_step_s=after_step, recompute=policy.recomputes_logprobs,
                                       reference=policy.reference_forward),
        prompts=workload.prompt_groups(seed, n_extra=policy.group_redundancy),
        cost_model=estimate if cost_refit_s is None else OnlineCostModel(
            estimate, f"the workload's, {estimation_error:.0%} error", refit_s=cost_refit_s, max_n=workload.instance.max_running),
        clock=clock,
        prefill=partial(prefill_seconds, per_token=workload.instance.prefill_s_per_token,
                        attn_per_token2=workload.instance.prefill_attn_s_per_token2),
    )
    loop = assemble_run(spec, parts, trace_path=trace_path)
    skew = SkewRecorder(engines, clock.now, loop.stats.busy_seconds)

    def step_done() -> None:
        skew.step_finished()
        if on_step is not None:
            on_step()

    started = time.perf_counter()
    try:
        with fewer_collections():
            metrics = loop.run(steps, on_step=step_done)
    finally:
        loop.close()
    wall = time.perf_counter() - started
    trained_groups = sum(metrics.staleness_histogram.values())
    return measured_against({
        "tokens_per_s": metrics.tokens_per_s,
        "step_time_s": metrics.step_time_s,
        "utilisation": metrics.utilisation,
        "max_staleness": metrics.max_staleness,
        "staleness_p99": metrics.staleness_p99,
        "keeps_bound": policy.keeps_bound,
        "staleness_histogram": {str(k): v for k, v in metrics.staleness_histogram.items()},
        "dropped": metrics.dropped,
        "wasted_tokens": metrics.wasted_tokens,
        "proactive_aborted": metrics.proactive_aborted,
        "mean_trained_length": metrics.tokens_trained / max(1, trained_groups * workload.batch.group_size),
        "admission_eta": policy.protocol_eta(spec.eta),
        "instances": instances,
        "generated_tokens_per_s": metrics.tokens_generated / metrics.elapsed_s,
        "trainer_busy": sum(m["step_time_s"] for m in metrics.train_metrics) / metrics.elapsed_s,
        "steps": metrics.steps,
        "step_times_s": metrics.step_times_s,
        "step_tokens": metrics.step_tokens,
        "staleness_per_buffer": {
            str(b): {str(s): n for s, n in counts.items()} for b, counts in metrics.staleness_per_buffer.items()
        },
        "lost": metrics.lost,
        "duplicated": metrics.duplicated,
        "virtual_s": metrics.elapsed_s,
        "wall_s": wall,
        "coordinator_decision_s": metrics.coordinator.get("decision_seconds", 0.0),
        "sync_loads": {kind: int(metrics.coordinator.get(kind, 0)) for kind in ("pulls", "broadcast_pulls")},
        "reused_run": False,
        "instance_skew": skew.figures(),
        "cost_fit": metrics.cost_fit,
        "draft_acceptance": policy.draft_acceptance,
    }, policy.protocol_eta(eta), eta)


def measured_against(figures: dict[str, Any], eta: int, comparison_eta: int) -> dict[str, Any]:
    """``figures`` of a run with the bound it is measured against set to ``eta``: ``eta`` and the
    share of trained groups past it (the run itself depends only on its ``admission_eta``), and its
    steady state: tokens/s and step time without the first ``comparison_eta + 2`` steps (the same
    steps for every system of a comparison at ``comparison_eta``; None when no step is left)."""
    from staleflow.runtime.run.run_stats import steady_state

    histogram = {int(s): n for s, n in figures["staleness_histogram"].items()}
    past = sum(n for s, n in histogram.items() if s > eta) / max(1, sum(histogram.values()))
    skip = comparison_eta + STEADY_SKIP_AFTER_ETA
    steady = steady_state(figures["step_times_s"], figures["step_tokens"], skip)
    return {**figures, "eta": eta, "past_eta_share": past, "steady_skip_steps": skip,
            "steady_tokens_per_s": None if steady is None else steady[0],
            "steady_step_time_s": None if steady is None else steady[1]}


def violations(results: dict[str, dict[str, Any]]) -> list[str]:
    """Broken guarantees: a system that keeps the bound trained a group past it (a baseline that
    does not keep it is measured, not failed), or a trajectory was lost or duplicated."""
    problems = []
    for name, figures in results.items():
        if figures["keeps_bound"] and figures["max_staleness"] > figures["eta"]:
            problems.append(f"{name}: staleness {figures['max_staleness']} above its bound {figures['eta']}")
        if figures["lost"] or figures["duplicated"]:
            problems.append(f"{name}: {figures['lost']} lost and {figures['duplicated']} duplicated trajectories")
    return problems


#: ``--speculation``: ``off``; ``request``: every system's engines draft from the request's own tokens;
#: ``siblings``: StaleFlow's also from the other responses of its prompt (the rest as ``request``).
SPECULATION = ("off", "request", "siblings")


def speculation_knobs(system: str, speculation: str) -> dict[str, float]:
    """The draft acceptance ``system``'s engines get under ``speculation`` (:data:`SPECULATION`;
    the rates: :data:`~staleflow.adapters.sim.speculation.DRAFT_ACCEPTANCE`). A system that
    models speculation its own way (``staleflow-spec``) keeps it."""
    from staleflow.adapters.sim.speculation import DRAFT_ACCEPTANCE
    from staleflow.runtime.settings.policies import make_policy

    if speculation not in SPECULATION:
        raise ValueError(f"unknown speculation {speculation!r}; known: {', '.join(SPECULATION)}")
    if speculation == "off" or make_policy(system).speculative_speedup > 1:
        return {}
    source = "siblings" if speculation == "siblings" and system.startswith("staleflow") else "request"
    return {"draft_acceptance": DRAFT_ACCEPTANCE[source]}


#: ``--draft-positions``: ``off``: a request accepts drafts at its mode's one rate wherever it is;
#: ``uniform``: at the rate measured where it is in its response (``ACCEPTANCE_BY_POSITION``), every
#: request of a step drafting the same ``k``; ``per-request``: so too, each drafting its own number.
DRAFT_POSITIONS = ("off", "uniform", "per-request")


def drafts_by_position(acceptance: float, draft_positions: str) -> dict[str, Any]:
    """The :class:`~staleflow.adapters.sim.speculation.DraftVerification` arguments of
    ``draft_positions`` (:data:`DRAFT_POSITIONS`) for an engine drafting at one of the measured
    ``DRAFT_ACCEPTANCE`` rates (the position profile of the same draft source)."""
    from staleflow.adapters.sim.speculation import ACCEPTANCE_BY_POSITION, DRAFT_ACCEPTANCE

    if draft_positions not in DRAFT_POSITIONS:
        raise ValueError(f"unknown draft_positions {draft_positions!r}; known: {', '.join(DRAFT_POSITIONS)}")
    if draft_positions == "off":
        return {}
    source = next((source for source, rate in DRAFT_ACCEPTANCE.items() if rate == acceptance), None)
    if source is None:
        raise ValueError(f"draft_positions {draft_positions!r} needs a measured acceptance {DRAFT_ACCEPTANCE}, got {acceptance}")
    return {"by_position": ACCEPTANCE_BY_POSITION[source], "budgets": draft_positions == "per-request"}


def knobs_for(system: str, group_redundancy: int, batch_redundancy: int) -> dict[str, int]:
    """The redundancy asked for, for StaleFlow's policies only."""
    if not system.startswith("staleflow"):
        return {}
    return {"group_redundancy": group_redundancy, "batch_redundancy": batch_redundancy}


def keeps_eta(figures: dict[str, Any], eta: int) -> bool:
    """A baseline that keeps the bound ``eta`` asked for: at most 1% of its groups past it (p99)."""
    return bool(figures["staleness_p99"] <= eta)


def ratios(systems: dict[str, dict[str, Any]], bound: float, eta: int, key: str = "tokens_per_s") -> dict[str, float]:
    """StaleFlow's throughput (``key``: ``tokens_per_s``, whole run, or ``steady_tokens_per_s``) over
    each other system's, and on both comparison bases: over the fastest system the paper ran as it
    runs (:data:`BEST_PAPER`) and over the fastest baseline whose p99 staleness is within ``eta``
    (:data:`BEST`; a baseline ablation never counts); and over the upper bound."""
    def speed(figures: dict[str, Any]) -> float:
        return figures.get(key) or 0.0

    if "staleflow" not in systems or speed(systems["staleflow"]) <= 0:
        return {}
    ours = speed(systems["staleflow"])
    others = {name: f for name, f in systems.items()
              if not name.startswith("staleflow") and name not in BASELINE_ABLATIONS and speed(f) > 0}
    ratios = {name: ours / speed(f) for name, f in systems.items() if name != "staleflow" and speed(f) > 0}
    paper = [speed(f) for name, f in others.items() if name in PAPER_SYSTEMS]
    if paper:
        ratios[BEST_PAPER] = ours / max(paper)
    keeping = [speed(f) for f in others.values() if keeps_eta(f, eta)]
    if keeping:
        ratios[BEST] = ours / max(keeping)
    ratios[UPPER_BOUND] = ours / bound if bound > 0 else 0.0
    return ratios


def of_bound(systems: dict[str, dict[str, Any]], bound: float) -> dict[str, float]:
    """StaleFlow's throughput, whole run and steady state, as a share of ``bound`` (empty without a StaleFlow run)."""
    ours = systems.get("staleflow")
    if ours is None or bound <= 0:
        return {}
    return {key: ours[key] / bound for key in ("tokens_per_s", "steady_tokens_per_s") if ours.get(key)}


def tight(workload: Workload, eta: int, run_one: Any) -> dict[str, Any]:
    """AReaL with a smaller admission bound: the largest ``eta' < eta`` whose run keeps its p99
    staleness within ``eta`` (down to 0; the last tried is reported if none does)."""
    figures: dict[str, Any] = {}
    for admission in range(eta - 1, -1, -1):
        figures = run_one("areal", admission_eta=admission)
        if keeps_eta(figures, eta):
            break
    return figures


@dataclass(frozen=True)
class Comparison:
    """What to run: the systems (:func:`expand_systems`), the bounds, and the knobs every run shares."""

    systems: list[str]
    etas: list[int]
    steps: int = 20
    seed: int = 0
    tick_s: float | None = None
    event_quantum_s: float | None = None
    estimation_error: float = 0.1
    cost_refit_s: float | None = None
    group_redundancy: int = 0
    batch_redundancy: int = 0
    trace_dir: Path | None = None
    speculation: str = "off"
    draft_positions: str = "off"


def compare_systems(
    workload: Workload, comparison: Comparison, progress: Any, on_error: Callable[[str], None]
) -> tuple[dict[str, Any], int]:
    """Run every system of ``comparison`` at every ``eta``; returns the report and the exit code.

    ``progress``: a :class:`rich.progress.Progress` (one task per run); ``on_error``: gets one line
    per stalled run or broken guarantee.
    """
    from staleflow.app.upper_bound import latency_bound, upper_bound
    from staleflow.runtime.run.loop import RunStalledError

    bound = upper_bound(workload, seed=comparison.seed)
    report: dict[str, Any] = {
        "workload": workload.name,
        "gpus": workload.gpus,
        "steps": comparison.steps,
        "seed": comparison.seed,
        "estimation_error": comparison.estimation_error,
        "cost_refit_s": comparison.cost_refit_s,
        # what tells runs of one workload and seed apart (scripts/simulate_tables.py keys its grids by them)
        "tick_s": comparison.tick_s if comparison.tick_s is not None else workload.simulation.tick_s,
        "workload_tick_s": workload.simulation.tick_s,
        "event_quantum_s": comparison.event_quantum_s if comparison.event_quantum_s is not None else workload.simulation.event_quantum_s,
        "rollout_gpus": workload.gpus - workload.cluster.trainer_gpus,
        "speculation": comparison.speculation,
        **({"draft_positions": comparison.draft_positions} if comparison.draft_positions != "off" else {}),
        "upper_bound_tokens_per_s": bound.tokens_per_s,
        "upper_bound": bound.to_dict(),
        "by_eta": {},
    }
    exit_code = 0
    if comparison.trace_dir is not None:
        comparison.trace_dir.mkdir(parents=True, exist_ok=True)
    # A run depends on its system and the bound it admits with, not on the bound it is measured
    # against: verl-sync (0) and one-step-off (1) run once for every eta, and areal-tight at eta
    # reuses areal's run at the smaller bound. Same seed, same run: only the measurement differs.
    runs: dict[tuple[str, int], tuple[dict[str, Any], Path | None]] = {}
    for eta in comparison.etas:
        results: dict[str, dict[str, Any]] = {}
        for name in comparison.systems:
            task = progress.add_task(f"eta={eta} {name}", total=comparison.steps)
            run_one = _runner(workload, comparison, runs, progress, task, eta)
            try:
                results[name] = tight(workload, eta, run_one) if name == TIGHT else run_one(name)
            except RunStalledError as exc:
                on_error(f"error: eta={eta} {name}: {exc}")
                exit_code = 1
            progress.remove_task(task)
        for problem in violations(results):
            on_error(f"error: eta={eta} {problem}")
            exit_code = 1
        latency = latency_bound(workload, eta, bound, seed=comparison.seed)
        report["by_eta"][str(eta)] = {
            "systems": results, "staleflow_ratio": ratios(results, bound.tokens_per_s, eta),
            "staleflow_ratio_steady": ratios(results, bound.tokens_per_s, eta, "steady_tokens_per_s"),
            "latency_bound": latency.to_dict(),
            "staleflow_of_latency_bound": of_bound(results, latency.tokens_per_s),
        }
    return report, exit_code


def _runner(
    workload: Workload, comparison: Comparison, runs: dict[tuple[str, int], tuple[dict[str, Any], Path | None]],
    progress: Any, task: Any, eta: int,
) -> Callable[..., dict[str, Any]]:
    """``run_one(system, **extra)`` for one progress task at ``eta``: a run already made with the same
    system and admission bound is measured again instead of run again (its trace copied)."""
    from staleflow.runtime.settings.policies import make_policy

    def run_one(system: str, **extra: Any) -> dict[str, Any]:
        policy = make_policy(system)
        key = (system, policy.protocol_eta(extra.get("admission_eta", eta)))
        trace_dir = comparison.trace_dir
        trace = None if trace_dir is None or not policy.keeps_bound else trace_dir / f"{system}-eta{eta}.jsonl"
        if key in runs:
            figures, earlier_trace = runs[key]
            if trace is not None and earlier_trace is not None:
                shutil.copyfile(earlier_trace, trace)
            return {**measured_against(figures, policy.protocol_eta(eta), eta), "reused_run": True}
        progress.reset(task)
        figures = simulate_system(
            workload, system, eta, comparison.steps, comparison.seed, comparison.tick_s, comparison.event_quantum_s,
            on_step=lambda: progress.advance(task), trace_path=trace, estimation_error=comparison.estimation_error,
            cost_refit_s=comparison.cost_refit_s, draft_positions=comparison.draft_positions,
            **knobs_for(system, comparison.group_redundancy, comparison.batch_redundancy),
            **speculation_knobs(system, comparison.speculation), **extra,
        )
        runs[key] = (figures, trace)
        return figures

    return run_one


def json_payload(report: dict[str, Any], comparison: Comparison) -> dict[str, Any]:
    """What ``--json`` prints: with one ``eta``, its systems and ratios at the top level; else the report."""
    if len(comparison.etas) != 1:
        return report
    eta = comparison.etas[0]
    only = report["by_eta"][str(eta)]
    return {"systems": only["systems"], "upper_bound_tokens_per_s": report["upper_bound_tokens_per_s"],
            "latency_bound": only["latency_bound"], "staleflow_of_latency_bound": only["staleflow_of_latency_bound"],
            "staleflow_ratio": only["staleflow_ratio"], "staleflow_ratio_steady": only["staleflow_ratio_steady"],
            "eta": eta, "workload": report["workload"],
            "steps": comparison.steps, "seed": comparison.seed, "estimation_error": comparison.estimation_error}


def write_results(report: dict[str, Any], out: Path) -> Path:
    """``out/results.json`` (the folder is made)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path

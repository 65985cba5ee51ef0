"""Deterministic simulation testing: many seeds of seeded faults, every event checked (VOPR style).

Each seed draws a scenario (cluster shape, policy, ``eta``, redundancy, and the rate of each fault
kind) and runs the unchanged runtime on simulated instances and trainer through the fault
injectors of :mod:`staleflow.verification.chaos.faults`: a faulty phase, then a healed phase that must make
progress. See :mod:`staleflow.verification.chaos.tester` for what is checked and when.

Prints the seeds run, the faults injected by kind, the events and audits checked, and each
violation with the one command that replays it. Exit code 1 if any seed found a violation.

Reproduce: ``staleflow bench chaos --seeds 200`` (seeds 0..199); one seed: ``--seed 1234``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--seeds", type=int, default=50, help="run seeds FIRST..FIRST+N-1 (default: 50)")
    which.add_argument("--seed", type=int, default=None, help="replay this one seed (prints its fault log)")
    parser.add_argument("--first", type=int, default=0, help="first seed of --seeds (default: 0)")
    parser.add_argument("--steps", type=int, default=8, help="training steps with faults on (default: 8)")
    parser.add_argument("--healed-steps", type=int, default=4, help="training steps after faults stop (default: 4)")
    parser.add_argument("--faults", nargs="+", default=None, metavar="KIND",
                        help="only these fault kinds (default: all); e.g. instance_crash push_fail")
    parser.add_argument("--system", default=None,
                        help="run every seed with this system instead of the drawn one (one that keeps the bound)")
    parser.add_argument("--tlc", action="store_true", help="also replay every trace through TLC (slower)")
    parser.add_argument("--trace-dir", type=Path, default=None, help="keep each seed's protocol trace here")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON only")


def _check_arguments(args: argparse.Namespace) -> list[str]:
    from staleflow.verification.chaos.plan import FaultKind

    problems = []
    if args.seed is None and args.seeds < 1:
        problems.append(f"--seeds must be >= 1, got {args.seeds}")
    if args.steps < 1 or args.healed_steps < 0:
        problems.append("--steps must be >= 1 and --healed-steps >= 0")
    from staleflow.runtime.settings.policies import POLICIES

    if args.system is not None and (args.system not in POLICIES or not POLICIES[args.system].keeps_bound):
        bounded = ", ".join(name for name, policy in POLICIES.items() if policy.keeps_bound)
        problems.append(f"--system: {args.system!r} is not a system that keeps the bound; known: {bounded}")
    known = [kind.value for kind in FaultKind]
    problems += [f"--faults: unknown kind {kind!r}; known: {', '.join(known)}" for kind in args.faults or () if kind not in known]
    return problems


def summarise(results: list[Any]) -> dict[str, Any]:
    """The figures of a batch of seeds (what the command prints and ``docs/reliability.md`` quotes)."""
    faults: Counter[str] = Counter()
    for result in results:
        faults.update(result.faults)
    return {
        "seeds_run": len(results),
        "seeds": [results[0].seed, results[-1].seed] if results else [],
        "steps": sum(r.steps for r in results),
        "faults_injected": sum(faults.values()),
        "faults_by_kind": dict(sorted(faults.items())),
        "events_checked": sum(r.events_checked for r in results),
        "event_ts_audits": sum(r.ts_audits for r in results),
        "audits": sum(r.audits for r in results),
        "trace_events_validated": sum(r.trace_events for r in results if r.ok),
        "violations": [{"seed": r.seed, "violation": r.violation, "reproduce": r.command} for r in results if not r.ok],
        "wall_s": sum(r.wall_s for r in results),
    }


def run(args: argparse.Namespace) -> int:
    problems = _check_arguments(args)
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        return 2
    from staleflow.verification.chaos.tester import run_seed

    seeds = [args.seed] if args.seed is not None else list(range(args.first, args.first + args.seeds))
    results = []
    started = time.perf_counter()
    for seed in seeds:
        result = run_seed(seed, args.trace_dir, args.tlc, args.steps, args.healed_steps, args.faults, args.system)
        results.append(result)
        if not args.json and not result.ok:
            print(f"seed {seed}: {result.violation}\n  reproduce: {result.command}", flush=True)
    summary = summarise(results)
    if args.json:
        print(json.dumps(summary | {"results": [vars(r) for r in results] if args.seed is not None else []}, indent=2))
        return 1 if summary["violations"] else 0
    if args.seed is not None:
        result = results[0]
        print(f"scenario: {json.dumps(result.scenario)}")
        print("faults injected:")
        for line in result.fault_log:
            print(f"  {line}")
    kinds = ", ".join(f"{kind} {count}" for kind, count in summary["faults_by_kind"].items() if count)
    print(
        f"{summary['seeds_run']} seeds, {summary['steps']} training steps, {summary['faults_injected']} faults "
        f"({kinds or 'none'}), {summary['events_checked']:,} protocol events checked "
        f"({summary['event_ts_audits']:,} with a full trajectory-server audit), {summary['audits']} step audits, "
        f"{summary['trace_events_validated']:,} trace events validated, {len(summary['violations'])} violations "
        f"({time.perf_counter() - started:.1f} s)"
    )
    faults = "" if args.faults is None else " --faults " + " ".join(args.faults)
    faults += "" if args.system is None else f" --system {args.system}"
    if args.seed is None:
        print(f"Reproduce: staleflow bench chaos --seeds {args.seeds} --first {args.first}{faults}")
    return 1 if summary["violations"] else 0

"""``staleflow train``: a real RL training run (vLLM rollout, torch training) under the staleness protocol.

With no arguments it runs the built-in job (``runtime/settings/configs/default.yaml``): the tiny model learns
the "repeat the letter" task on this machine's CPU in a few minutes, with two vLLM rollout
instances. ``--system sync`` runs the synchronous baseline on the same job. ``key=value``
arguments override the config (``staleflow train protocol.eta=4 train.steps=300``). The job itself is
:class:`staleflow.app.training_job.TrainingJob`.

A run directory (default ``runs/<UTC timestamp>``) receives ``config.yaml``, ``model-v0/`` (the
warmed-up starting model), ``metrics.jsonl``, ``instances.jsonl``, ``trace.jsonl`` (the protocol
trace for ``staleflow verify --trace``; a resumed run appends a segment to it),
``tensorboard/``, ``logs/`` (every notice of the engines and of Ray; the console shows only what may
signal a problem unless ``--verbose``), ``checkpoints/step-<n>/`` and, at the end, ``summary.json`` and ``report.md``
with its plots. ``--resume DIR`` continues a run from its newest checkpoint: trainer weights and
optimiser, the protocol state (every active group keeps its version, so the bound holds across the
resume), the trajectory server with its partial rollouts, and the prompt stream position.
"""

from __future__ import annotations

import argparse
import sys

from staleflow.runtime.settings.policies import training_systems


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. protocol.eta=4")
    parser.add_argument("--config", metavar="YAML", help="job file (default: the built-in job)")
    parser.add_argument("--system", help=f"the system that runs the job (default staleflow): {', '.join(training_systems())}")
    parser.add_argument("--steps", type=int, help="training steps (same as train.steps=N)")
    parser.add_argument("--run-dir", metavar="DIR", help="where the run's files go (default runs/<UTC timestamp>)")
    parser.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its newest checkpoint")
    parser.add_argument(
        "--dry-run", action="store_true",
        help="print the resolved config, the placement plan (actors, CPUs, GPUs), the engine settings, the cost model, the "
        "attention kernel and a memory estimate per trainer GPU; start nothing; exit 2 if the plan exceeds the cluster or a GPU",
    )
    parser.add_argument("--json", action="store_true", help="with --dry-run: print them as JSON")
    parser.add_argument(
        "--verbose", action="store_true",
        help="show the engines' and Ray's notices live (same as metrics.verbose=true; they always go to RUN_DIR/logs/)",
    )


def run(args: argparse.Namespace) -> int:
    from staleflow.app import job_preparation, summary, training_job

    overrides = list(args.overrides)
    if args.system:
        overrides.append(f"system={args.system}")
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.verbose:
        overrides.append("metrics.verbose=true")
    try:
        job = job_preparation.prepare_job(args.config, overrides, run_dir=args.run_dir, resume=args.resume)
        if args.dry_run:
            text, checks = job_preparation.dry_run(job.config, as_json=args.json)
            print(text)
            for warning in checks.warnings:
                print(f"staleflow train --dry-run: warning: {warning}", file=sys.stderr)
            for problem in checks.problems:
                print(f"staleflow train --dry-run: {problem}", file=sys.stderr)
            return 2 if checks.problems else 0
        job_preparation.check_installed(job.config)
    except job_preparation.PREPARATION_ERRORS as err:
        print(f"staleflow train: {err}", file=sys.stderr)
        return 2
    try:
        result = training_job.train(job.config, job.run_dir, job.checkpoint)
    except training_job.START_ERRORS as err:  # raised before anything starts
        print(f"staleflow train: {err}", file=sys.stderr)
        return 2
    print(summary.summary_text(result, job.run_dir))
    return 0 if result["audit_ok"] and result["bound_ok"] else 1

"""The ``staleflow`` command line.

Each subcommand lives in the module that owns its work and exposes two functions:
``add_arguments(parser)`` and ``run(args) -> int`` (the exit code). They are imported lazily, so that
``staleflow verify`` never pays for torch or Ray and ``staleflow --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

#: subcommand -> (module that implements it, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "verify": ("staleflow.verification.cli", "machine-check the staleness protocol (Z3, TLC, conformance, mutants)"),
    "train": ("staleflow.cli.train", "run an RL training job (no arguments: the built-in CPU job)"),
    "simulate": ("staleflow.cli.simulate", "run StaleFlow and the baselines on a simulated cluster"),
    "profile": ("staleflow.cli.profile", "measure a rollout engine and fit the cost model"),
    "report": ("staleflow.cli.report", "rewrite a training run's report, or compare runs"),
    "bench": ("staleflow.bench.cli", "run a benchmark and print its figures"),
    "export": ("staleflow.cli.export", "write a run's trained model as a Hugging Face folder"),
}


def build_parser() -> argparse.ArgumentParser:
    from staleflow import __version__

    parser = argparse.ArgumentParser(
        prog="staleflow",
        description="Disaggregated RL post-training with a strictly bounded staleness protocol.",
    )
    parser.add_argument("--version", action="version", version=f"staleflow {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(_module=module_name)
        importlib.import_module(module_name).add_arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(importlib.import_module(args._module).run(args))


if __name__ == "__main__":
    sys.exit(main())

"""The ``staleflow`` command and ``python -m staleflow``: the composition root.

The command line's subcommands (:mod:`staleflow.cli`) and the benchmarks' ``bench`` subcommand
(:mod:`staleflow.bench.cli`) are siblings above the application layer and neither imports the other;
this module, above both, puts them in one parser and dispatches to the chosen one's ``run``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from staleflow import __version__
from staleflow.bench import cli as bench
from staleflow.cli import SUBCOMMANDS

#: the benchmarks' subcommand and its one-line help
BENCH = (bench, "run a benchmark and print its figures")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="staleflow",
        description="Disaggregated RL post-training with a strictly bounded staleness protocol.",
    )
    parser.add_argument("--version", action="version", version=f"staleflow {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in {**SUBCOMMANDS, "bench": BENCH}.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(_run=module.run)
        module.add_arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(args._run(args))


if __name__ == "__main__":
    sys.exit(main())

"""``staleflow report RUN_DIR...``: one run directory rewrites its ``report.md``; several write
``compare.md`` and ``compare.png`` into ``--out`` (the work: :mod:`staleflow.app.report`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories of staleflow train")
    parser.add_argument("--out", type=Path, default=Path("runs/compare"), help="where a comparison goes (default runs/compare)")


def run(args: argparse.Namespace) -> int:
    from staleflow.app import report

    for run_dir in args.runs:
        if not (run_dir / "summary.json").is_file():
            print(f"staleflow report: {run_dir} has no summary.json (not a finished training run)", file=sys.stderr)
            return 2
    if len(args.runs) == 1:
        print(report.write_report(args.runs[0]))
    else:
        path = report.compare_runs(args.runs, args.out)
        print(path.read_text(encoding="utf-8"))
    return 0

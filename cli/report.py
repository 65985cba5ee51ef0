"""``staleflow report RUN_DIR [--compare OTHER_RUN ...]``: one run directory rewrites its
``report.md``; with ``--compare`` (or several run directories) the runs go on the same axes in
``compare.md`` and ``compare.png`` in ``--out`` (the work: :mod:`staleflow.app.report` and
:mod:`staleflow.app.report_compare`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories of staleflow train")
    parser.add_argument(
        "--compare", nargs="+", type=Path, default=[], metavar="OTHER_RUN",
        help="runs to put on the same axes as RUN_DIR (reward and eval against steps and seconds, tokens/s, staleness)",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/compare"), help="where a comparison goes (default runs/compare)")


def run(args: argparse.Namespace) -> int:
    from staleflow.app import report, report_compare

    runs = [*args.runs, *args.compare]
    for run_dir in runs:
        if not (run_dir / "summary.json").is_file():
            print(f"staleflow report: {run_dir} has no summary.json (not a finished training run)", file=sys.stderr)
            return 2
    if len(runs) == 1:
        print(report.write_report(runs[0]))
    else:
        path = report_compare.compare_runs(runs, args.out)
        print(path.read_text(encoding="utf-8"))
    return 0

"""``staleflow verify``: run every verification layer and print one row per check.

Layers, in order: Z3 proofs on the counter abstraction, TLC model checking of the TLA+ spec, the
spec mirror against TLC's state graph, Hypothesis conformance of the implementation against the
mirror, trace validation of implementation traces, spec mutants, implementation mutants (rows are
printed in this order; by default two worker processes run the layers side by side, slowest
first, so that TLC's Java runs overlap the Python and Z3 layers: ``--jobs``). Each
layer module exposes ``checks(quick) -> list[CheckResult]`` and is imported only when it runs
(z3, hypothesis and Java stay out of ``staleflow --help``). Any failed check (a solver ``unknown``,
a timeout or a crash included) makes the exit code 1; bad arguments exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path

from staleflow.verification.checks import CheckResult

#: (layer title, module); every module has ``checks(quick: bool) -> list[CheckResult]``.
LAYERS: tuple[tuple[str, str], ...] = (
    ("z3 proofs", "staleflow.verification.proofs.z3_proofs"),
    ("z3 all eta", "staleflow.verification.proofs.z3_unbounded"),
    ("z3 model = code", "staleflow.verification.proofs.model_link"),
    ("tlc", "staleflow.verification.proofs.tlc"),
    ("tlc liveness", "staleflow.verification.proofs.liveness"),
    ("graph equivalence", "staleflow.verification.proofs.graph_equivalence"),
    ("conformance", "staleflow.verification.proofs.conformance"),
    ("restore", "staleflow.verification.proofs.snapshots"),
    ("trace validation", "staleflow.verification.proofs.trace_validation"),
    ("spec mutants", "staleflow.verification.proofs.spec_mutants"),
    ("impl mutants", "staleflow.verification.proofs.impl_mutants"),
)

COLUMNS = ("name", "property", "method", "bounds", "explored", "result", "seconds")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--quick", action="store_true", help="the CI subset: smaller bounds, same layers (< 1 min)"
    )
    mode.add_argument(
        "--nightly",
        action="store_true",
        help="the full run with the Hypothesis 'nightly' profile (thousands of random runs)",
    )
    mode.add_argument(
        "--trace",
        type=Path,
        metavar="FILE",
        help="only validate this JSONL protocol trace (staleflow.protocol.trace) against the spec",
    )
    parser.add_argument(
        "--jobs",
        type=_positive_int,
        default=2,
        help="worker processes running the layers side by side (default 2; 1 runs them in order in this process)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help='print {"ok": bool, "checks": [...]} to stdout instead of a table',
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    if args.trace is not None and not args.trace.is_file():
        print(f"staleflow verify: error: --trace {args.trace}: no such file", file=sys.stderr)
        return 2
    if args.nightly:
        os.environ["HYPOTHESIS_PROFILE"] = "nightly"  # read by the conformance layer
    started = time.perf_counter()
    with _stdout_to_stderr() if args.json else contextlib.nullcontext():
        results = (
            _validate_trace(args.trace)
            if args.trace is not None
            else run_layers(quick=args.quick, progress=_progress, jobs=args.jobs)
        )
    ok = bool(results) and all(r.ok for r in results)
    if args.json:
        checks = [{key: r.to_json()[key] for key in (*COLUMNS, "detail")} for r in results]
        print(json.dumps({"ok": ok, "checks": checks}, indent=2))
    else:
        _print_table(results, time.perf_counter() - started)
    return 0 if ok else 1


def run_layers(
    quick: bool, progress: Callable[[str], None] | None = None, jobs: int = 2
) -> list[CheckResult]:
    """Every layer's rows, in :data:`LAYERS` order; a layer that crashes becomes one failed row
    naming the error. With ``jobs > 1`` the layers run in that many forked worker processes, the
    slowest first (:data:`SLOWEST_FIRST`), so TLC's Java runs overlap the Python and Z3 layers."""
    if jobs <= 1:
        return [row for title, module_name in LAYERS for row in _run_layer(title, module_name, quick, progress)]
    import multiprocessing

    order = sorted(LAYERS, key=lambda layer: SLOWEST_FIRST.index(layer[1]) if layer[1] in SLOWEST_FIRST else -1)
    # fork: the workers inherit this process's stdout redirection, environment and modules
    with ProcessPoolExecutor(min(jobs, len(LAYERS)), mp_context=multiprocessing.get_context("fork")) as pool:
        futures = {module_name: pool.submit(_run_layer, title, module_name, quick, progress)
                   for title, module_name in order}
        return [row for title, module_name in LAYERS for row in _collect(title, module_name, futures[module_name])]


def _collect(title: str, module_name: str, future: Future[list[CheckResult]]) -> list[CheckResult]:
    """A worker's rows; a worker process that died (killed, out of memory) is one failed row."""
    try:
        return future.result()
    except Exception as error:  # noqa: BLE001 - a lost layer is a failed check
        return [CheckResult(title, "the layer runs", module_name, "", "", "fail", 0.0,
                            f"its worker process failed: {type(error).__name__}: {error}")]


#: Layer modules by decreasing cost (CPU seconds of the full run): the parallel runner starts them
#: in this order; a module not listed starts first.
SLOWEST_FIRST: tuple[str, ...] = (
    "staleflow.verification.proofs.impl_mutants",
    "staleflow.verification.proofs.conformance",
    "staleflow.verification.proofs.z3_proofs",
    "staleflow.verification.proofs.spec_mutants",
    "staleflow.verification.proofs.tlc",
    "staleflow.verification.proofs.trace_validation",
    "staleflow.verification.proofs.model_link",
    "staleflow.verification.proofs.graph_equivalence",
    "staleflow.verification.proofs.liveness",
    "staleflow.verification.proofs.snapshots",
    "staleflow.verification.proofs.z3_unbounded",
)


def _run_layer(
    title: str, module_name: str, quick: bool, progress: Callable[[str], None] | None
) -> list[CheckResult]:
    """One layer's rows (a crash, or no rows, is one failed row); reports its wall and CPU time."""
    started, cpu = time.perf_counter(), _cpu_seconds()
    if progress is not None:
        progress(f"{title} ...")
    try:
        rows = importlib.import_module(module_name).checks(quick)
        if not rows:
            raise RuntimeError("the layer returned no checks")
    except Exception as error:  # noqa: BLE001 - a crashed layer is a failed check, never a silent skip
        rows = [
            CheckResult(
                name=title,
                property="the layer runs",
                method=module_name,
                bounds="",
                explored="",
                result="fail",
                seconds=round(time.perf_counter() - started, 3),
                detail=f"crashed: {type(error).__name__}: {error}",
            )
        ]
    if progress is not None:
        progress(f"{title} done: {len(rows)} rows, {time.perf_counter() - started:.1f} s wall, "
                 f"{_cpu_seconds() - cpu:.1f} s CPU (with its TLC runs)")
    return rows


def _cpu_seconds() -> float:
    """User + system CPU time of this process and its finished subprocesses (TLC's JVMs)."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _validate_trace(path: Path) -> list[CheckResult]:
    from staleflow.verification.proofs.trace_validation import validate_trace

    return [validate_trace(path)]


def _progress(message: str) -> None:
    print(f"verify: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send everything written to stdout (by Python or a subprocess such as TLC) to stderr, so
    that ``--json`` leaves stdout holding the JSON document only."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _print_table(results: list[CheckResult], seconds: float) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:  # piped or redirected: do not squeeze the table into 80 columns
        console = Console(width=200)
    table = Table(title="staleflow verify", show_lines=False)
    for column in COLUMNS:
        table.add_column(column, overflow="fold", justify="right" if column == "seconds" else "left")
    for r in results:
        colour = "green" if r.ok else "bold red"
        table.add_row(
            r.name, r.property, r.method, r.bounds, r.explored, f"[{colour}]{r.result}[/]", f"{r.seconds:.2f}"
        )
    console.print(table)
    failed = [r for r in results if not r.ok]
    for r in failed:
        console.print(f"[bold red]FAIL[/] {r.name}: {r.detail}", markup=True, highlight=False)
    summary = f"{len(results)} checks, {len(failed)} failed, {seconds:.1f} s"
    console.print(f"[{'bold red' if failed else 'green'}]{summary}[/]")

"""Mutation testing of the protocol with Cosmic Ray's operators, judged by ``verify --quick``.

Cosmic Ray (``cosmic-ray``, a maintained mutation-testing tool) enumerates every mutation its core
operators can make in ``protocol/manager.py`` (binary, comparison and unary operators, numbers,
``not`` insertion, and/or, loops that run zero times, exception types, decorators) and produces
each mutated text with ``cosmic_ray.mutating.mutate_code``. Each mutant is compiled into a fresh
module (never written to disk) and judged by the rows of ``staleflow verify --quick`` that depend on
``manager.py``, run on the mutant class in ``--jobs`` forked worker processes (warm: imports and
module state are reused from one mutant to the next), cheapest first, stopping at the first
failure (a survivor has therefore passed every one of them):

  restore (restore-fuzz, quick count) -> exhaustive (conformance-exhaustive, quick grid) -> model
  (z3-model = manager.py, quick grid) -> conformance (the Hypothesis machine, ci settings without
  shrinking) -> trace validation (mirror replay of the traced workloads) -> tests (the manager's
  unit tests, :data:`MANAGER_TESTS`, for its queries no verify row reads; run on a survivor of the
  rows only, in a forked child as for the other modules, within a wall-time limit).

The other rows of ``verify --quick`` (Z3 proofs, TLC, graph equivalence, spec mutants) read only the
spec, the mirror and the model, never ``manager.py``, so a mutant cannot change their verdict.

Outcomes: ``killed`` (a layer failed), ``timeout`` (a layer used more than ``--timeout-factor`` times
the CPU time it needs on the unmutated file, measured at the start, and at least ``--timeout`` CPU
seconds: a hang, counted as killed), ``incompetent`` (the mutant does not compile or import),
``survived``, and ``equivalent`` for survivors listed in :data:`EQUIVALENT` with the argument why no behaviour changes.
``docs/verification.md`` lists the last full run.

Reproduce: ``staleflow bench mutation [--jobs N] [--operators PREFIX,...] [--limit N] [--shard K/N] [--json]
[--out FILE]``; the report records the command and the per-layer CPU limits.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any

#: Survivors argued equivalent: (operator, occurrence) -> why the mutant cannot behave differently.
#: Keys are checked against the current text (the mutated line must still read as recorded).
_ANNOTATION = ("an annotation only (the module's code, annotations removed, is unchanged): manager.py has "
               "`from __future__ import annotations` and defines no dataclass, ClassVar or get_type_hints use, so "
               "annotations are strings never evaluated at run time (mypy --strict would reject the text)")
_SLACK_NONNEGATIVE = ("slack is never negative (0 for a passed deadline, else min over k of cap(k) - P(k) >= 0 "
                      "under Inv, proved inductive), so `!= 0` and `> 0` agree")
_LAST_VIEW = ("slot may pass eta only when the last view is full; under Inv the views hold cap(eta) >= all "
              "active groups, so every later (bucket, field) has count 0 and views[slot] is never read again")
_HEAD_DROPS = ("plan[0] = min(B, done0): if done0 <= B the right operand done0 - plan[0] is 0 and a | 0 = a ^ 0 = a; "
               "else Inv's cap0 (running0 + done0 <= B + X) makes running0 + done0 - B <= X, so the sum passes "
               "the guard, and a | b, a ^ b <= a + b (a, b >= 0) pass it too")
_PLAN_PREFIX = ("under Inv the prefix guard at k can fail only when the plan reaches past offset k, i.e. takes every "
                "done group of offsets 0..k, where each right operand done_k - plan[k] is 0 and a | 0 = a ^ 0 = a; "
                "elsewhere a | b, a ^ b <= a + b (a, b >= 0), so the mutant passes wherever the original passes")
EQUIVALENT: dict[tuple[str, int], tuple[str, str]] = {
    ("core/ReplaceBinaryOperator_Sub_RShift", 1): (
        "for version in range(max(0, self._version >> self._eta), self._version + 1):",
        ("c >> eta <= max(0, c - eta) for all c, eta >= 0, so the loop only starts earlier, at versions past "
         "their deadline, whose slack is 0: the first admissible version found is the same")),
    ("core/ReplaceComparisonOperator_Gt_NotEq", 0): ("return self.reserve_slack(version) != 0", _SLACK_NONNEGATIVE),
    ("core/ReplaceComparisonOperator_Gt_NotEq", 1): ("if self.reserve_slack(version) != 0:", _SLACK_NONNEGATIVE),
    ("core/ReplaceComparisonOperator_Gt_NotEq", 2): (
        "accepted = self._slack_at(offset) != 0", _SLACK_NONNEGATIVE),
    ("core/ReplaceComparisonOperator_Lt_LtE", 4): (
        "if k >= offset and capacity - prefix <= slack:",
        "on a tie the running minimum is replaced by an equal value: the same minimum"),
    ("core/ReplaceComparisonOperator_Is_Eq", 0): (
        "if bucket.running.pop(group_id, bucket) == bucket:",
        "_Bucket defines no __eq__, so == is identity, as `is`"),
    ("core/ReplaceComparisonOperator_Is_Eq", 1): (
        "(bucket.running if record.status == GroupStatus.RUNNING else bucket.done)[group_id] = None",
        "enum members are singletons: == and `is` agree"),
    ("core/ReplaceComparisonOperator_Is_GtE", 1): (
        "(bucket.running if record.status >= GroupStatus.RUNNING else bucket.done)[group_id] = None",
        "GroupStatus is a str enum with the two values 'done' < 'running': >= RUNNING holds exactly for RUNNING"),
    ("core/ReplaceComparisonOperator_Eq_LtE", 0): (
        "BufferView(self._version + i, self.capacity(0) if i <= 0 else self._batch_size, 0, 0)",
        "i runs over 0..eta: i <= 0 holds exactly when i == 0"),
    ("core/ReplaceComparisonOperator_Eq_LtE", 1): (
        "if view.free <= 0 and slot < self._eta:",
        "a view's free room is never negative (each step places min(count, free)): <= 0 holds exactly when == 0"),
    ("core/ReplaceComparisonOperator_Lt_LtE", 0): ("if view.free == 0 and slot <= self._eta:", _LAST_VIEW),
    ("core/ReplaceComparisonOperator_Lt_NotEq", 0): ("if view.free == 0 and slot != self._eta:", _LAST_VIEW),
    ("core/ReplaceComparisonOperator_Lt_IsNot", 0): ("if view.free == 0 and slot is not self._eta:", _LAST_VIEW),
    ("core/ReplaceBinaryOperator_Add_BitOr", 27): ("if counts[0] | counts[offsets] - plan[0] > self._redundancy:", _HEAD_DROPS),
    ("core/ReplaceBinaryOperator_Add_BitXor", 27): ("if counts[0] ^ counts[offsets] - plan[0] > self._redundancy:", _HEAD_DROPS),
    ("core/ReplaceBinaryOperator_Add_BitOr", 28): ("prefix += counts[k] | counts[offsets + k] - plan[k]", _PLAN_PREFIX),
    ("core/ReplaceBinaryOperator_Add_BitXor", 28): ("prefix += counts[k] ^ counts[offsets + k] - plan[k]", _PLAN_PREFIX),
}


class MutantTimeout(BaseException):
    """Raised by the timer inside a mutant's layer (BaseException: layers catch Exception only)."""


@dataclass
class Outcome:
    operator: str
    occurrence: int
    line: int
    original: str
    mutated: str
    outcome: str
    layer: str
    seconds: float
    why: str = ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--file", type=Path, default=None, help="module to mutate (default protocol/manager.py)")
    parser.add_argument("--operators", default="", help="comma-separated operator name prefixes, e.g. "
                        "core/ReplaceComparisonOperator,core/NumberReplacer (default: all core operators)")
    parser.add_argument("--mutants", default="", help="comma-separated OPERATOR#OCCURRENCE: judge only these "
                        "(e.g. the survivors of an earlier run)")
    parser.add_argument("--skip", type=int, default=0, help="skip the first N mutants (resume a run)")
    parser.add_argument("--limit", type=int, default=0, help="judge only the first N mutants (0: all)")
    parser.add_argument("--shard", default="1/1", help="K/N: judge every N-th mutant starting at the K-th")
    parser.add_argument("--timeout-factor", type=float, default=4.0,
                        help="a layer that uses more than this many times the CPU time it needs on the unmutated "
                        "manager.py (measured at the start of the run) counts as a hang (default 4)")
    parser.add_argument("--timeout", type=float, default=2.0,
                        help="the least CPU seconds any layer is allowed before it counts as a hang (default 2)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes judging mutants in parallel (default 2)")
    parser.add_argument("--json", action="store_true", help="print the outcomes as JSON")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON report to this file")


def mutation_sites(source: str, prefixes: list[str]) -> list[tuple[str, int, int]]:
    """(operator, occurrence, line) of every mutation Cosmic Ray can make, without producing the
    mutated texts (one parse of the source; :func:`mutated_text` makes one text when needed)."""
    from cosmic_ray import plugins
    from cosmic_ray.ast import ast_nodes, get_ast

    nodes = list(ast_nodes(get_ast(source)))
    out = []
    for name in plugins.operator_names():
        if prefixes and not any(name.startswith(p) for p in prefixes):
            continue
        operator_class = plugins.get_operator(name)
        if operator_class.arguments():  # VariableReplacer/VariableInserter need configured arguments
            continue
        operator = operator_class()
        positions = [start for node in nodes for start, _ in operator.mutation_positions(node)]
        out += [(name, occurrence, line) for occurrence, (line, _) in enumerate(positions)]
    return out


def mutated_text(source: str, operator_name: str, occurrence: int) -> str | None:
    """The source with that one mutation applied (None if it changes nothing)."""
    from cosmic_ray import plugins
    from cosmic_ray.mutating import mutate_code

    mutated = mutate_code(source, plugins.get_operator(operator_name)(), occurrence)
    return mutated if mutated is not None and mutated != source else None


def enumerate_mutants(source: str, prefixes: list[str]) -> list[tuple[str, int, int, str]]:
    """(operator, occurrence, line, mutated source) for every mutation Cosmic Ray can make."""
    out = []
    for name, occurrence, line in mutation_sites(source, prefixes):
        mutated = mutated_text(source, name, occurrence)
        if mutated is not None:
            out.append((name, occurrence, line, mutated))
    return out


def _changed_line(source: str, mutated: str, line: int) -> tuple[str, str]:
    before, after = source.splitlines(), mutated.splitlines()
    for a, b in zip(before, after):
        if a != b:
            return a.strip(), b.strip()
    return before[line - 1].strip() if 0 < line <= len(before) else "", ""


def judge_layers() -> dict[str, Any]:
    """The manager-dependent rows of ``verify --quick``, at that run's bounds, cheapest first."""
    from staleflow.verification.proofs import impl_mutants
    from staleflow.verification.proofs.conformance_grid import EXHAUSTIVE_GRID
    from staleflow.verification.proofs.model_link import GRID_QUICK
    from staleflow.verification.proofs.snapshots import QUICK_COUNT

    return impl_mutants.make_layers(EXHAUSTIVE_GRID, GRID_QUICK, QUICK_COUNT)


def judge(source: str, name: str, timeout: float | Mapping[str, float]) -> tuple[str, str, str]:
    """(outcome, layer, why) for one mutated text of manager.py; ``timeout`` is the CPU-second limit
    of every layer, or of each layer by name (:func:`calibrate`)."""
    import builtins

    from cosmic_ray.exceptions import CosmicRayTestingException
    from staleflow.verification.proofs import impl_mutants

    # ExceptionReplacer names this class in an except clause: make it resolvable, as a type that
    # is never raised (otherwise the mutant fails with NameError, which is not the mutation meant)
    builtins.CosmicRayTestingException = CosmicRayTestingException  # type: ignore[attr-defined]
    try:
        cls = impl_mutants.compile_manager(source, name)
    except Exception as error:  # noqa: BLE001 - a mutant that does not compile is incompetent
        return "incompetent", "compile", f"{type(error).__name__}: {error}"[:200]

    def alarm(signum: int, frame: FrameType | None) -> None:
        raise MutantTimeout()

    # CPU time of this process, not wall time: a loaded machine must not turn a slow layer into a "hang"
    previous = signal.signal(signal.SIGVTALRM, alarm)
    layer = ""
    try:
        for layer, check in judge_layers().items():
            # per layer; then every second, so that a re-run (Hypothesis replaying) cannot hang
            limit = timeout[layer] if isinstance(timeout, Mapping) else timeout
            signal.setitimer(signal.ITIMER_VIRTUAL, limit, 1.0)
            why = check(cls)
            signal.setitimer(signal.ITIMER_VIRTUAL, 0)
            if why is not None:
                return "killed", layer, why[:200]
    except MutantTimeout:
        limit = timeout[layer] if isinstance(timeout, Mapping) else timeout
        return "timeout", layer, f"{layer} ran past {limit:.1f} s of CPU time"
    finally:
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        signal.signal(signal.SIGVTALRM, previous)
    if not isinstance(timeout, Mapping) or "tests" not in timeout:
        return "survived", "", ""
    return manager_tests(source, timeout["tests"])


#: The manager's unit tests: the last layer, for what the verify rows do not read (its queries: stats,
#: start capacity, blocking groups, interrupted groups).
MANAGER_TESTS = ("tests/test_protocol.py", "tests/test_protocol_contract.py", "tests/test_locked_manager.py")


def manager_tests(source: str, limit_s: float) -> tuple[str, str, str]:
    """The last layer: the manager's unit tests against the mutated text (in a forked child,
    :mod:`staleflow.bench.mutation_suite`), within ``limit_s`` wall seconds."""
    from staleflow.bench import mutation_suite

    root = _repository_root()
    outcome, layer, why = mutation_suite.judge_with_tests(source, "manager", module="staleflow.protocol.manager",
                                                         path=str(root / "protocol" / "manager.py"), tests=MANAGER_TESTS,
                                                         root=root, limit_s=limit_s)
    return (outcome, "tests", why) if outcome in ("killed", "timeout") else (outcome, layer, why)


def calibrate(source: str, factor: float, floor: float) -> dict[str, float]:
    """Each layer's CPU-second limit: ``factor`` times the CPU time it takes on the unmutated
    source (compiled as the mutants are), at least ``floor``. The unmutated source must pass every
    layer, else no verdict would mean anything (RuntimeError)."""
    from staleflow.verification.proofs import impl_mutants

    cls = impl_mutants.compile_manager(source, "baseline")
    limits = {}
    for layer, check in judge_layers().items():
        started = time.process_time()
        why = check(cls)
        if why is not None:
            raise RuntimeError(f"the unmutated manager.py fails the {layer} layer: {why}")
        limits[layer] = round(max(floor, factor * (time.process_time() - started)), 1)
    from staleflow.bench import mutation_suite

    root = _repository_root()
    limits["tests"] = mutation_suite.calibrate("staleflow.protocol.manager", source, str(root / "protocol" / "manager.py"),
                                               MANAGER_TESTS, root, factor, max(floor, 30.0))
    return limits


def annotation_only(source: str, mutated: str) -> bool:
    """True if the two texts differ only in annotations (parameters, returns, annotated assignments):
    equivalent where annotations are never evaluated (``from __future__ import annotations``)."""
    import ast

    def code(text: str) -> str:
        tree = ast.parse(text)
        if not any(isinstance(node, ast.ImportFrom) and node.module == "__future__"
                   and any(alias.name == "annotations" for alias in node.names) for node in tree.body):
            return text  # annotations are evaluated: compare the whole text
        for node in ast.walk(tree):
            if isinstance(node, ast.arg):
                node.annotation = None
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                node.returns = None
            elif isinstance(node, ast.AnnAssign):
                node.annotation = ast.Constant(None)
        return ast.dump(tree)

    return code(source) == code(mutated)


#: How one mutated text is judged: ``judge(mutated source, mutant name) -> (outcome, layer, why)``.
Judge = Callable[[str, str], tuple[str, str, str]]


def judge_site(source: str, operator: str, occurrence: int, line: int, timeout: float | Mapping[str, float] | None = None,
               judge_text: Judge | None = None, equivalent: Mapping[tuple[str, int], tuple[str, str]] = EQUIVALENT) -> Outcome | None:
    """Judge one mutation site (None if the mutation changes nothing) by ``judge_text`` (default: the
    manager's layers within ``timeout``). An annotation-only mutant is ``equivalent`` without running
    anything; a survivor listed in ``equivalent`` (the manager's: :data:`EQUIVALENT`) too."""
    t0 = time.perf_counter()
    mutated = mutated_text(source, operator, occurrence)
    if mutated is None:
        return None
    original, changed = _changed_line(source, mutated, line)
    if annotation_only(source, mutated):
        return Outcome(operator, occurrence, line, original, changed, "equivalent", "", 0.0, _ANNOTATION)
    name = f"{operator.split('/')[-1]}-{occurrence}"
    outcome, layer, why = judge(mutated, name, timeout if timeout is not None else 2.0) if judge_text is None else judge_text(mutated, name)
    if outcome == "survived" and (operator, occurrence) in equivalent:
        recorded, argument = equivalent[(operator, occurrence)]
        if recorded == changed:
            outcome, why = "equivalent", argument
    return Outcome(operator, occurrence, line, original, changed, outcome, layer, round(time.perf_counter() - t0, 2), why)


def _judge_all(source: str, sites: list[tuple[str, int, int]], judge_text: Judge, jobs: int,
               equivalent: Mapping[tuple[str, int], tuple[str, str]]) -> list[Outcome]:
    """Judge every site, in ``jobs`` worker processes (each stays warm: its imports and the layers'
    module state are reused from one mutant to the next); outcomes in the order of ``sites``."""
    found: dict[int, Outcome] = {}

    def report(index: int, outcome: Outcome | None) -> None:
        if outcome is None:
            return
        found[index] = outcome
        print(f"[{len(found)}] {outcome.outcome:11} {outcome.operator} #{outcome.occurrence} line {outcome.line}: "
              f"{outcome.mutated[:90]}", file=sys.stderr, flush=True)

    if jobs <= 1:
        for index, site in enumerate(sites):
            report(index, judge_site(source, *site, judge_text=judge_text, equivalent=equivalent))
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        # fork: the workers start with this process's imports (no z3, Java or Hypothesis state yet)
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            futures = {pool.submit(judge_site, source, *site, judge_text=judge_text, equivalent=equivalent): index
                       for index, site in enumerate(sites)}
            for future in as_completed(futures):
                report(futures[future], future.result())
    return [found[index] for index in sorted(found)]


#: The fields of each mutant in the report's ``outcomes`` list (survivors, equivalents and timeouts are
#: also listed in full, with the mutated line and why).
COMPACT_FIELDS = ("operator", "occurrence", "line", "outcome", "layer", "seconds")


def compact(outcome: dict[str, Any]) -> list[Any]:
    """One mutant's outcome as a row of :data:`COMPACT_FIELDS`."""
    return [outcome[field] for field in COMPACT_FIELDS]


def _cpu_seconds() -> float:
    """User + system CPU time of this process and its finished workers."""
    import resource

    own, workers = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + workers.ru_utime + workers.ru_stime


def _repository_root() -> Path:
    """The repository's root: the ``staleflow`` package's folder."""
    import staleflow

    return Path(staleflow.__file__).resolve().parent


def _recorded_argument(token: str) -> str:
    """A command-line argument as the results file records it: an absolute path (alone or after
    ``--option=``) becomes repository-relative, or its bare name outside the repository."""
    flag, equals, value = token.partition("=") if token.startswith("--") and "=" in token else ("", "", token)
    if not Path(value).is_absolute():
        return token
    resolved, root = Path(value).resolve(), _repository_root()
    recorded = resolved.relative_to(root) if resolved.is_relative_to(root) else Path(resolved.name)
    return f"{flag}{equals}{recorded.as_posix()}"


Equivalents = Mapping[tuple[str, int], tuple[str, str]]


def _judging(relative: str, source: str, args: argparse.Namespace) -> tuple[Judge, dict[str, float], str, Equivalents]:
    """How ``relative``'s mutants are judged: the judge, its limits, what judges (for the report) and
    the survivors argued equivalent. ``protocol/manager.py``: the rows of ``verify --quick`` that
    read it, each within its CPU limit; the other protocol modules: their test files
    (:mod:`staleflow.bench.mutation_suite`) within a wall-time limit."""
    import functools

    if relative == "protocol/manager.py":
        limits = calibrate(source, args.timeout_factor, args.timeout)
        return functools.partial(judge, timeout=limits), limits, "the manager rows of verify --quick", EQUIVALENT
    from staleflow.bench import mutation_suite

    if relative not in mutation_suite.SUITES:
        raise SystemExit(f"error: --file {relative}: no tests are set to judge it (modules: protocol/manager.py, "
                         f"{', '.join(mutation_suite.SUITES)})")
    import hypothesis  # noqa: F401 - imported once here: every forked judge starts warm
    import pytest  # noqa: F401

    tests, root = mutation_suite.SUITES[relative], _repository_root()
    suite = {"module": mutation_suite.module_name(relative), "path": str(root / relative), "tests": tests, "root": root}
    limit = mutation_suite.calibrate(**suite, source=source, factor=args.timeout_factor, floor=args.timeout)
    judged = functools.partial(mutation_suite.judge_with_tests, **suite, limit_s=limit)
    return judged, {"tests": limit}, ", ".join(tests), mutation_suite.EQUIVALENT.get(relative, {})


def run(args: argparse.Namespace) -> int:
    from staleflow.protocol import manager as manager_module

    path = (args.file or Path(manager_module.__file__)).resolve()
    if not path.is_relative_to(_repository_root()) or not path.is_file():
        print(f"error: --file {args.file}: not a module of this repository ({_repository_root()})", file=sys.stderr)
        return 2
    source = path.read_text(encoding="utf-8")
    prefixes = [p for p in args.operators.split(",") if p]
    k, n = (int(v) for v in args.shard.split("/"))
    started = time.perf_counter()
    chosen = {(m.rsplit("#", 1)[0], int(m.rsplit("#", 1)[1])) for m in args.mutants.split(",") if m}
    if chosen:
        prefixes = sorted({operator for operator, _ in chosen})
    sites = [m for m in mutation_sites(source, prefixes) if not chosen or (m[0], m[1]) in chosen][k - 1 :: n]
    sites = sites[args.skip :]
    if args.limit:
        sites = sites[: args.limit]
    relative = path.relative_to(_repository_root()).as_posix()
    judge_text, limits, judged_by, equivalent = _judging(relative, source, args)
    print(f"bench mutation: {len(sites)} mutation sites in {path.name}, {args.jobs} worker(s), judged by {judged_by}; "
          f"limits (the unmutated file passes): {limits}", file=sys.stderr, flush=True)
    outcomes = _judge_all(source, sites, judge_text, args.jobs, equivalent)
    counts = Counter(o.outcome for o in outcomes)
    report: dict[str, Any] = {
        "file": relative,
        "judged_by": judged_by,
        "mutants": len(outcomes),
        "counts": dict(counts),
        "killed_by_layer": dict(Counter(o.layer for o in outcomes if o.outcome == "killed")),
        "seconds": round(time.perf_counter() - started, 1),
        "cpu_seconds": round(_cpu_seconds(), 1),
        "layer_cpu_limits": limits,
        "survivors": [asdict(o) for o in outcomes if o.outcome == "survived"],
        "equivalent": [asdict(o) for o in outcomes if o.outcome == "equivalent"],
        "timeouts": [asdict(o) for o in outcomes if o.outcome == "timeout"],
        "outcome_fields": list(COMPACT_FIELDS),
        "outcomes": [compact(asdict(o)) for o in outcomes],
        "command": " ".join(["staleflow bench mutation", *map(_recorded_argument, sys.argv[3:])]) if sys.argv[1:3] == ["bench", "mutation"]
        else "staleflow bench mutation",
    }
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{len(outcomes)} mutants: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
              + f" in {report['seconds']} s ({report['cpu_seconds']} s CPU); killed by layer: {report['killed_by_layer']}")
        for o in outcomes:
            if o.outcome == "survived":
                print(f"SURVIVED {o.operator} #{o.occurrence} line {o.line}: {o.original}  ->  {o.mutated}")
    return 1 if counts["survived"] else 0

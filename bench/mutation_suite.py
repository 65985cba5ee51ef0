"""Mutation testing of the protocol modules other than the manager, judged by their own tests.

``manager.py`` is judged by the rows of ``verify --quick`` that read it (:mod:`staleflow.bench.mutation`);
the wrapper, the trace writer, the trace checker, the waiting helpers and the hooks are exercised by
test files instead (:data:`SUITES`). Each mutant runs those files in a child process forked from a
warm worker (pytest and Hypothesis already imported): the child drops every ``staleflow`` module and test module it
inherited, puts a finder first on ``sys.meta_path`` that serves the mutated text under the module's
real name (so every importer, the tests and the other protocol modules alike, gets the mutant), and
runs pytest in-process, stopping at the first failure. Outcomes: ``killed`` (a test failed, named in
``layer``), ``timeout`` (the files ran longer than the limit: a hang, counted as killed),
``incompetent`` (pytest could not collect, e.g. the mutant does not import), ``survived``.
The limit is ``--timeout-factor`` times the wall time the unmutated module's run takes, measured
first, and at least ``--timeout`` seconds.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

#: The test files that judge each module's mutants (repository paths): the files that exercise it.
SUITES: dict[str, tuple[str, ...]] = {
    "protocol/locked.py": ("tests/test_locked_manager.py", "tests/test_protocol_waiting.py"),
    "protocol/waiting.py": ("tests/test_protocol_waiting.py",),
    "protocol/hooks.py": ("tests/test_protocol.py", "tests/test_trace_format.py"),
    "protocol/trace.py": ("tests/test_trace_io.py", "tests/test_trace_format.py", "tests/test_trace_cost.py", "tests/test_protocol.py",
                          "tests/test_protocol_contract.py", "tests/test_trace_check.py"),
    "protocol/check.py": ("tests/test_trace_check.py", "tests/test_trace_format.py", "tests/test_safety_alarms.py",
                          "tests/test_protocol_contract.py"),
}

#: Survivors argued equivalent, per module: (operator, occurrence) -> (the mutated line, why no
#: behaviour changes), as :data:`staleflow.bench.mutation.EQUIVALENT` for the manager.
_ONE_HOOK = ("only taken when exactly one hook is registered (len(hooks) == 1, or the recorder path that "
             "only a single hook gets): index -1 is index 0")
_BLOCK = ("the bytes read per step while looking for the last newline: any positive size finds the same "
          "newline (only the number of reads changes)")
_MODE = "mode is 'a' or 'w' (checked first) and 'a' < 'w': <= 'a' holds exactly for 'a'"
EQUIVALENT: dict[str, dict[tuple[str, int], tuple[str, str]]] = {
    "protocol/waiting.py": {
        ("core/ReplaceComparisonOperator_Gt_NotEq", 0): (
            "return manager.reserve_slack(version) != 0",
            "reserve_slack is never negative (0 for a passed deadline, else a minimum of free capacities under "
            "the invariant), so != 0 and > 0 agree (the manager's own mutants of this comparison are argued so)"),
        ("core/RemoveDecorator", 0): ("def eta(self) -> int: ...", "Waitable is a typing Protocol for annotations only "
                                      "(not runtime_checkable, never instantiated or isinstance-checked): no run-time effect"),
        ("core/RemoveDecorator", 1): ("def version(self) -> int: ...", "as for eta: a member of an annotation-only Protocol"),
    },
    "protocol/hooks.py": {
        ("core/ReplaceComparisonOperator_Is_Eq", 0): (
            "after = before if accepted == False else tuple(self._counts)",
            "accepted is True, False or None (a reserve's verdict, None for the other operations): == False and "
            "is False hold for exactly the same value"),
        ("core/ReplaceComparisonOperator_IsNot_NotEq", 0): (
            "if state != self._last_counted:",
            "a one-entry cache: with != a state equal in value to the cached one reuses the cached CounterState, "
            "which is immutable and equal to the one that would be built"),
        ("core/NumberReplacer", 2): (
            "self._last_counts = CounterState( 1, (), ())  # the CounterState of ``_last_counted`` (a cache)",
            "the cache's first entry is for the empty state (), which no event has: _set_hooks sets the last state "
            "to the counters (never empty: they end with the version) before any event, so it is never returned"),
        ("core/NumberReplacer", 3): (
            "self._last_counts = CounterState( -1, (), ())  # the CounterState of ``_last_counted`` (a cache)",
            "as for NumberReplacer #2: the entry for the empty state is never returned"),
        ("core/NumberReplacer", 5): (
            'record = getattr(type(hooks[ -1]), "record_event", None) if len(hooks) == 1 else None', _ONE_HOOK),
        ("core/NumberReplacer", 9): (
            "self._record = cast(EventRecorder, hooks[ -1]).record_event if callable(record) else None", _ONE_HOOK),
        ("core/NumberReplacer", 13): ("[(self._hooks[ -1], error)]) from error", _ONE_HOOK),
    },
    "protocol/check.py": {
        ("core/ReplaceComparisonOperator_Eq_LtE", 4): (
            'if __name__ <= "__main__":',
            "the module's name is '__main__' when run as a command, else staleflow.protocol.check or "
            "staleflow_protocol.check, both greater than '__main__' ('s' > '_'): <= holds exactly when == does"),
        ("core/ReplaceComparisonOperator_Eq_Is", 3): (
            'if __name__ is "__main__":',
            "runpy sets __name__ to its run_name '__main__', the interned literal (an identifier-like constant): "
            "the same object, so `is` holds exactly when == does"),
        ("core/ReplaceComparisonOperator_Eq_GtE", 1): (
            "(running if status >= mirror.RUNNING else done)[offset] += 1",
            "a status is 'running' or 'done' (start_state refuses any other, the mirror makes no other) and "
            "'done' < 'running': >= holds exactly for 'running'"),
        ("core/ReplaceComparisonOperator_Eq_GtE", 2): (
            'if e.op >= "reserve":',
            "an event's op is reserve, occupy, abort or consume (the reader refuses any other, the manager emits "
            "no other), and 'reserve' is the greatest of the four: >= holds exactly for 'reserve'"),
        ("core/ReplaceComparisonOperator_Eq_GtE", 3): (
            't = (mirror.occupy if e.op >= "occupy" else mirror.abort)(p, s, e.group_id)',
            "taken for occupy and abort only, and 'abort' < 'occupy': >= holds exactly for 'occupy'"),
        ("core/ReplaceComparisonOperator_NotEq_Lt", 3): (
            "if any(g is None for g in chosen) or len(set(b.group_ids)) < len(b.group_ids):",
            "a set of a tuple's items is never longer than the tuple: < holds exactly when != does"),
        ("core/ReplaceComparisonOperator_NotEq_Gt", 1): (
            "if len(state.groups) > len(state.ids()) or any(v > version for _, v, _ in groups):",
            "ids() is the set of the groups' first fields, never larger than the set of groups: > holds exactly "
            "when != does"),
        ("core/ReplaceComparisonOperator_NotEq_Gt", 6): (
            "if step.dropped != frozenset(b.dropped) or len(b.dropped) > len(step.dropped):",
            "the length test is reached only when frozenset(b.dropped) == step.dropped, so b.dropped has at least "
            "as many items as the set: > holds exactly when != does"),
    },
    "protocol/trace.py": {
        **{(f"core/ReplaceBinaryOperator_LShift_{name}", 0): (f"block = min(start, 1 {sign} 16)", _BLOCK)
           for name, sign in (("Add", "+"), ("Mul", "*"), ("Mod", "%"), ("Pow", "**"), ("BitOr", "|"), ("BitXor", "^"))},
        **{("core/NumberReplacer", k): (f"block = min(start, {text})", _BLOCK)
           for k, text in ((22, "2 << 16"), (24, "1 << 17"), (25, "1 << 15"))},
        ("core/ReplaceComparisonOperator_Gt_NotEq", 0): (
            'while start != 0 and b"\\n" not in tail:  # the last line, read backwards in blocks',
            "start begins at the file's size and each step takes at most what is left (min(start, block)): it is "
            "never negative, so != 0 and > 0 agree"),
        ("core/ReplaceComparisonOperator_Eq_LtE", 0): (
            "if len(data) % 2 <= 0:", "a remainder of 2 is 0 or 1: <= 0 holds exactly when == 0 does"),
        ("core/ReplaceComparisonOperator_Eq_LtE", 4): ('if mode <= "a":', _MODE),
        ("core/ReplaceComparisonOperator_Eq_GtE", 4): (
            'if mode >= "a":', "mode is 'a' or 'w' (checked first): for 'w' the torn line is dropped from a file "
            "that open(path, 'w') truncates at once, so only the mode 'a' changes anything"),
        ("core/ReplaceComparisonOperator_Eq_Is", 3): (
            'if mode is "a":', "CPython keeps one object per one-character Latin-1 string: any 'a' is the literal"),
        ("core/ReplaceComparisonOperator_Eq_GtE", 2): (
            'if op >= "reserve" and not isinstance(accepted, bool):',
            "op is one of abort, consume, occupy, reserve (refused above otherwise), and 'reserve' is the greatest: "
            ">= holds exactly for 'reserve'"),
        ("core/ReplaceComparisonOperator_Eq_Is", 5): (
            "after_state = before_state if after is before else after.flat()",
            "an equal after-state given as another object is recorded as a new, equal tuple; the writer compares "
            "its own last tuple by identity only to omit a before-state equal to it, and the next event's "
            "before-state is mapped to that same new tuple: the lines written are the same"),
        ("core/ReplaceComparisonOperator_Is_Eq", 0): (
            "if accepted == False and not self.refusals:",
            "accepted is True, False or None: == False and is False hold for exactly the same value"),
        ("core/ReplaceComparisonOperator_Is_Eq", 2): (
            "rows += (seq, op, group_id if type(group_id) == int else json_group_id(group_id), version,",
            "a type object equals only itself: == and is agree"),
        ("core/ReplaceBreakWithContinue", 0): (
            "continue  # torn: only the last line of a file can lack its newline",
            "a line without its newline is the file's last: continue ends the loop as break does"),
        **{("core/NumberReplacer", k): (f"first_line = {value}", "read only after a header line, which sets it: "
                                        "a file without one is an error before it is read")
           for k, value in ((8, "1"), (9, "-1"))},
        **{("core/NumberReplacer", k): (f"WRITE_EVERY = {value}", "a tuning constant: the flush points are specified "
                                        "relative to it, and the tests read writer.WRITE_EVERY")
           for k, value in ((36, "257"), (37, "255"))},
        **{("core/NumberReplacer", k): (
            f"self._rows_limit = {value}  # fields in _rows that call for a flush (_set_rows_limit)",
            "read only for an event chained to the last line written; the first line is never one (no line is "
            "written before it), and writing it sets the limit")
           for k, value in ((52, "1"), (53, "-1"))},
        **{("core/RemoveDecorator", k): (f"def {name}(self) -> int: ...", "Traceable is a typing Protocol for "
                                         "annotations only (not runtime_checkable, never instantiated): no run-time effect")
           for k, name in ((0, "eta"), (1, "batch_size"), (2, "redundancy"))},
    },
    "protocol/locked.py": {
        ("core/AddNot", 0): (
            "if not TYPE_CHECKING:",
            "the block imports pathlib.Path and the trace writer for annotations only; importing them at run time "
            "creates no cycle (trace imports nothing of locked) and changes no behaviour"),
    },
}

#: pytest's exit codes: 1 tests failed, 2 interrupted, 3 internal error, 4 usage error, 5 no tests collected
_KILLED, _COLLECTION = 1, (2, 3, 4, 5)


class _MutantLoader(importlib.abc.Loader):
    """Executes the mutated text as the module (its real file name, for tracebacks and ``__file__``)."""

    def __init__(self, source: str, path: str) -> None:
        self.source, self.path = source, path

    def create_module(self, spec: Any) -> None:
        return None

    def get_code(self, fullname: str) -> Any:
        """The mutated module's code (what ``runpy`` runs for ``python -m``, as tests may do)."""
        return compile(self.source, self.path, "exec")

    def exec_module(self, module: ModuleType) -> None:
        module.__file__ = self.path
        exec(self.get_code(module.__name__), module.__dict__)  # noqa: S102 - our own file, mutated


class _MutantFinder(importlib.abc.MetaPathFinder):
    """Serves ``name`` from the mutated text; every other module imports as usual."""

    def __init__(self, name: str, source: str, path: str) -> None:
        self.name, self.loader, self.path = name, _MutantLoader(source, path), path

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        return importlib.util.spec_from_loader(fullname, self.loader, origin=self.path)


def module_name(relative: str) -> str:
    """``protocol/locked.py`` -> ``staleflow.protocol.locked``."""
    return "staleflow." + relative.removesuffix(".py").replace("/", ".")


def _child(module: str, source: str, path: str, tests: Sequence[str], root: Path, result: Path) -> None:
    """In the forked child: the mutant in place of ``module``, then the tests; never returns."""
    code, failed = 3, ""
    try:
        # every module of this repository the parent had (the tests' own too, when the parent is a test
        # run that imported them already), so that they import again, against the mutant
        inherited = [name for name, mod in list(sys.modules.items()) if not name.startswith("staleflow.bench")
                     and (name.startswith("staleflow.") or str(getattr(mod, "__file__", "") or "").startswith(str(root / "tests")))]
        for name in inherited:
            del sys.modules[name]
        sys.meta_path.insert(0, _MutantFinder(module, source, path))
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        import pytest

        failures: list[str] = []

        class FirstFailure:
            def pytest_runtest_logreport(self, report: Any) -> None:
                if report.failed and not failures:
                    failures.append(report.nodeid)

        args = [*(str(root / t) for t in tests), "-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                "-m", "not nightly", "-n", "0", "--rootdir", str(root), "-c", str(root / "pyproject.toml")]
        code = int(pytest.main(args, plugins=[FirstFailure()]))
        failed = failures[0] if failures else ""
    finally:
        result.write_text(json.dumps({"code": code, "failed": failed}))
        os._exit(0)


def run_tests(module: str, source: str, path: str, tests: Sequence[str], root: Path, limit_s: float) -> tuple[int, str, float]:
    """Run ``tests`` against ``source`` as ``module`` in a forked child: (pytest's exit code, the
    first failed test, seconds); exit code -1 when the child passed ``limit_s`` and was killed."""
    with tempfile.TemporaryDirectory(prefix="staleflow-mutant-") as scratch:
        result = Path(scratch) / "result.json"
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:
            os.chdir(scratch)  # Hypothesis' example database and any file a test writes stay here
            _child(module, source, path, tests, root, result)
        while True:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() - started > limit_s:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return -1, "", time.monotonic() - started
            time.sleep(0.02)
        seconds = time.monotonic() - started
        if not result.is_file():
            return 3, "the child wrote no result", seconds
        report = json.loads(result.read_text())
        return int(report["code"]), str(report["failed"]), seconds


def judge_with_tests(source: str, name: str, *, module: str, path: str, tests: Sequence[str], root: Path,
                     limit_s: float) -> tuple[str, str, str]:
    """(outcome, layer, why) of one mutated text, judged by ``tests`` (module docstring)."""
    code, failed, _ = run_tests(module, source, path, tests, root, limit_s)
    if code == -1:
        return "timeout", "tests", f"the tests ran past {limit_s:.1f} s"
    if code == 0:
        return "survived", "", ""
    if code == _KILLED:
        return "killed", failed.split("::")[0].removeprefix("tests/") or "tests", failed[:200]
    return "incompetent", "collection", f"pytest exit code {code} {failed}"[:200]


def calibrate(module: str, source: str, path: str, tests: Sequence[str], root: Path, factor: float, floor: float) -> float:
    """The wall-second limit of one mutant's run: ``factor`` times the unmutated module's, at least
    ``floor``; the unmutated module must pass its tests (RuntimeError otherwise)."""
    code, failed, seconds = run_tests(module, source, path, tests, root, limit_s=3600.0)
    if code != 0:
        raise RuntimeError(f"the unmutated {path} fails its tests (pytest exit code {code}: {failed})")
    return round(max(floor, factor * seconds), 1)

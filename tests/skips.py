"""Which skips the suite accepts: every other skip fails the run (:class:`SkipPolicy`, a plugin that
``tests/conftest.py`` registers, checks at the end of the session, so ``pytest`` alone and ``.ci/run``
both go red, and lists each unaccepted skip with its reason).

A skip hides a test, and a hidden test cannot fail: a package installed but broken (an ABI or a
torch mismatch) used to turn every test that imports it into a skip. So:

* an optional package is asked for through :func:`require` (a module-level or in-test import) or
  :func:`needs` (a marker); only its absence (``ModuleNotFoundError`` naming that very package) skips,
  any other import error is raised, and the skip is accepted only when the run says the package's
  extra is left out: ``STALEFLOW_EXTRAS`` names the extras installed, as for ``scripts/setup.sh``
  (unset: every extra of the default install, so none of them may be missing);
* a skip for anything else must match one entry of :data:`ALLOWED`, which says why the machine may
  lack it. Core dependencies (ray, torch, numpy, transformers...) are imported plainly: never skipped.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
from dataclasses import dataclass
from types import ModuleType

import pytest

#: The extras ``scripts/setup.sh`` installs when ``STALEFLOW_EXTRAS`` is not set.
DEFAULT_EXTRAS = ("dev", "data", "rewards", "tracking", "megatron", "cpu-infer")
#: The reason of a skip for a package left out; :func:`unlisted` reads the extra back from it.
MISSING = "{package} is not installed (the {extra} extra)"
_MISSING = re.compile(r"(?P<package>\S+) is not installed \(the (?P<extra>[\w-]+) extra\)")


@dataclass(frozen=True)
class AllowedSkip:
    """Skips whose reason matches ``pattern`` (a regular expression, searched) are accepted: ``why``."""

    pattern: str
    why: str


#: Every skip the suite accepts besides a left-out extra's, and why the machine may lack what it needs.
ALLOWED = (
    AllowedSkip(r"^this machine has no address but the loopback$",
                "the weight sender's cross-address test needs a network interface besides lo (a sandbox may have none)"),
    AllowedSkip(r"^checks the CPU refusal$|^a driver without CUDA$",
                "megatron's CPU-refusal tests cannot run where CUDA is available: a GPU machine"),
    AllowedSkip(r"^this Python's venv comes with setuptools \S+, at the floor already$",
                "the light package's setuptools-floor test needs a venv whose bundled setuptools is above the floor"),
    AllowedSkip(r"^the `wheel` package \(\S+\) is installed here; scripts/setup.sh's venv has none$",
                "the offline build without `wheel` cannot be checked in a venv that has it (not one scripts/setup.sh made)"),
)


def installed_extras() -> set[str]:
    """The extras this run says are installed (``STALEFLOW_EXTRAS``, comma-separated; default: all)."""
    names = os.environ.get("STALEFLOW_EXTRAS")
    return set(DEFAULT_EXTRAS) if names is None else {name.strip() for name in names.split(",") if name.strip()}


def _absent(error: ModuleNotFoundError, module: str) -> bool:
    """Whether ``error`` says ``module`` itself (or a package above it) is not installed."""
    return error.name is not None and (module == error.name or module.startswith(error.name + "."))


def require(module: str, extra: str) -> ModuleType:
    """``module`` imported; a skip if it is not installed (``extra`` provides it); any other failure
    to import it (a broken install, a missing dependency of it) is raised as it is."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if not _absent(error, module):
            raise
        pytest.skip(MISSING.format(package=module, extra=extra), allow_module_level=True)


def needs(module: str, extra: str) -> pytest.MarkDecorator:
    """A marker that skips the test where ``module`` is not installed at all (an installed but broken
    one is found, and the test fails on importing it)."""
    top = module.split(".")[0]
    return pytest.mark.skipif(importlib.util.find_spec(top) is None, reason=MISSING.format(package=module, extra=extra))


def unlisted(reason: str, extras: set[str]) -> bool:
    """Whether a skip for ``reason`` is not accepted (``extras``: those installed)."""
    missing = _MISSING.fullmatch(reason)
    if missing is not None:
        return missing["extra"] in extras
    return not any(re.search(allowed.pattern, reason) for allowed in ALLOWED)


def skip_reason(longrepr: object) -> str:
    """The reason of a skipped report (its ``longrepr`` is ``(path, line, "Skipped: reason")``)."""
    message = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return str(message).removeprefix("Skipped: ")


class SkipPolicy:
    """The pytest plugin: notes every skip :func:`unlisted` refuses and fails the session over them.
    Registered in the controller and in each xdist worker; the workers' skipped tests and collections
    reach the controller's hooks, which decides the exit status."""

    def __init__(self) -> None:
        self.unlisted: list[tuple[str, str]] = []  # (test id, reason)

    def _note(self, report: pytest.CollectReport | pytest.TestReport) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            reason = skip_reason(report.longrepr)
            if unlisted(reason, installed_extras()):
                self.unlisted.append((report.nodeid, reason))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._note(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._note(report)  # a module-level skip

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        worker = hasattr(session.config, "workerinput")  # an xdist worker: its controller decides
        if self.unlisted and not worker and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.unlisted:
            terminalreporter.section("skips not accepted (tests/skips.py): the run fails", sep="=", red=True, bold=True)
            for nodeid, reason in self.unlisted:
                terminalreporter.line(f"UNLISTED SKIP {nodeid}: {reason}")


def pytest_configure(config: pytest.Config) -> None:
    """Loaded as a plugin (``-p skips``): the policy is registered once per process."""
    if not config.pluginmanager.has_plugin("skip-policy"):
        config.pluginmanager.register(SkipPolicy(), "skip-policy")

"""The architecture holds by tools, not by convention: import-linter's layer contracts (pyproject),
ruff's rules, mypy --strict on the protocol, and one owner of a group's life."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

#: Methods that change a group's protocol entry (on the manager) or its trajectory-server state.
PROTOCOL_TRANSITIONS = {"reserve", "occupy", "abort", "consume", "restore"}
SERVER_TRANSITIONS = {"add_groups", "admit", "finish", "set_rewards", "fail_group", "abort_group", "take_batch", "load_state_dict"}
#: The one module allowed to call them (and the modules that define them).
OWNER = "runtime/run/group_life.py"


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_COLOR": "1"}
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


def test_import_contracts_are_kept() -> None:
    result = _run(str(BIN / "lint-imports"), "--no-cache")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "8 kept, 0 broken" in result.stdout


def _lint_copy_with(tmp_path: Path, modules: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """import-linter on a copy of the package with more modules (``modules``: path in the package -> source)."""
    copy = tmp_path / "staleflow"
    # what git ignores is left out: the venv, and the files that tests running beside this one (another
    # pytest worker) create and delete in the root while the copy is made (.coverage.*, TLC's states/)
    lines = (ROOT / ".gitignore").read_text().splitlines()
    ignored = [line.strip().strip("/") for line in lines if line.strip() and not line.startswith("#")]
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", ".typecheck", *ignored))
    for module, source in modules.items():
        (copy / module).write_text(source, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "NO_COLOR": "1"}
    return subprocess.run(
        [str(BIN / "lint-imports"), "--no-cache", "--config", str(copy / "pyproject.toml")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env,
    )


def test_import_linter_reports_a_layer_violation(tmp_path: Path) -> None:
    """The contracts bind: a runtime module importing an adapter is reported (checked on a copy)."""
    result = _lint_copy_with(tmp_path, {"runtime/bad_import.py": "from staleflow.adapters.sim import engine\n"})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "staleflow.runtime.bad_import -> staleflow.adapters.sim.engine" in result.stdout


def test_import_linter_keeps_the_command_line_and_the_benchmarks_apart(tmp_path: Path) -> None:
    """``cli`` and ``bench`` are independent siblings: a command-line module importing a benchmark is
    reported (checked on a copy), even from inside a function."""
    source = "def run() -> None:\n    from staleflow.bench import coordinator  # noqa: F401\n"
    result = _lint_copy_with(tmp_path, {"cli/bad_import.py": source})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "staleflow.cli.bad_import -> staleflow.bench.coordinator" in result.stdout


def test_import_linter_reports_a_cycle_between_two_modules_of_a_package(tmp_path: Path) -> None:
    """Two modules of one package that import each other (as ``runtime/settings/config.py`` and
    ``placement_plan.py`` did, one of the imports only for type checking) break the acyclic contract."""
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from staleflow.runtime.settings import cycle_b  # noqa: F401\n"
    result = _lint_copy_with(tmp_path, {"runtime/settings/cycle_a.py": typed,
                                        "runtime/settings/cycle_b.py": "from staleflow.runtime.settings import cycle_a  # noqa: F401\n"})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "No cycles are allowed in staleflow.runtime.settings." in result.stdout


def test_ruff_rules_pass() -> None:
    result = _run(str(BIN / "ruff"), "check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_protocol_passes_mypy_strict() -> None:
    result = _run(str(BIN / "mypy"), "--strict", "--no-incremental", "-p", "staleflow.protocol")
    assert result.returncode == 0, result.stdout + result.stderr


def _transition_calls(path: Path) -> list[str]:
    """``file:line method`` for every call of a group transition in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        method, receiver = node.func.attr, ast.unparse(node.func.value)
        on_manager = method in PROTOCOL_TRANSITIONS and receiver.split(".")[-1] == "manager"
        on_server = method in SERVER_TRANSITIONS and receiver.split(".")[-1] in {"ts", "trajectory_server", "server"}
        if on_manager or on_server:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {receiver}.{method}")
    return found


#: A peer system's binding drives the protocol from the peer's own rollout code (its executor is
#: the host; docs/integrating.md): StaleFlow's runtime and trajectory server are not involved.
PEER_HOSTS: tuple[str, ...] = ()


def test_only_the_group_owner_changes_groups() -> None:
    """Outside runtime/run/group_life.py, no runtime, binding or command changes a group's protocol
    entry or trajectory-server state (tests, the verification layers and peer bindings drive the
    protocol directly)."""
    calls = [
        call
        for folder in ("runtime", "adapters", "app", "cli")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if str(path.relative_to(ROOT)) != OWNER and not str(path.relative_to(ROOT)).startswith(PEER_HOSTS)
        for call in _transition_calls(path)
    ]
    assert calls == []
    owner_calls = {call.split()[-1] for call in _transition_calls(ROOT / OWNER)}
    assert owner_calls >= {
        "self.manager.reserve", "self.manager.occupy", "self.manager.abort", "self.manager.consume",
        "self.ts.add_groups", "self.ts.admit", "self.ts.finish", "self.ts.set_rewards", "self.ts.fail_group",
        "self.ts.abort_group", "self.ts.take_batch", "self.ts.load_state_dict",
    }


#: What GroupLife changes a group with: the coordinator may ask for these (a Ready), never call them.
GROUP_CHANGES = {"add", "admit", "finish", "reward", "abort", "requeue", "consume", "restore", "load_state_dict"}


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }


def test_the_coordinator_is_fed_not_called_back() -> None:
    """The instance driver returns what it observed and holds no coordinator (no ``bind``); the
    coordinator reads GroupLife but changes no group (it asks, in a Ready)."""
    driver = ROOT / "runtime" / "run" / "instance_driver.py"
    assert "staleflow.runtime.coordination.coordinator" not in _imported_modules(driver)
    assert "coordinator" not in {
        n.attr for n in ast.walk(ast.parse(driver.read_text(encoding="utf-8"))) if isinstance(n, ast.Attribute)
    }
    coordinator = ROOT / "runtime" / "coordination" / "coordinator.py"
    calls = [
        ast.unparse(n.func)
        for n in ast.walk(ast.parse(coordinator.read_text(encoding="utf-8")))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in GROUP_CHANGES
        and ast.unparse(n.func.value).split(".")[-1] == "groups"
    ]
    assert calls == []


#: Keys of the simulated workload and engine (runtime/settings/workload.py, adapters/sim).
SIMULATION_KEYS = ("response_length", "retry_length")


@pytest.mark.parametrize("module", ["runtime/servers/trajectory_server.py", "runtime/run/group_life.py", "runtime/types.py"])
def test_the_runtimes_servers_know_no_simulation_key(module: str) -> None:
    """The trajectory server and group life carry a group's per-sample metadata without reading it."""
    text = (ROOT / module).read_text(encoding="utf-8")
    assert [key for key in SIMULATION_KEYS if key in text] == []
    assert "staleflow.runtime.settings.workload" not in _imported_modules(ROOT / module)


@pytest.mark.parametrize("folder", ["protocol", "spec", "verification", "runtime", "adapters", "app", "cli", "bench"])
def test_modules_stay_small(folder: str) -> None:
    """About 400 lines at most (420 non-blank) per module, in every folder of the package."""
    sizes = {
        str(p.relative_to(ROOT)): sum(1 for line in p.read_text(encoding="utf-8").splitlines() if line.strip())
        for p in (ROOT / folder).rglob("*.py")
    }
    assert {name: n for name, n in sizes.items() if n > 420} == {}


def _package_modules(root: Path) -> dict[str, Path]:
    """``staleflow.<dotted path>`` -> file, for every module of the package rooted at ``root`` (tests
    and hidden folders, the venv among them, left out)."""
    modules = {}
    top = [p for p in root.iterdir() if p.name != "tests" and not p.name.startswith(".")]
    for path in sorted(p for entry in top for p in ([entry] if entry.is_file() else entry.rglob("*.py")) if p.suffix == ".py"):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(("staleflow", *(parts[:-1] if parts[-1] == "__init__" else parts)))] = path
    return modules


def _imports(module: str, path: Path) -> list[tuple[int, str, str | None]]:
    """``(line, module imported from, name or None)`` for every import in ``path``, those inside
    functions included; relative imports resolved against ``module``."""
    found: list[tuple[int, str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                source = ".".join(package[: len(package) - node.level + 1] + ([source] if source else []))
            found.extend((node.lineno, source, alias.name) for alias in node.names)
    return found


def _private_imports(root: Path) -> list[str]:
    """``file:line dotted.name`` for each import of a private name (or from a private module) of
    another of the package's modules."""
    found = []
    for module, path in _package_modules(root).items():
        for line, source, name in _imports(module, path):
            if source.split(".")[0] != "staleflow" or source == module:
                continue
            dotted = source if name is None else f"{source}.{name}"
            if any(part.startswith("_") and not part.startswith("__") for part in dotted.split(".")):
                found.append(f"{path.relative_to(root)}:{line} {dotted}")
    return found


def _adapter_import_graph(root: Path) -> dict[str, dict[str, str]]:
    """Sub-package -> {imported sub-package: ``file:line`` of one such import}, over ``staleflow.adapters.*``."""
    graph: dict[str, dict[str, str]] = {}
    for module, path in _package_modules(root).items():
        parts = module.split(".")
        if parts[:2] != ["staleflow", "adapters"] or len(parts) < 3:
            continue
        for line, source, name in _imports(module, path):
            target = source.split(".") if name is None else [*source.split("."), name]
            if target[:2] == ["staleflow", "adapters"] and len(target) > 2 and target[2] != parts[2]:
                graph.setdefault(parts[2], {}).setdefault(target[2], f"{path.relative_to(root)}:{line}")
    return graph


def _adapter_cycle(root: Path) -> list[str]:
    """One import cycle between adapter sub-packages, as ``a -> b (file:line)`` steps; [] if none."""
    graph = _adapter_import_graph(root)
    done: set[str] = set()

    def visit(node: str, trail: list[str]) -> list[str]:
        if node in trail:
            cycle = [*trail[trail.index(node):], node]
            return [f"{a} -> {b} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
        if node in done:
            return []
        for successor in sorted(graph.get(node, {})):
            found = visit(successor, [*trail, node])
            if found:
                return found
        done.add(node)
        return []

    for start in sorted(graph):
        cycle = visit(start, [])
        if cycle:
            return cycle
    return []


def test_no_module_imports_another_modules_private_names() -> None:
    """A name with a leading underscore is its module's own: anything used across modules is public
    (function-level imports included; tests may reach inside)."""
    assert _private_imports(ROOT) == []


def test_adapter_sub_packages_import_each_other_without_cycles() -> None:
    """The adapter sub-packages form no import cycle, function-level imports included (import-linter's
    adapters contract states the intended order: the bindings, then Ray placement, then the RL kit)."""
    assert _adapter_cycle(ROOT) == []


def test_the_import_scans_find_lazy_private_imports_and_cycles(tmp_path: Path) -> None:
    """Both scans see imports inside functions and relative imports (a package written here)."""
    files = {
        "adapters/__init__.py": "",
        "adapters/one/__init__.py": "",
        "adapters/one/core.py": "def _helper():\n    pass\n\n\ndef use():\n    from staleflow.adapters.two.tool import run\n",
        "adapters/two/__init__.py": "",
        "adapters/two/tool.py": "def run():\n    from ..one.core import _helper\n    from . import __name__ as own\n",
        "adapters/three/__init__.py": "from staleflow.adapters.one import core\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    assert _private_imports(tmp_path) == ["adapters/two/tool.py:2 staleflow.adapters.one.core._helper"]
    assert _adapter_cycle(tmp_path) == ["one -> two (adapters/one/core.py:6)", "two -> one (adapters/two/tool.py:2)"]

#: The only reasons a package line may be left out of line coverage (docs/testing.md, "Coverage").
COVERAGE_EXCLUSIONS = {"needs CUDA"}


def test_lines_left_out_of_coverage_name_an_allowed_reason() -> None:
    """``# pragma: no cover`` is only for code that cannot run on the CPU machine CI is, and says why."""
    import re

    pragma = re.compile(r"#\s*pragma:?\s*no\s*cover(.*)$", re.IGNORECASE)
    found, bad = 0, []
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT)
        if relative.parts[0] in {"tests", ".venv", ".typecheck"}:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            match = pragma.search(line)
            if match is not None:
                found += 1
                if match[1].strip().removeprefix("-").strip() not in COVERAGE_EXCLUSIONS:
                    bad.append(f"{relative}:{number}: {line.strip()}")
    assert bad == [], "a `# pragma: no cover` without an allowed reason " + str(sorted(COVERAGE_EXCLUSIONS))
    assert found > 0  # the Megatron ranks' CUDA-only methods: the scan sees them

"""The skip policy (tests/skips.py) can fail a run: pytest runs on small test files in a temporary
folder with the policy as its only plugin, serially and with xdist workers (whose skips reach the
controller)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def _pytest(folder: Path, *args: str, extras: str | None = None) -> subprocess.CompletedProcess[str]:
    (folder / "pytest.ini").write_text("[pytest]\n")  # not the repository's settings
    env = {k: v for k, v in os.environ.items() if k not in ("STALEFLOW_EXTRAS", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER")}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(folder)])
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # only the policy (and xdist where asked for): a fast start
    if extras is not None:
        env["STALEFLOW_EXTRAS"] = extras
    command = [sys.executable, "-m", "pytest", "-p", "skips", "-p", "no:cacheprovider", "-q", "-rs", *args]
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=300)


def test_an_unlisted_skip_fails_the_run_and_an_allowed_one_does_not(tmp_path: Path) -> None:
    (tmp_path / "test_some.py").write_text(
        "import pytest\n"
        "def test_unlisted():\n    pytest.skip('the network is flaky today')\n"
        "def test_allowed():\n    pytest.skip('this machine has no address but the loopback')\n"
        "def test_passes():\n    assert True\n"
    )
    done = _pytest(tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "UNLISTED SKIP test_some.py::test_unlisted: the network is flaky today" in done.stdout
    assert "UNLISTED SKIP test_some.py::test_allowed" not in done.stdout and "1 passed, 2 skipped" in done.stdout
    (tmp_path / "test_some.py").write_text("import pytest\ndef test_allowed():\n    pytest.skip('checks the CPU refusal')\n")
    done = _pytest(tmp_path)
    assert done.returncode == 0 and "1 skipped" in done.stdout, done.stdout + done.stderr


def test_a_missing_extra_fails_the_run_unless_the_run_leaves_that_extra_out(tmp_path: Path) -> None:
    """A module-level ``require`` of a package that is not installed skips the module, and with xdist
    the skip is judged in the controller: refused while its extra counts as installed."""
    (tmp_path / "test_needs_data.py").write_text(
        "from skips import require\nrequire('no_such_package_37', 'data')\ndef test_uses_it():\n    pass\n")
    (tmp_path / "test_other.py").write_text("def test_passes():\n    assert True\n")
    done = _pytest(tmp_path, "-p", "xdist", "-n", "2")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "UNLISTED SKIP test_needs_data.py: no_such_package_37 is not installed (the data extra)" in done.stdout
    done = _pytest(tmp_path, "-p", "xdist", "-n", "2", extras="dev,cpu-infer")
    assert done.returncode == 0 and "1 passed, 1 skipped" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize(
    ("package_source", "error"),
    [("raise ImportError('libtorch_cpu.so: undefined symbol: _ZN3c10')", "undefined symbol"),  # an ABI mismatch
     ("import no_such_dependency_37", "No module named 'no_such_dependency_37'")],  # installed, its dependency is not
)
def test_a_package_that_is_installed_but_fails_to_import_is_an_error_not_a_skip(tmp_path: Path, package_source: str, error: str) -> None:
    (tmp_path / "broken_37").mkdir()
    (tmp_path / "broken_37" / "__init__.py").write_text(package_source + "\n")
    (tmp_path / "test_broken.py").write_text("from skips import require\ndef test_uses_it():\n    require('broken_37', 'data')\n")
    done = _pytest(tmp_path, extras="dev")  # even with the data extra left out
    assert done.returncode == 1 and "1 failed" in done.stdout and "skipped" not in done.stdout, done.stdout + done.stderr
    assert error in done.stdout

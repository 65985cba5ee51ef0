"""A peer system's own venv for the drop-in tests (AReaL, verl): the peer's packages and only the
light ``staleflow-protocol`` package from ``protocol/``, never the ``staleflow`` package.

The venv is built once per package set (the lists, Python's version and, when shared, the main
venv's path: a hash names the folder in the system's temporary directory, outside the repository
the other tests scan) with the ordinary pip configuration, and the light package is reinstalled
from ``protocol/`` (offline) whenever its sources changed, so a rerun is offline and fast; a cold
build needs the package index (or a wheel folder in pip's ``find-links``).

``shared=True`` lets the peer venv see the main venv's site-packages for the heavy packages both
use (torch, numpy, ray, transformers, pyarrow...) through a plain path line in a ``.pth`` file: the
folder is appended to ``sys.path`` after the peer venv's own site-packages (the peer's own pins win
where both have a package), and the ``.pth`` files inside it are not processed, so the main venv's
editable ``staleflow`` install stays invisible (the tests assert ``import staleflow`` fails there).
The trade-off: the shared packages are the main venv's versions, not the peer's pins.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The path line that lets a shared peer venv see the main venv's packages.
SHARED_PTH = "staleflow-peer-shared.pth"


def _light_sources_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted((ROOT / "protocol").rglob("*.py")) + [ROOT / "protocol" / "pyproject.toml"]:
        digest.update(str(path.relative_to(ROOT)).encode() + path.read_bytes())
    return digest.hexdigest()


def _pip(python: Path, *args: str) -> None:
    done = subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", "--no-input", *args],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=1200, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def peer_python(name: str, with_deps: list[str], no_deps: list[str], *, shared: bool = False) -> tuple[Path, float]:
    """The python of the peer venv ``name`` (built when missing: ``with_deps`` installed with their
    dependencies, then ``no_deps`` with ``--no-deps``; with ``shared``, the main venv's site-packages
    appended to its path), the light package installed from the current sources; and the seconds
    this took."""
    main_site = sysconfig.get_paths()["purelib"]
    keyed = [with_deps, no_deps, sys.version, *([main_site] if shared else [])]
    key = hashlib.sha256(json.dumps(keyed).encode()).hexdigest()[:16]
    env_dir = Path(tempfile.gettempdir()) / f"staleflow-{name}-venv-{key}"  # outside the repository
    python = env_dir / "bin" / "python"
    started = time.perf_counter()
    if not (env_dir / "ready").exists():
        shutil.rmtree(env_dir, ignore_errors=True)
        venv.EnvBuilder(with_pip=True).create(env_dir)
        if shared:
            site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True, timeout=120).stdout.strip()
            (Path(site) / SHARED_PTH).write_text(main_site + "\n")
        if with_deps:
            _pip(python, "install", "--no-compile", *with_deps)
        if no_deps:
            _pip(python, "install", "--no-compile", "--no-deps", *no_deps)
        (env_dir / "ready").write_text("ok\n")
    stamp, sources = env_dir / "light-package.sha256", _light_sources_hash()
    if not stamp.exists() or stamp.read_text() != sources:
        source = env_dir / "protocol-src"  # a copy: the build writes build/ and *.egg-info next to the sources
        shutil.rmtree(source, ignore_errors=True)
        shutil.copytree(ROOT / "protocol", source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        _pip(python, "install", "--force-reinstall", "--check-build-dependencies", "--no-deps", "--no-build-isolation", "--no-index",
             str(source))
        stamp.write_text(sources)
    return python, time.perf_counter() - started


@functools.cache
def _ensure_coverage(python: str, version: str) -> None:
    """Install coverage.py ``version`` into the peer venv of ``python`` unless it imports there (once per run)."""
    probe = subprocess.run([python, "-I", "-c", "import coverage"], capture_output=True, timeout=120, check=False)
    if probe.returncode != 0:
        _pip(Path(python), "install", "--no-compile", f"coverage=={version}")


def peer_command(python: Path | str, *args: str, isolated: bool = False) -> list[str]:
    """The command that runs ``python [-I] *args`` in a peer venv (``args`` a script or ``-m``/``-c`` and
    what follows): under coverage.py when this test process is measured (``pytest --cov``), so the
    light package's lines that only a peer's venv runs (the AReaL and verl bindings) join the suite's
    figure. The peer writes a parallel data file beside the suite's, which pytest-cov combines at the
    end; pyproject's ``[tool.coverage.paths]`` maps its installed ``staleflow_protocol`` files back to
    ``protocol/``. A peer venv without coverage.py gets the suite's version installed first."""
    head = [str(python), *(["-I"] if isolated else [])]
    try:
        import coverage
    except ImportError:  # a run without the test extras: nothing measures
        return [*head, *args]
    current = coverage.Coverage.current()
    if current is None:
        return [*head, *args]
    _ensure_coverage(str(python), coverage.__version__)
    data_file = Path(current.config.data_file)
    data_file = data_file if data_file.is_absolute() else ROOT / data_file
    return [*head, "-m", "coverage", "run", "--rcfile=/dev/null", "--parallel-mode", "--source=staleflow_protocol",
            f"--data-file={data_file}", *args]

"""The documentation site builds in strict mode (mkdocs.yml): a broken link or anchor between pages, a
link that leaves docs/, a page missing from the navigation or a docstring mkdocstrings cannot render
fails the suite. Re-run by hand: ``.venv/bin/mkdocs build --strict``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """``mkdocs build --strict`` of ``config`` into ``site``, its output captured."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's notice about MkDocs 2.0, not a warning
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir", str(site)],
        cwd=config.parent, env=env, capture_output=True, text=True, timeout=300,
    )


def test_the_documentation_builds_in_strict_mode_with_the_generated_api_page(tmp_path: Path) -> None:
    result = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    # generated from protocol/'s docstrings, under the light distribution's import name
    assert "staleflow_protocol.manager.StalenessManager" in api
    assert "Admission and consumption of prompt groups" in api
    assert "LockedStalenessManager" in api and "check_trace" in api
    for page in ("index.html", "install/index.html", "cli/index.html", "changelog/index.html", "testing/index.html"):
        assert (tmp_path / "site" / page).is_file(), page


def test_the_strict_build_refuses_a_broken_anchor_and_a_link_out_of_docs_but_takes_github_slugs(tmp_path: Path) -> None:
    """The project's settings (inherited) on a two-page site: a missing anchor and a ``../`` link are
    the build's two warnings (so it fails), and a heading's GitHub slug resolves (an anchor works on
    github.com and on the site alike)."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "other.md").write_text("# Other\n\n## Rollout -> training: `eta` (v2)\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text(f"INHERIT: {ROOT / 'mkdocs.yml'}\ndocs_dir: docs\nnav: [index.md, other.md]\nplugins: [search]\n")

    (docs / "index.md").write_text(
        "# Home\n\n[ok](other.md#rollout---training-eta-v2) [gone](other.md#no-such-heading) [out](../tests/test_x.py)\n"
    )
    bad = mkdocs_build(config, tmp_path / "site")
    assert bad.returncode == 1
    warnings = [line for line in bad.stderr.splitlines() if "WARNING" in line]
    assert any("no-such-heading" in line for line in warnings), bad.stderr
    assert any("../tests/test_x.py" in line for line in warnings), bad.stderr
    assert not any("rollout---training-eta-v2" in line for line in warnings), bad.stderr  # GitHub's slug is the site's
    assert len(warnings) == 2, bad.stderr


def test_every_benchmark_is_listed_in_the_benchmarks_page() -> None:
    """docs/benchmarks.md names every `staleflow bench` command, with a section or a row of its own."""
    from staleflow.bench.cli import BENCHMARKS

    page = (Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md").read_text()
    assert [name for name in BENCHMARKS if not re.search(rf"`{name}`|`staleflow bench {name}[` ]", page)] == []

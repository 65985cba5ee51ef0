"""README.md is the front door: at most 200 lines, every relative link resolves (file and GitHub
anchor), its test command is the one CI runs, and it says how to read the documentation site."""

from __future__ import annotations

import re
from pathlib import Path

from markdown_links import anchors, broken_links, github_slug, relative_links

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def test_the_readme_is_at_most_200_lines() -> None:
    assert len(README.read_text().splitlines()) <= 200


def test_every_relative_link_of_the_readme_resolves() -> None:
    links = relative_links(README.read_text())
    assert any("#" in link for link in links) and any(link.endswith(".png") for link in links)  # anchors and the figure are checked
    assert broken_links(README) == []


def test_the_link_check_finds_a_missing_file_and_a_missing_anchor(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    page = "# Page\n\n## Time to quality (`staleflow bench time-to-quality`)\n\n```\n# not a heading\n```\n"
    (tmp_path / "docs" / "page.md").write_text(page)
    readme = tmp_path / "README.md"
    readme.write_text(
        "# Title\n\n## Results\n\n"
        "[ok](docs/page.md#time-to-quality-staleflow-bench-time-to-quality) [self](#results) [web](https://example.org/x)\n"
        "`[code](nowhere.md)` [gone](docs/missing.md) [no anchor](docs/page.md#not-a-heading) [bad self](#nope)\n"
    )
    assert broken_links(readme) == [
        "docs/missing.md: no file docs/missing.md",
        "docs/page.md#not-a-heading: no heading with the anchor #not-a-heading in docs/page.md",
        "#nope: no heading with the anchor #nope in README.md",
    ]


def test_github_slugs() -> None:
    assert github_slug("Time to quality (`staleflow bench time-to-quality`)") == "time-to-quality-staleflow-bench-time-to-quality"
    assert github_slug("Limits: what is proved, and what is not") == "limits-what-is-proved-and-what-is-not"
    assert github_slug("The console and the run's logs") == "the-console-and-the-runs-logs"
    assert github_slug("Rollout -> training") == "rollout---training"
    assert github_slug("The protocol alone (`staleflow_protocol`)") == "the-protocol-alone-staleflow_protocol"
    assert anchors("## Measured\n## Measured\n") == {"measured", "measured-1"}


def test_the_readme_test_command_is_the_one_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    command = ".venv/bin/python -m pytest"
    assert re.search(rf"^scripts/setup\.sh && {re.escape(command)}$", ci, flags=re.M)
    assert f"scripts/setup.sh && {command}\n" in README.read_text()


def test_the_readme_says_how_to_read_and_check_the_documentation_site() -> None:
    text = README.read_text()
    assert "mkdocs serve" in text and "mkdocs build --strict" in text
    assert (ROOT / "mkdocs.yml").is_file()

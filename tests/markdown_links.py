"""Relative links of a Markdown file and whether they resolve: the file exists and, for ``#anchor``,
a heading of the target has that GitHub slug (the slugs github.com gives headings, and mkdocs.yml's
``pymdownx.slugs.slugify`` too). Links inside code spans and fenced blocks are not links."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", flags=re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", flags=re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", flags=re.M)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", flags=re.I)  # https:, mailto:, ...


def _prose(text: str) -> str:
    """The text without fenced blocks and code spans (whose brackets are not links)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: inline markup dropped, lower case, every character that
    is not a letter, digit, underscore, hyphen or space removed, spaces turned into hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link reads as its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a Markdown text; a repeated slug gets -1, -2, ... as on GitHub."""
    seen: Counter[str] = Counter()
    found = set()
    for match in HEADING.finditer(FENCE.sub("", text)):
        slug = github_slug(match.group(1))
        found.add(f"{slug}-{seen[slug]}" if seen[slug] else slug)
        seen[slug] += 1
    return found


def relative_links(text: str) -> list[str]:
    """The targets of the text's links and images that point into the repository."""
    return [target for target in LINK.findall(_prose(text)) if not EXTERNAL.match(target)]


def broken_links(markdown: Path) -> list[str]:
    """Each relative link of ``markdown`` that does not resolve, with the reason."""
    broken = []
    for target in relative_links(markdown.read_text()):
        path, _, anchor = target.partition("#")
        file = (markdown.parent / path).resolve() if path else markdown
        if not file.exists():
            broken.append(f"{target}: no file {path}")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file.read_text())):
            broken.append(f"{target}: no heading with the anchor #{anchor} in {path or markdown.name}")
    return broken

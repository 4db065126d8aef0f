"""The definitions pages shipped with a report: docs/metrics.md and docs/leaderboard.md as HTML.

Rendered from the docs themselves (never a copy), so a report always carries the definitions of the
code that made it. Headings get GitHub-style ids so the leaderboard's column links land on them.
"""
from __future__ import annotations

import itertools
import re
from pathlib import Path

from aspire_bench.report.html import esc
from aspire_bench.report.leaderboard import COLUMNS

DOCS = Path(__file__).resolve().parents[2] / "docs"


def slug(text: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def markdown_to_html(text: str) -> str:
    """CommonMark + tables; images are left out (the docs' screenshots show the report itself, and the
    report directory does not carry them)."""
    from markdown_it import MarkdownIt
    md = MarkdownIt("commonmark").enable("table")
    tokens = md.parse(text)
    for tok, nxt in itertools.pairwise(tokens):
        if tok.type == "heading_open":
            tok.attrSet("id", slug(nxt.content))
    for tok in tokens:
        if tok.type == "inline" and tok.children:
            tok.children = [c for c in tok.children if c.type != "image"]
    return md.renderer.render(tokens, md.options, {})


def doc_body(name: str) -> str:
    """docs/<name> as HTML; when the docs are not installed (a wheel), the column definitions alone."""
    path = DOCS / name
    if path.exists():
        return markdown_to_html(path.read_text())
    rows = "".join(f"<tr><th class=\"l\" id=\"{esc(c.anchor)}\">{esc(c.header)}</th><td class=\"l\">{esc(c.tip)}</td></tr>"
                   for c in COLUMNS)
    return (f"<p class=\"note\">{esc(name)} was not found next to this installation; the short definitions "
            f"follow. The full text is docs/{esc(name)} in the aspire-bench repository.</p><table>{rows}</table>")

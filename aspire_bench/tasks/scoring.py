"""Small, dependency-free scoring helpers shared by tasks."""
from __future__ import annotations

import re

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def boxed_contents(text: str) -> list[str]:
    """The contents of every complete \\boxed{...} (and \\fbox{...}) in order; nested braces are
    matched, an unclosed one (a generation cut short) is ignored."""
    out = []
    for m in _BOXED.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append(text[m.end():i - 1])
    return out


def last_boxed(text: str) -> str | None:
    found = boxed_contents(text)
    return found[-1] if found else None


_INT = re.compile(r"^[+-]?\d+(?:\.0*)?$")


def parse_int(s) -> int | None:
    """An integer written as e.g. "42", "042", "1,000", "1{,}000", "$42$", "42.0"; else None."""
    if isinstance(s, bool):
        return None
    if isinstance(s, int):
        return s
    s = str(s).strip().strip("$").strip()
    s = re.sub(r"\\(?:text|textbf|mathbf|mathrm)\{\s*(.*?)\s*\}", r"\1", s)  # \text{42}
    while s.startswith("{") and s.endswith("}"):  # {42}
        s = s[1:-1].strip()
    s = s.replace("{,}", "").replace("\\,", "").replace(",", "").replace(" ", "")
    if not _INT.match(s):
        return None
    return int(s.split(".")[0])


def normalize_ws(s: str) -> str:
    return " ".join(s.split())


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insert, delete, substitute: cost 1), two-row dynamic programme."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def edit_similarity(a: str, b: str) -> float:
    """1 - levenshtein / max length: 1.0 for equal strings (two empty ones included), 0.0 for disjoint."""
    if not a and not b:
        return 1.0
    return 1.0 - levenshtein(a, b) / max(len(a), len(b))

"""Small scoring helpers shared by tasks (string distances from rapidfuzz)."""
from __future__ import annotations

import re

from rapidfuzz import fuzz
from rapidfuzz.distance import Levenshtein

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


def starts_with_answer(text: str, answer: str) -> bool:
    """Whether the whitespace-normalised text begins with `answer`, not continued by more of a token:
    "1234567." or "1234567 is ..." count; "12345678" (a longer number) does not."""
    t = normalize_ws(text)
    if not t.startswith(answer):
        return False
    rest = t[len(answer):]
    return not rest or not (rest[0].isalnum() or (answer[-1:].isalnum() and rest[0] in "-_"))


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insert, delete, substitute: cost 1)."""
    return Levenshtein.distance(a, b)


def edit_similarity(a: str, b: str) -> float:
    """1 - levenshtein / max length: 1.0 for equal strings (two empty ones included), 0.0 for disjoint."""
    return Levenshtein.normalized_similarity(a, b)


def code_sim_score(prediction: str, ground_truth: str) -> float:
    """LongBench's code-completion score (lcc, repobench-p): the prediction's first line (after leading
    newlines) containing none of ` # // ("" when none does) is compared with the ground truth by
    fuzzywuzzy's `fuzz.ratio` (the InDel similarity of python-Levenshtein, rounded to a whole percent;
    100 for equal strings, 0 when just one is empty), divided by 100. rapidfuzz computes the same ratio."""
    candidate = next((x for x in prediction.lstrip("\n").split("\n")
                      if "`" not in x and "#" not in x and "//" not in x), "")
    return round(fuzz.ratio(candidate, ground_truth)) / 100

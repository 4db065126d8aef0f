"""Context-length buckets: "4k" (one exact length) or "30-40k" (a window), in tokens, k = 1024."""
from __future__ import annotations

import re

from aspire_bench.errors import UserError

_SIZE = r"(\d+(?:\.\d+)?)\s*([kK]?)"
_RANGE = re.compile(rf"^\s*{_SIZE}\s*(?:-|\.\.)\s*{_SIZE}\s*$")
_ONE = re.compile(rf"^\s*{_SIZE}\s*$")


def _tokens(num: str, k: str) -> int:
    return round(float(num) * (1024 if k else 1))


def parse_bucket(s: str | int) -> tuple[int, int]:
    """"4k" -> (4096, 4096); "30-40k" -> (30720, 40960); "4096" -> (4096, 4096).

    In a window a bare lower bound takes the upper bound's unit ("30-40k" is 30k..40k)."""
    if isinstance(s, int):
        lo = hi = s
    else:
        m = _RANGE.match(str(s))
        if m:
            a, ka, b, kb = m.groups()
            lo, hi = _tokens(a, ka or kb), _tokens(b, kb)
        else:
            m = _ONE.match(str(s))
            if not m:
                raise UserError(f"bad context length {s!r}: use e.g. 4k, 16k, 32k, 30-40k or 80-100k")
            lo = hi = _tokens(*m.groups())
    if lo <= 0 or hi < lo:
        raise UserError(f"bad context length {s!r}: need 0 < low <= high")
    return lo, hi

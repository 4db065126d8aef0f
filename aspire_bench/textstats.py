"""Text statistics shared by tasks and metrics."""
from __future__ import annotations

from collections.abc import Hashable, Sequence


def distinct_n(seq: Sequence[Hashable], n: int = 4) -> float | None:
    """Distinct n-grams / total n-grams of `seq` (tokens or words); None when it has fewer than n items.

    1.0 means no n-gram repeats; a model stuck in a loop drives it towards 0.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    total = len(seq) - n + 1
    if total <= 0:
        return None
    return len({tuple(seq[i:i + n]) for i in range(total)}) / total

"""The test suite's seeds: fixed by default, fresh with ASPIRE_BENCH_FUZZ=1 (or =N to replay base N)."""
from __future__ import annotations

import os
import random
import zlib

_FUZZ = os.environ.get("ASPIRE_BENCH_FUZZ", "")
FUZZ_BASE = (random.SystemRandom().randrange(1, 2 ** 31) if _FUZZ.lower() in ("1", "true", "yes")
             else int(_FUZZ) if _FUZZ.isdigit() else 0)


def seed_for(name: str) -> int:
    """A test's seed: a fixed function of its name, shifted by the fuzz base."""
    return (zlib.crc32(name.encode()) + FUZZ_BASE) % 2 ** 31

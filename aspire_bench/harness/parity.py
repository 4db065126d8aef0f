"""Exactness parity: a greedy speculative output against the AR output of the same request.

The one parity function of the suite: run, bench, sweep (through run) and the lm-eval model all call
`against_ar`, and records.from_output stores what it returns. AR's own record is the teacher-forced
reference: up to the first divergence j the outputs are equal, so AR's logits at j were computed on the
speculative output's prefix, and AR records per position all the classification needs (top-1 logit,
runner-up, margin: decoders/sampler.py): no extra forward pass. Definitions and the choice of default
tolerances: docs/metrics.md#exactness-parity.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..decoders.base import ParityMargins
from ..errors import ConfigError

IDENTICAL, NEAR_TIE, MISMATCH, LENGTH = "identical", "near-tie", "mismatch", "length"

# Default tolerance per logits dtype, relative to max(1, |AR's top-1 logit|): a divergence is a near-tie
# only when AR's margin is below tolerance x that scale. fp32: equivalent kernels differ by rounding in
# the last few bits (more on GPUs, whose reductions run in other orders); 1e-4 leaves ample headroom. bf16 logits are rounded to 8
# significant bits (steps of 1/256 to 1/128 of the magnitude), so two equivalent kernels can differ by a
# few steps: 2^-6 = 2 to 4 steps. fp16 (11 bits): likewise 2^-9.
DEFAULT_TOLERANCE = {"float32": 1e-4, "bfloat16": 2.0 ** -6, "float16": 2.0 ** -9}


@dataclass
class Parity:
    kind: str  # IDENTICAL | NEAR_TIE | MISMATCH | LENGTH
    first_divergence: int | None  # first position where the tokens differ (or the shorter length)
    margin: float | None  # AR's top1-top2 logit gap at first_divergence, when recorded
    matched: int  # length of the common prefix
    length: int  # max(len(spec), len(ar))
    threshold: float | None = None  # the near-tie threshold at first_divergence (tolerance x logit scale)
    runner_up: bool | None = None  # whether the speculative token at first_divergence was AR's runner-up

    @property
    def identical(self) -> bool:
        return self.kind == IDENTICAL


def default_tolerance(dtype) -> float:
    """The default relative tolerance for logits computed in `dtype` (a torch dtype or its name)."""
    name = str(dtype).replace("torch.", "")
    if name not in DEFAULT_TOLERANCE:
        raise ConfigError(f"no default parity tolerance for dtype {name!r}: pass --parity-tolerance")
    return DEFAULT_TOLERANCE[name]


def check_tolerance(tolerance) -> float | None:
    """A user's tolerance as a float (None stays None: the dtype's default); bad values raise ConfigError."""
    if tolerance is None:
        return None
    try:
        tol = float(tolerance)
    except (TypeError, ValueError):
        raise ConfigError(f"parity tolerance {tolerance!r} is not a number: pass e.g. 1e-4") from None
    if not math.isfinite(tol) or tol < 0:
        raise ConfigError(f"parity tolerance {tolerance!r} must be a finite number >= 0: pass e.g. 1e-4")
    return tol


def resolve_tolerance(tolerance, dtype) -> float:
    """`tolerance` checked, or the default for logits computed in `dtype` when None."""
    tol = check_tolerance(tolerance)
    return default_tolerance(dtype) if tol is None else tol


def _at(values: Sequence | None, pos: int):
    return values[pos] if values is not None and pos < len(values) else None


def compare(spec_ids: Sequence[int], ar_ids: Sequence[int], ar: ParityMargins | None,
            tolerance: float) -> Parity:
    """Classify one request. `ar` is AR's record (`RequestResult.margins`): per output position its
    `margin` (top-1 minus top-2 logit), `runner_up` (the top-2 token) and `top_logit`.

    Only the first divergence matters: after it the two continue from different prefixes. It is a
    near-tie only when the speculative token is AR's runner-up and AR's margin is under
    tolerance x max(1, |top-1 logit|); anything unknown (no record) cannot excuse a divergence.
    """
    common = min(len(spec_ids), len(ar_ids))
    pos = next((i for i in range(common) if spec_ids[i] != ar_ids[i]), None)
    length = max(len(spec_ids), len(ar_ids))
    if pos is None:
        # Equal over the common length: a length difference is a stopping-rule difference, not numerics.
        kind = IDENTICAL if len(spec_ids) == len(ar_ids) else LENGTH
        return Parity(kind, None if kind == IDENTICAL else common, None, common, length)
    ar = ar or ParityMargins()
    margin, second, top = _at(ar.margin, pos), _at(ar.runner_up, pos), _at(ar.top_logit, pos)
    threshold = tolerance * max(1.0, abs(top)) if top is not None else None
    runner_up = None if second is None else int(spec_ids[pos]) == int(second)
    tie = runner_up and margin is not None and threshold is not None and margin <= threshold
    return Parity(NEAR_TIE if tie else MISMATCH, pos, margin, pos, length, threshold, runner_up)


def compare_runs(spec: Iterable, ar: Iterable, tolerance: float) -> dict[str, Parity]:
    """{request id: Parity} for two runs of the same requests. Items are RequestResults or stored
    RequestRows (anything with `id`, `output_ids` and `margins`); AR's are matched by id."""
    by_id = {a.id: a for a in ar}
    return {s.id: compare(s.output_ids, by_id[s.id].output_ids, by_id[s.id].margins, tolerance) for s in spec}


@dataclass(frozen=True)
class RunParity:
    """A run compared with AR: per request id its Parity, and the tolerance that classified them."""
    requests: dict[str, Parity]
    tolerance: float


def against_ar(spec: Iterable, ar: Iterable, tolerance, dtype) -> RunParity:
    """Parity of a run against AR on the same requests: `tolerance` checked, or the default for logits
    computed in `dtype` when None; items as in compare_runs."""
    tol = resolve_tolerance(tolerance, dtype)
    return RunParity(compare_runs(spec, ar, tol), tol)


def summarize(items: Iterable[Parity]) -> dict[str, float | int | None]:
    items = list(items)
    length = sum(p.length for p in items)
    counts = {k: sum(1 for p in items if p.kind == k) for k in (IDENTICAL, NEAR_TIE, MISMATCH, LENGTH)}
    return {
        "parity_n": len(items),
        "parity_identical_pct": 100.0 * counts[IDENTICAL] / len(items) if items else None,
        "parity_identical_token_pct": 100.0 * sum(p.matched for p in items) / length if length else None,
        "parity_near_tie": counts[NEAR_TIE],
        "parity_mismatch": counts[MISMATCH],
        "parity_length": counts[LENGTH],
    }

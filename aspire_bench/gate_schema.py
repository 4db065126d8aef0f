"""The gate baseline's schema (docs/gate.md), strict: a string metric, an entry without `key`, a
tolerance that is not a number or an entry that holds nothing to compare is malformed (exit 2)."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from .errors import UserError, validation_message

Share = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=0)]
PARITY_COUNTS = ("parity_n", "parity_near_tie", "parity_mismatch", "parity_length")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class Entry(_Strict):
    key: Annotated[str, Field(min_length=1)]
    decoder: str | None = None
    runs: list[int] = []
    groups: list[str] = []
    speedup: Share | None = None
    mean_accepted_len: Share | None = None
    draft_acceptance_rate: Share | None = None
    bound_share: Share | None = None
    score_mean: Share | None = None
    parity_identical_pct: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    parity_n: Count | None = None
    parity_near_tie: Count | None = None
    parity_mismatch: Count | None = None
    parity_length: Count | None = None


class Source(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    store: str | None = None
    groups: list[str] = []
    runs: list[int] = []


def _model(tolerance_names: tuple[str, ...]):
    tolerances = create_model("Tolerances", __config__=ConfigDict(strict=True, extra="forbid"),
                              **{n: (Share | None, None) for n in tolerance_names})
    return create_model("Baseline", __base__=_Strict, format=(str, ...), version=(int, ...),
                        created_at=(str | None, None), source=(Source | None, None),
                        env=(dict[str, Any] | None, None), tolerances=(tolerances | None, None),
                        entries=(Annotated[list[Entry], Field(min_length=1)], ...))


def check_baseline(data: dict, where: str, tolerance_names: tuple[str, ...], metrics: tuple[str, ...]) -> None:
    try:
        _model(tolerance_names).model_validate(data)
    except ValidationError as e:
        raise UserError(validation_message(e, where) + " (see docs/gate.md)") from None
    keys = [e["key"] for e in data["entries"]]
    dup = next((k for k in keys if keys.count(k) > 1), None)
    if dup is not None:
        raise UserError(f"{where}: entry {dup!r} is listed twice: keep one")
    for e in data["entries"]:
        if all(e.get(m) is None for m in metrics):
            raise UserError(f"{where}: entry {e['key']!r} has no figure to compare (every metric is null): "
                            "remove it or rebuild the baseline with --update")

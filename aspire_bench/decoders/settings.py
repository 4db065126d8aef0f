"""Decoder settings: names, types and defaults come from each decoder's `Settings` dataclass (the one
place a method writes them), the ranges are declared here.

A setting is checked before the decoder is built, so `gamma=abc` or `ratio=-1` is refused with one
line naming the setting, never silently changed or failing deep inside a run. Types are strict: a
string is never a number and `"false"` is never a boolean.
"""
from __future__ import annotations

import dataclasses
import inspect
import typing
from functools import cache

from ..errors import ConfigError, validation_message

# (min, max, inclusive max) per setting name; a decoder's setting not listed here has no range.
# Ranges are shared by name: every decoder means the same thing by `gamma` or `ratio`.
GE, GT = "ge", "gt"
RANGES: dict[str, dict] = {
    "gamma": {GE: 0}, "gamma_init": {GE: 0}, "d_max": {GE: 1},
    "ratio": {GT: 0, "le": 1}, "omega": {GT: 0, "le": 1}, "alpha0": {GE: 0, "le": 1},
    "min_pages": {GE: 1}, "recent_pages": {GE: 0}, "min_tokens": {GE: 1},
    "budget": {GE: 1}, "sinks": {GE: 0}, "online_fit_every": {GE: 1}, "window": {GE: 1},
}


@cache
def _model(cls: type):
    from pydantic import ConfigDict, Field, create_model
    fields = {}
    if dataclasses.is_dataclass(getattr(cls, "Settings", None)):
        hints = typing.get_type_hints(cls.Settings)
        fields = {f.name: (hints[f.name], Field(f.default, **RANGES.get(f.name, {})))
                  for f in dataclasses.fields(cls.Settings)}
        return create_model(f"{cls.__name__}Settings", __config__=ConfigDict(strict=True, extra="forbid"), **fields)
    for klass in cls.__mro__:  # a decoder without a Settings dataclass: its constructors' parameters
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        hints = typing.get_type_hints(init)
        for name, p in inspect.signature(init).parameters.items():
            if name == "self" or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) or name in fields:
                continue
            fields[name] = (hints.get(name, typing.Any), Field(p.default, **RANGES.get(name, {})))
    return create_model(f"{cls.__name__}Settings",
                        __config__=ConfigDict(strict=True, extra="forbid"), **fields)


def check_settings(name: str, cls: type, settings: dict) -> None:
    """Raise ConfigError when a setting is unknown, of the wrong type or out of range."""
    from pydantic import ValidationError
    try:
        _model(cls).model_validate(settings)
    except ValidationError as e:
        known = ", ".join(_model(cls).model_fields) or "none"
        raise ConfigError(validation_message(e, f"decoder {name!r} setting") + f" (settings: {known})") from None


def parse_value(v: str):
    """A `--decoder-arg k=v` value: int, float, true/false or string. The declared type of the
    setting then decides whether it fits (`gamma=4.5` and `refresh=1` are refused, not rounded)."""
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v

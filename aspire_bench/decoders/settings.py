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

from ..errors import ConfigError, did_you_mean, validation_message
from ..limits import C_INT_MAX

# (min, max, inclusive max) per setting name; a decoder's setting not listed here has no range.
# Ranges are shared by name: every decoder means the same thing by `gamma` or `ratio`.
GE, GT = "ge", "gt"
RANGES: dict[str, dict] = {
    "gamma": {GE: 0}, "gamma_init": {GE: 0}, "d_max": {GE: 1},
    "ratio": {GT: 0, "le": 1}, "omega": {GT: 0, "le": 1}, "alpha0": {GE: 0, "le": 1},
    "min_pages": {GE: 1}, "recent_pages": {GE: 0}, "min_tokens": {GE: 1},
    "budget": {GE: 1}, "sinks": {GE: 0}, "online_fit_every": {GE: 1}, "window": {GE: 1},
}


def _field(name: str, hint, default):
    """A setting's pydantic Field: its declared range; integers within a C int (they reach the kernels
    as one), floats finite."""
    from pydantic import Field
    bounds = dict(RANGES.get(name, {}))
    if hint is int:
        bounds.setdefault("ge", -C_INT_MAX - 1)
        bounds.setdefault("le", C_INT_MAX)
    if hint is float:
        bounds["allow_inf_nan"] = False
    return Field(default, **bounds)


def check_for_model(decoder, num_layers: int) -> None:
    """A built decoder's settings against the model it is about to run on (check_layers)."""
    settings = getattr(decoder, "settings", None)
    check_layers(getattr(decoder, "name", "?"), settings() if callable(settings) else {}, num_layers)


def check_layers(name: str, settings: dict, num_layers: int) -> None:
    """A setting naming a layer (`*_layer`, negative counting from the last) must be one of the model's,
    checked once the model is known and before any compute; never taken modulo the layer count."""
    for key, value in settings.items():
        if key.endswith("_layer") and isinstance(value, int) and not -num_layers <= value < num_layers:
            raise ConfigError(f"decoder {name!r} setting {key}={value} is not a layer of this model ({num_layers} "
                              f"layers: 0..{num_layers - 1}, or -1..-{num_layers} from the last)")


@cache
def _model(cls: type):
    from pydantic import ConfigDict, create_model
    fields = {}
    if dataclasses.is_dataclass(getattr(cls, "Settings", None)):
        hints = typing.get_type_hints(cls.Settings)
        fields = {f.name: (hints[f.name], _field(f.name, hints[f.name], f.default))
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
            fields[name] = (hints.get(name, typing.Any), _field(name, hints.get(name), p.default))
    return create_model(f"{cls.__name__}Settings",
                        __config__=ConfigDict(strict=True, extra="forbid"), **fields)


def check_settings(name: str, cls: type, settings: dict) -> None:
    """Raise ConfigError when a setting is unknown, of the wrong type or out of range."""
    from pydantic import ValidationError
    try:
        _model(cls).model_validate(settings)
    except ValidationError as e:
        fields = list(_model(cls).model_fields)
        unknown = [k for k in settings if k not in fields]
        hint = did_you_mean(unknown[0], fields) if unknown else ""
        raise ConfigError(validation_message(e, f"decoder {name!r} setting") + hint
                          + f" (settings: {', '.join(fields) or 'none'})") from None


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

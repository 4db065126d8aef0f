"""Decoders: what each schedules on the shared engine. Registry by name."""
from __future__ import annotations

from ..errors import ConfigError
from .base import Decoder, GenerationOutput, Request, RequestResult, SamplingParams  # noqa: F401

_REGISTRY = {
    "ar": ("aspire_bench.decoders.ar", "ARDecoder", {}),
}


def decoder_names() -> list[str]:
    return list(_REGISTRY)


def parse_value(v: str):
    """`--decoder-arg k=v` values: int, float, bool or string."""
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def get_decoder(name: str, **settings) -> Decoder:
    if name not in _REGISTRY:
        raise ConfigError(f"unknown decoder {name!r}: choose one of {', '.join(_REGISTRY)}")
    import importlib
    module, cls, defaults = _REGISTRY[name]
    return getattr(importlib.import_module(module), cls)(**{**defaults, **settings})

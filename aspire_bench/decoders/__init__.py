"""Decoders: what each schedules on the shared engine. Registry by name."""
from __future__ import annotations

from ..errors import ConfigError
from .base import Decoder, GenerationOutput, Request, RequestResult, SamplingParams  # noqa: F401
from .settings import check_settings, parse_value  # noqa: F401

_REGISTRY = {
    "ar": ("aspire_bench.decoders.ar", "ARDecoder", {}),
    "magicdec": ("aspire_bench.decoders.magicdec", "MagicDecDecoder", {}),
    "vegas": ("aspire_bench.decoders.vegas", "VegasDecoder", {}),
    "aspire": ("aspire_bench.decoders.aspire", "AspireDecoder", {}),
    # ablations of the paper
    "aspire-fixed": ("aspire_bench.decoders.aspire", "AspireDecoder", {"policy": "fixed", "gamma": 5}),
    "aspire-fsm": ("aspire_bench.decoders.aspire", "AspireDecoder", {"policy": "fsm"}),
    "aspire-norefresh": ("aspire_bench.decoders.aspire", "AspireDecoder", {"refresh": False}),
    # the paper's cost model as published: three terms, verification cost flat in the draft length
    "aspire-papercost": ("aspire_bench.decoders.aspire", "AspireDecoder", {"cost_terms": "paper"}),
    # an upper bound, not a decoder one could deploy: it knows the target's tokens in hindsight
    "aspire-oracle": ("aspire_bench.decoders.aspire", "AspireDecoder", {"policy": "oracle"}),
}


def decoder_names() -> list[str]:
    return list(_REGISTRY)


def get_decoder(name: str, **settings) -> Decoder:
    if name not in _REGISTRY:
        raise ConfigError(f"unknown decoder {name!r}: choose one of {', '.join(_REGISTRY)}")
    import importlib
    module, cls, defaults = _REGISTRY[name]
    klass = getattr(importlib.import_module(module), cls)
    check_settings(name, klass, {**defaults, **settings})
    try:
        dec = klass(**{**defaults, **settings})
    except (TypeError, ValueError) as e:  # an unknown or invalid --decoder-arg
        raise ConfigError(f"decoder {name!r}: {e}") from e
    dec.name = name
    return dec

"""Decoders: what each schedules on the shared engine. Registry by name: the built-ins below, then
plug-ins from other packages (entry point group `aspire_bench.decoders`, docs/adding-a-decoder.md)."""
from __future__ import annotations

import importlib
import inspect
from functools import cache

from .. import plugins
from ..errors import ConfigError
from .base import Decoder, GenerationOutput, Request, RequestResult, SamplingParams  # noqa: F401
from .settings import check_settings, parse_value  # noqa: F401

_REGISTRY = {
    "ar": ("aspire_bench.decoders.ar", "ARDecoder", {}),
    "magicdec": ("aspire_bench.decoders.magicdec", "MagicDecDecoder", {}),
    "vegas": ("aspire_bench.decoders.vegas", "VegasDecoder", {}),
    "aspire": ("aspire_bench.decoders.aspire", "AspireDecoder", {}),
    "ngram": ("aspire_bench.decoders.ngram", "NgramDecoder", {}),
    "draft-model": ("aspire_bench.decoders.draft_model", "DraftModelDecoder", {}),
    # ablations of the paper
    "aspire-fixed": ("aspire_bench.decoders.aspire", "AspireDecoder", {"policy": "fixed", "gamma": 5}),
    "aspire-fsm": ("aspire_bench.decoders.aspire", "AspireDecoder", {"policy": "fsm"}),
    "aspire-norefresh": ("aspire_bench.decoders.aspire", "AspireDecoder", {"refresh": False}),
    # the paper's cost model as published: three terms, verification cost flat in the draft length
    "aspire-papercost": ("aspire_bench.decoders.aspire", "AspireDecoder", {"cost_terms": "paper"}),
    # an upper bound, not a decoder one could deploy: it knows the target's tokens in hindsight
    "aspire-oracle": ("aspire_bench.decoders.aspire", "AspireDecoder", {"policy": "oracle"}),
}


@cache
def _plugins() -> dict:
    return plugins.discover(plugins.DECODERS, _REGISTRY, "decoder")


def decoder_names() -> list[str]:
    return [*_REGISTRY, *_plugins()]


def describe_decoder(name: str) -> str:
    """A built-in decoder class's one-line `description` ('' for plug-ins and for settings aliases)."""
    if name not in _REGISTRY or _REGISTRY[name][2]:
        return ""
    module, cls, _ = _REGISTRY[name]
    return getattr(getattr(importlib.import_module(module), cls), "description", "")


def _decoder_class(name: str) -> tuple[type, dict]:
    if name in _REGISTRY:
        module, cls, defaults = _REGISTRY[name]
        return getattr(importlib.import_module(module), cls), defaults
    if name in _plugins():
        ep = _plugins()[name]
        klass = plugins.load(ep, "decoder")
        if not inspect.isclass(klass) or not callable(getattr(klass, "generate", None)):
            raise ConfigError(f"the decoder plug-in {name!r} of package {plugins.package_of(ep)} names "
                              f"{ep.value}, which is not a decoder class (one with a generate method)")
        return klass, {}
    raise ConfigError(f"unknown decoder {name!r}: choose one of {', '.join(decoder_names())}")


def get_decoder(name: str, **settings) -> Decoder:
    klass, defaults = _decoder_class(name)
    check_settings(name, klass, {**defaults, **settings})
    try:
        dec = klass(**{**defaults, **settings})
    except (TypeError, ValueError) as e:  # an unknown or invalid --decoder-arg
        raise ConfigError(f"decoder {name!r}: {e}") from e
    dec.name = name
    return dec

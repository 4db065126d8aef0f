"""Decoders: what each schedules on the shared engine. Registry by name: the built-ins below, then
plug-ins from other packages (entry point group `aspire_bench.decoders`, docs/adding-a-decoder.md)."""
from __future__ import annotations

import importlib
import inspect
from functools import cache

from .. import plugins
from ..errors import ConfigError, did_you_mean
from .base import Decoder, GenerationOutput, Request, RequestResult, SamplingParams  # noqa: F401
from .settings import check_for_model, check_settings, parse_value  # noqa: F401

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


@cache
def _plugins() -> dict:
    return plugins.discover(plugins.DECODERS, _REGISTRY, "decoder")


def decoder_names() -> list[str]:
    return [*_REGISTRY, *_plugins()]


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
    raise ConfigError(f"unknown decoder {name!r}{did_you_mean(name, decoder_names())}: choose one of "
                      f"{', '.join(decoder_names())}")


# One line per built-in decoder class, until each class carries its own `description`.
_DESCRIPTIONS = {
    "ar": "autoregressive decoding, one token per step: the reference every speedup is over",
    "magicdec": "self-speculation: drafts with a StreamingLLM window (sinks + recent tokens), verifies in full",
    "vegas": "self-speculation: drafts over a token view of the context picked by attention scores",
    "aspire": "asynchronous batched self-speculation: page-sparse drafts, per-request draft lengths "
              "from a step-cost model",
}
# What a built-in variant (a decoder class run with fixed settings) changes.
_VARIANTS = {
    "aspire-fixed": "ASPIRE with a fixed draft length (gamma 5) instead of the cost model",
    "aspire-fsm": "ASPIRE with draft lengths from a finite-state machine instead of the cost model",
    "aspire-norefresh": "ASPIRE without the full-attention refresh layer in the draft",
    "aspire-papercost": "ASPIRE with the paper's three-term cost model (verify cost flat in the draft length)",
    "aspire-oracle": "ASPIRE knowing the target's tokens in hindsight: an upper bound, not deployable",
}


def describe_decoders() -> list[dict]:
    """Each decoder's name, kind (decoder, ablation, bound or plug-in) and one-line description."""
    out = []
    for name in decoder_names():
        try:
            klass, defaults = _decoder_class(name)
        except ConfigError as e:  # a broken plug-in is listed with what is wrong
            out.append({"name": name, "kind": "plug-in", "description": str(e)})
            continue
        doc = (klass.__doc__ or "").strip().splitlines()
        own = getattr(klass, "description", None) or _DESCRIPTIONS.get(name) or (doc[0] if doc else "")
        kind = ("plug-in" if name not in _REGISTRY else "bound" if defaults.get("policy") == "oracle"
                else "ablation" if defaults else "decoder")
        out.append({"name": name, "kind": kind, "description": _VARIANTS.get(name, own)})
    return out


def get_decoder(name: str, **settings) -> Decoder:
    klass, defaults = _decoder_class(name)
    check_settings(name, klass, {**defaults, **settings})
    try:
        dec = klass(**{**defaults, **settings})
    except (TypeError, ValueError) as e:  # an unknown or invalid --decoder-arg
        raise ConfigError(f"decoder {name!r}: {e}") from e
    dec.name = name
    return dec

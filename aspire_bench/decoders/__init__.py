"""Decoders: what each schedules on the shared engine. Registry by name: the built-ins below, then
plug-ins from other packages (entry point group `aspire_bench.decoders`, docs/adding-a-decoder.md).

A decoder is one class (a subclass of loop.Decoder); what the harness, bench, step costs and the
simulator need to know about it are its class attributes, read through `trait`.
"""
from __future__ import annotations

import importlib
import inspect
from functools import cache

from .. import plugins
from ..errors import ConfigError, did_you_mean
from .base import GenerationOutput, Request, RequestResult, SamplingParams, SupportsGenerate  # noqa: F401
from .settings import check_for_model, check_settings, parse_value  # noqa: F401

# name -> "module:class" (imported when first used)
BUILTIN = {
    "ar": "aspire_bench.decoders.ar:ARDecoder",
    "magicdec": "aspire_bench.decoders.magicdec:MagicDecDecoder",
    "vegas": "aspire_bench.decoders.vegas:VegasDecoder",
    "aspire": "aspire_bench.decoders.aspire:AspireDecoder",
    "ngram": "aspire_bench.decoders.ngram:NgramDecoder",
    "draft-model": "aspire_bench.decoders.draft_model:DraftModelDecoder",
    "aspire-fixed": "aspire_bench.decoders.aspire:AspireFixedDecoder",
    "aspire-fsm": "aspire_bench.decoders.aspire:AspireFsmDecoder",
    "aspire-norefresh": "aspire_bench.decoders.aspire:AspireNoRefreshDecoder",
    "aspire-papercost": "aspire_bench.decoders.aspire:AspirePaperCostDecoder",
    "aspire-oracle": "aspire_bench.decoders.aspire:AspireOracleDecoder",
}
# A trait's value for a plug-in class that does not set it.
TRAIT_DEFAULTS = {"description": "", "baseline": False, "ablation": False, "draft_kind": None, "tune_grid": {},
                  "simulated": False, "uses_cost_model": False, "host_drafts": False,
                  "draft_engine": lambda engine: None}


@cache
def _plugins() -> dict:
    return plugins.discover(plugins.DECODERS, BUILTIN, "decoder")


def decoder_names() -> list[str]:
    return [*BUILTIN, *_plugins()]


@cache
def decoder_class(name: str) -> type:
    """The class of the decoder called `name` (a built-in or a plug-in); ConfigError if none is."""
    if name in BUILTIN:
        module, cls = BUILTIN[name].split(":")
        return getattr(importlib.import_module(module), cls)
    if name in _plugins():
        ep = _plugins()[name]
        klass = plugins.load(ep, "decoder")
        if not inspect.isclass(klass) or not callable(getattr(klass, "generate", None)):
            raise ConfigError(f"the decoder plug-in {name!r} of package {plugins.package_of(ep)} names "
                              f"{ep.value}, which is not a decoder class (one with a generate method)")
        return klass
    raise ConfigError(f"unknown decoder {name!r}{did_you_mean(name, decoder_names())}: choose one of "
                      f"{', '.join(decoder_names())}")


def describe_decoders() -> list[dict]:
    """Each decoder's name, kind (decoder, ablation, bound or plug-in) and one-line description."""
    out = []
    for name in decoder_names():
        try:
            desc = trait(name, "description")
        except ConfigError as e:  # a broken plug-in is listed with what is wrong
            out.append({"name": name, "kind": "plug-in", "description": str(e)})
            continue
        kind = ("plug-in" if name not in BUILTIN else "bound" if desc.startswith("upper bound")
                else "ablation" if trait(name, "ablation") else "decoder")
        for prefix in ("ablation: ", "upper bound: "):  # the mark says it
            desc = desc.removeprefix(prefix)
        out.append({"name": name, "kind": kind, "description": desc})
    return out


def trait(name: str, attr: str):
    """One of a decoder's traits (TRAIT_DEFAULTS names them; loop.Decoder documents them)."""
    if attr not in TRAIT_DEFAULTS:
        raise KeyError(f"no decoder trait {attr!r}: one of {', '.join(TRAIT_DEFAULTS)}")
    klass = decoder_class(name)
    value = getattr(klass, attr, TRAIT_DEFAULTS[attr])
    if attr == "description" and not value:
        value = (inspect.getdoc(klass) or "").split("\n")[0]
    return value


def get_decoder(name: str, **settings) -> SupportsGenerate:
    klass = decoder_class(name)
    check_settings(name, klass, settings)
    try:
        dec = klass(**settings)
    except (TypeError, ValueError) as e:  # an unknown or invalid --decoder-arg
        raise ConfigError(f"decoder {name!r}: {e}") from e
    dec.name = name
    return dec

"""One colour per decoder on every plot and page: fixed for the built-in decoders, and for any other
name (a plug-in) a palette entry picked by a stable hash of the name, so it never changes between
plots, pages or reports."""
from __future__ import annotations

import zlib

BUILTIN = {
    "ar": "#555555", "aspire": "#1f77b4", "magicdec": "#d62728", "vegas": "#2ca02c",
    "aspire-fixed": "#17becf", "aspire-fsm": "#9467bd", "aspire-norefresh": "#8c564b",
    "ngram": "#ff7f0e", "draft-model": "#e377c2",
}
# For other decoders: colours apart from the built-ins'.
EXTRA = ("#bcbd22", "#7f3c8d", "#11a579", "#f2b701", "#e73f74", "#3969ac", "#80ba5a", "#008695", "#cf1c90", "#a5aa99")
# Variants of one decoder in one plot (other settings, tuned): the same colour, another dash and marker.
DASHES = ("solid", "dash", "dot", "dashdot", "longdash")
SYMBOLS = ("circle", "square", "diamond", "triangle-up", "x")


def decoder_color(name: str) -> str:
    return BUILTIN.get(name) or EXTRA[zlib.crc32(name.encode()) % len(EXTRA)]


def styles(decoders: list[str]) -> list[dict]:
    """Per trace of a plot (its decoder names in order): colour, dash and marker symbol, the n-th trace
    of a decoder getting the n-th dash and symbol."""
    seen: dict[str, int] = {}
    out = []
    for d in decoders:
        n = seen[d] = seen.get(d, -1) + 1
        out.append({"color": decoder_color(d), "dash": DASHES[n % len(DASHES)], "symbol": SYMBOLS[n % len(SYMBOLS)]})
    return out

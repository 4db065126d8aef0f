"""Click types and callbacks for the CLI's options: a value that makes no sense is refused with a
one-line usage error (exit 2) naming the option, never clamped or replaced by a default."""
from __future__ import annotations

import math
import re
from pathlib import Path

import click

from .errors import UserError
from .harness.tables import examples  # noqa: F401  (commands import it from here)
from .limits import MAX_BATCH, MAX_REQUESTS, MAX_THREADS

SEED_MAX = 2**63 - 1  # torch.Generator.manual_seed's range


class FiniteFloat(click.FloatRange):
    """A FloatRange that also refuses nan and inf (they pass every comparison or break sampling)."""

    name = "float"

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return rv


POSITIVE = click.IntRange(min=1)
REQUESTS = click.IntRange(1, MAX_REQUESTS)  # bounded: each request is built (and held) before the run
BATCH = click.IntRange(1, MAX_BATCH)
THREADS = click.IntRange(1, MAX_THREADS)
NON_NEGATIVE = click.IntRange(min=0)


class Seed(click.IntRange):
    """A sampling seed, 0 .. 2**63 - 1 (torch's range), shown in help as a plain integer."""

    name = "seed"

    def __init__(self):
        super().__init__(0, SEED_MAX)

    def _describe_range(self) -> str:
        return "x>=0"


SEED = Seed()
TEMPERATURE = FiniteFloat(min=0.0)  # 0 = greedy
TOP_P = FiniteFloat(min=0.0, max=1.0, min_open=True)  # 1 = off
DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "auto")  # auto: the checkpoint's own
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")


def env_positive_int(name: str) -> int | None:
    """An environment variable holding an integer >= 1 (None when unset or empty); a bad value is
    refused naming the variable, not an option the user never gave."""
    import os
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_THREADS:
        raise UserError(f"{name}={value!r} must be an integer in 1..{MAX_THREADS}: fix or unset it")
    return n


class TokenCount(click.ParamType):
    """A number of tokens: 4096, 4k or 4.5k (k = 1024), as context buckets are written."""
    name = "tokens"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        from .tasks.buckets import parse_bucket
        try:
            lo, hi = parse_bucket(value)
        except UserError as e:
            self.fail(f"{e}; here one length, e.g. 4096 or 4k", param, ctx)
        if lo != hi:
            self.fail(f"{value!r} is a window; give one length, e.g. 4096 or 4k", param, ctx)
        return lo


def context_len(ctx, param, value):
    """--context-len: a bucket such as 4k or 30-40k, checked before anything is loaded."""
    if value is None:
        return None
    from .tasks.buckets import parse_bucket
    try:
        parse_bucket(value)
    except UserError as e:
        raise click.BadParameter(str(e)) from None
    return value


# RoPE scalings a factor alone defines (engine/config.py reads them as config.json's rope_scaling).
ROPE_SCALINGS = ("yarn", "linear", "dynamic")


def rope_scaling(ctx, param, value):
    """--rope-scaling TYPE:FACTOR as config.json's rope_scaling form, {"rope_type", "factor"}; `none`
    or absent: None, the checkpoint's own scaling."""
    if value is None or value.strip().lower() == "none":
        return None
    kind, sep, factor = value.strip().partition(":")
    kind = kind.strip().lower()
    if kind == "llama3":
        raise click.BadParameter("llama3 scaling needs low_freq_factor, high_freq_factor and "
                                 "original_max_position_embeddings besides a factor: give it as a sweep file's "
                                 "rope_scaling (docs/sweeps.md)")
    if kind not in ROPE_SCALINGS:
        raise click.BadParameter(f"{value!r}: unknown scaling type {kind!r}: use {', '.join(ROPE_SCALINGS)} "
                                 "as TYPE:FACTOR (e.g. yarn:2), or none for the checkpoint's own")
    if not sep:
        raise click.BadParameter(f"{value!r} has no factor: write TYPE:FACTOR, e.g. {kind}:2")
    try:
        f = float(factor)
    except ValueError:
        f = math.nan
    if not (math.isfinite(f) and f > 1):
        raise click.BadParameter(f"{value!r}: the factor must be a number above 1 (the context grows by it), "
                                 f"e.g. {kind}:2")
    return {"rope_type": kind, "factor": f}


def csv_list(ctx, param, value):
    """A comma-separated option as a list (empty items dropped; none at all, or one twice, is an error)."""
    items = [x.strip() for x in (value or "").split(",") if x.strip()]
    if not items:
        raise click.BadParameter("give at least one value")
    refuse_duplicates(items)
    return items


def refuse_duplicates(items, what: str = "") -> None:
    """A list option naming one value twice would run (and store) the same thing twice."""
    seen = set()
    for x in items:
        if x in seen:
            raise click.BadParameter(f"{what}{x!r} is given twice: keep one")
        seen.add(x)


def csv_contexts(ctx, param, value):
    items = csv_list(ctx, param, value)
    for c in items:
        context_len(ctx, param, c)
    return items


def csv_positive_ints(ctx, param, value):
    out = []
    for x in csv_list(ctx, param, value):
        try:
            n = int(x)
        except ValueError:
            raise click.BadParameter(f"{x!r} is not an integer") from None
        if n < 1:
            raise click.BadParameter(f"{n} is not >= 1")
        out.append(n)
    refuse_duplicates(out)
    return out


def csv_batch_sizes(ctx, param, value):
    out = csv_positive_ints(ctx, param, value)
    for n in out:
        if n > MAX_BATCH:
            raise click.BadParameter(f"batch size {n} is more than {MAX_BATCH:,}: each slot holds a request's KV cache")
    return out


def new_output_path(ctx, param, value):
    """An --out file: its directory must exist and the file must not be a directory or a SQLite
    database (a results store), so nothing is computed for an output that cannot be written."""
    if value is None or str(value) == "-":
        return value
    from .harness.store import check_output_path
    try:
        check_output_path(Path(value))
    except UserError as e:
        raise click.BadParameter(str(e)) from None
    return value


def parse_decoder_args(pairs: tuple[str, ...], option: str = "--decoder-arg") -> dict:
    from .decoders import parse_value
    out = {}
    for p in pairs:
        k, sep, v = p.partition("=")
        k = k.strip().replace("-", "_")
        if not sep or not k.isidentifier():
            raise UserError(f"{option} {p!r} is not of the form key=value (e.g. gamma=4)")
        if k in out:
            raise UserError(f"{option} {k} is given twice: keep one")
        out[k] = parse_value(v.strip())
    return out


_DECODER_SPEC = re.compile(r"\s*([^\[\],\s]+)\s*(?:\[([^\[\]]*)\])?\s*")


def decoder_specs(ctx, param, value) -> list[tuple[str, dict]]:
    """--decoders: comma-separated decoder names, each optionally with settings in brackets, e.g.
    `ar,magicdec,magicdec[budget=512],aspire[ratio=0.035,min_pages=16]`, as (name, settings) pairs."""
    specs = []
    for item in filter(str.strip, re.split(r",(?![^\[]*\])", value or "")):  # commas outside brackets
        if item.count("[") != item.count("]"):
            raise click.BadParameter(f"unbalanced brackets in {item.strip()!r}: write name[key=value,...]")
        m = _DECODER_SPEC.fullmatch(item)
        if m is None:
            raise click.BadParameter(f"{item.strip()!r} is not a decoder name with optional [key=value,...] settings")
        name, settings = m.groups()
        try:
            args = parse_decoder_args(tuple(filter(str.strip, (settings or "").split(","))), f"--decoders {name}[...]:")
        except UserError as e:
            raise click.BadParameter(str(e)) from None
        if (name, args) in specs:
            raise click.BadParameter(f"{item.strip()!r} is given twice: keep one")
        specs.append((name, args))
    if not specs:
        raise click.BadParameter("give at least one decoder")
    return specs


def hidden_alias(name: str, dest: str, callback=None, **kw):
    """An older spelling of an option, kept working but not shown in --help; the command merges it
    with `merge_alias`."""
    return click.option(name, dest, default=None, hidden=True, callback=callback, **kw)


def merge_alias(value, alias, default, option: str, alias_name: str):
    """The value of an option given under its name or its hidden alias (never both), else `default`."""
    if value is not None and alias is not None:
        raise click.UsageError(f"{alias_name} is another spelling of {option}: give one of them")
    return value if value is not None else alias if alias is not None else default

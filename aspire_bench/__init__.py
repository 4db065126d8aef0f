"""aspire-bench: benchmark and evaluation suite for long-context speculative decoding.

The Python API mirrors the command line: `run` stores to the same default store as `aspire-bench run`
(./aspire_results.db, or $ASPIRE_BENCH_STORE; `store=None` keeps the run in memory only), and
`results` / `request_results` read it. Bad input raises the CLI's exceptions (aspire_bench.errors)
worded for Python: `store=` where the CLI says `--store`.
"""
__version__ = "0.1.0"

import functools
import os
import re

_DEFAULT = object()


def default_store() -> str:
    """The store the CLI uses when no --store is given: $ASPIRE_BENCH_STORE, else ./aspire_results.db."""
    from .harness.store import DEFAULT_PATH
    return os.environ.get("ASPIRE_BENCH_STORE") or DEFAULT_PATH


# CLI options whose keyword differs from the option's name with '-' -> '_'
_KEYWORDS = {"decoder-arg": "decoder_args", "unequal-work": "equal_work=False", "json": "json_out"}


def _python_wording(message: str) -> str:
    """A CLI message as a Python caller reads it: `--store PATH` -> `store=PATH`, `--context-len` -> `context_len=`."""
    def keyword(m):
        name, valued = m.group(1), m.group(0).endswith(" ")
        kw = _KEYWORDS.get(name, name.replace("-", "_"))
        kw = kw if "=" in kw else f"{kw}="
        return kw if valued else f"`{kw}`"
    parts = message.split("`")  # a command line quoted in backticks stays as the CLI spells it
    return "`".join(p if i % 2 else re.sub(r"(?<![\w-])--([a-z][a-z0-9-]*)(?: (?=[A-Z0-9./~]))?", keyword, p)
                    for i, p in enumerate(parts))


def _api(f):
    """Re-raise a UserError of the CLI in Python wording (same exception class)."""
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        from .errors import UserError
        try:
            return f(*args, **kwargs)
        except UserError as e:
            raise type(e)(_python_wording(str(e))) from None
    return wrapper


@_api
def run(cfg=None, *, store=_DEFAULT, **kwargs):
    """Python API of `aspire-bench run`: `aspire_bench.run(decoder="aspire", task="code-completion", ...)`;
    keywords are RunConfig's fields (harness/runner.py). Stores the run in `store` (default: the CLI's,
    see `default_store`; None: not stored). Returns a RunResult: `.aggregates`, `.record`, `.run_id`,
    `.store`, and `result["decode_tok_s"]` for any aggregate."""
    from .harness.runner import run as _run
    return _run(cfg, store=default_store() if store is _DEFAULT else store, **kwargs)


@_api
def results(store=None, **filters):
    """The stored runs as a pandas DataFrame, one row per run: identity, flattened config, aggregates.
    store: default the CLI's (`default_store`). Filters: decoder, model, task, sweep, tag, group,
    config_hash, status, kind. See harness/frames.py."""
    from .harness.frames import results as _results
    return _results(default_store() if store is None else store, **filters)


@_api
def request_results(store=None, **filters):
    """The stored runs' requests as a pandas DataFrame, one row per request (store and filters as `results`)."""
    from .harness.frames import request_results as _request_results
    return _request_results(default_store() if store is None else store, **filters)

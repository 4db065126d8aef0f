"""aspire-bench: benchmark and evaluation suite for long-context speculative decoding."""
__version__ = "0.1.0"


def run(*args, **kwargs):
    """Python API of `aspire-bench run`: `aspire_bench.run(decoder="aspire", task="needle", ...)`.
    Returns a RunResult (`.aggregates`, `.record`, `.run_id`). See harness/runner.py."""
    from .harness.runner import run as _run
    return _run(*args, **kwargs)


def results(store="./aspire_results.db", **filters):
    """The stored runs as a pandas DataFrame, one row per run: identity, flattened config, aggregates.
    Filters: decoder, model, task, sweep, tag, group, config_hash, status. See harness/frames.py."""
    from .harness.frames import results as _results
    return _results(store, **filters)


def request_results(store="./aspire_results.db", **filters):
    """The stored runs' requests as a pandas DataFrame, one row per request (filters as `results`)."""
    from .harness.frames import request_results as _request_results
    return _request_results(store, **filters)

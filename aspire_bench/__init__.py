"""aspire-bench: benchmark and evaluation suite for long-context speculative decoding."""
__version__ = "0.1.0"


def run(*args, **kwargs):
    """Python API of `aspire-bench run`: `aspire_bench.run(decoder="aspire", task="needle", ...)`.
    Returns a RunResult (`.aggregates`, `.record`, `.run_id`). See harness/runner.py."""
    from .harness.runner import run as _run
    return _run(*args, **kwargs)

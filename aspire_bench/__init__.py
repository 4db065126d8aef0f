"""aspire-bench: benchmark and evaluation suite for long-context speculative decoding."""
__version__ = "0.1.0"

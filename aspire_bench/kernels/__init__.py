"""Attention backends behind one interface (see base.py): torch reference, compiled CPU kernel, Triton,
flash-attn prefill."""
from __future__ import annotations

import warnings

from ..errors import ConfigError
from .base import AttentionBackend, AttentionMeta, RowMeta  # noqa: F401

BACKENDS = ("auto", "torch", "cpu", "triton")


def get_backend(name: str, device_type: str) -> AttentionBackend:
    """`auto` = triton on CUDA (when importable); on CPU the compiled kernel (when it builds), else torch."""
    if name == "auto":
        name = "torch"
        if device_type == "cuda":
            try:
                import triton  # noqa: F401
                name = "triton"
            except ImportError:
                pass
        elif device_type == "cpu":
            from .cpu_attention import KernelBuildError
            try:
                return get_backend("cpu", device_type)
            except KernelBuildError as e:
                warnings.warn(f"{e}\nfalling back to the torch attention backend (slower on CPU)", stacklevel=2)
    if name == "torch":
        from .torch_ref import TorchAttention
        return TorchAttention()
    if name == "cpu":
        from .cpu_attention import CpuAttention
        return CpuAttention()
    if name == "triton":
        try:
            from .triton_backend import TritonAttention
        except ImportError as e:
            raise ConfigError(f"attention backend 'triton' is unavailable ({e}): "
                              "pip install 'aspire-bench[triton]' or use --attention-backend torch") from e
        return TritonAttention()
    raise ConfigError(f"unknown attention backend {name!r}: choose one of {', '.join(BACKENDS)}")

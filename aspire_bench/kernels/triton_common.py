"""What the Triton kernels (triton_attention, triton_scores) share: constants, the matmul helper, its
precision flags, buffer allocation. Backend-neutral shared pieces live in base.py (this module needs
Triton installed; base.py must not)."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # log-sum-exps are kept in base 2 (exp2 is the fast path on GPUs)
MIN_M = 16  # smallest tile height handed to tl.dot


@triton.jit
def mm(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with fp32 accumulation. UPCAST: Triton's CPU interpreter multiplies bf16 operands as raw
    bits, so under the interpreter bf16 goes through fp32 (exact: a bf16 product fits in fp32)."""
    if UPCAST:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        r = tl.dot(a, b, input_precision=PREC)
    return r


def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreting() -> bool:
    """Whether the backend may take CPU tensors (Triton's interpreter, TRITON_INTERPRET=1).
    triton_compile_check patches this to run the host side on CPU; dot_flags reads the environment
    itself, so the kernels compiled there keep their GPU flags."""
    return _interpret_env()


def dot_flags(dtype: torch.dtype) -> dict:
    """The constexpr flags of `mm` for operands of `dtype`."""
    # fp32 must not silently drop to tf32 on tensor cores: the reference is exact fp32.
    # fp16/bf16: the target's default (tensor cores); None keeps this portable across backends.
    return {"PREC": "ieee" if dtype == torch.float32 else None, "UPCAST": _interpret_env() and dtype == torch.bfloat16}


def empty(shape, dtype, device) -> torch.Tensor:
    """Every output and scratch buffer of the Triton path comes from here (tests poison it with NaN):
    call it as triton_common.empty so that a patch reaches every caller."""
    return torch.empty(shape, dtype=dtype, device=device)


def pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1): Triton block shapes are powers of two."""
    return 1 if x <= 1 else 1 << (x - 1).bit_length()

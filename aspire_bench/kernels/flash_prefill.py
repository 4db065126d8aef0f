"""Long query blocks (prefill chunks): flash-attn's varlen kernel when importable, torch SDPA otherwise.

Prefill is compute-bound, so the Triton decode kernel (tuned to stream K/V for few queries) is the
wrong tool. Both paths read a full view in place: a row's keys are the strided view
k_cache[:, base:base+L] seen as [L, Hkv, D] (flash-attn only needs the last dim contiguous), one
varlen call per row with a batch of one, which avoids packing rows that live in different slots.
flash-attn's causal mask with more keys than queries is bottom-right aligned (since 2.1): query i sees
keys 0..L-n+i = start+i, our rule. Sparse views (rare for long blocks) and fp32 go to SDPA.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # optional: pip install flash-attn
    from flash_attn import flash_attn_varlen_func
except (ImportError, OSError, RuntimeError):  # absent, or a build that does not match this torch/CUDA
    flash_attn_varlen_func = None


def flash_available(q: torch.Tensor) -> bool:
    return (flash_attn_varlen_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] <= 256)


def prefill_row(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, base: int, start: int,
                scale: float, idx: torch.Tensor | None = None, key_pos: torch.Tensor | None = None) -> torch.Tensor:
    """q: [n, Hq, D] of one row at positions start..start+n-1; returns [n, Hq, D]."""
    n = q.shape[0]
    if idx is None and flash_available(q):
        L = start + n
        k = k_cache[:, base:base + L].transpose(0, 1)  # [L, Hkv, D], no copy
        v = v_cache[:, base:base + L].transpose(0, 1)
        cu_q = torch.tensor([0, n], dtype=torch.int32, device=q.device)
        cu_k = torch.tensor([0, L], dtype=torch.int32, device=q.device)
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, n, L, softmax_scale=scale, causal=True)
    if idx is None:
        k = k_cache[:, base:base + start + n]
        v = v_cache[:, base:base + start + n]
        kp = torch.arange(start + n, device=q.device)
    else:
        k = k_cache.index_select(1, idx)
        v = v_cache.index_select(1, idx)
        kp = key_pos
    return sdpa_row(q, k, v, kp, start, scale)


def sdpa_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_pos: torch.Tensor, start: int,
             scale: float) -> torch.Tensor:
    """q: [n, Hq, D] at positions start..; k, v: [Hkv, L, D] at `key_pos`; causal by position."""
    n = q.shape[0]
    mask = key_pos[None, :] <= torch.arange(start, start + n, device=q.device)[:, None]
    # GQA without repeating K/V: enable_gqa (a K broadcast over the group sends SDPA to a slow path)
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                       attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)

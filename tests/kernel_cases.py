"""Random attention inputs shared by the kernel tests (Triton and compiled CPU backends)."""
from __future__ import annotations

import torch

from aspire_bench.kernels.base import AttentionMeta, RowMeta


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    assert not torch.isnan(a).any(), "NaN in the kernel output (an unwritten element?)"
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def make_batch(specs, hq, hkv, d, dtype, page_size=16, layers=1, seed=0):
    """specs: (n, start, view) per row; view None = full, else fraction of the prefix's pages kept.
    Rows get disjoint slots in one pool, in shuffled order so bases are not monotonic in the batch."""
    g = torch.Generator().manual_seed(seed)
    sizes = [start + n + 5 for n, start, _ in specs]
    order = torch.randperm(len(specs), generator=g).tolist()
    bases, off = [0] * len(specs), 3
    for i in order:
        bases[i] = off
        off += sizes[i]
    cap = off + 7
    k = torch.randn(hkv, cap, d, generator=g).to(dtype)
    v = torch.randn(hkv, cap, d, generator=g).to(dtype)
    rows, q0 = [], 0
    for (n, start, frac), base in zip(specs, bases):
        r = RowMeta(q_start=q0, n=n, base=base, start=start)
        if frac is not None:
            pages = -(-start // page_size)
            keep = torch.randperm(pages, generator=g)[:max(1, int(frac * pages))].sort().values
            pos = (keep[:, None] * page_size + torch.arange(page_size)).flatten()
            pos = torch.cat((pos[pos < start], torch.arange(start, start + n)))
            r.sparse = [pos + base] * layers
            r.sparse_pos = [pos] * layers
        rows.append(r)
        q0 += n
    q = torch.randn(q0, hq, d, generator=g).to(dtype)
    return q, k, v, rows


def meta_of(rows, d, page_size=16):
    return AttentionMeta(rows=rows, num_tokens=sum(r.n for r in rows), page_size=page_size, scale=d ** -0.5)

"""Torch reference attention backend: exact, and efficient enough on CPU.

Full views read the slot in place (a strided view of the pool); sparse views gather only their
keys; GQA groups query heads per KV head by reshaping (never repeats K/V).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import PAGE_MAX_SUM, SDPA_MIN_QUERIES, TOKEN_MEAN, AttentionMeta, RowMeta
from .flash_prefill import sdpa_row


def reduce_scores(p: torch.Tensor, queries, reduce: str, page_size: int) -> torch.Tensor:
    """p: softmax probabilities [Hq, n, L]; averaged over the chosen query rows.
    TOKEN_MEAN -> [L] mean over heads; PAGE_MAX_SUM -> [ceil(L/page)] max over heads, summed per page."""
    p = p[:, list(queries)]
    if reduce == TOKEN_MEAN:
        return p.mean(dim=0).mean(dim=0)
    if reduce == PAGE_MAX_SUM:
        tok = p.amax(dim=0)  # [nq, L]
        pad = (-tok.shape[-1]) % page_size
        if pad:
            tok = F.pad(tok, (0, pad))
        return tok.view(tok.shape[0], -1, page_size).sum(-1).mean(dim=0)
    raise ValueError(f"unknown score reduction {reduce!r}")


class TorchAttention:
    name = "torch"

    def attend(self, layer, q, k_cache, v_cache, meta: AttentionMeta):
        out = torch.empty_like(q)
        captures: dict[int, torch.Tensor] = {}
        for i, row in enumerate(meta.rows):
            o, scores = self.attend_row(layer, q[row.q_start:row.q_start + row.n], k_cache, v_cache, row, meta)
            out[row.q_start:row.q_start + row.n] = o
            if scores is not None:
                captures[i] = scores
        return out, captures

    def attend_row(self, layer, q, k_cache, v_cache, row: RowMeta, meta: AttentionMeta):
        """One row's attention (q: its [n, Hq, D] queries): (out [n, Hq, D], its scores or None). Shorter
        rows use a plain matmul-softmax-matmul, faster than SDPA for few queries on CPU."""
        n, hq, d = q.shape
        q = q.to(k_cache.dtype)  # in the pool's dtype: the compiled dense path hands fp32 queries over a bf16 pool
        hkv = k_cache.shape[0]
        g = hq // hkv
        idx = row.view(layer)
        capture = row.captures_at(layer)
        if idx is None:
            k = k_cache[:, row.base:row.base + row.start + n]  # in place, no copy
            v = v_cache[:, row.base:row.base + row.start + n]
            key_pos = None
        else:
            k = k_cache.index_select(1, idx)
            v = v_cache.index_select(1, idx)
            key_pos = row.sparse_pos[layer]
        L = k.shape[1]
        if n >= SDPA_MIN_QUERIES and not capture:
            kp = torch.arange(L, device=q.device) if key_pos is None else key_pos
            return sdpa_row(q, k, v, kp, row.start, meta.scale), None
        # [Hkv, G, n, D]: query head h = kv * G + g, as in transformers' repeat_kv
        qg = q.view(n, hkv, g, d).permute(1, 2, 0, 3)
        # scale the few queries rather than the long score rows
        s = torch.bmm((qg * meta.scale).reshape(hkv, g * n, d), k.transpose(1, 2)).view(hkv, g, n, L)
        if n > 1:
            # Every prefix key is visible to every query; only the row's own n keys (the last n
            # columns, in order) need the causal triangle.
            tail = torch.ones(n, n, dtype=torch.bool, device=q.device).triu_(1)
            s[..., L - n:].masked_fill_(tail, float("-inf"))
        p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.bmm(p.view(hkv, g * n, L), v).view(hkv, g, n, d)
        scores = None
        if capture:
            scores = reduce_scores(p.reshape(hq, n, L).float(), row.capture_queries, row.capture_reduce,
                                   meta.page_size)
        return o.permute(2, 0, 1, 3).reshape(n, hq, d), scores

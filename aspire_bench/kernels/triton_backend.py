"""Triton attention backend ("triton"): the mixed-batch paged kernel for decode/draft/verify rows,
the score kernel for captures, flash-attn/SDPA for long prefill chunks. Same interface and results as
torch_ref.TorchAttention (see base.py)."""
from __future__ import annotations

import torch

from ..errors import ConfigError
from . import triton_common as tc
from .base import SDPA_MIN_QUERIES, AttentionMeta
from .flash_prefill import prefill_row
from .triton_attention import RowSpec, max_block_m, paged_attention, plan_attention
from .triton_scores import ScoreRow, attention_scores


class TritonAttention:
    name = "triton"

    def __init__(self, block_n: int = 64, min_chunk: int = 512, target_programs: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None):
        """min_chunk / target_programs steer split-K (see plan_attention); tests shrink them to force
        splits on tiny contexts. block_n / num_warps / num_stages: tiling and launch knobs of the
        attention kernel (benchmarks/gpu_kernels.py --tune compares a few)."""
        self.block_n = block_n
        self.num_warps = num_warps
        self.num_stages = num_stages
        self.min_chunk = min_chunk
        self.target_programs = target_programs

    def attend(self, layer, q, k_cache, v_cache, meta: AttentionMeta):
        if not q.is_cuda and not tc.interpreting():
            raise ConfigError("attention backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1 for "
                              "testing): use --attention-backend torch on CPU")
        out = tc.empty(q.shape, q.dtype, q.device)
        specs: list[RowSpec] = []
        sig = []
        captures = []  # (row index, ScoreRow): kernel rows, lse from the attention kernel
        late = []  # capturing prefill rows: their scores run both passes in triton_scores
        for i, row in enumerate(meta.rows):
            idx = row.view(layer)
            capture = row.captures_at(layer)
            srow = ScoreRow(row.q_start, row.start, row.base, row.start + row.n, tuple(row.capture_queries),
                            row.capture_reduce) if capture else None
            if row.n >= SDPA_MIN_QUERIES:
                # Prefill chunk (e.g. Vegas' last chunk, which captures at every layer): compute-bound,
                # so flash-attn/SDPA; the decode kernel would re-read K/V once per 16 queries.
                out[row.q_start:row.q_start + row.n] = prefill_row(
                    q[row.q_start:row.q_start + row.n], k_cache, v_cache, row.base, row.start, meta.scale,
                    idx, row.sparse_pos[layer] if idx is not None else None)
                sig.append(False)
                if capture:
                    late.append((i, srow))
                continue
            specs.append(RowSpec(row.q_start, row.n, row.start, row.base,
                                 row.start + row.n if idx is None else idx.numel(), idx,
                                 row.sparse_pos[layer] if idx is not None else None))
            sig.append(id(idx) if idx is not None else True)
            if capture:
                captures.append((i, srow))
        result: dict[int, torch.Tensor] = {}
        if specs:
            # Layers sharing the same views (all but the refresh layer in ASPIRE, every layer in AR and
            # MagicDec) share one plan: the host-side flattening and copies happen once per forward.
            cache = meta.backend_cache
            key = ("plan", tuple(sig))
            plan = cache.get(key)
            if plan is None:
                plan = plan_attention(specs, q.shape[0], k_cache.shape[0], q.shape[1] // k_cache.shape[0],
                                      q.device, self.block_n, self.min_chunk, self.target_programs,
                                      max_block_m(q.dtype))
                cache[key] = plan
            ws = cache.setdefault("workspace", {})
            out, lse = paged_attention(q, k_cache, v_cache, plan, meta.scale, out=out,
                                       want_lse=bool(captures), block_n=self.block_n, workspace=ws,
                                       num_warps=self.num_warps, num_stages=self.num_stages)
            if captures:
                scores = attention_scores(q, k_cache, lse, [c for _, c in captures], meta.scale,
                                          meta.page_size, self.block_n)
                result.update({i: sc for (i, _), sc in zip(captures, scores)})
        if late:
            scores = attention_scores(q, k_cache, None, [c for _, c in late], meta.scale, meta.page_size,
                                      self.block_n)
            result.update({i: sc for (i, _), sc in zip(late, scores)})
        return out, result

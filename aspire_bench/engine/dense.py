"""The CPU dense paths: a layer's norms, RoPE, projections and MLP in fewer calls than model.py's eager ones.

On a CPU with a small model a forward is dominated by per-call overhead, not arithmetic, so these paths
remove calls (same maths, fp32 rounding order aside). `CompiledDense` (backend `cpp`, the default on a
CPU; at the end of this file) runs a layer as one compiled C++ call, in fp32 over an fp32 or bf16 pool.
`FusedDense` (backend `fused`, the fp32 fallback without a C++ compiler) folds each RMSNorm weight into
the next projection, q/k norm weights into RoPE tables built once per forward, and runs projections
through oneDNN with prepacked weights and the residual add as a post-op (plain `F.linear` where torch
has no oneDNN). Other dtypes and devices run the eager reference in model.py (docs/kernels.md).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

_TABLE_LIMIT = 1 << 20  # floats: larger per-forward q/k tables (long prefill chunks) are built per layer
_SMALL = 1 << 19  # multiply-adds under which MKL's sgemm beats oneDNN's call (see Proj)
_SMALL_WEIGHT = 1 << 17  # floats: matrices at most this big also keep a plain copy for F.linear
_warned = False


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Proj:
    """y = x @ W^T (+ b), optionally added to a residual in the same call.

    oneDNN's call has a larger fixed cost than MKL's sgemm, which its faster kernel only repays on larger
    products: below _SMALL multiply-adds a matrix small enough to keep a plain copy goes to F.linear."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, packed: bool):
        self.out_features, self.in_features = w.shape
        self.b = b
        self.pk = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 8) if packed else None
        self.w = w.contiguous() if not packed or w.numel() <= _SMALL_WEIGHT else None

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T + b (+ residual, fused into the matmul's epilogue)."""
        if self.pk is not None and (self.w is None or x.shape[0] * self.w.numel() >= _SMALL):
            lp = torch.ops.mkldnn._linear_pointwise
            if residual is not None:
                return lp.binary(x, residual, self.pk, self.b, "add")
            return lp(x, self.pk, self.b, "none", [], "")
        if residual is not None and self.b is None:
            return torch.addmm(residual, x, self.w.t())
        y = F.linear(x, self.w, self.b)
        return y if residual is None else y.add_(residual)


class FusedLayer:
    def __init__(self, w, packed: bool):
        self.qkv = Proj(w.wqkv * w.attn_norm, w.bqkv, packed)
        self.o = Proj(w.wo, w.bo, packed)
        self.gate_up = Proj(w.w_gate_up * w.mlp_norm, w.b_gate_up, packed)
        self.down = Proj(w.w_down, w.b_down, packed)


def _inv_rms(x: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """rsqrt(mean(x^2) + eps) over the last dim, keepdim; three calls (pow + mean cost twice that)."""
    n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return torch.addcmul(eps, n, n, value=1.0 / x.shape[-1]).rsqrt_()


class FusedDense:
    """Prepared weights of one model for the fused path (built once, at engine creation)."""

    def __init__(self, model):
        global _warned
        cfg = model.cfg
        packed = onednn_available()
        if not packed and not _warned:
            _warned = True
            warnings.warn("this torch build has no oneDNN: the fused dense path uses plain F.linear", stacklevel=2)
        self.cfg = cfg
        self.layers = [FusedLayer(w, packed) for w in model.layers]
        self.head = Proj(model.lm_head, None, packed)
        self.norm = model.norm
        self.eps = torch.tensor(cfg.rms_norm_eps, dtype=model.dtype, device=model.device)
        d = cfg.head_dim
        half = d // 2
        self._sign = torch.cat((-torch.ones(half), torch.ones(d - half))).to(model.device, model.dtype)
        if cfg.qk_norm:  # per layer [Hq + Hkv, D]: q_norm's weight for the query heads, k_norm's for the keys
            self.qk_w = torch.stack([torch.cat((w.q_norm.expand(cfg.num_heads, d), w.k_norm.expand(cfg.num_kv_heads, d)))
                                     for w in model.layers])
            self.qk_w_rolled = self.qk_w.roll(half, -1)

    def _tables(self, cos: torch.Tensor, sin: torch.Tensor):
        """Per layer (A, B) with rope(norm(x)) = r * (x A + roll(x) B); r = 1/rms per head (Qwen3) or 1."""
        sin = sin * self._sign
        if not self.cfg.qk_norm:
            a, b = cos[:, None], sin[:, None]
            return [(a, b)] * len(self.layers)
        if self.qk_w.numel() * cos.shape[0] <= _TABLE_LIMIT:
            a = self.qk_w[:, None] * cos[None, :, None]  # [L, T, H, D]
            b = self.qk_w_rolled[:, None] * sin[None, :, None]
            return list(zip(a, b))
        return _LazyTables(self.qk_w, self.qk_w_rolled, cos, sin)

    def forward(self, model, tokens, cos, sin, dest, k_cache, v_cache, meta, backend, logit_rows):
        cfg = self.cfg
        T = tokens.shape[0]
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        H, eps, half = hq + hkv, self.eps, d // 2
        tables = self._tables(cos, sin)
        x = model.embed[tokens]
        captures: dict[int, dict[int, torch.Tensor]] = {}
        for li, f in enumerate(self.layers):
            qkv = f.qkv(x * _inv_rms(x, eps))
            qk = qkv[:, :H * d].view(T, H, d)
            a, b = tables[li]
            rot = torch.addcmul(qk * a, qk.roll(half, -1), b)
            if cfg.qk_norm:
                rot.mul_(_inv_rms(qk, eps))
            q = rot[:, :hq].contiguous()
            k_cache[li].index_copy_(1, dest, rot[:, hq:].transpose(0, 1))
            v_cache[li].index_copy_(1, dest, qkv[:, H * d:].view(T, hkv, d).transpose(0, 1))
            attn, caps = backend.attend(li, q, k_cache[li], v_cache[li], meta)
            for row, scores in caps.items():
                captures.setdefault(row, {})[li] = scores
            x = f.o(attn.view(T, hq * d), residual=x)
            gate, up = f.gate_up(x * _inv_rms(x, eps)).chunk(2, dim=-1)
            x = f.down(F.silu(gate).mul_(up), residual=x)
        x = x[logit_rows]
        return self.head(F.rms_norm(x, (x.shape[-1],), self.norm, cfg.rms_norm_eps)), captures


class _LazyTables:
    """The q/k tables of one layer at a time, for forwards too long to hold all layers' at once."""

    def __init__(self, w, w_rolled, cos, sin):
        self.w, self.w_rolled, self.cos, self.sin = w, w_rolled, cos[:, None], sin[:, None]

    def __getitem__(self, li):
        return self.w[li] * self.cos, self.w_rolled[li] * self.sin


class CompiledDense:
    """The compiled dense path (kernels/csrc/cpu_dense.cpp): one C++ call per layer for everything
    between two attention calls, one for the final norm and LM head; fp32 arithmetic on a CPU, over an
    fp32 or a bf16 model (a bf16 model's weights packed into bf16 panels that the kernel widens as it
    reads them, its KV rounded to bf16 as it is written).

    Per-call overhead, not arithmetic, dominates the fused path on a small model (~20 torch calls per
    layer): here a forward is 17 ctypes calls plus the attention backend's 16, or one call running the
    whole layer loop when the backend can hand over every layer's kernel call up front (the compiled
    CPU attention backend, for forwards without prefill chunks). The weights are packed once into the
    kernel's panels (a copy: the model's tensors stay as they are)."""

    _POINTERS = ("attn_norm", "wqkv", "bqkv", "q_norm", "k_norm", "wo", "bo", "mlp_norm", "w_gate_up",
                 "b_gate_up", "w_down", "b_down")
    _PANELS = frozenset({"wqkv", "wo", "w_gate_up", "w_down"})  # packed weights, in the model's panel dtype

    def __init__(self, model):
        from ..kernels import cpu_dense

        lib = cpu_dense.load_library()
        # the weights' panels and the KV pool share one element: a bf16 model's, else fp32
        self.dtype = cpu_dense.panel_dtype(model.dtype)
        bf16 = self.dtype == torch.bfloat16
        self._head = lib.aspire_dense_head_bf16 if bf16 else lib.aspire_dense_head
        self._layer_fn, self._forward_fn = ((lib.aspire_dense_layer_bf16, lib.aspire_dense_forward_bf16) if bf16
                                            else (lib.aspire_dense_layer, lib.aspire_dense_forward))
        cfg = self.cfg = model.cfg
        self._keep = []  # every tensor whose address the kernel holds

        def addr(t: torch.Tensor | None, panel: bool = False) -> int:
            if t is None:
                return 0
            t = t.detach().to(self.dtype if panel else torch.float32).contiguous()  # norms and biases: fp32
            self._keep.append(t)
            return t.data_ptr()

        self._ptrs = []
        for w in model.layers:
            gate_up, b_gate_up = cpu_dense.pack_gate_up(w.w_gate_up, w.b_gate_up)
            packed = {"wqkv": cpu_dense.pack(w.wqkv), "bqkv": cpu_dense.pad_bias(w.bqkv),
                      "wo": cpu_dense.pack(w.wo), "bo": cpu_dense.pad_bias(w.bo),
                      "w_gate_up": gate_up, "b_gate_up": b_gate_up,
                      "w_down": cpu_dense.pack(w.w_down), "b_down": cpu_dense.pad_bias(w.b_down)}
            ptrs = torch.tensor([addr(packed[n] if n in packed else getattr(w, n), n in self._PANELS)
                                 for n in self._POINTERS], dtype=torch.int64)
            self._ptrs.append(ptrs)
        self._ptr_addr = [p.data_ptr() for p in self._ptrs]
        self._layer_table = torch.tensor(self._ptr_addr, dtype=torch.int64)
        self._norm = addr(model.norm)
        self._lm_head = addr(cpu_dense.pack(model.lm_head), panel=True)
        self.vocab = model.lm_head.shape[0]
        self._shape = [cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.layers[0].w_down.shape[1]]
        self._dims = torch.tensor([*self._shape, 0], dtype=torch.int64)  # the head's call reads dims[0] only
        self.eps = float(cfg.rms_norm_eps)

    def forward(self, model, tokens, cos, sin, dest, k_cache, v_cache, meta, backend, logit_rows):
        cfg = self.cfg
        T = tokens.shape[0]
        L, hq, d = len(self._ptrs), cfg.num_heads, cfg.head_dim
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or dest.dtype != torch.int64:
            raise ValueError("the compiled dense path needs contiguous K/V pools and int64 destinations")
        if k_cache.dtype != self.dtype or v_cache.dtype != self.dtype:
            raise ValueError(f"the compiled dense path of a {self.dtype} model needs a {self.dtype} KV pool, not "
                             f"{k_cache.dtype}")
        layer_fn, forward_fn = self._layer_fn, self._forward_fn
        # per forward, with this pool's capacity: engines sharing the model may have pools of other sizes
        dims_t = torch.tensor([*self._shape, k_cache.shape[2]], dtype=torch.int64)
        dims, eps, threads = dims_t.data_ptr(), self.eps, torch.get_num_threads()
        x = model.embed[tokens].float().contiguous()
        q = torch.empty(T, hq, d)
        cos, sin, dest = cos.contiguous(), sin.contiguous(), dest.contiguous()  # fp32 tables (model.forward)
        xp, qp, kp, vp = x.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()
        dp, cp, sp = dest.data_ptr(), cos.data_ptr(), sin.data_ptr()
        layer_calls = getattr(backend, "layer_calls", None)
        calls = layer_calls(meta, q, L, k_cache.dtype) if layer_calls else None
        if calls is not None:  # the whole layer loop in one call
            attn = torch.empty(T, hq, d)
            rc = forward_fn(self._layer_table.data_ptr(), L, dims, eps, xp, attn.data_ptr(), qp, kp, vp, dp, cp,
                            sp, T, calls.attention, calls.reduce_scores, calls.table.data_ptr(), meta.scale,
                            meta.page_size, threads)
            if rc == 1:
                raise ValueError(f"the compiled dense path needs an even head dim, not {d}: use dense backend fused")
            if rc:
                raise ValueError(f"the CPU attention kernel rejected the shapes (Hq={hq}, D={d}, page size "
                                 f"{meta.page_size}; code {rc})")
            return self._logits(xp, dims, eps, logit_rows, threads), calls.captures()
        if layer_fn(None, self._ptr_addr[0], 0, dims, eps, xp, None, qp, kp, vp, dp, cp, sp, T, threads):
            raise ValueError(f"the compiled dense path needs an even head dim, not {d}: use dense backend fused")
        captures: dict[int, dict[int, torch.Tensor]] = {}
        for li in range(L):
            attn, caps = backend.attend(li, q, k_cache[li], v_cache[li], meta)
            for row, scores in caps.items():
                captures.setdefault(row, {})[li] = scores
            attn = attn.contiguous()
            nxt = self._ptr_addr[li + 1] if li + 1 < L else None  # q is free again: the next layer's goes there
            layer_fn(self._ptr_addr[li], nxt, li + 1, dims, eps, xp, attn.data_ptr(), qp, kp, vp, dp, cp, sp,
                     T, threads)
        return self._logits(xp, dims, eps, logit_rows, threads), captures

    def _logits(self, xp: int, dims: int, eps: float, logit_rows: torch.Tensor, threads: int) -> torch.Tensor:
        rows = logit_rows.to(torch.int64).contiguous()
        logits = torch.empty(rows.shape[0], self.vocab)
        if rows.shape[0]:
            self._head(self._norm, self._lm_head, dims, eps, xp, rows.data_ptr(), rows.shape[0], self.vocab,
                       logits.data_ptr(), threads)
        return logits

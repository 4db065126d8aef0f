"""Llama / Qwen2 / Qwen3 decoder-only transformer over our own KV cache (gpt-fast style).

Weights are plain tensors; q/k/v and gate/up projections are fused so a layer is few matmuls.
The forward takes flattened tokens of a mixed batch; attention is delegated to a backend.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..kernels.base import AttentionBackend, AttentionMeta
from ..kernels.cpu_attention import KernelBuildError
from .config import ModelConfig, dynamic_ntk_inv_freq, rope_attention_factor, rope_inv_freq
from .dense import CompiledDense, FusedDense

DENSE_BACKENDS = ("auto", "cpp", "fused", "eager")
_warned_fallback = False


def _warn_fallback(e: Exception, path: str) -> None:
    global _warned_fallback
    _warned_fallback = True
    warnings.warn(f"{e}\nfalling back to the {path} torch dense path (slower on CPU)", stacklevel=4)


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    wqkv: torch.Tensor  # [(Hq + 2 Hkv) * D, hidden]
    bqkv: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    mlp_norm: torch.Tensor
    w_gate_up: torch.Tensor  # [2 * inter, hidden]
    b_gate_up: torch.Tensor | None
    w_down: torch.Tensor
    b_down: torch.Tensor | None


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # fused, and bit-identical to the formula below in fp32
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf.to(x.dtype)) * w


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D] (first half / second half convention of HF)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rot = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


class Transformer:
    def __init__(self, cfg: ModelConfig, embed: torch.Tensor, layers: list[LayerWeights],
                 norm: torch.Tensor, lm_head: torch.Tensor):
        self.cfg = cfg
        self.embed = embed
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head
        self.dtype = embed.dtype
        self.device = embed.device
        self._inv_freq = rope_inv_freq(cfg).to(self.device)
        self._cos = self._sin = torch.empty(0, cfg.head_dim, device=self.device)
        self._fused: FusedDense | None = None  # built on first use, shared by the engines on this model
        self._compiled: CompiledDense | bool | None = None  # likewise; False: it could not be built

    def prepare_dense(self, backend: str) -> str:
        """How a layer's dense part runs: `cpp` (dense.py's CompiledDense: one compiled C++ call per
        layer; fp32 or bf16 on a CPU, computing in fp32; needs a C++ compiler), `fused` (dense.py:
        folded norms, RoPE tables, prepacked oneDNN projections; fp32 on a CPU), `eager` (the reference
        below), or `auto` (cpp where it applies; else, with one warning, fused for fp32 and eager for
        bf16 when it cannot be built). Returns the one chosen, for `forward(dense=...)`."""
        if backend not in DENSE_BACKENDS:
            raise ConfigError(f"unknown dense backend {backend!r}: choose one of {', '.join(DENSE_BACKENDS)}")
        cpu, dtype = self.device.type == "cpu", str(self.dtype).replace("torch.", "")
        fits = cpu and self.dtype == torch.float32  # the fused path's
        fits_cpp = cpu and self.dtype in (torch.float32, torch.bfloat16)
        if (backend == "fused" and not fits) or (backend == "cpp" and not fits_cpp):
            runs = "fp32" if backend == "fused" else "fp32 or bf16"
            raise ConfigError(f"the {backend} dense path runs {runs} on a CPU, not {dtype} on {self.device.type}: "
                              f"use dense backend eager or auto")
        if backend in ("cpp", "auto") and fits_cpp:
            if self._compiled is None:
                try:
                    self._compiled = CompiledDense(self)
                except KernelBuildError as e:
                    if backend == "cpp":
                        raise
                    if not _warned_fallback:
                        _warn_fallback(e, "fused" if fits else "eager")
                    self._compiled = False
            if self._compiled:
                return "cpp"
        chosen = "fused" if backend == "fused" or (backend == "auto" and fits) else "eager"
        if chosen == "fused" and self._fused is None:
            self._fused = FusedDense(self)
        return chosen

    def _rope_tables(self, positions: torch.Tensor, dtype: torch.dtype | None = None):
        need = int(positions.max()) + 1
        if need > self._cos.shape[0]:
            size = max(need, 2 * self._cos.shape[0], 4096)
            t = torch.arange(size, device=self.device, dtype=torch.float32)
            freqs = torch.outer(t, self._inv_freq)
            if self.cfg.rope["rope_type"] == "dynamic" and size > self.cfg.max_position_embeddings:
                # Each position past the original context is rotated with the base of the sequence length at
                # which it is written (position + 1), as transformers does token by token; so a position's
                # rotation never depends on which decoder wrote it, or how many tokens it wrote at once.
                past = t[self.cfg.max_position_embeddings:]
                inv = dynamic_ntk_inv_freq(self.cfg, past + 1).float().to(self.device)
                freqs[self.cfg.max_position_embeddings:] = past[:, None] * inv
            emb = torch.cat((freqs, freqs), dim=-1)
            scale = rope_attention_factor(self.cfg)  # YaRN scales cos and sin; 1 otherwise
            self._cos, self._sin = emb.cos() * scale, emb.sin() * scale
        dtype = dtype or self.dtype
        return self._cos[positions].to(dtype), self._sin[positions].to(dtype)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, dest: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMeta,
                backend: AttentionBackend, logit_rows: torch.Tensor, dense: str = "eager"):
        """tokens/positions/dest: [T]; dest = pool index where each token's KV is written.
        Returns logits [len(logit_rows), vocab] (fp32) and {row: {layer: scores}}."""
        cfg = self.cfg
        T = tokens.shape[0]
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        cos, sin = self._rope_tables(positions, torch.float32 if dense == "cpp" else self.dtype)
        if dense == "cpp":
            return self._compiled.forward(self, tokens, cos, sin, dest, k_cache, v_cache, meta, backend, logit_rows)
        if dense == "fused":
            return self._fused.forward(self, tokens, cos, sin, dest, k_cache, v_cache, meta, backend, logit_rows)
        x = self.embed[tokens]
        captures: dict[int, dict[int, torch.Tensor]] = {}
        for li, w in enumerate(self.layers):
            h = rms_norm(x, w.attn_norm, cfg.rms_norm_eps)
            qkv = F.linear(h, w.wqkv, w.bqkv)
            q = qkv[:, :hq * d].view(T, hq, d)
            k = qkv[:, hq * d:(hq + hkv) * d].view(T, hkv, d)
            v = qkv[:, (hq + hkv) * d:].view(T, hkv, d)
            if cfg.qk_norm:
                q = rms_norm(q, w.q_norm, cfg.rms_norm_eps)
                k = rms_norm(k, w.k_norm, cfg.rms_norm_eps)
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
            k_cache[li].index_copy_(1, dest, k.transpose(0, 1))
            v_cache[li].index_copy_(1, dest, v.transpose(0, 1))
            attn, caps = backend.attend(li, q, k_cache[li], v_cache[li], meta)
            for row, scores in caps.items():
                captures.setdefault(row, {})[li] = scores
            x = x + F.linear(attn.reshape(T, hq * d), w.wo, w.bo)
            h = rms_norm(x, w.mlp_norm, cfg.rms_norm_eps)
            gu = F.linear(h, w.w_gate_up, w.b_gate_up)
            gate, up = gu.chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w.w_down, w.b_down)
        x = rms_norm(x[logit_rows], self.norm, cfg.rms_norm_eps)
        return F.linear(x, self.lm_head).float(), captures

    def weight_bytes(self) -> int:
        """Bytes of weights read by one forward (embedding rows excluded: only T rows are read)."""
        total = self.lm_head.numel() * self.lm_head.element_size() + self.norm.numel() * self.norm.element_size()
        for w in self.layers:
            for t in vars(w).values():
                if t is not None:
                    total += t.numel() * t.element_size()
        return total

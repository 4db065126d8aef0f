"""The compiled dense path (dense backend cpp) against the eager reference on fresh random inputs."""
from __future__ import annotations

import json

import pytest
import torch

from aspire_bench.engine import Engine, PageView, Row
from aspire_bench.engine.loading import random_model
from aspire_bench.kernels import cpu_dense
from aspire_bench.tinymodel import TINY_DIR

TINY = json.loads((TINY_DIR / "config.json").read_text())
# Shapes that leave the kernel's panels partly filled: hidden 80, intermediate 100 (neither a multiple
# of 16), head dim 16 or 24; q/k/v bias (Qwen2), MLP bias and an untied head (Llama), q/k norm (Qwen3).
QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 300, "hidden_size": 80, "intermediate_size": 100,
         "num_hidden_layers": 3, "num_attention_heads": 5, "num_key_value_heads": 1, "head_dim": 16,
         "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": True}
LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 333, "hidden_size": 96, "intermediate_size": 200,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
         "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "tie_word_embeddings": False}
CASES = {"tiny-qwen3": (TINY, "cpu"), "qwen2-bias": (QWEN2, "cpu"), "llama-mlp-bias": (LLAMA, "torch")}


def close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape
    if ref.numel():  # fp32 rounding order differs: a tolerance relative to the logits' size
        torch.testing.assert_close(out, ref, atol=2e-4 * max(1.0, ref.abs().max().item()), rtol=1e-4)


def scrambled(config: dict, seed: int):
    """A random model whose norm weights and biases are not 1 and 0 (random_model's init) either; Llama
    gets MLP biases too (random_model makes none)."""
    model = random_model(config, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    if model.cfg.family == "llama":
        for w in model.layers:
            w.b_gate_up, w.b_down = torch.empty(w.w_gate_up.shape[0]), torch.empty(w.w_down.shape[0])
    with torch.no_grad():
        model.embed.normal_(0.0, 1.0, generator=g)
        model.norm.uniform_(0.5, 1.5, generator=g)
        for w in model.layers:
            for name, t in vars(w).items():
                if t is None:
                    continue
                if "norm" in name:
                    t.uniform_(0.5, 1.5, generator=g)
                else:
                    t.normal_(0.0, 0.1 if name.startswith("w") else 0.5, generator=g)
        if not model.cfg.tie_word_embeddings:
            model.lm_head.normal_(0.0, 0.1, generator=g)
    return model


def run(model, dense: str, backend: str, steps: list[list[tuple[int, int, str]]], seed: int):
    """Forwards of rows (slot index, tokens, logits) per step on fresh random token ids; returns the logits
    of every step and the K/V pools at the end."""
    eng = Engine(model, attention_backend=backend, dense_backend=dense)
    assert eng.dense_backend == dense
    eng.reserve(2048)
    slots = [eng.alloc(256) for _ in range(4)]
    g = torch.Generator().manual_seed(seed)
    logits = []
    for step in steps:
        rows = [Row(slots[i], torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist(), slots[i].length,
                    logits=lg) for i, n, lg in step]
        logits.append(eng.forward(rows).logits)
    return logits, eng.cache.k, eng.cache.v


# Prefill chunks of odd lengths beside decode rows, then verify-sized blocks and 1-token steps of rows
# at different lengths in one forward, and logits of every kind (all, last, none).
STEPS = [[(0, 13, "last"), (1, 1, "all"), (2, 40, "none")],
         [(0, 13, "none"), (1, 7, "all"), (2, 9, "all"), (3, 3, "last")],
         [(0, 1, "all"), (1, 1, "last"), (2, 5, "all"), (3, 1, "all")],
         [(2, 1, "all")]]


@pytest.mark.parametrize("case", CASES)
def test_compiled_dense_matches_eager(case):
    config, backend = CASES[case]
    model = scrambled(config, seed=len(case))
    ref, k_ref, v_ref = run(model, "eager", backend, STEPS, seed=7)
    out, k, v = run(model, "cpp", backend, STEPS, seed=7)
    for step_ref, step_out in zip(ref, out):
        assert len(step_ref) == len(step_out)
        for a, b in zip(step_ref, step_out):
            close(b, a)
    torch.testing.assert_close(k, k_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v, v_ref, atol=1e-4, rtol=1e-4)


def test_compiled_dense_with_sparse_rows_and_captures_matches_eager():
    """A draft step's rows (a page view, scores captured at one layer) go through unchanged."""
    model = scrambled(TINY, seed=3)
    results = []
    for dense in ("eager", "cpp"):
        eng = Engine(model, attention_backend="cpu", dense_backend=dense)
        eng.reserve(1024)
        slots = [eng.alloc(300) for _ in range(3)]
        g = torch.Generator().manual_seed(11)
        eng.forward([Row(s, torch.randint(0, 4096, (n,), generator=g).tolist(), 0, logits="none")
                     for s, n in zip(slots, (200, 77, 129))])
        from aspire_bench.engine import Capture
        rows = [Row(s, [int(torch.randint(0, 4096, (1,), generator=g))], s.length,
                    view=PageView(torch.tensor([0, 2, s.length // 16 - 1])), full_layers=frozenset({14}),
                    capture=Capture([14], [-1])) for s in slots]
        results.append(eng.forward(rows))
    ref, out = results
    for a, b in zip(ref.logits, out.logits):
        close(b, a)
    assert ref.captures.keys() == out.captures.keys() and ref.captures
    for row in ref.captures:
        for layer in ref.captures[row]:
            torch.testing.assert_close(out.captures[row][layer], ref.captures[row][layer], atol=1e-4, rtol=1e-4)


class LayerByLayer:
    """The compiled attention backend without its whole-forward hand-over: the layer loop stays in Python."""

    def __init__(self, backend):
        self.inner, self.name = backend, backend.name

    def attend(self, *args):
        return self.inner.attend(*args)


def test_the_layer_loop_in_one_call_matches_the_loop_in_python():
    """The same kernels in the same order, so the same bits: rows of every kind, a page view with
    ASPIRE's capture at one layer, per-layer token views and Vegas's token-mean capture at every layer."""
    from aspire_bench.engine import TOKEN_MEAN, Capture, LayerTokenView
    model = scrambled(TINY, seed=4)
    L = model.cfg.num_layers
    outs, loops = [], []
    for in_one_call in (True, False):
        eng = Engine(model, attention_backend="cpu", dense_backend="cpp")
        calls = []
        real = eng.backend.layer_calls

        def layer_calls(*args, real=real, calls=calls):
            out = real(*args)
            calls.append(out is not None)
            return out
        eng.backend.layer_calls = layer_calls
        if not in_one_call:
            eng.backend = LayerByLayer(eng.backend)
        eng.reserve(2048)
        slots = [eng.alloc(400) for _ in range(4)]
        g = torch.Generator().manual_seed(5)

        def ids(n, g=g):
            return torch.randint(0, 4096, (n,), generator=g).tolist()
        eng.forward([Row(s, ids(n), 0, logits="none") for s, n in zip(slots, (300, 140, 77, 201))])
        tokens = torch.stack([torch.randperm(130, generator=g)[:40].sort().values for _ in range(L)])
        step = [Row(slots[0], ids(1), slots[0].length, view=PageView(torch.tensor([0, 5, 18])),
                    full_layers=frozenset({L - 2}), capture=Capture([L - 2], [-1])),
                Row(slots[1], ids(1), slots[1].length, view=LayerTokenView(tokens)),
                Row(slots[2], ids(4), slots[2].length, logits="all",
                    capture=Capture(range(L), [0, -1], TOKEN_MEAN)),
                Row(slots[3], ids(3), slots[3].length, logits="all", capture=Capture([L - 2], [0, -1]))]
        outs.append(eng.forward(step))
        loops.append(calls[-1] if calls else None)
    assert loops == [True, None]  # the first forward ran its layer loop in one call, the second never could
    one_call, per_layer = outs
    for a, b in zip(one_call.logits, per_layer.logits):
        assert torch.equal(a, b)
    assert one_call.captures.keys() == per_layer.captures.keys() == {0, 2, 3}
    for row, layers in per_layer.captures.items():
        assert one_call.captures[row].keys() == layers.keys()
        for layer, scores in layers.items():
            assert torch.equal(one_call.captures[row][layer], scores)


def test_a_token_gets_the_same_result_in_any_batch():
    """The kernel sums each output in one order whatever the number of tokens in the call (no
    attention involved: the dense kernels alone, by packing and calling them as a forward does)."""
    model = scrambled(QWEN2, seed=5)
    eng = Engine(model, attention_backend="torch", dense_backend="cpp")
    compiled = model._compiled
    x = torch.randn(19, model.cfg.hidden_size)
    rows = torch.arange(19)

    def head(xs):
        out = torch.empty(xs.shape[0], compiled.vocab)
        r = rows[:xs.shape[0]].contiguous()
        compiled._head(compiled._norm, compiled._lm_head, compiled._dims.data_ptr(), compiled.eps, xs.data_ptr(),
                       r.data_ptr(), r.shape[0], compiled.vocab, out.data_ptr(), 1)
        return out
    full = head(x.contiguous())
    for n in (1, 3, 8, 9):
        assert torch.equal(head(x[:n].contiguous()), full[:n])
    assert eng.dense_backend == "cpp"


def test_packing_layouts():
    w = torch.arange(3 * 40, dtype=torch.float32).view(40, 3)  # 40 outputs: two panels, the second padded
    p = cpu_dense.pack(w)
    assert p.shape == (2, 3, 32)
    assert torch.equal(p[0, :, 5], w[5]) and torch.equal(p[1, :, 7], w[39]) and not p[1, :, 8:].any()
    gu = torch.arange(2 * 20 * 2, dtype=torch.float32).view(40, 2)  # gate rows 0..19, up rows 20..39
    b = torch.arange(40, dtype=torch.float32)
    pg, pb = cpu_dense.pack_gate_up(gu, b)
    assert pg.shape == (2, 2, 32)  # intermediate 20: two panels of 16 gate + 16 up columns
    assert torch.equal(pg[0, :, 3], gu[3]) and torch.equal(pg[0, :, 16 + 3], gu[20 + 3])
    assert torch.equal(pg[1, :, 2], gu[18]) and torch.equal(pg[1, :, 16 + 2], gu[38])
    assert not pg[1, :, 4:16].any() and not pg[1, :, 20:].any()
    assert pb[16 + 3] == 23 and pb[32 + 1] == 17 and pb[48 + 1] == 37 and pb.numel() == 64


def test_bf16_panels_compute_what_fp32_panels_of_the_same_values_do():
    """A bf16 model's weights stay bf16 in their panels (half the bytes a decode step reads) and are
    widened in registers as they are loaded: the arithmetic of fp32 panels holding the same values, so
    a layer's dense work (Wo, the SwiGLU MLP, biases) and the LM head give the same bits."""
    from dataclasses import replace

    from aspire_bench.engine.model import Transformer
    fp32 = scrambled(LLAMA, seed=7)  # MLP biases and an untied head
    with torch.no_grad():  # weights that bf16 holds exactly
        for t in [fp32.embed, fp32.norm, fp32.lm_head, *(t for w in fp32.layers for t in vars(w).values())]:
            if t is not None:
                t.copy_(t.to(torch.bfloat16))

    def bf(t):
        return None if t is None else t.to(torch.bfloat16)
    bf16 = Transformer(fp32.cfg, bf(fp32.embed), [replace(w, **{k: bf(v) for k, v in vars(w).items()})
                                                 for w in fp32.layers], bf(fp32.norm), bf(fp32.lm_head))
    g = torch.Generator().manual_seed(8)
    cfg = fp32.cfg
    xs, attns = torch.randn(41, cfg.hidden_size, generator=g), torch.randn(41, cfg.num_heads * cfg.head_dim, generator=g)
    outs, panel_bytes = {}, {}
    for model in (fp32, bf16):
        Engine(model, attention_backend="torch", dense_backend="cpp")
        c = model._compiled
        panels = [t for t in c._keep if t.dim() == 3]
        assert {t.dtype for t in panels} == {model.dtype}
        panel_bytes[model.dtype] = sum(t.numel() * t.element_size() for t in panels)
        for T in (1, 5, 9, 41):  # tokens per call: tiles of 1, 5, 8 + 1; 41 = 6 blocks, a panel widened once
            x, attn = xs[:T].clone(), attns[:T].contiguous()
            for li in range(len(c._ptrs)):  # the post part only (pre absent): no pool or RoPE involved
                assert c._layer_fn(c._ptr_addr[li], None, 0, c._dims.data_ptr(), c.eps, x.data_ptr(),
                                   attn.data_ptr(), None, None, None, None, None, None, T, 2) == 0
            logits = torch.empty(T, c.vocab)
            rows = torch.arange(T)
            c._head(c._norm, c._lm_head, c._dims.data_ptr(), c.eps, x.data_ptr(), rows.data_ptr(), T, c.vocab,
                    logits.data_ptr(), 2)
            outs[model.dtype, T] = x, logits
    assert panel_bytes[torch.bfloat16] * 2 == panel_bytes[torch.float32]
    for T in (1, 5, 9, 41):
        for ours, theirs in zip(outs[torch.bfloat16, T], outs[torch.float32, T]):
            assert torch.equal(ours, theirs) and ours.abs().sum() > 0

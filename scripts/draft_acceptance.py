"""Draft acceptance of sparse views, measured with the engine: 1 - TV(p, q) per position.

Teacher-forced on a held-out continuation: at each position the target distribution p comes from
full attention, the draft distribution q from the same model through a sparse view of the same KV
(self-speculation), both under the sampling transform (temperature, top-k, top-p). Views:
  window     StreamingLLM: 16 sinks + recent tokens, `--window` in all (MagicDec's draft)
  pages      ASPIRE: 7% of the pages (>= 8 recent), chosen by the refresh layer's scores at the
             previous position (one-token lag)
  pages-norefresh   the same budget, pages chosen only at the start of each `--cycle`-token
             verification cycle (ASPIRE without the refresh layer)
  vegas      Vegas: per layer the top 5% (>= 256) tokens by the attention of the query at the start of
             each 6-token cycle (averaged over heads), plus the tokens written since

--model takes what every command takes: `tiny`, a name from `aspire-bench models` (e.g. smollm2-135m),
a checkpoint directory or a .gguf file.

    python scripts/draft_acceptance.py --model tiny --contexts 4096,16384 --positions 64
"""
from __future__ import annotations

import argparse
import json

import torch

from aspire_bench import corpus
from aspire_bench.decoders.base import SamplingParams
from aspire_bench.decoders.sampler import logits_to_probs
from aspire_bench.decoders.selection import (
    page_budget,
    select_pages,
    streaming_positions,
    token_budget,
    top_tokens,
)
from aspire_bench.decoders.vegas import VegasSettings
from aspire_bench.engine import (
    PAGE_MAX_SUM,
    TOKEN_MEAN,
    Capture,
    Engine,
    LayerTokenView,
    PageView,
    Row,
    TokenView,
)


def heldout_ids(tokenizer, n: int) -> list[int]:
    text = "".join(f"# file: {f.relpath}\n{f.text}" for f in corpus.list_files("heldout"))
    ids = tokenizer.encode(text)
    if len(ids) < n:
        raise SystemExit(f"held-out corpus has {len(ids)} tokens, fewer than {n}")
    return ids[:n]


def measure(engine: Engine, ids: list[int], context: int, positions: int, params: SamplingParams,
            window: int = 256, ratio: float = 0.07, min_pages: int = 32, recent: int = 8, cycle: int = 8) -> dict:
    r = engine.cfg.num_layers - 2
    engine.reserve(context + positions + engine.page_size)
    slot = engine.alloc(context + positions + 1)
    for a in range(0, context - 1, engine.prefill_chunk):
        engine.forward([Row(slot, ids[a:min(a + engine.prefill_chunk, context - 1)], a, logits="none")])
    cap = Capture((r,), (0,), PAGE_MAX_SUM)
    vegas, vegas_cap = VegasSettings(), Capture(tuple(range(engine.cfg.num_layers)), (0,), TOKEN_MEAN)
    scores = fixed = selected = None
    acc: dict[str, list[float]] = {"window": [], "pages": [], "pages-norefresh": [], "vegas": []}
    for t in range(positions):
        pos = context - 1 + t
        tok = [ids[pos]]
        n_pages = -(-pos // engine.page_size)
        budget = page_budget(n_pages, ratio, min_pages)
        views = {}
        win = streaming_positions(pos, 16, window)
        views["window"] = None if win is None else TokenView(win)
        if scores is not None:
            pages = select_pages(scores, n_pages, budget, recent)
            views["pages"] = None if pages is None else PageView(pages)
            if t % cycle == 0:
                fixed = scores
            pages = select_pages(fixed, n_pages, budget, recent)
            views["pages-norefresh"] = None if pages is None else PageView(pages)
        if selected is not None:
            length, sel = selected
            since = torch.arange(length, pos).expand(sel.shape[0], -1)
            views["vegas"] = LayerTokenView(torch.cat((sel, since), dim=1))
        qs = {}
        for name, view in views.items():  # sparse passes first; the full pass rewrites exact KV last
            qs[name] = logits_to_probs(engine.forward([Row(slot, tok, pos, view=view)]).logits[0][-1], params)
        out = engine.forward([Row(slot, tok, pos, capture=cap)])
        p = logits_to_probs(out.logits[0][-1], params)
        scores = out.captures[0][r]
        if t % vegas.gamma == 0:  # a verification: the same token again (the same KV), every layer's scores
            layer_scores = engine.forward([Row(slot, tok, pos, capture=vegas_cap, logits="none")]).captures[0]
            length = pos + 1
            k = token_budget(length, vegas.ratio, vegas.min_tokens)
            stacked = torch.stack([layer_scores[li][:length] for li in range(engine.cfg.num_layers)])
            sel = top_tokens(stacked, length, k)
            selected = None if sel is None else (length, sel)
        for name, q in qs.items():
            acc[name].append(1.0 - 0.5 * float((p - q).abs().sum()))
    engine.free(slot)
    return {k: sum(v) / len(v) for k, v in acc.items() if v}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--contexts", default="4096,16384")
    ap.add_argument("--positions", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-k", type=int, default=50)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    engine = Engine.from_pretrained(args.model, attention_backend="torch")
    params = SamplingParams(args.temperature, args.top_k, args.top_p)
    contexts = [int(c) for c in args.contexts.split(",")]
    ids = heldout_ids(engine.tokenizer, max(contexts) + args.positions)
    rows = []
    for ctx in contexts:
        res = measure(engine, ids, ctx, args.positions, params)
        rows.append({"context": ctx, **res})
        print(f"context {ctx:6d}: " + "  ".join(f"{k} {v:.3f}" for k, v in res.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

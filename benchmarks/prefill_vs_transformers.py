"""Prefill of one long prompt: the engine's chunked prefill against transformers' own forward.

    python -m benchmarks.prefill_vs_transformers --model smollm2-135m --context 7168 --repeats 5 --threads 2

The same checkpoint, dtype and threads on both sides; the prompt is random token ids (prefill work does
not depend on them). The engine prefills as the decoder loop admits a request (chunks of
`engine.prefill_chunk`, logits for the last position only); transformers runs one forward over the whole
prompt with its default attention (SDPA) and `logits_to_keep=1`, so neither side pays for logits it
does not need. The two alternate within every repeat, so drift of the machine hits both alike; the
figures are medians over repeats and the ratio is transformers' time over the engine's (> 1: the
engine is faster).
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from aspire_bench.atomic import write_text
from aspire_bench.engine import Engine
from aspire_bench.engine.batch import Row
from aspire_bench.engine.loading import resolve_model_path
from aspire_bench.harness.records import cpu_model


def engine_prefill(engine: Engine, ids: list[int]) -> float:
    """Seconds for the loop's chunked prefill of `ids` into a fresh slot."""
    engine.reserve(len(ids) + engine.page_size)
    slot = engine.alloc(len(ids) + 1)
    chunk = engine.prefill_chunk
    t0 = time.perf_counter()
    for start in range(0, len(ids), chunk):
        end = min(start + chunk, len(ids))
        engine.forward([Row(slot, ids[start:end], start, logits="last" if end == len(ids) else "none")])
    dt = time.perf_counter() - t0
    engine.free(slot)
    return dt


def hf_prefill(model, ids: torch.Tensor) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode():
        model(input_ids=ids, use_cache=True, logits_to_keep=1)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny, a name from `aspire-bench models`, a directory")
    ap.add_argument("--context", type=int, default=7168, help="prompt length in tokens")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(a.model)
    engine = Engine.from_pretrained(a.model)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if a.context + 1 > engine.max_context:
        print(f"error: --context {a.context} exceeds the model's {engine.max_context} positions", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(a.seed)
    ids = torch.randint(1, engine.cfg.vocab_size, (a.context,), generator=g)
    engine_prefill(engine, ids[:256].tolist())  # warm-up both: first calls pay for allocation
    hf_prefill(hf, ids[None, :256])
    ours, theirs = [], []
    for r in range(a.repeats):
        ours.append(engine_prefill(engine, ids.tolist()))
        theirs.append(hf_prefill(hf, ids[None]))
        print(f"repeat {r + 1}/{a.repeats}: engine {ours[-1]:.2f} s, transformers {theirs[-1]:.2f} s",
              file=sys.stderr)
    med = statistics.median
    res = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python -m benchmarks.prefill_vs_transformers"] + (argv or sys.argv[1:])),
        "cpu": cpu_model(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "model": a.model, "context": a.context, "dtype": "float32", "prefill_chunk": engine.prefill_chunk,
        "attention_backend": engine.backend.name, "hf_attention": hf.config._attn_implementation,
        "engine_s": ours, "transformers_s": theirs, "engine_median_s": med(ours),
        "transformers_median_s": med(theirs), "speed_ratio": med(theirs) / med(ours),
        "ratio_per_repeat": [t / o for o, t in zip(ours, theirs)],
    }
    print(f"| model | context | engine s | transformers s | transformers / engine |\n| --- | ---: | ---: | ---: | ---: |\n"
          f"| {a.model} | {a.context} | {res['engine_median_s']:.2f} | {res['transformers_median_s']:.2f} | "
          f"{res['speed_ratio']:.2f} (repeats {min(res['ratio_per_repeat']):.2f}-{max(res['ratio_per_repeat']):.2f}) |")
    print(f"{res['cpu']}, {res['torch_threads']} threads, torch {res['torch']}; engine backend "
          f"{res['attention_backend']}, transformers attention {res['hf_attention']}")
    if a.json:
        write_text(a.json, json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Learning curves of a `train-tiny` run: held-out loss and draft acceptance against training tokens.

Reads OUT/curve.jsonl (held-out loss at 4k per evaluation point, written by `--eval-every`), measures
teacher-forced draft acceptance of the weights kept at each point (OUT/curve/step_N) with
scripts/draft_acceptance.py's method, and extrapolates where each target of the model card would be
reached, stating the fit it assumes:

- loss against tokens: a straight line in log(tokens) through the last `--fit-points` points (the
  usual local behaviour of a power law), solved for the target loss;
- acceptance against loss: a straight line through all measured points, solved for the loss at which
  the acceptance target is met, then mapped to tokens through the loss fit.

    python scripts/learning_curve.py --run /path/to/OUT --contexts 4096,16384 --positions 32 --json curve.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from draft_acceptance import heldout_ids, measure  # noqa: E402

from aspire_bench.decoders.base import SamplingParams  # noqa: E402
from aspire_bench.engine import Engine  # noqa: E402

TARGETS = {"heldout_loss_4096": 3.9, "pages@16384": 0.88, "pages@32768": 0.82}


def read_curve(run: Path) -> list[dict]:
    path = run / "curve.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path} does not exist: train with --eval-every N to record a learning curve")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def tokens_for_loss(points: list[dict], target: float, fit_points: int) -> float | None:
    """Tokens at which the log-linear fit of the last points reaches `target` (None: not decreasing)."""
    pts = [p for p in points if p.get("heldout_loss_4096") is not None][-fit_points:]
    if len(pts) < 2:
        return None
    slope, icept = np.polyfit([math.log(p["tokens_total"]) for p in pts], [p["heldout_loss_4096"] for p in pts], 1)
    if slope > -1e-6:  # flat or rising: no target is ever reached on this trend
        return None
    try:
        return float(math.exp((target - icept) / slope))
    except OverflowError:
        return None


def loss_for_acceptance(points: list[dict], key: str, target: float) -> float | None:
    pts = [p for p in points if p.get(key) is not None]
    if len(pts) < 2:
        return None
    slope, icept = np.polyfit([p["heldout_loss_4096"] for p in pts], [p[key] for p in pts], 1)
    if slope > -1e-6:  # acceptance should rise as loss falls
        return None
    return float((target - icept) / slope)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", required=True, type=Path, help="a train-tiny --out directory")
    ap.add_argument("--contexts", default="4096,16384")
    ap.add_argument("--positions", type=int, default=32)
    ap.add_argument("--every", type=int, default=1, help="measure acceptance at every N-th point")
    ap.add_argument("--base-tokens", type=int, default=None,
                    help="tokens the initial weights had seen (default: the run's training.json chain, else 0)")
    ap.add_argument("--fit-points", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    curve = read_curve(args.run)
    base = args.base_tokens or 0
    contexts = [int(c) for c in args.contexts.split(",")]
    params = SamplingParams(0.7, 50, 0.9)  # the paper's sampling
    for i, point in enumerate(curve):
        point["tokens_total"] = base + point["tokens_seen"]
        snap = args.run / "curve" / f"step_{point['step']}"
        if i % args.every and i != len(curve) - 1 or not snap.is_dir():
            continue
        torch.manual_seed(0)
        engine = Engine.from_pretrained(str(snap), attention_backend="torch")
        ids = heldout_ids(engine.tokenizer, max(contexts) + args.positions)
        for ctx in contexts:
            res = measure(engine, ids, ctx, args.positions, params)
            for view, value in res.items():
                point[f"{view}@{ctx}"] = round(value, 4)
        print(json.dumps(point), file=sys.stderr, flush=True)
    extrapolation = {}
    for key, target in TARGETS.items():
        if key == "heldout_loss_4096":
            loss = target
        else:
            loss = loss_for_acceptance(curve, key, target)
        tokens = tokens_for_loss(curve, loss, args.fit_points) if loss is not None else None
        extrapolation[key] = {"target": target, "at_heldout_loss_4096": loss, "tokens": tokens}
    out = {"points": curve, "extrapolation": extrapolation,
           "assumptions": "loss linear in log(tokens) over the last fit points; acceptance linear in loss"}
    print(json.dumps(out["extrapolation"], indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

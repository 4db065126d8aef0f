"""Mass recall@k of attention predictors: the share of a query's true attention mass that a predicted
key set of size k covers. Pure tensor code over captured scores (see capture.py); docs/diagnostics.md
gives the formulas.

Scores of query position t at every layer are a tensor [layers, t + 1] over keys 0..t, already reduced
over heads (max or mean). Recall is taken over the prefix keys [0, t): the query's own key is attended
by every sparse view (a row always sees its own tokens), so it is left out of the mass and of the sets.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

TOKENS, PAGES = "tokens", "pages"
FAMILIES = ("temporal", "cross-layer", "refresh", "window", "vegas")


@dataclass(frozen=True)
class RecallSpec:
    k_tokens: tuple[int, ...] = (256, 1024)
    k_pages: tuple[int, ...] = (32, 64)
    page_size: int = 16
    lags: tuple[int, ...] = (1, 2, 4, 8, 16)
    sinks: int = 16  # StreamingLLM's attention sinks, as MagicDec's view
    vegas_gamma: int = 6  # the last verification is taken to be this many tokens back
    families: tuple[str, ...] = FAMILIES

    @property
    def history(self) -> int:
        """How many positions before the first query need captured scores."""
        need = [1]  # refresh: the previous token
        if "temporal" in self.families:
            need.append(max(self.lags))
        if "vegas" in self.families:
            need.append(2 * self.vegas_gamma)
        return max(need)

    def ks(self) -> list[tuple[str, int]]:
        return [(TOKENS, k) for k in self.k_tokens] + [(PAGES, k) for k in self.k_pages]


def page_sums(x: torch.Tensor, page_size: int) -> torch.Tensor:
    """[..., n] -> [..., ceil(n / page_size)]: the sum over each page of keys."""
    pad = (-x.shape[-1]) % page_size
    if pad:
        x = F.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], -1, page_size).sum(-1)


def covered(mass: torch.Tensor, scores: torch.Tensor, ks: Sequence[int]) -> torch.Tensor:
    """mass [L, n] (each row sums to 1); scores [L or 1, m], m <= n: a score per candidate key (or
    page) 0..m-1. Returns [L, len(ks)]: the mass of each layer's top-k candidates by its score row
    (a single score row serves every layer); k >= m takes every candidate."""
    m = scores.shape[-1]
    kk = min(max(ks), m)
    idx = torch.topk(scores, kk, dim=-1, sorted=True).indices  # [L or 1, kk], best first
    cum = mass.gather(1, idx.expand(mass.shape[0], kk)).cumsum(1)
    return cum[:, [min(k, kk) - 1 for k in ks]]


def window_mass(mass: torch.Tensor, sinks: int, ks: Sequence[int]) -> torch.Tensor:
    """mass [L, n] over keys (or pages) 0..n-1: the `sinks` first plus the most recent k - sinks."""
    n = mass.shape[-1]
    cum = F.pad(mass.cumsum(1), (1, 0))  # cum[:, i] = mass of keys [0, i)
    out = []
    for k in ks:
        if k >= n:
            out.append(cum[:, n])
            continue
        s = min(sinks, k)
        out.append(cum[:, s] + cum[:, n] - cum[:, n - (k - s)])
    return torch.stack(out, 1)


@dataclass
class RecallAccumulator:
    """Sums of recall per (predictor, unit, k) and layer over query positions."""
    num_layers: int
    spec: RecallSpec
    sums: dict = field(default_factory=lambda: defaultdict(lambda: torch.zeros(0)))
    counts: dict = field(default_factory=dict)

    def _add(self, predictor: str, unit: str, ks: Sequence[int], layers: Sequence[int], rec: torch.Tensor):
        """rec [len(layers), len(ks)]."""
        for j, k in enumerate(ks):
            key = (predictor, unit, k)
            if key not in self.counts:
                self.sums[key] = torch.zeros(self.num_layers, dtype=torch.float64)
                self.counts[key] = torch.zeros(self.num_layers, dtype=torch.long)
            self.sums[key][list(layers)] += rec[:, j].double()
            self.counts[key][list(layers)] += 1

    def add_query(self, t: int, scores: Mapping[int, torch.Tensor],
                  mean_scores: Mapping[int, torch.Tensor] | None = None) -> None:
        """One query position t; scores[p] = [L, p + 1] for every position p the predictors read
        (t, t-1, t-lag, and Vegas's t-gamma and t-2*gamma); mean_scores: the same reduced by the mean
        over heads, for Vegas (None: `scores` are already head means)."""
        sp, L = self.spec, self.num_layers
        every = list(range(L))
        true = scores[t][:, :t].double()
        true = true / true.sum(-1, keepdim=True).clamp_min(1e-300)
        units = {TOKENS: (true, sp.k_tokens, None), PAGES: (page_sums(true, sp.page_size), sp.k_pages, sp.page_size)}
        for unit, (mass, ks, page) in units.items():
            if not ks:
                continue
            def add(name, source, layers=every, mass=mass, ks=ks, page=page, unit=unit):
                scores_ = source.double() if page is None else page_sums(source.double(), page)
                self._add(name, unit, ks, layers, covered(mass[layers], scores_, ks))
            if "temporal" in sp.families:
                for g in sp.lags:
                    add(f"temporal:lag={g}", scores[t - g][:, :t - g + 1])
            if "cross-layer" in sp.families:
                for j in range(L - 1):
                    add(f"cross-layer:from={j}", scores[t][j:j + 1, :t], list(range(j + 1, L)))
            if "refresh" in sp.families:
                for j in range(L):
                    add(f"refresh:layer={j}", scores[t - 1][j:j + 1, :t], [li for li in every if li != j])
            if "window" in sp.families:
                sinks = sp.sinks if page is None else -(-sp.sinks // page)
                self._add("window", unit, ks, every, window_mass(mass, sinks, ks))
            if "vegas" in sp.families:
                ms = scores if mean_scores is None else mean_scores
                last, first = t - sp.vegas_gamma, t - 2 * sp.vegas_gamma
                a, b = ms[first][:, :first + 1], ms[last][:, :last + 1]
                add("vegas", (F.pad(a, (0, b.shape[-1] - a.shape[-1])) + b) / 2)

    def rows(self) -> list[dict]:
        """The JSON rows: per (predictor, unit, k) one row per layer it was evaluated on, then `mean`."""
        out = []
        for (pred, unit, k), s in self.sums.items():
            c = self.counts[(pred, unit, k)]
            layers = [li for li in range(self.num_layers) if c[li] > 0]
            per = {li: min(1.0, float(s[li] / c[li])) for li in layers}  # no 1 + 1e-16 from rounding
            for li in layers:
                out.append({"predictor": pred, "layer": li, "unit": unit, "k": k, "recall": per[li], "n": int(c[li])})
            out.append({"predictor": pred, "layer": "mean", "unit": unit, "k": k,
                        "recall": sum(per.values()) / len(per), "n": int(c[layers[0]])})
        return out

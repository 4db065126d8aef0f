"""What a simulated verification accepts: `accept(request, drafted, context)`, the count a of d drafts.

- `ReplayAcceptance`: a stored run's own outcomes, each request's verifications (d, a) as a token
  stream (a accepts, then a reject when a < d) consumed whatever draft lengths the simulation
  chooses; with the recorded lengths it gives back the recorded outcomes exactly (cyclic at the end).
- `MeasuredAcceptance`: stored runs' per-request streams for another setting: the i-th simulated
  request replays the i-th measured one's, so requests keep their measured differences.
- `ParametricAcceptance`: each draft accepted independently with probability alpha(kind, context).
Details: docs/simulator.md, "What it models" (Acceptance) and "Measured acceptance".
"""
from __future__ import annotations

import json
import random
from bisect import bisect_left
from pathlib import Path

from ..errors import UserError


def token_stream(verifications) -> list[bool]:
    out: list[bool] = []
    for d, a in verifications:
        if d <= 0:
            continue
        out.extend([True] * min(a, d))
        if a < d:
            out.append(False)
    return out


class ReplayAcceptance:
    def __init__(self, streams: dict[str, list[bool]]):
        self.streams = streams
        self.pos = dict.fromkeys(streams, 0)

    def accept(self, request: str, drafted: int, context: int = 0) -> int:
        s = self.streams.get(request) or []
        if drafted <= 0:
            return 0
        if not s:  # a request that never verified anything: nothing would have been accepted
            return 0
        a = 0
        while a < drafted:
            ok = s[self.pos[request] % len(s)]
            self.pos[request] += 1
            if not ok:
                return a
            a += 1
        return a

    def describe(self) -> dict:
        return {"acceptance": "replay", "tokens": sum(len(s) for s in self.streams.values())}


class MeasuredAcceptance:
    def __init__(self, streams: dict[str, list[list[bool]]], runs: dict[str, list[int]],
                 contexts: dict[str, list[int]]):
        """streams: per key (a decoder name or a draft kind), one token stream per measured request;
        runs and contexts: per key, the stored runs the streams come from and their prompt lengths."""
        self.streams, self.runs, self.contexts = streams, runs, contexts

    def key(self, keys: list[str]) -> str | None:
        return next((k for k in keys if self.streams.get(k)), None)

    def model(self, keys: list[str], request_ids: list[str]) -> ReplayAcceptance:
        """The acceptance of a simulation's requests under the first of `keys` measured."""
        key = self.key(keys)
        if key is None:
            have = ", ".join(sorted(self.streams)) or "none"
            raise UserError(f"the runs of --acceptance-from measured no {keys[0]} acceptance (they have: {have}): "
                            f"add a stored {keys[0]} run, or leave {keys[0]} out of --decoders")
        streams = self.streams[key]
        rates = [alpha_of_stream(s) for s in streams]
        info = {"acceptance": "measured", "draft_kind": key, "source_runs": self.runs[key],
                "measured_contexts": sorted(set(self.contexts[key])), "measured_requests": len(streams),
                "alpha_pooled": alpha_of_stream([t for s in streams for t in s]),
                "alpha_per_request_range": [min(rates), max(rates)]}
        return MeasuredReplay({rid: streams[i % len(streams)] for i, rid in enumerate(request_ids)}, info)


class MeasuredReplay(ReplayAcceptance):
    """ReplayAcceptance of measured requests' streams, described by where they were measured."""
    def __init__(self, streams: dict[str, list[bool]], info: dict):
        super().__init__(streams)
        self.info = info

    def describe(self) -> dict:
        return {**self.info, "tokens": sum(len(s) for s in self.streams.values())}


def alpha_of_stream(stream: list[bool]) -> float:
    """The share of a token stream's judgements that accepted (alpha_mle of its verifications)."""
    return sum(stream) / len(stream)


class ParametricAcceptance:
    def __init__(self, table: dict[str, list[tuple[float, float]]], kind: str | list[str], seed: int = 0):
        """kind: the table's key, or keys to try in order (simulator.policies.acceptance_keys); then `*`."""
        self.table = {k: sorted((float(c), float(a)) for c, a in v) for k, v in table.items()}
        keys = [kind] if isinstance(kind, str) else list(kind)
        self.kind = next((k for k in keys if k in self.table), keys[0])
        self.seed = seed
        self.points = self.table.get(self.kind) or self.table.get("*")
        if not self.points:
            raise UserError(f"the acceptance table has no entry for {' or '.join(map(repr, keys))} drafts "
                            "(nor '*'): add one")
        self.rngs: dict[str, random.Random] = {}

    def alpha(self, context: float) -> float:
        pts = self.points
        i = bisect_left([c for c, _ in pts], context)
        if i == 0:
            return pts[0][1]
        if i == len(pts):
            return pts[-1][1]
        (c0, a0), (c1, a1) = pts[i - 1], pts[i]
        return a0 + (a1 - a0) * (context - c0) / (c1 - c0)

    def accept(self, request: str, drafted: int, context: int = 0) -> int:
        rng = self.rngs.setdefault(request, random.Random(f"{self.seed}:{request}"))
        p = self.alpha(context)
        a = 0
        while a < drafted and rng.random() < p:
            a += 1
        return a

    def describe(self) -> dict:
        return {"acceptance": "parametric", "draft_kind": self.kind, "alpha_by_context": self.points}


def alpha_mle(verifications) -> float | None:
    """Maximum-likelihood per-token acceptance of i.i.d. drafts from (drafted, accepted) outcomes:
    every accepted token is a success, every verification that stopped early one failure."""
    accepted = sum(min(a, d) for d, a in verifications if d > 0)
    rejected = sum(1 for d, a in verifications if 0 < d and a < d)
    return accepted / (accepted + rejected) if accepted + rejected else None


def parse_alpha(spec: str | None) -> dict[str, list[tuple[float, float]]]:
    """--alpha: a number for every draft kind, `kind=alpha,...`, or a JSON file
    {kind: [[context, alpha], ...]} (keys: a decoder name such as aspire, magicdec, vegas, a draft kind, or * for any)."""
    if spec is None:
        raise UserError("a parametric simulation needs --alpha (a number, kind=alpha pairs or a JSON table)")
    path = Path(spec)
    if path.suffix == ".json" or path.is_file():
        try:
            raw = json.loads(path.read_text())
            table = {str(k): [(float(c), float(a)) for c, a in v] for k, v in raw.items()}
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise UserError(f"--alpha {spec}: not an acceptance table ({e}); write "
                            '{"aspire": [[16384, 0.9], [65536, 0.85]], "magicdec": [[16384, 0.8]]}') from None
    else:
        table = {}
        try:
            for part in spec.split(","):
                kind, _, val = part.rpartition("=")
                table[kind.strip() or "*"] = [(0.0, float(val))]
        except ValueError:
            raise UserError(f"--alpha {spec!r}: write a number (0.8), kind=alpha pairs "
                            "(aspire=0.9,magicdec=0.8) or a JSON file") from None
    for kind, pts in table.items():
        if not pts or any(not 0.0 <= a <= 1.0 for _, a in pts):
            raise UserError(f"--alpha: acceptance for {kind!r} must be between 0 and 1 (and given at least once)")
    return table

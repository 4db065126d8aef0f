"""Each decoder's scheduling decision, for the simulator: which row each active request runs.

The decisions are those of aspire_bench/decoders: ASPIRE's Algorithm 1 through the scheduler's pure
functions (update_alpha, best_gamma, CostModel.cost_ratio) with the decoder's own settings and
defaults; MagicDec and Vegas synchronous (every request drafts gamma tokens in lockstep, then one
batched verification), AR one token per step. Each row is (kind, tokens, KV positions read per
layer), computed as the decoders compute their trace rows' `kv_read`.
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field

from ..decoders import decoder_names
from ..decoders.scheduler import CostModel, RequestSchedule, best_gamma, update_alpha
from ..errors import UserError

DECODE, DRAFT, VERIFY = "decode", "draft", "verify"


def page_budget(num_pages: int, ratio: float, min_pages: int) -> int:
    from ..decoders.selection import page_budget as pb  # torch-free at call time: selection imports torch
    return pb(num_pages, ratio, min_pages)


def token_budget(length: int, ratio: float, min_tokens: int) -> int:
    from ..decoders.selection import token_budget as tb
    return tb(length, ratio, min_tokens)


@dataclass
class SimState:
    """One request in the simulated batch."""

    id: str
    prompt_len: int
    max_new: int
    out: int = 0  # committed output tokens
    pending: int = 0  # drafts not yet verified
    sel_len: int = 0  # Vegas: KV length its selection covers (set at prefill and at each verification)
    sched: RequestSchedule | None = None
    times: list[float] = field(default_factory=list)
    verifications: list[tuple[int, int]] = field(default_factory=list)
    schedule: list[dict] = field(default_factory=list)  # what the scheduler saw, per verification
    last_c: float | None = None  # ASPIRE: the cost ratio of the last decision

    @property
    def context_len(self) -> int:
        return self.prompt_len + self.out

    @property
    def max_drafts(self) -> int:
        return max(0, self.max_new - self.out - 1)


def decoder_settings(name: str, stored: dict | None = None) -> dict:
    """The decoder's settings: its constructor defaults, its registry entry's, then the stored ones."""
    from ..decoders import _REGISTRY
    if name not in _REGISTRY:
        raise UserError(f"unknown decoder {name!r}: choose one of {', '.join(decoder_names())}")
    module, cls, defaults = _REGISTRY[name]
    klass = getattr(importlib.import_module(module), cls)
    out = {}
    for k in reversed(klass.__mro__):
        init = k.__dict__.get("__init__")
        if init is None or k is object:
            continue
        out.update({p.name: p.default for p in inspect.signature(init).parameters.values()
                    if p.default is not inspect.Parameter.empty})
    out.update(defaults)
    out.update({k: v for k, v in (stored or {}).items() if k in out and v is not None})
    return out


class ARPolicy:
    draft_kind = None

    def plan(self, active, batch):
        return [(DECODE, 1, st.context_len) for st in active]

    def observe(self, st, drafted, accepted):
        pass


class SyncPolicy:
    """MagicDec and Vegas: decoders/magicdec.py SyncSpeculativeDecoder.step."""

    def __init__(self, kind: str, settings: dict):
        self.draft_kind, self.s = kind, settings
        self.gamma = int(settings["gamma"])
        self.drafted = 0  # draft steps done in the current cycle (shared by the batch)

    def view(self, st: SimState, prefix: int) -> int:
        if self.draft_kind == "magicdec":
            return prefix if prefix <= self.s["budget"] else int(self.s["budget"])
        k = token_budget(st.sel_len, self.s["ratio"], self.s["min_tokens"])
        return prefix if k >= st.sel_len else k + (prefix - st.sel_len)

    def plan(self, active, batch):
        drafting = [self.drafted < self.gamma and st.pending < min(self.gamma, st.max_drafts) for st in active]
        if any(drafting):
            self.drafted += 1
            return [(DRAFT, 1, self.view(st, st.context_len - 1 + st.pending) + 1) if dr else None
                    for st, dr in zip(active, drafting)]
        self.drafted = 0
        return [(VERIFY, st.pending + 1, st.context_len + st.pending) for st in active]

    def observe(self, st, drafted, accepted):
        st.sel_len = st.context_len - 1
        st.schedule.append({"gamma": self.gamma})


class AspirePolicy:
    """decoders/aspire.py AspireDecoder.wants_verify and _after_verify, on the simulated state."""

    draft_kind = "aspire"

    def __init__(self, settings: dict, cost: CostModel, page_size: int, num_layers: int):
        if settings["policy"] == "oracle":
            raise UserError("aspire-oracle needs the target's tokens, which a simulation does not have: "
                            "simulate aspire, aspire-fixed or aspire-fsm")
        self.s, self.cost, self.page_size, self.num_layers = settings, cost, page_size, num_layers

    def _sched(self, st: SimState) -> RequestSchedule:
        if st.sched is None:
            st.sched = RequestSchedule(alpha=self.s["alpha0"], target=self.s["gamma_init"])
        return st.sched

    def wants_verify(self, st: SimState, batch: int) -> bool:
        s, sch, d = self.s, self._sched(st), st.pending
        cap = min(s["d_max"], st.max_drafts)
        if d >= cap:
            return True
        if s["policy"] == "fixed":
            return d >= s["gamma"]
        if s["policy"] == "fsm":
            return d >= sch.target
        if not sch.verified and d < s["gamma_init"]:
            return False
        context = st.context_len + d
        c = self.cost.cost_ratio(batch, self.draft_kv(context), context, d)
        st.last_c = c
        return d >= best_gamma(sch.alpha, c, cap)

    def draft_kv(self, context: int) -> int:
        n_pages = -(-context // self.page_size)
        return min(context, page_budget(n_pages, self.s["ratio"], self.s["min_pages"]) * self.page_size)

    def plan(self, active, batch):
        rows = []
        for st in active:
            if self.wants_verify(st, batch):
                rows.append((VERIFY, st.pending + 1, st.context_len + st.pending))
                continue
            prefix = st.context_len - 1 + st.pending
            n_pages = -(-prefix // self.page_size)
            budget = page_budget(n_pages, self.s["ratio"], self.s["min_pages"])
            sparse = prefix if budget >= n_pages else min(prefix, budget * self.page_size)
            L = self.num_layers
            kv = round(((L - 1) * sparse + prefix) / L) + 1 if self.s["refresh"] else sparse + 1
            rows.append((DRAFT, 1, kv))
        return rows

    def observe(self, st, drafted, accepted):
        sch = self._sched(st)
        seen = {"alpha": sch.alpha, "c": st.last_c, "gamma": drafted}
        sch.alpha = update_alpha(sch.alpha, accepted, drafted, self.s["omega"],
                                 self.s["alpha0"] if self.s["zero_draft"] == "relax" else None)
        sch.verified = True
        if self.s["policy"] == "fsm":
            sch.target = max(1, min(self.s["d_max"], sch.target + (1 if accepted >= drafted else -1)))
        st.schedule.append(seen)


def make_policy(name: str, settings: dict, cost: CostModel | None, page_size: int, num_layers: int):
    from ..decoders import _REGISTRY
    cls = _REGISTRY[name][1]
    if cls == "ARDecoder":
        return ARPolicy()
    if cls == "MagicDecDecoder":
        return SyncPolicy("magicdec", settings)
    if cls == "VegasDecoder":
        return SyncPolicy("vegas", settings)
    if cls == "AspireDecoder":
        return AspirePolicy(settings, cost, page_size, num_layers)
    raise UserError(f"decoder {name!r} has no simulator policy: simulate one of ar, magicdec, vegas, aspire")

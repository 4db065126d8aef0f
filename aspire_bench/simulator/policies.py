"""Each decoder's scheduling, for the simulator: the decoder's own policy object, driven without an
engine (decoders/loop.py's contract: per-request state lives in `Sequence.state`).

The decisions are the policies' own code: ASPIRE's `AspirePolicy.decide` (should_verify, recording the
cost ratio it decided with) and `observe` (Algorithm 1 through the scheduler's pure functions, with
the run's cost model), MagicDec's and Vegas's `lockstep` (decoders/sync.py, the function both plan
with: every request drafts gamma tokens in lockstep, then one batched verification) and their
`observe`, AR one token per step, ngram a verification of its drafts every step (no draft rows: its
lookup runs on the host; a stored run's draft lengths are replayed, since the matches need the
tokens, and a parametric run proposes gamma every step). What the simulator adds is each row's KV read, computed as the
engine reports it (docs/simulator.md), without building the sparse views themselves (no attention
scores exist in a simulation).
"""
from __future__ import annotations

from collections import deque
from dataclasses import fields

from ..decoders import _REGISTRY, get_decoder
from ..decoders.base import DECODE, DRAFT, VERIFY, Request
from ..decoders.scheduler import CostModel
from ..decoders.selection import streaming_positions, token_budget
from ..decoders.sequence import Sequence
from ..decoders.sync import lockstep
from ..engine import SCATTERED_HEAD, scattered_positions
from ..errors import UserError

__all__ = ["DECODE", "DRAFT", "VERIFY", "SimPolicy"]
DRAFT_KINDS = {"ARDecoder": None, "MagicDecDecoder": "magicdec", "VegasDecoder": "vegas", "AspireDecoder": "aspire",
               "NgramDecoder": "ngram"}


class SimPolicy:
    def __init__(self, name: str, stored: dict | None = None, cost: CostModel | None = None, page_size: int = 16,
                 num_layers: int = 0, draft_scattered: dict[str, list[int]] | None = None,
                 draft_lengths: dict[str, list[int]] | None = None):
        """`draft_scattered`: per request, the scattered positions the engine counted for each of its
        draft rows in a stored run, in order (ASPIRE: without attention scores there are no pages to
        count; beyond them, or without them, a draft is priced as its policy prices it, draft_kv).
        `draft_lengths`: per request, the drafts of each of its verifications in a stored run (ngram)."""
        if name not in _REGISTRY:
            raise UserError(f"unknown decoder {name!r}: choose one of {', '.join(_REGISTRY)}")
        cls = _REGISTRY[name][1]
        if cls not in DRAFT_KINDS:
            raise UserError(f"decoder {name!r} has no simulator policy: simulate ar, magicdec, vegas, aspire or ngram")
        self.draft_kind = DRAFT_KINDS[cls]
        dec = get_decoder(name)
        known = {f.name for f in fields(dec.config)} if hasattr(dec.config, "__dataclass_fields__") else set()
        # The stored run's settings (its info also holds measurements and the cost model: left out).
        dec = get_decoder(name, **{k: v for k, v in (stored or {}).items() if k in known and v is not None})
        self.settings = dec.settings()
        self.config, self.page_size, self.num_layers = dec.config, page_size, num_layers
        if self.draft_kind == "aspire":
            if dec.config.policy == "oracle":
                raise UserError("aspire-oracle needs the target's tokens, which a simulation does not have: "
                                "simulate aspire, aspire-fixed or aspire-fsm")
            self.policy = dec.Policy(dec.config, page_size, num_layers, cost)
        else:
            self.policy = dec.Policy(dec.config, page_size, num_layers)
        self.scheduler_cost = cost if self.draft_kind == "aspire" else None
        self._scattered = {rid: deque(counts) for rid, counts in (draft_scattered or {}).items()}
        self._lengths = {rid: deque(ds) for rid, ds in (draft_lengths or {}).items()}
        self._assumed: list[int | None] = []  # ASPIRE: per row of the step, a draft's scattered bound

    def new_sequence(self, index: int, rid: str, prompt_len: int, max_new: int) -> Sequence:
        # range: a prompt of prompt_len tokens without holding them (only its length is read)
        return Sequence(index, Request(rid, range(prompt_len), max_new), None, None, state=self.policy.new_state())

    def admitted(self, seq: Sequence) -> None:
        seq.extra["_sel_len"] = seq.context_len - 1  # Vegas: its selection covers the prompt

    # --- rows: (kind, tokens, KV positions read per layer, of which scattered through a view, positions
    # whose scores it captured) or None (sits the step out)
    def plan(self, seqs: list[Sequence], batch: int) -> list[tuple | None]:
        if self.draft_kind is None:
            return [(DECODE, 1, s.context_len, 0, 0) for s in seqs]
        if self.draft_kind == "aspire":
            self._assumed = []
            return [self._aspire_row(s, batch) for s in seqs]
        if self.draft_kind == "ngram":
            return [self._ngram_row(s) for s in seqs]
        plans, self.policy.cycle = lockstep(seqs, self.config.gamma, self.policy.cycle, lambda s, p: None)
        kinds = {id(p.seq): p.kind for p in plans}
        return [None if id(s) not in kinds else self._verify(s) if kinds[id(s)] == VERIFY else
                (DRAFT, 1, *self._sync_draft_kv(s), 0) for s in seqs]

    def _ngram_row(self, seq: Sequence) -> tuple:
        """Every step a verification of the next recorded draft length (gamma when none is left)."""
        lengths = self._lengths.get(seq.req.id)
        seq.pending = [0] * min(lengths.popleft() if lengths else self.config.gamma, seq.max_drafts)
        return self._verify(seq)

    def _verify(self, seq: Sequence) -> tuple:
        """A verify row, with the scores it captures as the engine counts them (per layer, mean): ASPIRE's
        first and last query at its refresh layer, Vegas's at every layer, none for MagicDec."""
        n, kv = len(seq.pending) + 1, seq.context_len + len(seq.pending)
        per_layer = {"aspire": min(2, n) * kv / (self.num_layers or 1), "vegas": min(2, n) * kv}  # 1 layer, all
        return VERIFY, n, kv, 0, round(per_layer.get(self.draft_kind, 0))

    def _sync_draft_kv(self, seq: Sequence) -> tuple[int, int]:
        """(KV read, of which scattered: see engine.scattered_positions) of a MagicDec or Vegas draft
        row, its own token included; a prefix within the budget is read in full, without a view.
        MagicDec's view is the one its policy builds, counted as the engine counts it; Vegas's top-k
        tokens are taken as scattered, the tokens since its selection as one run. Where selected positions
        come together in long runs the engine counts fewer: an upper bound for Vegas, exact for
        MagicDec. (ASPIRE's draft rows: _aspire_row.)"""
        prefix = seq.context_len - 1 + len(seq.pending)
        if self.draft_kind == "magicdec":
            window = streaming_positions(prefix, self.config.sinks, self.config.budget)
            return (prefix + 1, 0) if window is None else (self.config.budget + 1, scattered_positions(window))
        length = seq.extra["_sel_len"]  # Vegas: top-k of the KV at its last verification + every token since
        k = token_budget(length, self.config.ratio, self.config.min_tokens)
        if k >= length:
            return prefix + 1, 0
        since = prefix - length
        return k + since + 1, k + min(since, SCATTERED_HEAD)

    def _aspire_row(self, seq: Sequence, batch: int) -> tuple:
        pol = self.policy
        if pol.decide(seq, batch):  # as AspirePolicy.plan decides, recording c
            self._assumed.append(None)
            return self._verify(seq)
        prefix = seq.context_len - 1 + len(seq.pending)
        kv, bound = pol.draft_kv(prefix, share=1.0)
        self._assumed.append(bound)
        counted = self._scattered.get(seq.req.id)
        captured = round((prefix + 1) / self.num_layers) if self.config.refresh else 0  # the refresh layer's scores
        return DRAFT, 1, kv, counted.popleft() if counted else pol.draft_kv(prefix)[1], captured

    def step_done(self, trace) -> None:
        """ASPIRE: its policy counts the step's draft reads, as after an engine step (count_scattered)."""
        if self.draft_kind == "aspire":
            self.policy.count_scattered(trace.rows, self._assumed)

    def observe(self, seq: Sequence, drafted: int, accepted: int) -> None:
        self.policy.observe(seq, drafted, accepted)
        seq.extra["_sel_len"] = seq.context_len - 1

"""Each decoder's scheduling, for the simulator: the decoder's own policy object, driven without an
engine (decoders/loop.py's contract: per-request state lives in `RequestState.state`).

The decisions are the policies' own code: `plan` (which requests draft, verify or decode this step),
`observe` after each verification, `scores` where a row captures attention scores (a simulation has
none: the policy keeps what it can without them) and `step_done`. Each planned row's KV read is the
policy's own account of it (`Policy.reads`), as the engine would report it, without building the
sparse views' contents (no attention scores exist in a simulation; docs/simulator.md). A policy with
a model of its own (a draft model) counts that model's forwards (`own_forwards`), priced apart.
"""
from __future__ import annotations

from collections import deque
from dataclasses import fields, is_dataclass

from ..decoders import decoder_class, get_decoder, trait
from ..decoders.base import DECODE, DRAFT, VERIFY, Request
from ..decoders.scheduler import CostModel
from ..decoders.state import RequestState
from ..errors import UserError

__all__ = ["DECODE", "DRAFT", "VERIFY", "SimPolicy", "acceptance_keys", "lineage"]


def lineage(name: str) -> list[str]:
    """The decoder's name, then the names of the decoders it derives from (an ablation's base last)."""
    return list(dict.fromkeys([name] + [c.__dict__["name"] for c in decoder_class(name).__mro__[1:]
                                        if isinstance(c.__dict__.get("name"), str) and c.__dict__["name"] != "base"]))


def acceptance_keys(name: str) -> list[str]:
    """The keys an acceptance table may give a decoder's acceptance under, most specific first: its
    lineage, then its draft kind (`*` stands for any)."""
    return list(dict.fromkeys([*lineage(name), trait(name, "draft_kind")]))


class SimPolicy:
    def __init__(self, name: str, stored: dict | None = None, cost: CostModel | None = None, page_size: int = 16,
                 num_layers: int = 0, draft_scattered: dict[str, list[int]] | None = None,
                 recorded: dict[str, list[tuple[int, int]]] | None = None, settings: dict | None = None):
        """`stored`: a stored run's info (None: a parametric setting); `settings`: a parametric setting's
        decoder settings beside the defaults (a stored run's come from its info); `draft_scattered`: per
        request, the scattered positions the engine counted for each of its draft rows in a stored run, in order
        (beyond them, or without them, a draft is priced as its policy reads it); `recorded`: per
        request, its verifications in that run. `cost`: the scheduler's cost model, for a policy that
        decides with one."""
        simulated = trait(name, "simulated")
        if not simulated:
            from ..decoders import decoder_names
            able = [n for n in decoder_names() if trait(n, "simulated")]
            raise UserError(f"decoder {name!r} has no simulator policy: simulate one of {', '.join(able)}")
        if simulated == "replay" and stored is None:
            raise UserError(f"decoder {name!r} is simulated only by replaying a stored run of it (its drafts need "
                            "what the run recorded or used): pass --run RUN_ID")
        self.draft_kind = trait(name, "draft_kind")
        dec = get_decoder(name)
        known = {f.name for f in fields(dec.config)} if is_dataclass(dec.config) else set()
        # The stored run's settings (its info also holds measurements and the cost model: left out).
        given = {**(stored or {}), **(settings or {})}
        dec = get_decoder(name, **{k: v for k, v in given.items() if k in known and v is not None})
        self.settings = dec.settings()
        self.scheduler_cost = cost if trait(name, "uses_cost_model") else None
        self.policy = dec.Policy.for_simulation(dec.config, page_size, num_layers, self.scheduler_cost, stored,
                                                recorded)
        self.own_model = self.policy.own_model()  # a draft model's checkpoint: its forwards priced by its shape
        self._scattered = {rid: deque(counts) for rid, counts in (draft_scattered or {}).items()}
        self._captures: dict[int, bool] = {}  # per sequence of this step's verify rows: whether it captures

    def new_sequence(self, index: int, rid: str, prompt_len: int, max_new: int) -> RequestState:
        # range: a prompt of prompt_len tokens without holding them (only its length is read)
        return RequestState(index, Request(rid, range(prompt_len), max_new), None, None, state=self.policy.new_state())

    def admitted(self, seq: RequestState) -> None:
        if self.policy.prefill_capture() is not None:  # as the loop hands over the prefill's scores
            self.policy.scores(seq, {})
        self.policy.admitted(seq)

    def plan(self, seqs: list[RequestState], batch: int) -> list[tuple[RequestState, tuple]]:
        """This step's rows in the policy's order, each (its request, (kind, tokens, KV positions read per
        layer, of which scattered through a view, positions whose scores it captured, kv_layered, kv_topk))."""
        out = []
        self._captures = {}
        for p in self.policy.plan(seqs, batch):
            seq = p.seq
            kv, sparse, captured, *shaped = self.policy.reads(p)  # a plug-in's reads may give three
            layered, topk = shaped or (0, 0)
            counted = self._scattered.get(seq.req.id)
            if p.kind == DRAFT and counted:
                sparse = counted.popleft()
                layered = sparse if layered else 0
            if p.kind == VERIFY:
                self._captures[id(seq)] = p.capture is not None
            out.append((seq, (p.kind, len(seq.pending) + 1 if p.kind == VERIFY else 1, kv, sparse, captured,
                              layered, topk)))
        return out

    def own_forwards(self) -> list[list[tuple]]:
        """The forwards of the policy's own model (a draft model) in the step just planned, each its rows
        (kind, tokens, KV positions read per layer, 0, 0) for that model's step-cost model."""
        return [[(DRAFT, n, kv, 0, 0) for n, kv in rows] for rows in self.policy.own_forwards()]

    def step_done(self, trace) -> None:
        self.policy.step_done(trace)

    def observe(self, seq: RequestState, drafted: int, accepted: int) -> None:
        self.policy.observe(seq, drafted, accepted)
        if self._captures.get(id(seq)):
            self.policy.scores(seq, {})

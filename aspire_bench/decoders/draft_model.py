"""A separate draft model (Leviathan et al. 2023, Chen et al. 2023; vLLM's draft-model method).

A smaller model with the target's vocabulary drafts gamma tokens per request, one batched forward of
its own engine (its own weights and KV pool, in this process) per draft token; the target verifies
every request's drafts in the step's mixed forward with the loop's rejection sampling. The draft's KV
of a request is rolled back with the target's after each verification, and caught up on the tokens
it has not seen (the correction or bonus token) at the next step's first draft forward. Driven
without an engine (the simulator), it counts those forwards instead (`own_forwards`), for the
simulator to price with the draft's shape.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import ClassVar

import torch

from ..engine import Engine, Row, load_model, load_tokenizer, resolve_model_path
from ..errors import ConfigError
from ..models.bundled import BUNDLED, bundled_name
from .base import DECODE, VERIFY
from .loop import Decoder, Plan, Policy
from .sampler import logits_to_probs, sample_from, stack_rows

SHIPPED = "tiny-draft"  # a 2-layer draft for the bundled model, same tokenizer
AUTO = "auto"  # the shipped draft for the bundled model; other targets name theirs


@dataclass(frozen=True)
class DraftModelSettings:
    gamma: int = 4  # draft tokens per verification
    draft_model: str = AUTO  # a checkpoint directory, `tiny`, `tiny-draft`, or auto

    def __post_init__(self):
        if self.gamma < 1:
            raise ValueError("gamma must be >= 1 (gamma=0 is AR: use --decoders ar)")
        if self.draft_model not in (AUTO, *BUNDLED) and not Path(self.draft_model).expanduser().is_dir():
            raise ValueError(f"draft_model={self.draft_model}: no such checkpoint directory (give a local "
                             "checkpoint with the target's vocabulary, or tiny-draft)")


def draft_path(name: str, target: Engine | None) -> Path:
    """The draft checkpoint a setting names for this target (None: a stored run's `draft_model_used`)."""
    if name == AUTO:
        if target is None:
            raise ConfigError("the run does not say which draft model it used (draft_model=auto): simulate a run "
                              "stored with its draft_model_used")
        if bundled_name(target.name) != "tiny":
            raise ConfigError("decoder 'draft-model' has no default draft for this model: pass --decoder-arg "
                              "draft_model=PATH (a checkpoint with the target's vocabulary)")
        name = SHIPPED
    return resolve_model_path(name)


@lru_cache(maxsize=2)
def _load(path: str, dtype: torch.dtype, device: str, page_size: int, prefill_chunk: int) -> Engine:
    return Engine(load_model(path, dtype, device), load_tokenizer(path), page_size=page_size,
                  prefill_chunk=prefill_chunk, name=path)


def draft_engine(name: str, target: Engine) -> Engine:
    """The draft's engine (loaded once per process), checked against the target: same vocabulary."""
    path = draft_path(name, target)
    draft = _load(str(path), target.dtype, str(target.device), target.page_size, target.prefill_chunk)
    if draft.cfg.vocab_size != target.cfg.vocab_size:
        raise ConfigError(f"draft model {path} has a vocabulary of {draft.cfg.vocab_size} tokens, the target "
                          f"{target.cfg.vocab_size}: pass a draft with the target's tokenizer")
    if (draft.tokenizer is not None and target.tokenizer is not None
            and draft.tokenizer.get_vocab() != target.tokenizer.get_vocab()):
        raise ConfigError(f"draft model {path} has another tokenizer than the target's: pass a draft with the "
                          "target's tokenizer")
    draft.backend = target.backend  # the same attention kernels as the target's
    return draft


class DraftModelPolicy(Policy):
    draft: Engine | None = None  # None: driven without an engine (the simulator), its forwards only counted
    checkpoint: Path | None = None
    forwards: tuple | list = ()  # the simulator's count of this step's draft forwards (own_forwards)

    @classmethod
    def for_run(cls, settings, engine, batch_size, requests=()):
        policy = super().for_run(settings, engine, batch_size, requests)
        draft = policy.draft = draft_engine(settings.draft_model, engine)
        policy.checkpoint = Path(draft.name)
        need = max((len(r.prompt_ids) + r.max_new_tokens for r in requests), default=1)
        if need > draft.max_context:
            raise ConfigError(f"the draft model's maximum context is {draft.max_context} tokens, a request needs "
                              f"{need}: shorten the context or pass another draft_model")
        policy.slot_size = -(-need // draft.page_size) * draft.page_size
        draft.reserve(policy.slot_size * max(1, min(batch_size, len(requests))))
        # the target's prefix cache on (bench): the draft prefills each prompt once too
        if engine.prefix_cache is None:
            draft.prefix_cache = None
        elif draft.prefix_cache is None:
            draft.prefix_cache = {}
        policy.slots = {}  # Sequence -> its slot in the draft's KV pool
        return policy

    def _free_finished(self) -> None:
        for seq in [s for s in self.slots if s.finish]:
            self.draft.free(self.slots.pop(seq))

    @classmethod
    def for_simulation(cls, settings, page_size, num_layers, cost=None, stored=None, recorded=None):
        policy = super().for_simulation(settings, page_size, num_layers, cost, stored, recorded)
        policy.checkpoint = draft_path((stored or {}).get("draft_model_used") or settings.draft_model, None)
        return policy

    def own_model(self):
        return self.checkpoint

    def own_forwards(self):
        return self.forwards

    def admitted(self, seq):
        """The draft's prefill of the prompt (its first output token is fed at the first draft step)."""
        if self.draft is None:  # simulated: seq.state is the length of the draft's KV of the request
            seq.state = len(seq.req.prompt_ids)
            return seq.state
        self._free_finished()
        draft, ids = self.draft, seq.req.prompt_ids
        slot = self.slots[seq] = draft.alloc(self.slot_size)
        if draft.restore_prefix(slot, ids):
            return 0
        for start in range(0, len(ids), draft.prefill_chunk):
            draft.forward([Row(slot, ids[start:start + draft.prefill_chunk], start, logits="none")])
        draft.save_prefix(slot, ids)
        return len(ids)

    def plan(self, seqs, batch):
        todo = {seq: min(self.settings.gamma, seq.max_drafts) for seq in seqs}
        todo = {seq: k for seq, k in todo.items() if k > 0}
        if self.draft is None:
            self.forwards = self._count(todo)
        else:
            self._free_finished()
            if todo:
                self._draft(todo)
        return [Plan(seq, VERIFY if seq in todo else DECODE) for seq in seqs]

    @staticmethod
    def _count(todo: dict) -> list[list[tuple[int, int]]]:
        """Simulated: placeholder drafts, and the rows (tokens, KV read) of the draft forwards `_draft`
        would run for them: the first feeds the committed tokens the draft lacks, each later one the
        previous draft token (the last draft token is never fed)."""
        forwards = []
        for j in range(max(todo.values(), default=0)):
            rows = []
            for seq, k in todo.items():
                if j < k:
                    n = seq.context_len - seq.state if j == 0 else 1
                    seq.state += n
                    rows.append((n, seq.state))
                    seq.pending.append(0)
            forwards.append(rows)
        return forwards

    def _draft(self, todo: dict) -> None:
        """k draft tokens per sequence, one batched draft forward per token: the first forward also feeds
        the committed tokens the draft's KV lacks."""
        params = self.params
        greedy = params is None or params.greedy
        rows = []
        for seq in todo:
            slot, P = self.slots[seq], len(seq.req.prompt_ids)
            start = slot.length
            toks = seq.out[start - P:] if start >= P else list(seq.req.prompt_ids[start:]) + seq.out
            rows.append(Row(slot, toks, start, logits="last"))
        live = list(todo)
        while live:
            logits = stack_rows([lg[-1:] for lg in self.draft.forward(rows).logits])
            if greedy:
                picks, qs = logits.argmax(-1).tolist(), None
            else:
                qs = logits_to_probs(logits, params)
                picks = [sample_from(q, seq.gen, seq.uniforms(1)[0]) for seq, q in zip(live, qs)]
            rows, still = [], []
            for i, (seq, tok) in enumerate(zip(live, picks)):
                seq.pending.append(tok)
                if qs is not None:
                    seq.qs.append(qs[i])
                if len(seq.pending) < todo[seq]:
                    slot = self.slots[seq]
                    rows.append(Row(slot, [tok], slot.length, logits="last"))
                    still.append(seq)
            live = still

    def observe(self, seq, drafted, accepted):
        """The draft's KV keeps the committed tokens it has seen (the last one is fed next step)."""
        if self.draft is None:
            seq.state = min(seq.state, seq.context_len - 1)
        elif (slot := self.slots.get(seq)) is not None:
            self.draft.rollback(slot, min(slot.length, seq.context_len - 1))
        seq.schedule.append({"gamma": drafted})

    def info(self):
        used = {"draft_model_used": SHIPPED if bundled_name(self.checkpoint) == SHIPPED else str(self.checkpoint)}
        return used if self.draft is None else {**used, "draft_layers": self.draft.cfg.num_layers}


class DraftModelDecoder(Decoder):
    name = "draft-model"
    description = "a separate small draft model (same vocabulary) drafts gamma tokens; the target verifies"
    baseline = True
    ablation = False
    draft_kind = "draft-model"
    tune_grid: ClassVar[dict[str, tuple]] = {"gamma": (2, 3, 4, 5, 6)}

    @classmethod
    def draft_engine(cls, engine):
        return draft_engine(cls.Settings().draft_model, engine)

    simulated = "replay"  # a stored run names its draft (draft_model_used): its forwards priced by its shape
    Settings = DraftModelSettings
    Policy = DraftModelPolicy

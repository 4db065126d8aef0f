"""ASPIRE (arXiv 2609.17943): asynchronous batched self-speculation.

Every step is one mixed forward in which each request independently drafts (one token through
its page set) or verifies (d+1 tokens, full attention). While drafting, the refresh layer
(num_layers - 2) attends fully; its page scores pick the next step's pages (one-token lag).
A per-request scheduler with a batch-aware cost model chooses when each request verifies
(`AspirePolicy.should_verify`: pure, no engine forward, so a simulator can call it).
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch

from ..engine import PAGE_MAX_SUM, SCATTERED_HEAD, Capture, PageView
from ..errors import ConfigError
from .base import DRAFT, VERIFY
from .calibration import ensure_calibration, read_calibration, run_cost_model
from .loop import Decoder, Plan, Policy
from .scheduler import (
    DEFAULT_COST,
    CostModel,
    CostSample,
    RequestSchedule,
    best_gamma,
    best_gamma_priced,
    fit_cost_model,
    fit_problem,
    qk_term,
    update_alpha,
)
from .selection import MIN_PAGES, PAGE_RATIO, RECENT_PAGES, page_budget, select_pages

POLICIES = ("adaptive", "fixed", "fsm", "oracle")
ZERO_DRAFT = ("relax", "freeze")
COST_TERMS = ("auto", "paper")


@dataclass(frozen=True)
class AspireSettings:
    ratio: float = PAGE_RATIO  # share of the pages a draft reads
    min_pages: int = MIN_PAGES  # ... but at least this many
    recent_pages: int = RECENT_PAGES  # the most recent pages, always in the draft's set
    d_max: int = 16  # longest draft
    gamma_init: int = 3  # drafts before a request's first verification
    omega: float = 0.8  # EMA weight of the acceptance estimate
    alpha0: float = 0.9  # initial acceptance estimate
    policy: str = "adaptive"  # when to verify: adaptive | fixed | fsm | oracle
    gamma: int = 5  # policy=fixed: drafts per verification
    refresh: bool = True  # the refresh layer attends fully while drafting and re-scores the pages
    refresh_layer: int = -2  # which layer (negative: from the last)
    calibration: str = "auto"  # cost model: auto | none | online | a calibration file
    online_fit_every: int = 16  # calibration=online: refit every this many steps
    zero_draft: str = "relax"  # a 0-draft verification: relax alpha toward alpha0, or freeze it
    cost_terms: str = "auto"  # auto: fit the query x KV and sparse terms when significant; paper: three terms

    def __post_init__(self):
        for name, allowed in (("policy", POLICIES), ("zero_draft", ZERO_DRAFT), ("cost_terms", COST_TERMS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"unknown aspire {name} {getattr(self, name)!r}: choose one of {', '.join(allowed)}")
        if self.calibration not in ("auto", "none", "online"):
            read_calibration(self.calibration)  # a file: checked now, before any compute

    def describe(self) -> dict:
        return {**asdict(self), "gamma": self.gamma if self.policy == "fixed" else None}


@dataclass
class AspireState(RequestSchedule):
    scores: torch.Tensor | None = None  # the refresh layer's latest page scores
    c: float | None = None  # the cost ratio of the latest verify decision (adaptive)


class AspirePolicy(Policy):
    def __init__(self, settings: AspireSettings, page_size: int, num_layers: int, cost: CostModel | None = None):
        super().__init__(settings, page_size, num_layers, DEFAULT_COST if cost is None else cost)
        if not -num_layers <= settings.refresh_layer < num_layers:  # never wrapped around the layer count
            raise ConfigError(f"aspire refresh_layer={settings.refresh_layer} is not a layer of this model "
                              f"({num_layers} layers)")
        self.layer = settings.refresh_layer % num_layers
        self.samples: list[CostSample] = []  # calibration=online: this run's steps
        # Of the scattered positions draft_kv's upper bound assumed for this run's drafts, the share the
        # engine counted (selected pages often lie side by side): the bound's factor in draft_kv.
        self.scattered_counted, self.scattered_assumed = 0, 0
        self._assumed: list[int | None] = []  # per plan of the current step: a draft's scattered bound

    @classmethod
    def prepare(cls, settings, engine, batch_size, requests):
        """calibration=auto: this machine's calibration for the run, timed and stored now if there is none."""
        if settings.calibration == "auto":
            ensure_calibration(engine, batch_size, [len(r.prompt_ids) for r in requests], settings.d_max)

    @classmethod
    def for_run(cls, settings, engine, batch_size, requests=()):
        return cls(settings, engine.page_size, engine.cfg.num_layers,
                   run_cost_model(settings.calibration, settings.cost_terms, settings.d_max, engine, batch_size,
                                  [len(r.prompt_ids) for r in requests]))

    def new_state(self):
        return AspireState(alpha=self.settings.alpha0, target=self.settings.gamma_init)

    def prefill_capture(self):
        return Capture((self.layer,), (0,), PAGE_MAX_SUM)

    def info(self):
        return {"cost_model": self.cost.to_dict(), "draft_scattered_share": round(self.scattered_share, 4)}

    @property
    def scattered_share(self) -> float:
        """Counted / assumed scattered positions of this run's drafts so far (1 before the first)."""
        return self.scattered_counted / self.scattered_assumed if self.scattered_assumed else 1.0

    # --- when to verify --------------------------------------------------------------------------
    def draft_kv(self, prefix: int, share: float | None = None) -> tuple[int, int]:
        """(KV positions, of which scattered) a draft row over `prefix` positions reads per layer,
        averaged over layers as the engine counts them (what the cost model was fitted on): its page
        set (the most recent page partly filled) and its own token, and the whole prefix at the
        refresh layer. Of the page set, the most recent pages are one run; of the others, at most all
        are scattered: the bound times `share` (default: the share of it the engine counted in this
        run's drafts so far, scattered_share). A budget covering every page leaves the row without a view."""
        s = self.settings
        page_set = _page_set_reads(prefix, self.page_size, s.ratio, s.min_pages, s.recent_pages)
        if page_set is None:
            return prefix + 1, 0
        viewed, bound = page_set
        scattered = bound * (self.scattered_share if share is None else share)
        pages = viewed + 1  # and the row's own token
        L = self.num_layers
        if not self.settings.refresh:
            return pages, round(scattered)
        return round(((L - 1) * pages + prefix + 1) / L), round((L - 1) * scattered / L)

    def cycle_prices(self, seq, batch: int, d_max: int, context_len: int | None = None) -> tuple[float, list[float]]:
        """The cost model's price of the next draft step and of verifying 0..d_max drafts now
        (CostModel.cycle_prices), for this request's context and its next draft's KV read (draft_kv) and
        the page scores its rows capture."""
        context = (seq.context_len if context_len is None else context_len) + len(seq.pending)
        kv, scattered = self.draft_kv(context - 1)
        # page scores captured at the refresh layer over the whole prefix, per query (kv_captured's unit)
        per_query = context / self.num_layers
        return self.cost.cycle_prices(batch, kv, context, d_max, scattered,
                                      per_query if self.settings.refresh else 0.0, per_query)

    def cost_ratio(self, seq, batch: int, context_len: int | None = None) -> float:
        """The paper's c_i = T_draft / T_verify(d_i) of verifying now (what a verification records)."""
        d = len(seq.pending)
        return _paper_c(*self.cycle_prices(seq, batch, d, context_len), d)

    def should_verify(self, seq, batch: int, context_len: int | None = None) -> bool:
        """Pure: reads the sequence's pending drafts, its state and this run's cost model."""
        return self.verify_now(seq, batch, context_len)[0]

    def decide(self, seq, batch: int) -> bool:
        """should_verify, for the step being planned: a verification by the adaptive policy records on
        the state the cost ratio c it decided with (observe's schedule shows it)."""
        verify, c = self.verify_now(seq, batch)
        if verify and self.settings.policy == "adaptive":
            seq.state.c = self.cost_ratio(seq, batch) if c is None else c
        return verify

    def verify_now(self, seq, batch: int, context_len: int | None = None) -> tuple[bool, float | None]:
        """should_verify, and the cost ratio c the adaptive policy decided with (None where it needed none)."""
        s, st, d = self.settings, seq.state, len(seq.pending)
        cap = min(s.d_max, seq.max_drafts)
        if d >= cap:
            return True, None
        if s.policy == "fixed":
            return d >= s.gamma, None
        if s.policy == "fsm":
            return d >= st.target, None
        if s.policy == "oracle":  # hindsight: verify right after the first wrong draft
            ref = seq.req.reference_ids
            if ref is None:
                raise ConfigError("aspire-oracle needs the target's tokens (Request.reference_ids); "
                                  "`aspire-bench run` supplies them under greedy decoding")
            pos = len(seq.out)
            return d > 0 and (pos + d > len(ref) or seq.pending[-1] != ref[pos + d - 1]), None
        if not st.verified and d < s.gamma_init:
            return False, None
        t_draft, t_verify = self.cycle_prices(seq, batch, cap, context_len)
        c = _paper_c(t_draft, t_verify, d)
        # the paper's rule, Omega / (1 + c * gamma), prices a verification alike for every gamma
        if s.cost_terms == "paper" or t_verify[0] <= 0:
            return d >= best_gamma(st.alpha, c, cap), c
        return d >= best_gamma_priced(st.alpha, t_draft, t_verify), c

    # --- the two verbs ----------------------------------------------------------------------------
    def plan(self, seqs, batch):
        r, plans, self._assumed = self.layer, [], []
        for seq in seqs:
            if self.decide(seq, batch):
                plans.append(Plan(seq, VERIFY, capture=Capture((r,), (0, -1), PAGE_MAX_SUM)))
                self._assumed.append(None)
                continue
            prefix = seq.context_len - 1 + len(seq.pending)
            n_pages = -(-prefix // self.page_size)
            pages = select_pages(seq.state.scores, n_pages, page_budget(n_pages, self.settings.ratio,
                                 self.settings.min_pages), self.settings.recent_pages)
            view = None if pages is None else PageView(pages)
            self._assumed.append(self.draft_kv(prefix, share=1.0)[1])  # 0 without a view
            if self.settings.refresh:
                plans.append(Plan(seq, DRAFT, view, frozenset({r}), Capture((r,), (0,), PAGE_MAX_SUM)))
            else:
                plans.append(Plan(seq, DRAFT, view))
        return plans

    def observe(self, seq, drafted, accepted):
        s, st = self.settings, seq.state
        view = {"alpha": st.alpha, "c": st.c, "gamma": drafted} if s.policy == "adaptive" else {"gamma": drafted}
        seq.schedule.append(view)
        seq.draft_lengths.append(drafted)
        st.alpha = update_alpha(st.alpha, accepted, drafted, s.omega, s.alpha0 if s.zero_draft == "relax" else None)
        st.verified = True
        if s.policy == "fsm":  # +1 when all drafts were accepted, -1 otherwise
            st.target = max(1, min(s.d_max, st.target + (1 if accepted >= drafted else -1)))

    def draft_reads(self, plan, prefix):
        return self.draft_kv(prefix)

    def count_scattered(self, rows, assumed) -> None:
        """Adds the scattered positions the engine counted for a step's draft rows, and what draft_kv's
        bound assumed for each (`assumed`: per row, in plan order; None for a verify row)."""
        for row, bound in zip(rows, assumed, strict=True):
            if bound is not None and row.kind == DRAFT:
                self.scattered_counted += row.kv_sparse
                self.scattered_assumed += bound

    def scores(self, seq, scores):
        if scores.get(self.layer) is not None:
            seq.state.scores = scores[self.layer]

    def step_done(self, trace):
        """Counts the step's draft reads (count_scattered); calibration=online: refits the cost model
        from this run's own steps (timing-dependent)."""
        self.count_scattered(trace.rows, self._assumed)
        if self.settings.calibration != "online":
            return
        per_row = [(rw.n_tokens, rw.kv_read, rw.kv_sparse, rw.kv_captured) for rw in trace.rows]
        self.samples.append(CostSample(trace.n_tokens, sum(r[1] for r in per_row), qk_term(per_row), trace.wall,
                                       per_row))
        every = self.settings.online_fit_every
        if len(self.samples) >= every and len(self.samples) % every == 0:
            fit = fit_cost_model(self.samples[-256:], source="online", terms=self.settings.cost_terms)
            if fit_problem(fit) is None:
                self.cost = fit


def _paper_c(t_draft: float, t_verify: list[float], d: int) -> float:
    """The paper's c = T_draft / T_verify(d); 1 for a model that prices steps at nothing."""
    return t_draft / t_verify[d] if t_verify[d] > 0 else 1.0


@functools.lru_cache(maxsize=1024)
def _page_set_reads(prefix: int, page_size: int, ratio: float, min_pages: int, recent: int) -> tuple[int, int] | None:
    """(positions of a draft's page set over `prefix`, the most recent page partly filled; the upper
    bound of them scattered: every older page alone, and the head of the recent pages' run), or None
    when the budget covers every page. Cached: the scheduler asks for each row twice per step."""
    n_pages = -(-prefix // page_size)
    budget = page_budget(n_pages, ratio, min_pages)
    if budget >= n_pages:
        return None
    unfilled = n_pages * page_size - prefix  # of the most recent page
    viewed = budget * page_size - unfilled
    recent_run = min(recent, budget) * page_size - unfilled
    return viewed, viewed - recent_run + min(recent_run, SCATTERED_HEAD)


class AspireDecoder(Decoder):
    name = "aspire"
    Settings = AspireSettings
    Policy = AspirePolicy
    # The oracle policy reads Request.reference_ids: the harness must run AR first.
    needs_reference = property(lambda self: self.config.policy == "oracle")
    description = "ASPIRE: asynchronous batched self-speculation, per-request draft lengths from a cost model"
    draft_kind = "aspire"
    uses_cost_model = True


# Ablations of the paper: ASPIRE with other defaults.
@dataclass(frozen=True)
class _FixedSettings(AspireSettings):
    policy: str = "fixed"
    gamma: int = 5


@dataclass(frozen=True)
class _FsmSettings(AspireSettings):
    policy: str = "fsm"


@dataclass(frozen=True)
class _NoRefreshSettings(AspireSettings):
    refresh: bool = False


@dataclass(frozen=True)
class _PaperCostSettings(AspireSettings):
    cost_terms: str = "paper"


@dataclass(frozen=True)
class _OracleSettings(AspireSettings):
    policy: str = "oracle"


class AspireFixedDecoder(AspireDecoder):
    name, Settings, ablation = "aspire-fixed", _FixedSettings, True
    description = "ablation: ASPIRE verifying after a fixed 5 drafts"


class AspireFsmDecoder(AspireDecoder):
    name, Settings, ablation = "aspire-fsm", _FsmSettings, True
    description = "ablation: ASPIRE with a +1/-1 draft-length state machine instead of the cost model"


class AspireNoRefreshDecoder(AspireDecoder):
    name, Settings, ablation = "aspire-norefresh", _NoRefreshSettings, True
    description = "ablation: ASPIRE without the refresh layer (the draft pages are never re-scored)"


class AspirePaperCostDecoder(AspireDecoder):
    """The paper's cost model as published: three terms, verification cost flat in the draft length."""
    name, Settings, ablation = "aspire-papercost", _PaperCostSettings, True
    description = "ablation: ASPIRE with the paper's three-term cost model"


class AspireOracleDecoder(AspireDecoder):
    """An upper bound, not a decoder one could deploy: it knows the target's tokens in hindsight."""
    name, Settings, ablation, simulated = "aspire-oracle", _OracleSettings, True, False
    description = "upper bound: ASPIRE verifying right after the first wrong draft (knows the target's tokens)"

"""ASPIRE (arXiv 2609.17943): asynchronous batched self-speculation.

Every step is one mixed forward in which each request independently drafts (one token through
its page set) or verifies (d+1 tokens, full attention). While drafting, the refresh layer
(num_layers - 2) attends fully; its page scores pick the next step's pages (one-token lag).
A per-request scheduler with a batch-aware cost model chooses when each request verifies.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import replace
from pathlib import Path

from ..engine import PAGE_MAX_SUM, Capture, PageView
from ..errors import ConfigError
from .base import StepTrace
from .scheduler import (
    DEFAULT_COST,
    CostModel,
    RequestSchedule,
    best_gamma,
    fit_cost_model,
    fit_problem,
    update_alpha,
)
from .selection import page_budget, select_pages
from .speculative import SpeculativeDecoder

POLICIES = ("adaptive", "fixed", "fsm", "oracle")
ZERO_DRAFT = ("relax", "freeze")
COST_TERMS = ("auto", "paper")


class AspireDecoder(SpeculativeDecoder):
    name = "aspire"
    # The oracle policy reads Request.reference_ids: the harness must run AR first.
    needs_reference = property(lambda self: self.policy == "oracle")

    def __init__(self, ratio: float = 0.07, min_pages: int = 32, recent_pages: int = 8, d_max: int = 16,
                 gamma_init: int = 3, omega: float = 0.8, alpha0: float = 0.9, policy: str = "adaptive",
                 gamma: int = 5, refresh: bool = True, refresh_layer: int = -2, calibration: str = "auto",
                 online_fit_every: int = 16, zero_draft: str = "relax", cost_terms: str = "auto"):
        super().__init__()
        if policy not in POLICIES:
            raise ConfigError(f"unknown aspire policy {policy!r}: choose one of {', '.join(POLICIES)}")
        if zero_draft not in ZERO_DRAFT:
            raise ConfigError(f"unknown aspire zero_draft {zero_draft!r}: choose one of {', '.join(ZERO_DRAFT)}")
        if cost_terms not in COST_TERMS:
            raise ConfigError(f"unknown aspire cost_terms {cost_terms!r}: choose one of {', '.join(COST_TERMS)}")
        self.ratio, self.min_pages, self.recent_pages = ratio, min_pages, recent_pages
        self.d_max, self.gamma_init, self.omega, self.alpha0 = d_max, gamma_init, omega, alpha0
        self.policy, self.gamma = policy, gamma
        self.refresh, self.refresh_layer = refresh, refresh_layer
        self.calibration, self.online_fit_every = calibration, online_fit_every
        self.zero_draft, self.cost_terms = zero_draft, cost_terms
        self._cost: CostModel = DEFAULT_COST
        self._samples: list[tuple[float, float, float, float]] = []

    def settings(self):
        return {"policy": self.policy, "gamma": self.gamma if self.policy == "fixed" else None,
                "ratio": self.ratio, "min_pages": self.min_pages, "recent_pages": self.recent_pages,
                "d_max": self.d_max, "gamma_init": self.gamma_init, "omega": self.omega, "alpha0": self.alpha0,
                "refresh": self.refresh, "refresh_layer": self.refresh_layer, "zero_draft": self.zero_draft,
                "cost_terms": self.cost_terms, "calibration": self.calibration, "cost_model": self._cost.to_dict()}

    # --- set-up --------------------------------------------------------------------------------
    def _layer(self, engine) -> int:
        return self.refresh_layer % engine.cfg.num_layers

    def generate(self, engine, requests, params, batch_size, progress=None):
        self._samples = []
        self._cost = self._cost_model(engine, batch_size)
        return super().generate(engine, requests, params, batch_size, progress)

    def _cost_model(self, engine, batch_size) -> CostModel:
        """The cost model of this run, fixed for the whole run unless calibration=online.

        none: the fixed default. auto: this machine's stored calibration for the same model, device,
        dtype, backend, page size and batch size, measured once now (and stored) when there is none.
        FILE: that calibration, replayed. online: the default, refitted from this run's own steps.
        A fit that fails the quality check is rejected with a warning for the default.
        """
        if self.calibration == "none":  # reproducible by construction, as a regression gate needs
            return replace(DEFAULT_COST, source="none")
        if self.calibration == "online":
            return DEFAULT_COST
        from .calibration import (
            CALIBRATION_CONTEXT,
            calibrate,
            calibration_path,
            cost_model_from,
            save_calibration,
        )
        if self.calibration == "auto":
            path = calibration_path(engine, batch_size)
            if not path.exists():
                context = min(CALIBRATION_CONTEXT, engine.max_context - self.d_max - engine.page_size - 1)
                save_calibration(calibrate(engine, batch_size, context, repeats=2), engine, batch_size, path)
        else:
            path = Path(self.calibration)
            if not path.exists():
                raise ConfigError(f"calibration file {path} does not exist: run `aspire-bench calibrate` "
                                  "or pass calibration=auto")
        try:
            stored = json.loads(path.read_text())
            model = cost_model_from(stored, f"calibration:{path.name}", qk=self.cost_terms == "auto")
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"calibration file {path} is not a calibration ({e}): "
                              "run `aspire-bench calibrate` again or delete the file") from e
        problem = fit_problem(model)
        if problem:
            warnings.warn(f"aspire: calibration {path} rejected ({problem}); using the default cost model. "
                          "Re-run `aspire-bench calibrate` on an idle machine.", stacklevel=2)
            return replace(DEFAULT_COST, source=f"default (rejected {path.name}: {problem})")
        return model

    def prefill_capture(self, engine):
        return Capture((self._layer(engine),), (0,), PAGE_MAX_SUM)

    def on_prefilled(self, engine, st, scores):
        st.extra["_scores"] = scores.get(self._layer(engine))

    # --- scheduling ----------------------------------------------------------------------------
    def _sched(self, st) -> RequestSchedule:
        if "_sched" not in st.extra:
            st.extra["_sched"] = RequestSchedule(alpha=self.alpha0, target=self.gamma_init)
        return st.extra["_sched"]

    def _pages(self, engine, st, prefix: int):
        n_pages = -(-prefix // engine.page_size)
        return select_pages(st.extra.get("_scores"), n_pages,
                            page_budget(n_pages, self.ratio, self.min_pages), self.recent_pages)

    def wants_verify(self, engine, st, batch: int) -> bool:
        sch = self._sched(st)
        d = len(self.pending(st))
        cap = min(self.d_max, self.max_drafts(st))
        if d >= cap:
            return True
        if self.policy == "fixed":
            return d >= self.gamma
        if self.policy == "fsm":
            return d >= sch.target
        if self.policy == "oracle":  # hindsight: verify right after the first wrong draft
            ref = st.req.reference_ids
            if ref is None:
                raise ConfigError("aspire-oracle needs the target's tokens (Request.reference_ids); "
                                  "`aspire-bench run` supplies them under greedy decoding")
            pos = len(st.out)
            return d > 0 and (pos + d > len(ref) or self.pending(st)[-1] != ref[pos + d - 1])
        if not sch.verified and d < self.gamma_init:
            return False
        context = st.context_len + d
        n_pages = -(-context // engine.page_size)  # the draft's KV read: its page budget, not which pages
        draft_kv = min(context, page_budget(n_pages, self.ratio, self.min_pages) * engine.page_size)
        c = self._cost.cost_ratio(batch, draft_kv, context, d)
        return d >= best_gamma(sch.alpha, c, cap)

    def step(self, engine, active, params, clock):
        t0 = clock()
        r = self._layer(engine)
        L = engine.cfg.num_layers
        verify = [self.wants_verify(engine, st, len(active)) for st in active]
        rows, reads = [], []
        for st, v in zip(active, verify):
            if v:
                rows.append(self.verify_row(st, Capture((r,), (0, -1), PAGE_MAX_SUM)))
                reads.append(None)
                continue
            prefix = st.context_len - 1 + len(self.pending(st))
            pages = self._pages(engine, st, prefix)
            view = None if pages is None else PageView(pages)
            sparse = prefix if pages is None else min(prefix, int(pages.numel()) * engine.page_size)
            if self.refresh:
                rows.append(self.draft_row(st, view, frozenset({r}), Capture((r,), (0,), PAGE_MAX_SUM)))
                reads.append(round(((L - 1) * sparse + prefix) / L) + 1)
            else:
                rows.append(self.draft_row(st, view))
                reads.append(sparse + 1)
        out = engine.forward(rows)
        t1 = clock()
        trace = StepTrace(0, t0, t1)
        for i, (st, v, lg) in enumerate(zip(active, verify, out.logits)):
            scores = out.captures.get(i, {}).get(r)
            if v:
                rt = self.finish_verify(engine, st, lg, params, t1)
                self._after_verify(st, rt.drafted, rt.accepted)
                st.extra.setdefault("draft_lengths", []).append(rt.drafted)
                trace.rows.append(rt)
            else:
                self.take_draft(st, lg[-1], params)
                trace.rows.append(self.draft_trace(st, reads[i]))
            if scores is not None:
                st.extra["_scores"] = scores
        trace.t_end = clock()
        self._observe(trace)
        return trace

    def _after_verify(self, st, d: int, a: int) -> None:
        sch = self._sched(st)
        sch.alpha = update_alpha(sch.alpha, a, d, self.omega,
                                 self.alpha0 if self.zero_draft == "relax" else None)
        sch.verified = True
        if self.policy == "fsm":  # +1 when all drafts were accepted, -1 otherwise
            sch.target = max(1, min(self.d_max, sch.target + (1 if a >= d else -1)))

    def _observe(self, trace: StepTrace) -> None:
        """calibration=online only: refit the cost model from this run's own steps (timing-dependent)."""
        if self.calibration != "online":
            return
        self._samples.append((trace.n_tokens, sum(rw.kv_read for rw in trace.rows),
                              sum(rw.n_tokens * rw.kv_read for rw in trace.rows), trace.wall))
        if len(self._samples) >= self.online_fit_every and len(self._samples) % self.online_fit_every == 0:
            fit = fit_cost_model(self._samples[-256:], source="online", qk=self.cost_terms == "auto")
            if fit_problem(fit) is None:
                self._cost = fit

"""ASPIRE's per-request online scheduler (Algorithm 1) and its batch-aware cost model. Pure."""
from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import combinations
from typing import NamedTuple

import numpy as np

# A fit explaining less of the step-time variance than this, or with a negative coefficient, is
# not a cost model: the scheduler would chase noise. Such fits are rejected (see `fit_problem`).
MIN_R2 = 0.9
# A term beyond the paper's three (beta_qk, beta_sparse, beta_multi, beta_capture) is kept only when its t-statistic reaches
# this: on a GPU (verification cost flat in the number of queries, gathers as cheap as a contiguous
# read) both fit ~0 and the model reduces to the paper's three terms.
EXTRA_MIN_T = 3.0
# The terms beyond the paper's three, each fitted only when significant.
EXTRA_TERMS = ("beta_qk", "beta_multi", "beta_sparse", "beta_capture")
# Candidate numbers of a row's queries that ride free on its KV read (see CostModel.qk_free).
QK_FREE = (0, 1, 2, 3, 4, 6, 8)
# The terms of Vegas-shaped work (per-layer token views, token scores at every layer and their top-k),
# fitted apart on the steps that do it (None in a model fitted without such steps: priced as before).
SHAPED_TERMS = ("beta_layered", "beta_topk")


def qk_term(rows, free: int = 0) -> float:
    """Sum over rows (tokens, KV positions read[, of which sparse]) of the tokens beyond the first
    `free` x the KV read."""
    return float(sum(max(0, r[0] - free) * r[1] for r in rows))


def multi_term(rows, free: int) -> float:
    """Sum over rows (tokens, KV positions read[, ...]) with more than `free` tokens of their KV read."""
    return float(sum(r[1] for r in rows if r[0] > free))


def sparse_term(rows) -> float:
    """Sum over rows (tokens, KV positions read, of which scattered[, captured]) of the KV read scattered
    through views (0 for rows given as (tokens, KV read))."""
    return float(sum(r[2] for r in rows if len(r) > 2))


def capture_term(rows) -> float:
    """Sum over rows (tokens, KV positions read, of which scattered, captured) of the KV positions whose
    scores they captured (0 for rows without the fourth element)."""
    return float(sum(r[3] for r in rows if len(r) > 3))


def layered_term(rows) -> float:
    """Sum over rows (tokens, KV read, scattered, captured, layered[, topk]) of the scattered positions read
    through views that differ per layer (0 for rows without the fifth element)."""
    return float(sum(r[4] for r in rows if len(r) > 4))


def topk_term(rows) -> float:
    """Sum over rows (tokens, KV read, scattered, captured, layered, topk) of the captured positions whose
    per-token scores a top-k per layer is selected from (0 for rows without the sixth element)."""
    return float(sum(r[5] for r in rows if len(r) > 5))


def expected_tokens(alpha: float, gamma: int) -> float:
    """Omega(alpha, gamma) = (1 - alpha^(gamma+1)) / (1 - alpha): tokens per verification."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def best_gamma(alpha: float, c: float, d_max: int) -> int:
    """argmax over gamma in 0..d_max of Omega(alpha, gamma) / (1 + c * gamma) (first on ties)."""
    # Plain Python, Omega summed term by term: called for every row of every step, where numpy's
    # per-call cost (or a power per gamma) dominates.
    best, best_value, omega, term = 0, 1.0, 1.0, 1.0
    for g in range(1, d_max + 1):
        term *= alpha
        omega += term
        value = omega / (1.0 + c * g)
        if value > best_value:
            best, best_value = g, value
    return best


def best_gamma_priced(alpha: float, t_draft: float, t_verify: list[float]) -> int:
    """argmax over gamma in 0..len(t_verify)-1 of Omega(alpha, gamma) / (gamma * t_draft + t_verify[gamma])
    (first on ties): tokens per second of a request's cycle of gamma drafts and their verification,
    each priced by the cost model. With t_verify the same for every gamma it is best_gamma's rule
    with c = t_draft / t_verify."""
    best, best_value, omega, term = 0, 1.0 / t_verify[0], 1.0, 1.0
    for g in range(1, len(t_verify)):
        term *= alpha
        omega += term
        value = omega / (g * t_draft + t_verify[g])
        if value > best_value:
            best, best_value = g, value
    return best


def update_alpha(alpha: float, accepted: int, drafted: int, omega: float = 0.8,
                 alpha0: float | None = None) -> float:
    """EMA of the per-token acceptance: alpha_hat = a / min(a + 1, d), 1 when all were accepted.

    A verification of 0 drafts says nothing about acceptance (0/0). Left there, alpha would never
    move again and the request would stay at gamma = 0 for good. Given `alpha0`, such a verification
    relaxes alpha one EMA step toward alpha0 instead, so the request probes drafting again after a
    few AR-like steps and a real verification re-estimates alpha. `alpha0=None` keeps it frozen.
    """
    if drafted == 0:
        return alpha if alpha0 is None else omega * alpha + (1.0 - omega) * alpha0
    hat = 1.0 if accepted >= drafted else accepted / min(accepted + 1, drafted)
    return omega * alpha + (1.0 - omega) * hat


class CostSample(NamedTuple):
    """One timed step, what the cost model is fitted on: its tokens, KV positions read (summed over
    rows), the query x KV term (qk_term), its seconds, and each row's (tokens, KV read[, of which
    scattered[, captured[, layered, topk]]]) (None in calibrations stored before rows were kept)."""
    tokens: float
    kv_read: float
    qk: float
    seconds: float
    rows: list | None = None

    @classmethod
    def of(cls, sample) -> CostSample:
        """A sample as stored: (tokens, kv, qk, seconds, rows), or the older (tokens, kv, qk, seconds)
        and (tokens, kv, seconds)."""
        s = tuple(sample)
        if len(s) == 3:
            return cls(s[0], s[1], 0.0, s[2])
        return cls(*s[:4], [tuple(r) for r in s[4]] if len(s) > 4 and s[4] is not None else None)


@dataclass
class RequestSchedule:
    alpha: float = 0.9
    verified: bool = False
    target: int = 0  # FSM / fixed policies: current draft-length target


@dataclass
class CostModel:
    """Step time = beta0 + beta_tok * tokens + beta_attn * KV positions read (per layer)
    + beta_qk * sum over rows of (row tokens beyond the first qk_free x row KV positions read)
    + beta_sparse * KV positions read scattered through sparse views
    + beta_multi * KV positions read by rows of more than qk_free tokens
    + beta_capture * KV positions whose attention scores rows captured.
    The paper's model has the first three terms; the others price what a CPU adds: verify queries past
    those that ride free on a row's KV read, the head of each scattered run, the kernel's change of
    method past qk_free queries, the refresh layer's score capture; beta_layered and beta_topk (when not
    None) Vegas's positions in place of beta_sparse and beta_capture (docs/decoders.md, "Cost model").
    """

    beta0: float
    beta_tok: float
    beta_attn: float
    beta_qk: float = 0.0
    source: str = "default"
    r2: float | None = None
    qk_free: int = 0
    beta_sparse: float = 0.0
    beta_multi: float = 0.0
    beta_capture: float = 0.0
    beta_layered: float | None = None
    beta_topk: float | None = None

    def step_time(self, n_tokens: float, kv_read: float, qk: float = 0.0, sparse: float = 0.0,
                  multi: float = 0.0, captured: float = 0.0, layered: float = 0.0, topk: float = 0.0) -> float:
        """`qk`: the query x KV feature of the step's rows, qk_term(rows, self.qk_free); `sparse`: their
        KV read scattered through views, sparse_term(rows); `multi`: multi_term(rows, self.qk_free);
        `captured`: the positions whose scores they captured, capture_term(rows); `layered` and `topk`:
        the parts of `sparse` and `captured` that are Vegas-shaped (layered_term, topk_term)."""
        t = (self.beta0 + self.beta_tok * n_tokens + self.beta_attn * kv_read + self.beta_qk * qk
             + self.beta_sparse * sparse + self.beta_multi * multi + self.beta_capture * captured)
        if self.beta_layered is not None:
            t += (self.beta_layered - self.beta_sparse) * layered
        if self.beta_topk is not None:
            t += (self.beta_topk - self.beta_capture) * topk
        return t

    def rows_time(self, rows) -> float:
        """The time of a step of these rows, each (tokens, KV positions read[, of which sparse[, captured[,
        layered, topk]]])."""
        rows = list(rows)
        return self.step_time(sum(r[0] for r in rows), sum(r[1] for r in rows), qk_term(rows, self.qk_free),
                              sparse_term(rows), multi_term(rows, self.qk_free) if self.beta_multi else 0.0,
                              capture_term(rows), layered_term(rows), topk_term(rows))

    def _uniform_time(self, batch: int, n: int, kv: float, sparse: float = 0.0, captured: float = 0.0) -> float:
        """rows_time of `batch` rows of n tokens reading kv positions each (`sparse` of them through a
        view, the scores of `captured` captured), in closed form (per row and step in the scheduler)."""
        return self.step_time(batch * n, batch * kv, batch * max(0, n - self.qk_free) * kv, batch * sparse,
                              captured=batch * captured)

    def cycle_prices(self, batch: int, draft_kv: float, context: float, d_max: int,
                     draft_sparse: float = 0.0, draft_captured: float = 0.0,
                     verify_captured: float = 0.0) -> tuple[float, list[float]]:
        """(T_draft, [T_verify(gamma) for gamma = 0..d_max]): a step of `batch` rows drafting, each
        reading draft_kv positions (draft_sparse of them scattered, capturing the scores of
        draft_captured), and one of `batch` rows verifying gamma drafts after `context` positions, each
        capturing verify_captured scores per captured query (one query at gamma = 0, its first and
        last after), every term of the model included (the multi-query step too), in closed form: the
        scheduler prices every gamma for every row of every step."""
        t_draft = self._uniform_time(batch, 1, draft_kv, draft_sparse, draft_captured)
        base = self.beta0 + self.beta_attn * batch * context
        per_token, per_query = self.beta_tok * batch, self.beta_qk * batch * context
        step, free = self.beta_multi * batch * context, self.qk_free
        capture = self.beta_capture * batch * verify_captured
        t_verify = [base + per_token * (g + 1) + per_query * max(0, g + 1 - free) + (step if g + 1 > free else 0.0)
                    + capture * min(2, g + 1) for g in range(d_max + 1)]
        return t_draft, t_verify

    def to_dict(self) -> dict:
        """The coefficients; beta_layered and beta_topk only when fitted (absent: priced as before them)."""
        shaped = {k: getattr(self, k) for k in SHAPED_TERMS if getattr(self, k) is not None}
        return {"beta0": self.beta0, "beta_tok": self.beta_tok, "beta_attn": self.beta_attn,
                "beta_qk": self.beta_qk, "qk_free": self.qk_free, "beta_sparse": self.beta_sparse,
                "beta_multi": self.beta_multi, "beta_capture": self.beta_capture, **shaped, "source": self.source,
                "r2": self.r2}

    @classmethod
    def from_dict(cls, d: dict, source: str) -> CostModel:
        shaped = {k: float(d[k]) for k in SHAPED_TERMS if d.get(k) is not None}
        return cls(float(d["beta0"]), float(d["beta_tok"]), float(d["beta_attn"]), float(d.get("beta_qk", 0.0)),
                   source, d.get("r2"), int(d.get("qk_free", 0)), float(d.get("beta_sparse", 0.0)),
                   float(d.get("beta_multi", 0.0)), float(d.get("beta_capture", 0.0)), **shaped)


def _lstsq(X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, float | None]:
    """Coefficients, their t-statistics and R^2 of an ordinary least-squares fit."""
    beta, *_ = np.linalg.lstsq(X, y, rcond=None)
    resid = y - X @ beta
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((resid ** 2).sum()) / ss_tot if ss_tot > 0 else None
    dof = max(1, len(y) - X.shape[1])
    sigma2 = float((resid ** 2).sum()) / dof
    try:
        se = np.sqrt(np.clip(np.diag(np.linalg.inv(X.T @ X)) * sigma2, 0, None))
    except np.linalg.LinAlgError:
        se = np.full(X.shape[1], np.inf)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(se > 0, beta / se, np.inf)
    return beta, t, r2


def _nonnegative_lstsq(X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, float | None]:
    """Least squares with every coefficient >= 0: the best-fitting of the fits over subsets of the
    columns (the others held at 0) whose coefficients all come out non-negative. Exact, and cheap for
    the few terms here. A step cost has no negative part; an intercept fitted below zero (a fast
    dense path leaves little fixed cost per step) is a misfit of the curvature, not a cost."""
    beta, t, r2 = _lstsq(X, y)
    if (beta >= 0).all():
        return beta, t, r2
    best = None
    cols = range(X.shape[1])
    for k in range(X.shape[1] - 1, 0, -1):
        for keep in combinations(cols, k):
            b, tk, _ = _lstsq(X[:, keep], y)
            if (b < 0).any():
                continue
            sse = float(((y - X[:, keep] @ b) ** 2).sum())
            if best is None or sse < best[0]:
                best = (sse, keep, b, tk)
    if best is None:
        return beta, t, r2  # nothing non-negative fits: fit_problem refuses it
    sse, keep, b, tk = best
    full, tfull = np.zeros(X.shape[1]), np.zeros(X.shape[1])
    full[list(keep)], tfull[list(keep)] = b, tk
    ss_tot = float(((y - y.mean()) ** 2).sum())
    return full, tfull, (1.0 - sse / ss_tot if ss_tot > 0 else None)


def fit_cost_model(samples: list, source: str = "fit", terms: str = "auto", without=()) -> CostModel:
    """Non-negative least squares on CostSamples (or tuples as stored, CostSample.of); samples without
    rows fit qk_free = 0 and no sparse term. A term that would fit below zero is held at 0.

    terms="paper": the paper's three terms. terms="auto": also the query x KV term (at each candidate
    qk_free when the samples have rows), the multi-query term at the same qk_free (rows only, qk_free >= 1),
    the sparse and the capture term, each kept only when significant (t >= EXTRA_MIN_T and positive); of
    those fits the one with the highest R^2, one with the multi-query step only if it explains
    significantly more (F >= EXTRA_MIN_T^2); steps of Vegas-shaped work then fit SHAPED_TERMS (_fit_shaped).
    `without`: terms (EXTRA_TERMS, SHAPED_TERMS) left out. Checked by `fit_problem`; docs/decoders.md.
    """
    if terms not in ("auto", "paper"):
        raise ValueError(f"terms must be 'auto' or 'paper', not {terms!r}")
    if not samples:
        raise ValueError("no timed steps to fit a cost model to")
    if set(without) - set(EXTRA_TERMS) - set(SHAPED_TERMS):
        raise ValueError(f"terms that can be left out are {', '.join(EXTRA_TERMS + SHAPED_TERMS)}, "
                         f"not {sorted(set(without))}")
    norm = [CostSample.of(s) for s in samples]
    generic = [s for s in norm if not _shaped(s)]
    if generic and len(generic) < len(norm):
        model = fit_cost_model(generic, source, terms, without)
        return model if model is None or terms == "paper" else _fit_shaped(model, norm, without)
    y = np.array([s.seconds for s in norm])
    base = np.array([[1.0, s.tokens, s.kv_read] for s in norm])
    with_rows = all(s.rows is not None for s in norm)
    # (qk_free, sparse column, capture column, multi-query term) of each candidate fit
    if terms == "auto":
        def optional(term, name):
            col = np.array([term(s.rows) for s in norm]) if with_rows else np.zeros(len(norm))
            return [None] + ([col] if col.std() > 0 and name not in without else [])
        frees = [None] if "beta_qk" in without else [None, *(QK_FREE if with_rows else (0,))]
        multis = (False,) if "beta_multi" in without else (False, True)
        extras = [(free, sp, cap, multi) for free in frees for sp in optional(sparse_term, "beta_sparse")
                  for cap in optional(capture_term, "beta_capture")
                  for multi in (multis if with_rows and free else (False,))]
    else:
        extras = [(None, None, None, False)]
    best: dict[bool, CostModel | None] = {False: None, True: None}  # the best fit without / with the step
    for free, sp, cap, multi in extras:
        named = []  # (coefficient, column) beyond the three base terms
        if free is not None:
            q = np.array([qk_term(s.rows, free) if with_rows else s.qk for s in norm])
            if q.std() == 0:
                continue
            named.append(("beta_qk", q))
        if multi:
            m = np.array([multi_term(s.rows, free) for s in norm])
            if m.std() == 0:
                continue
            named.append(("beta_multi", m))
        if sp is not None:
            named.append(("beta_sparse", sp))
        if cap is not None:
            named.append(("beta_capture", cap))
        beta, t, r2 = _nonnegative_lstsq(np.column_stack([base, *(col for _, col in named)]), y)
        if any(not (beta[j] > 0 and t[j] >= EXTRA_MIN_T) for j in range(3, beta.size)):
            continue
        coef = dict(zip(("beta0", "beta_tok", "beta_attn", *(name for name, _ in named)), map(float, beta)))
        model = CostModel(**coef, source=source, r2=r2, qk_free=free or 0)
        if best[multi] is None or (r2 or 0) > (best[multi].r2 or 0):
            best[multi] = model
    plain, stepped = best[False], best[True]
    params = 3 + sum(getattr(stepped, k) > 0 for k in EXTRA_TERMS) if stepped else 0
    if stepped is None or (plain is not None and _improvement(plain, stepped, len(y), params) < EXTRA_MIN_T ** 2):
        return plain
    return stepped


def _shaped(sample: CostSample) -> bool:
    """Whether a timed step did Vegas-shaped work (layered_term or topk_term of its rows above 0)."""
    return bool(sample.rows) and (layered_term(sample.rows) > 0 or topk_term(sample.rows) > 0)


def _fit_shaped(model: CostModel, samples: list[CostSample], without=()) -> CostModel:
    """`model` (fitted on the steps without Vegas-shaped work) with SHAPED_TERMS fitted on the steps with
    it: non-negative least squares, through zero, of what `model` leaves of their times once their
    shaped positions are taken out of the generic terms. A term no step exercises stays None."""
    shaped = [s for s in samples if _shaped(s)]
    names = [k for k, term in zip(SHAPED_TERMS, (layered_term, topk_term))
             if k not in without and any(term(s.rows) > 0 for s in shaped)]
    if not names:
        return model
    columns = {"beta_layered": layered_term, "beta_topk": topk_term}
    X = np.array([[columns[k](s.rows) for k in names] for s in shaped])
    generic = replace(model, beta_layered=0.0, beta_topk=0.0)
    y = np.array([s.seconds - generic.rows_time(s.rows) for s in shaped])
    beta = np.clip(_nonnegative_lstsq(X, y)[0], 0.0, None)
    return replace(model, **{k: float(b) for k, b in zip(names, beta)})


def _improvement(simpler: CostModel, richer: CostModel, n: int, params: int) -> float:
    """F statistic of the richer fit's reduction of the residual over the simpler's. A step at qk_free
    = f' with a slope after it matches a slope from f < f' wherever the samples have no row of f + 1
    .. f' tokens: such a richer fit explains the same, and must not win by fitting noise."""
    if richer.r2 is None or simpler.r2 is None:
        return 0.0
    return (richer.r2 - simpler.r2) * max(1, n - params) / max(1e-12, 1.0 - richer.r2)


def fit_problem(model: CostModel) -> str | None:
    """Why a fitted cost model must not be used, or None when it may."""
    negative = [k for k in ("beta0", "beta_tok", "beta_attn", *EXTRA_TERMS, *SHAPED_TERMS)
                if (getattr(model, k) or 0.0) < 0]
    if negative:
        return f"negative coefficient(s) {', '.join(f'{k}={getattr(model, k):.3g}' for k in negative)}"
    if model.r2 is None or model.r2 < MIN_R2:
        return f"R^2 {model.r2 if model.r2 is None else round(model.r2, 3)} < {MIN_R2}"
    return None


# Before any timing exists: attention-dominated decode, as at long context (documented).
DEFAULT_COST = CostModel(beta0=1.0, beta_tok=0.05, beta_attn=1.0 / 1024, source="default")

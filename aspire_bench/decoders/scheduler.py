"""ASPIRE's per-request online scheduler (Algorithm 1) and its batch-aware cost model. Pure."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def expected_tokens(alpha: float, gamma: int) -> float:
    """Omega(alpha, gamma) = (1 - alpha^(gamma+1)) / (1 - alpha): tokens per verification."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def best_gamma(alpha: float, c: float, d_max: int) -> int:
    """argmax over gamma in 0..d_max of Omega(alpha, gamma) / (1 + c * gamma) (first on ties)."""
    vals = [expected_tokens(alpha, g) / (1.0 + c * g) for g in range(d_max + 1)]
    return int(np.argmax(vals))


def update_alpha(alpha: float, accepted: int, drafted: int, omega: float = 0.8) -> float:
    """EMA of the per-token acceptance: alpha_hat = a / min(a + 1, d), 1 when all were accepted."""
    if drafted == 0:
        return alpha
    hat = 1.0 if accepted >= drafted else accepted / min(accepted + 1, drafted)
    return omega * alpha + (1.0 - omega) * hat


@dataclass
class RequestSchedule:
    alpha: float = 0.9
    verified: bool = False
    target: int = 0  # FSM / fixed policies: current draft-length target


@dataclass
class CostModel:
    """Step time = beta0 + beta_tok * tokens + beta_attn * KV positions read (per layer)."""

    beta0: float
    beta_tok: float
    beta_attn: float
    source: str = "default"
    r2: float | None = None

    def step_time(self, n_tokens: float, kv_read: float) -> float:
        return self.beta0 + self.beta_tok * n_tokens + self.beta_attn * kv_read

    def cost_ratio(self, batch: int, draft_kv: float, context: float, drafts: int) -> float:
        """c_i = T_draft / T_verify for a request in a batch of `batch`."""
        t_draft = self.step_time(batch, batch * draft_kv)
        t_verify = self.step_time(batch * (drafts + 1), batch * context)
        return t_draft / t_verify if t_verify > 0 else 1.0

    def to_dict(self) -> dict:
        return {"beta0": self.beta0, "beta_tok": self.beta_tok, "beta_attn": self.beta_attn,
                "source": self.source, "r2": self.r2}


def fit_cost_model(samples: list[tuple[float, float, float]], source: str = "fit") -> CostModel:
    """Least squares on (n_tokens, kv_read, seconds) samples; coefficients clipped at 0."""
    X = np.array([[1.0, n, kv] for n, kv, _ in samples])
    y = np.array([t for _, _, t in samples])
    beta, *_ = np.linalg.lstsq(X, y, rcond=None)
    beta = np.clip(beta, 0.0, None)
    pred = X @ beta
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else None
    return CostModel(float(beta[0]), float(beta[1]), float(beta[2]), source, r2)


# Before any timing exists: attention-dominated decode, as at long context (documented).
DEFAULT_COST = CostModel(beta0=1.0, beta_tok=0.05, beta_attn=1.0 / 1024, source="default")

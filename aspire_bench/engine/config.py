"""Model configuration read from a Hugging Face `config.json` (transformers 4.x and 5.x dialects)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import CheckpointError

# architecture name in config.json -> our family
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    # Mistral without a sliding window is a Llama (same weights and layout); with one it is refused below.
    "MistralForCausalLM": "llama",
}
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


@dataclass
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope_theta: float
    rope: dict = field(default_factory=dict)  # rope_type and its parameters
    eos_token_ids: tuple[int, ...] = ()

    @property
    def max_context(self) -> int:
        """Longest sequence: YaRN and dynamic NTK extend the context by their factor, linear scaling when
        it names the context it scales (an override does, engine/loading.py)."""
        r, kind = self.rope, self.rope.get("rope_type")
        if kind == "yarn" or (kind == "linear" and r.get("original_max_position_embeddings")):
            return max(self.max_position_embeddings, int(r["original_max_position_embeddings"] * float(r["factor"])))
        if kind == "dynamic":
            return int(self.max_position_embeddings * float(r["factor"]))
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, d: dict) -> ModelConfig:
        archs = d.get("architectures") or []
        family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        family = family or _MODEL_TYPES.get(d.get("model_type", ""))
        if family is None:
            name = (archs or [d.get("model_type", "?")])[0]
            raise CheckpointError(
                f"unsupported architecture {name!r}: supported are "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama, Qwen2, Qwen3 and Mistral without sliding window)")
        # Qwen2/3 switch the window on with use_sliding_window; Mistral has a window whenever sliding_window is
        # set (a window at least as long as the model's context changes nothing).
        window = d.get("sliding_window")
        max_pos = d.get("max_position_embeddings", 32768)
        uses_window = d.get("use_sliding_window") if "use_sliding_window" in d else (
            "MistralForCausalLM" in archs or d.get("model_type") == "mistral")
        if uses_window and window and window < max_pos:
            raise CheckpointError(f"sliding-window attention (sliding_window={window}) is not supported; set "
                                  "sliding_window to null in config.json if the model tolerates full attention")
        n_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // n_heads
        theta, rope = _read_rope(d)
        eos = d.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            family=family,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=n_heads,
            num_kv_heads=d.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias (its config has no flag); Llama/Qwen3 carry `attention_bias`.
            attention_bias=True if family == "qwen2" else bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            rope_theta=theta,
            rope=rope,
            eos_token_ids=eos,
        )


def _read_rope(d: dict) -> tuple[float, dict]:
    """(theta, rope params) from 5.x `rope_parameters` or 4.x `rope_theta` + `rope_scaling`."""
    params = d.get("rope_parameters")
    if params:
        # 5.x may nest per attention type ({"full_attention": {...}}); these families have one.
        if "rope_type" not in params and "rope_theta" not in params and len(params) == 1:
            params = next(iter(params.values()))
        params = dict(params)
        theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    else:
        theta = float(d.get("rope_theta", 10000.0))
        params = dict(d.get("rope_scaling") or {})
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(f"unsupported rope type {rope_type!r}: supported are "
                              f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type in ("dynamic", "linear", "llama3") and params.get("factor") is None:
        raise CheckpointError(f"rope type {rope_type!r} needs a 'factor' in config.json's rope scaling")
    if rope_type == "yarn":
        # transformers' defaults: the original context is max_position_embeddings unless given; the factor
        # defaults to the ratio of the two.
        params.setdefault("original_max_position_embeddings", d.get("max_position_embeddings", 32768))
        if params.get("factor") is None:
            params["factor"] = d.get("max_position_embeddings", 32768) / params["original_max_position_embeddings"]
    return theta, {"rope_type": rope_type, **params}


def _default_inv_freq(theta, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def _yarn_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """YaRN (Peng et al. 2023) as transformers computes it: interpolated low frequencies, extrapolated high
    ones, a linear ramp between the correction dimensions of beta_fast and beta_slow rotations."""
    dim, base, r = cfg.head_dim, cfg.rope_theta, cfg.rope
    factor, old = float(r["factor"]), float(r["original_max_position_embeddings"])
    beta_fast, beta_slow = r.get("beta_fast") or 32, r.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if r.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero, as transformers does
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    inv = _default_inv_freq(base, dim)
    return inv / factor * (1 - extrapolate) + inv * extrapolate


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor YaRN applies to cos and sin (1 for every other rope type)."""
    r = cfg.rope
    if r["rope_type"] != "yarn":
        return 1.0
    if r.get("attention_factor") is not None:
        return float(r["attention_factor"])
    factor = float(r["factor"])

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if r.get("mscale") and r.get("mscale_all_dim"):
        return float(mscale(factor, r["mscale"]) / mscale(factor, r["mscale_all_dim"]))
    return mscale(factor)


def dynamic_ntk_inv_freq(cfg: ModelConfig, lengths: torch.Tensor) -> torch.Tensor:
    """Dynamic-NTK inverse frequencies [len(lengths), head_dim/2] (fp64) for sequences of the given lengths:
    the rope base grows with the length past the original context, max_position_embeddings, as in transformers
    (at or below it nothing changes)."""
    dim, factor = cfg.head_dim, float(cfg.rope["factor"])
    old = float(cfg.max_position_embeddings)
    n = lengths.to(torch.float64).clamp(min=old)
    base = cfg.rope_theta * ((factor * n / old) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / base[:, None] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)[None, :]


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (fp32) with the config's scaling applied (dynamic NTK: those of positions within
    the original context; see dynamic_ntk_inv_freq for the rest)."""
    dim = cfg.head_dim
    inv = _default_inv_freq(cfg.rope_theta, dim)
    kind = cfg.rope["rope_type"]
    if kind == "yarn":
        inv = _yarn_inv_freq(cfg)
    elif kind == "linear":
        inv = inv / float(cfg.rope["factor"])
    elif kind == "llama3":
        factor = float(cfg.rope["factor"])
        lo, hi = float(cfg.rope["low_freq_factor"]), float(cfg.rope["high_freq_factor"])
        old = float(cfg.rope["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = torch.where(medium, smoothed, scaled)
    return inv.float()

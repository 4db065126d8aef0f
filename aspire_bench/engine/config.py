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
}
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


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
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, d: dict) -> ModelConfig:
        archs = d.get("architectures") or []
        family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        family = family or _MODEL_TYPES.get(d.get("model_type", ""))
        if family is None:
            name = (archs or [d.get("model_type", "?")])[0]
            raise CheckpointError(
                f"unsupported architecture {name!r}: supported are "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama, Qwen2 and Qwen3 families)")
        if d.get("use_sliding_window") and d.get("sliding_window"):
            raise CheckpointError("sliding-window attention configs are not supported; "
                                  "set use_sliding_window=false in config.json if the model tolerates it")
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
            max_position_embeddings=d.get("max_position_embeddings", 32768),
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
    return theta, {"rope_type": rope_type, **params}


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (fp32) with the config's scaling applied."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    kind = cfg.rope["rope_type"]
    if kind == "linear":
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

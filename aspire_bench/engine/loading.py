"""Hugging Face checkpoint directory -> Transformer (+ tokenizer).

A directory holds config.json, model.safetensors or a sharded model.safetensors.index.json, and
tokenizer files. `tiny` and `tiny-draft` name the checkpoints shipped inside this package (expanded into
the cache on first use, see ..models.bundled); the names of `aspire-bench models` (e.g. smollm2-135m) and
GGUF files resolve to checkpoints converted into the user cache (see ..models).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import CheckpointError, ConfigError
from .config import ModelConfig
from .model import LayerWeights, Transformer

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_model_path(model: str | Path) -> Path:
    from ..models import KNOWN, resolve_model
    from ..models.bundled import bundled_checkpoint, bundled_name
    if (name := bundled_name(model)) is not None:
        return bundled_checkpoint(name)
    found = resolve_model(str(model))
    if found is not None:
        return found
    path = Path(model).expanduser()
    if not path.exists():
        raise CheckpointError(f"model path {path} does not exist: pass a local Hugging Face checkpoint "
                              f"directory (config.json + *.safetensors + tokenizer), a .gguf file, `tiny`, or "
                              f"one of {', '.join(KNOWN)} (see `aspire-bench models`)")
    if not path.is_dir() or not (path / "config.json").exists():
        raise CheckpointError(f"{path} has no config.json: pass the checkpoint directory itself "
                              "(for a Hub cache, the snapshots/<revision> folder) or a .gguf file")
    return path


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {dtype!r}: choose float32, bfloat16, float16 or auto")
        dtype = DTYPES[dtype]
    if device.type == "cpu" and dtype == torch.float16:
        raise ConfigError("float16 is not supported on CPU here: use --dtype float32 (fastest on CPU) "
                          "or bfloat16")
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ConfigError("this GPU cannot run bfloat16: use --dtype float16 or float32")
    return dtype


def resolve_device(device: str | torch.device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA device is available: use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"unsupported device {device!r}: use cpu or cuda")
    return dev


def read_config(path: Path, rope_scaling: dict | None = None) -> ModelConfig:
    """The checkpoint's config; rope_scaling (config.json's form) replaces its rope scaling, as editing
    config.json would (e.g. YaRN for texts past the native context, as model cards prescribe)."""
    raw = _read_raw_config(path)
    if rope_scaling is not None and isinstance(raw, dict):
        if not isinstance(rope_scaling, dict):
            raise ConfigError(f"rope_scaling must be a mapping such as {{rope_type: yarn, factor: 4.0}}, "
                              f"not {rope_scaling!r}")
        params = raw.pop("rope_parameters", None) or {}
        if isinstance(params, dict) and "rope_theta" in params:
            raw.setdefault("rope_theta", params["rope_theta"])
        scaling = dict(rope_scaling)
        if scaling.get("rope_type", scaling.get("type")) == "linear" and "max_position_embeddings" in raw:
            # The factor scales the checkpoint's context, as YaRN's default does: an override extends it
            # (config.json's own linear entries come with max_position_embeddings already scaled).
            scaling.setdefault("original_max_position_embeddings", raw["max_position_embeddings"])
        raw["rope_scaling"] = scaling
    return parse_config(raw, str(path / "config.json"))


def _read_raw_config(path: Path):
    try:
        return json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path / 'config.json'} is not valid JSON ({e})") from None


# config.json entries that must be positive integers for the model to be built at all.
POSITIVE_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                       "num_kv_heads", "head_dim", "max_position_embeddings")


def parse_config(raw, source: str) -> ModelConfig:
    """ModelConfig.from_hf with its failures (a missing key, a value of the wrong type) as one line."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{source} is not a JSON object")
    try:
        cfg = ModelConfig.from_hf(raw)
    except KeyError as e:
        raise CheckpointError(f"{source} lacks {e.args[0]!r}: the checkpoint's config.json is incomplete") from None
    except (TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
        raise CheckpointError(f"{source} has a value of the wrong type ({e})") from None
    for name in POSITIVE_INT_FIELDS:
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise CheckpointError(f"{source}: {name} must be a positive integer, not {v!r}")
    if cfg.num_heads % cfg.num_kv_heads:
        raise CheckpointError(f"{source}: num_attention_heads ({cfg.num_heads}) is not a multiple of "
                              f"num_key_value_heads ({cfg.num_kv_heads})")
    if not all(isinstance(t, int) and 0 <= t < cfg.vocab_size for t in cfg.eos_token_ids):
        raise CheckpointError(f"{source}: eos_token_id {list(cfg.eos_token_ids)} is outside the vocabulary")
    return cfg


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index} is not a safetensors index ({type(e).__name__}: {e}): "
                                  "download it again") from None
        missing = [s for s in shards if not (path / s).exists()]
        if missing:
            raise CheckpointError(f"{path} is missing weight shard(s) {', '.join(missing)} named in "
                                  "model.safetensors.index.json: finish the download")
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        extra = " (only PyTorch .bin weights found: convert them to safetensors)" if any(
            path.glob("*.bin")) else ""
        raise CheckpointError(f"{path} has no *.safetensors weights{extra}")
    return files


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    sd: dict[str, torch.Tensor] = {}
    for f in _weight_files(path):
        try:
            sd.update(load_file(str(f)))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error type (and OSError) on a damaged file
            raise CheckpointError(f"{f} cannot be read as safetensors ({' '.join(str(e).split())}): the file is "
                                  "truncated or corrupt; download it again") from None
    return sd


def checkpoint_dtype(path: Path) -> str:
    """The dtype a checkpoint's config.json names (`torch_dtype`, or 5.x `dtype`); float32 when none."""
    raw = _read_raw_config(path)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path / 'config.json'} is not a JSON object")
    name = str(raw.get("dtype") or raw.get("torch_dtype") or "float32").removeprefix("torch.")
    if name not in DTYPES:
        raise CheckpointError(f"dtype auto: {path / 'config.json'} names dtype {name!r}; pass float32, "
                              "bfloat16 or float16 instead")
    return name


def load_model(model: str | Path, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu", rope_scaling: dict | None = None) -> Transformer:
    """dtype "auto": the checkpoint's own (config.json's torch_dtype)."""
    path = resolve_model_path(model)
    dev = resolve_device(device)
    if dtype == "auto":
        dtype = checkpoint_dtype(path)
        if dev.type == "cpu" and DTYPES[dtype] == torch.float16:
            raise ConfigError("dtype auto: the checkpoint is float16, which is not supported on CPU here: "
                              "pass float32 (fastest on CPU) or bfloat16")
    cfg = read_config(path, rope_scaling)
    return build_model(cfg, load_state_dict(path), resolve_dtype(dtype, dev), dev, str(path))


def random_model(hf_config: dict, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
                 seed: int = 0) -> Transformer:
    """A random-init model of a config.json's shape, made on the device (no checkpoint written).

    For per-step costs of shapes whose weights are not at hand (e.g. Qwen3-1.7B on a GPU); its outputs
    mean nothing. Weights ~ N(0, 0.02), norms 1, biases 0, as transformers initialises them.
    """
    cfg = parse_config(hf_config, "the config")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    g = torch.Generator(device=dev).manual_seed(seed)
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size

    def w(*shape):
        return torch.empty(shape, device=dev, dtype=dt).normal_(0.0, 0.02, generator=g)

    sd = {"model.embed_tokens.weight": w(cfg.vocab_size, h), "model.norm.weight": torch.ones(h, device=dev, dtype=dt)}
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = w(cfg.vocab_size, h)
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        outs = {"q": cfg.num_heads * d, "k": cfg.num_kv_heads * d, "v": cfg.num_kv_heads * d}
        for x, rows in outs.items():
            sd[p + f"self_attn.{x}_proj.weight"] = w(rows, h)
            if cfg.attention_bias:
                sd[p + f"self_attn.{x}_proj.bias"] = torch.zeros(rows, device=dev, dtype=dt)
        if cfg.qk_norm:
            sd[p + "self_attn.q_norm.weight"] = torch.ones(d, device=dev, dtype=dt)
            sd[p + "self_attn.k_norm.weight"] = torch.ones(d, device=dev, dtype=dt)
        sd[p + "self_attn.o_proj.weight"] = w(h, cfg.num_heads * d)
        sd[p + "mlp.gate_proj.weight"] = w(i, h)
        sd[p + "mlp.up_proj.weight"] = w(i, h)
        sd[p + "mlp.down_proj.weight"] = w(h, i)
        sd[p + "input_layernorm.weight"] = torch.ones(h, device=dev, dtype=dt)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(h, device=dev, dtype=dt)
    return build_model(cfg, sd, dt, dev, "random init")


def build_model(cfg: ModelConfig, sd: dict[str, torch.Tensor], dt: torch.dtype, dev: torch.device,
                source: str) -> Transformer:
    """Our fused layout from Hugging Face parameter names (whatever their dtype/device)."""

    def get(name: str, *shape: int, required: bool = True):
        t = sd.get(name)
        if t is None:
            if required:
                raise CheckpointError(f"weight {name!r} is missing from the checkpoint in {source}")
            return None
        if tuple(t.shape) != shape:  # caught here, not as a matmul error inside the first forward
            raise CheckpointError(f"weight {name!r} in {source} has shape {tuple(t.shape)} but config.json "
                                  f"implies {shape}: the weights do not belong to this config")
        return t.to(device=dev, dtype=dt)

    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    rows = {"q": cfg.num_heads * d, "k": cfg.num_kv_heads * d, "v": cfg.num_kv_heads * d}
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        qkv = [get(p + f"self_attn.{x}_proj.weight", rows[x], h) for x in "qkv"]
        bias = [get(p + f"self_attn.{x}_proj.bias", rows[x], required=cfg.attention_bias) for x in "qkv"]
        gate_up = [get(p + "mlp.gate_proj.weight", inter, h), get(p + "mlp.up_proj.weight", inter, h)]
        b_gu = [get(p + "mlp.gate_proj.bias", inter, required=cfg.mlp_bias),
                get(p + "mlp.up_proj.bias", inter, required=cfg.mlp_bias)]
        layers.append(LayerWeights(
            attn_norm=get(p + "input_layernorm.weight", h),
            wqkv=torch.cat(qkv).contiguous(),
            bqkv=torch.cat(bias) if all(b is not None for b in bias) else None,
            q_norm=get(p + "self_attn.q_norm.weight", d) if cfg.qk_norm else None,
            k_norm=get(p + "self_attn.k_norm.weight", d) if cfg.qk_norm else None,
            wo=get(p + "self_attn.o_proj.weight", h, cfg.num_heads * d),
            bo=get(p + "self_attn.o_proj.bias", h, required=False),
            mlp_norm=get(p + "post_attention_layernorm.weight", h),
            w_gate_up=torch.cat(gate_up).contiguous(),
            b_gate_up=torch.cat(b_gu) if all(b is not None for b in b_gu) else None,
            w_down=get(p + "mlp.down_proj.weight", h, inter),
            b_down=get(p + "mlp.down_proj.bias", h, required=cfg.mlp_bias),
        ))
    embed = get("model.embed_tokens.weight", cfg.vocab_size, h)
    head = get("lm_head.weight", cfg.vocab_size, h, required=not cfg.tie_word_embeddings)
    return Transformer(cfg, embed, layers, get("model.norm.weight", h), embed if head is None else head)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model: str | Path):
    """The checkpoint's tokenizer, or None when the directory has no tokenizer files (then only
    token-id prompts work)."""
    path = resolve_model_path(model)
    if not any((path / f).exists() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types here; the user needs one line
        raise CheckpointError(f"could not load the tokenizer from {path} ({type(e).__name__}: {e}); "
                              "the directory needs tokenizer.json or the model's tokenizer files") from e

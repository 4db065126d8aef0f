"""Step-cost models for the simulator: the time of one engine step from the rows it runs.

A row is (kind, tokens it puts through the forward pass, KV positions it attends per layer[, of
which scattered through a sparse view[, positions whose scores it captured[, kv_layered, kv_topk]]]), as
in a stored run's step rows. `CalibratedCost` prices them with this machine's fitted cost model (decoders/scheduler.py
CostModel). `Roofline` with a hardware profile and a model shape: every weight and each row's KV
read once, 2 FLOPs per weight per token plus attention's FLOPs, time = max(bytes / bandwidth, FLOPs /
peak) (their sum where the profile says they do not overlap, a CPU's) + a fixed per-step overhead;
scattered positions and captured scores cost nothing extra there. docs/simulator.md.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..decoders.scheduler import SHAPED_TERMS, CostModel, CostSample, fit_cost_model, qk_term
from ..errors import UserError

ASSETS = Path(__file__).resolve().parent.parent / "assets"
HARDWARE_DIR = ASSETS / "hardware"
SHAPES_DIR = ASSETS / "shapes"
TINY_SHAPE = str(ASSETS / "tiny" / "config.json")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def named_assets(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.json"))


def _read_json(spec: str, folder: Path, what: str, option: str) -> tuple[dict, str]:
    """A bundled asset by name, or a JSON file by path: (its content, its name)."""
    path = folder / f"{spec.lower()}.json"
    if not path.exists():
        path = Path(spec)
        if path.is_dir():
            path = path / "config.json"
    if not path.is_file():
        raise UserError(f"{option} {spec!r} is neither a bundled {what} ({', '.join(named_assets(folder))}) "
                        "nor a JSON file: pass one of those names or a file's path")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{option} {path} cannot be read as JSON ({e}): pass a valid JSON file") from None
    if not isinstance(data, dict):
        raise UserError(f"{option} {path} is not a JSON object: pass a {what} file")
    return data, (spec.lower() if path.parent == folder else str(path))


@dataclass(frozen=True)
class ModelShape:
    """What a roofline needs of a model: read from any Hugging Face config.json."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    dtype: str

    @property
    def weight_params(self) -> int:
        """Parameters read per step: attention and MLP of every layer and the LM head (the embedding
        is a lookup of a few rows, not a read of the table)."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp) + self.vocab * self.hidden

    @property
    def kv_bytes_per_position(self) -> int:
        """K and V of one position in every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @classmethod
    def load(cls, spec: str, dtype: str | None = None) -> ModelShape:
        d, name = _read_json(spec, SHAPES_DIR, "model shape", "--model-shape")
        try:
            heads = int(d["num_attention_heads"])
            dt = dtype or str(d.get("torch_dtype") or d.get("dtype") or "bfloat16")
            if dt not in DTYPE_BYTES:
                raise UserError(f"--model-shape {name}: dtype {dt!r} is not one of {', '.join(DTYPE_BYTES)}: "
                                "pass --dtype")
            return cls(name, int(d["num_hidden_layers"]), int(d["hidden_size"]), heads,
                       int(d.get("num_key_value_heads") or heads),
                       int(d.get("head_dim") or int(d["hidden_size"]) // heads), int(d["intermediate_size"]),
                       int(d["vocab_size"]), bool(d.get("tie_word_embeddings", False)), dt)
        except KeyError as e:
            raise UserError(f"--model-shape {name} lacks {e.args[0]!r}: pass a Hugging Face config.json") from None


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_bw_gbs: float
    tflops: dict
    bw_efficiency: float = 1.0
    flops_efficiency: float = 1.0
    step_overhead_us: float = 0.0
    overlap: bool = True  # reads hide under arithmetic or the reverse (a GPU); False: they add (a CPU)

    @classmethod
    def load(cls, spec: str) -> Hardware:
        d, name = _read_json(spec, HARDWARE_DIR, "hardware profile", "--hardware")
        try:
            hw = cls(str(d.get("name", name)), float(d["memory_bw_gbs"]), {k: float(v) for k, v in d["tflops"].items()},
                     float(d.get("bw_efficiency", 1.0)), float(d.get("flops_efficiency", 1.0)),
                     float(d.get("step_overhead_us", 0.0)), d.get("overlap", True))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise UserError(f"--hardware {name} is not a hardware profile ({e!r}): it needs memory_bw_gbs and "
                            "tflops {dtype: TFLOP/s}") from None
        if hw.memory_bw_gbs <= 0 or not all(v > 0 for v in hw.tflops.values()):
            raise UserError(f"--hardware {name}: bandwidth and FLOP/s must be positive")
        if not isinstance(hw.overlap, bool):
            raise UserError(f"--hardware {name}: overlap is {hw.overlap!r}: write true (a GPU) or false (a CPU)")
        return hw


class CalibratedCost:
    def __init__(self, model: CostModel):
        self.model = model

    def step_time(self, rows) -> float:
        return self.model.rows_time(r[1:7] for r in rows)

    def scheduler_model(self, batch: int = 8, context: int = 16384) -> CostModel:
        return self.model

    def for_model(self, other: ModelShape, calibrated: Callable[[], ModelShape]) -> CalibratedCost:
        """This calibration scaled to another model on the same machine (a draft model): the fixed term
        by the ratio of layers, the per-token term by the ratio of weights read, the per-KV-position
        terms by the ratio of KV bytes per position, the query x KV term by the ratio of attention
        FLOPs per (query, position). `calibrated`: gives the shape of the model it was timed on."""
        base, m = calibrated(), self.model
        layers, weights = other.layers / base.layers, other.weight_params / base.weight_params
        kv = other.kv_bytes_per_position / base.kv_bytes_per_position
        qk = (other.heads * other.head_dim * other.layers) / (base.heads * base.head_dim * base.layers)
        return CalibratedCost(replace(m, beta0=m.beta0 * layers, beta_tok=m.beta_tok * weights,
                                      beta_attn=m.beta_attn * kv, beta_qk=m.beta_qk * qk,
                                      beta_sparse=m.beta_sparse * kv, beta_multi=m.beta_multi * kv,
                                      beta_capture=m.beta_capture * kv, source=f"{m.source} scaled to {other.name}",
                                      **{k: getattr(m, k) * kv for k in SHAPED_TERMS if getattr(m, k) is not None}))

    def describe(self) -> dict:
        return {"cost_model": "calibration", **self.model.to_dict()}


class Roofline:
    def __init__(self, hardware: Hardware, shape: ModelShape):
        if shape.dtype not in hardware.tflops:
            raise UserError(f"--hardware {hardware.name} has no FLOP/s for {shape.dtype}: add it to the profile "
                            f"or pass --dtype one of {', '.join(hardware.tflops)}")
        self.hw, self.shape = hardware, shape
        self.bw = hardware.memory_bw_gbs * 1e9 * hardware.bw_efficiency
        self.flops = hardware.tflops[shape.dtype] * 1e12 * hardware.flops_efficiency
        self.weight_bytes = shape.weight_params * DTYPE_BYTES[shape.dtype]
        self.attn_flops = 4 * shape.heads * shape.head_dim * shape.layers  # per (query, KV position)

    def step_time(self, rows) -> float:
        n = sum(r[1] for r in rows)
        kv = sum(r[2] for r in rows)
        qk = sum(r[1] * r[2] for r in rows)
        nbytes = self.weight_bytes + kv * self.shape.kv_bytes_per_position
        flops = 2 * self.shape.weight_params * n + self.attn_flops * qk
        read, compute = nbytes / self.bw, flops / self.flops
        busy = max(read, compute) if self.hw.overlap else read + compute
        return busy + self.hw.step_overhead_us * 1e-6

    def scheduler_model(self, batch: int = 8, context: int = 16384) -> CostModel:
        """What `aspire-bench calibrate --batch-size batch --context-len context` would fit on this
        hardware: the linear model fitted to this roofline's times over a calibration grid (draft
        and verify rows of 1, 4, 8 and 16 drafts mixed, two lengths)."""
        samples = []
        for length in (context // 4, context):
            for n_verify in sorted({0, batch // 2, batch}):
                for d in (1, 4, 8, 16):
                    for ratio in (0.07, 0.25, 1.0):
                        rows = [("verify", d + 1, length + d + 1) if j < n_verify else
                                ("draft", 1, int(ratio * length) + 1) for j in range(batch)]
                        per_row = [(r[1], r[2]) for r in rows]
                        samples.append(CostSample(sum(r[1] for r in rows), sum(r[2] for r in rows),
                                                  qk_term(per_row), self.step_time(rows), per_row))
        return fit_cost_model(samples, source=f"roofline fit ({self.hw.name}, {self.shape.name})")

    def for_model(self, other: ModelShape, calibrated: Callable[[], ModelShape] | None = None) -> Roofline:
        """The same hardware for another model in this one's dtype (a draft model runs in its target's):
        its own weights and KV read per step."""
        return Roofline(self.hw, replace(other, dtype=self.shape.dtype))

    def describe(self) -> dict:
        return {"cost_model": "roofline", "hardware": asdict(self.hw), "model_shape": asdict(self.shape),
                "weight_bytes": self.weight_bytes, "kv_bytes_per_position": self.shape.kv_bytes_per_position}


def profile_for(device_name: str | None) -> str | None:
    """The bundled profile of a GPU by its CUDA name (None when none fits)."""
    name = (device_name or "").upper()
    for key, profile in (("H200", "h200"), ("H100 NVL", "h100-nvl"), ("H100", "h100"), ("A100", "a100")):
        if key in name:
            return profile
    return None


def predicted_step_ms(roofline: Roofline, cell: dict) -> dict:
    """The roofline's time of each step kind of a benchmarks/step_costs.py cell (batch rows of one kind)."""
    batch, gamma = cell["batch"], cell["gamma"]
    out = {}
    for kind, kv in cell.get("kv_positions_per_row", {}).items():
        n = gamma + 1 if kind == "verify" else 1
        out[kind] = roofline.step_time([(kind, n, kv + (n if kind in ("ar", "verify") else 1))] * batch) * 1e3
    return out

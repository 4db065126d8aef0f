"""Typed schemas of what users write: a sweep file, and the settings of one run (RunConfig).

pydantic in strict mode: a value of the wrong type (`batch_sizes: [abc]`, `repeats: many`,
`parity: "false"`) or out of range (`max_new_tokens: 0`) is refused with one line naming the key,
never coerced. Unknown keys are errors: a typo would otherwise silently run the defaults.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from ..errors import ConfigError, UserError, validation_message
from ..limits import MAX_BATCH, MAX_REQUESTS

SEED_MAX = 2**63 - 1
Dtype = Literal["float32", "fp32", "bfloat16", "bf16", "float16", "fp16"]
Backend = Literal["auto", "torch", "cpu", "triton"]
Positive = Annotated[int, Field(ge=1)]
NonNegative = Annotated[int, Field(ge=0)]
Requests = Annotated[int, Field(ge=1, le=MAX_REQUESTS)]
Batch = Annotated[int, Field(ge=1, le=MAX_BATCH)]


def _distinct(items: list) -> list:
    """A list that names one value twice would run the same cells twice."""
    seen = []
    for x in items:
        if x in seen:
            shown = x.model_dump(exclude_defaults=True) if isinstance(x, BaseModel) else x
            if isinstance(shown, dict) and len(shown) == 1 and set(shown) <= {"name", "path"}:
                shown = next(iter(shown.values()))  # a bare name, as it was written
            raise ValueError(f"{shown!r} is listed twice: keep one")
        seen.append(x)
    return items


def _finite(x: float) -> float:
    if not math.isfinite(x):
        raise ValueError("must be a finite number")
    return x


def _bucket(c: str | None) -> str | None:
    if c is not None:
        from ..tasks.buckets import parse_bucket
        try:
            parse_bucket(c)
        except UserError as e:
            raise ValueError(str(e)) from None
    return c


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _named(key: str):
    """A bare string stands for {key: string}."""
    return lambda x: {key: x} if isinstance(x, str) else x


def _int_as_str(x):
    return str(x) if isinstance(x, int) and not isinstance(x, bool) else x


Temperature = Annotated[float, Field(ge=0.0), AfterValidator(_finite)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
Seed = Annotated[int, Field(ge=0, le=SEED_MAX)]
Context = Annotated[str | None, BeforeValidator(_int_as_str), AfterValidator(_bucket)]
Contexts = Annotated[list[Context], BeforeValidator(_as_list), AfterValidator(_distinct)]
MaxNew = Annotated[list[Positive | None], BeforeValidator(_as_list), AfterValidator(_distinct)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class ModelEntry(_Strict):
    path: str
    dtype: Dtype | None = None
    device: str | None = None
    attention_backend: Backend | None = None
    # config.json's rope_scaling form (checked when the model loads), and the contexts it applies to
    rope_scaling: dict[str, Any] | None = None
    rope_scaling_contexts: Contexts | None = None


class DecoderEntry(_Strict):
    name: str
    args: dict[str, Any] | None = None  # checked by the decoder's own settings schema, per cell


class TaskEntry(_Strict):
    name: str
    data: str | None = None
    limit: Requests | None = None
    contexts: Contexts | None = None
    max_new_tokens: MaxNew | None = None


class SamplingEntry(_Strict):
    temperature: Temperature = 0.0
    top_k: NonNegative = 0
    top_p: TopP = 1.0
    seed: Seed = 0


class RayOptions(_Strict):
    num_cpus: Annotated[float, Field(gt=0)] | None = None
    num_gpus: Annotated[float, Field(ge=0)] | None = None
    local_num_cpus: Positive | None = None


class SweepSpec(_Strict):
    name: str | None = None
    models: Annotated[list[Annotated[ModelEntry, BeforeValidator(_named("path"))]],
                      BeforeValidator(_as_list), Field(min_length=1), AfterValidator(_distinct)]
    decoders: Annotated[list[Annotated[DecoderEntry, BeforeValidator(_named("name"))]],
                        BeforeValidator(_as_list), Field(min_length=1), AfterValidator(_distinct)]
    tasks: Annotated[list[Annotated[TaskEntry, BeforeValidator(_named("name"))]],
                     BeforeValidator(_as_list), Field(min_length=1), AfterValidator(_distinct)]
    contexts: Contexts | None = None
    batch_sizes: Annotated[list[Batch], BeforeValidator(_as_list), Field(min_length=1), AfterValidator(_distinct)] = [8]
    max_new_tokens: MaxNew | None = None
    sampling: Annotated[list[SamplingEntry], BeforeValidator(_as_list), AfterValidator(_distinct)] | None = None
    limit: Requests | None = 8
    repeats: Positive = 1
    parity: bool = False
    parity_tolerance: float | None = None  # its range: harness/parity.check_tolerance
    tune: bool = False
    equal_work: bool = True
    warmup: bool = True
    prefix_cache: bool = False
    dtype: Dtype = "float32"
    device: str = "cpu"
    attention_backend: Backend = "auto"
    max_retries: NonNegative = 0
    ray: RayOptions | None = None


def check_sweep(spec: Any, where: str) -> None:
    """Raise ConfigError (one line) unless `spec` (the parsed YAML) fits SweepSpec."""
    if not isinstance(spec, dict):
        raise ConfigError(f"{where}: a sweep file is a mapping with at least models, decoders and tasks")
    try:
        SweepSpec.model_validate(spec)
    except ValidationError as e:
        raise ConfigError(validation_message(e, where)) from None


def read_sweep_file(path) -> Any:
    """The parsed YAML of a sweep file (safe_load: plain data only)."""
    import yaml
    path = Path(path)
    if not path.is_file():
        raise UserError(f"sweep file {path} does not exist" if not path.exists() else f"{path} is not a file")
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=_unique_key_loader())  # SafeLoader's subclass: plain data only
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except (yaml.YAMLError, UnicodeDecodeError, OSError) as e:
        raise UserError(f"{path} is not a readable YAML file: {' '.join(str(e).split())}") from None


def _unique_key_loader():
    import yaml

    class Loader(yaml.SafeLoader):
        """safe_load's loader that refuses a key given twice in one mapping (PyYAML keeps the last)."""

    def mapping(loader, node, deep=False):
        loader.flatten_mapping(node)
        seen = {}
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int, float, bool, type(None))):
                continue  # an unhashable key: construct_mapping refuses it below
            if key in seen:
                raise ConfigError(f"line {key_node.start_mark.line + 1}: key {key!r} is given twice (also on line "
                                  f"{seen[key]}): keep one")
            seen[key] = key_node.start_mark.line + 1
        return loader.construct_mapping(node, deep)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return Loader


def check_sweep_file(path) -> None:
    check_sweep(read_sweep_file(path), str(path))


class RunSettings(BaseModel):
    """The RunConfig fields a user sets, with their ranges (other fields pass through unchecked)."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: str
    decoder: str
    decoder_args: dict[str, Any]
    task: str
    data: str | None
    limit: Requests | None
    context_len: Context
    batch_size: Batch
    max_new_tokens: Positive | None
    temperature: Temperature
    top_k: NonNegative
    top_p: TopP
    seed: Seed
    repeat: Positive
    parity: bool
    dtype: Dtype
    device: str
    attention_backend: Backend


def check_run_settings(settings: dict) -> None:
    try:
        RunSettings.model_validate(settings)
    except ValidationError as e:
        raise ConfigError(validation_message(e, "run option")) from None

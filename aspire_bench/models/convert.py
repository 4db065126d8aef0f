"""GGUF file -> Hugging Face checkpoint directory (config, bf16 safetensors, tokenizer, chat template,
provenance.json), dequantised once through transformers' GGUF reader and published by one rename."""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from ..errors import CheckpointError
from .catalog import is_checkpoint
from .gguf_file import GGUFInfo

PROVENANCE = "provenance.json"


def convert_gguf(info: GGUFInfo, dest: Path, provenance: dict) -> Path:
    """Convert the checked GGUF `info` into `dest` (its parent is created). A concurrent conversion that
    published first wins; a failed one leaves nothing behind."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    print(f"converting {info.path.name} ({info.architecture}, {info.quantisation}) once into {dest}",
          file=sys.stderr, flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    try:
        tokenizer = _write_checkpoint(info, tmp)
        record = {**provenance, "gguf_file": info.path.name, "architecture": info.architecture,
                  "quantisation": info.quantisation, "tensor_types": info.tensor_types,
                  "gguf_name": info.name, "weights_dtype": "bfloat16", "tokenizer": tokenizer,
                  "converted_with": {p: _version(p) for p in ("aspire-bench", "transformers", "gguf", "torch")},
                  "converted_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        record.setdefault("licence", info.licence)
        (tmp / PROVENANCE).write_text(json.dumps(record, indent=1) + "\n")
        try:
            os.rename(tmp, dest)
        except OSError:
            if not is_checkpoint(dest):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process published the same conversion first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _write_checkpoint(info: GGUFInfo, out: Path) -> bool:
    """Config, bf16 weights and (when the file has one) tokenizer into `out`; whether a tokenizer was written."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    folder, name = str(info.path.parent), info.path.name
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    except ImportError as e:
        raise CheckpointError(f"converting a GGUF file needs {e}: pip install gguf accelerate") from None
    except Exception as e:  # noqa: BLE001 - transformers raises many types; the user needs one line
        raise CheckpointError(f"transformers could not read {info.path} ({type(e).__name__}: "
                              f"{' '.join(str(e).split())})") from None
    cfg = model.config
    for attr in ("quantization_config",):
        if hasattr(cfg, attr):
            delattr(cfg, attr)
    cfg.architectures = [type(model).__name__]
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the embedding itself (safetensors stores no shared tensors)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(str(out))
    _name_dtype(out / "config.json", "bfloat16")
    if not info.has_tokenizer:
        return False
    try:
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(str(out))
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"transformers could not read the tokenizer of {info.path} ({type(e).__name__}: "
                              f"{' '.join(str(e).split())})") from None
    return True


def _name_dtype(config_json: Path, dtype: str) -> None:
    """config.json names the weights' dtype under the key this transformers writes (4.x torch_dtype, 5.x dtype)."""
    raw = json.loads(config_json.read_text())
    raw.pop("_model_name_or_path", None)  # the GGUF's general.name, kept in provenance.json
    keys = [k for k in ("dtype", "torch_dtype") if k in raw] or ["dtype"]
    raw.update({k: dtype for k in keys})
    config_json.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")

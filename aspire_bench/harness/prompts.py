"""The prompts JSONL of `aspire-bench generate`: one {"id", "prompt"} or {"id", "input_ids"} object a line.

Every line is checked before anything is generated; a bad one is refused with its line number,
never skipped, truncated or wrapped around the vocabulary.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError

KEYS = ("id", "prompt", "input_ids")


@dataclass
class PromptRow:
    line: int
    id: str
    input_ids: list[int] | None = None
    text: str | None = None


def read_prompts(path: Path) -> list[PromptRow]:
    """The rows of a prompts file, checked in form (no model needed, so a bad file fails before one
    is loaded); blank lines are allowed between rows, but at least one row is needed."""
    if not path.is_file():
        raise UserError(f"prompts file {path} does not exist" if not path.exists() else
                        f"prompts file {path} is not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    rows, seen = [], set()
    for n, line in enumerate(text.split("\n"), 1):  # not splitlines: U+2028 inside a JSON string is valid
        if line.strip():
            row = parse_line(line, n, where=str(path))
            if row.id in seen:
                raise UserError(f"{path}:{n}: id {row.id!r} is used twice: give every prompt its own id")
            seen.add(row.id)
            rows.append(row)
    if not rows:
        raise UserError(f"{path} has no prompts: write one JSON object per line, "
                        '{"id": ..., "prompt": "..."} or {"id": ..., "input_ids": [...]}')
    return rows


def parse_line(line: str, n: int, where: str = "prompts") -> PromptRow:
    at = f"{where}:{n}"
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as e:
        raise UserError(f"{at} is not valid JSON ({getattr(e, 'msg', 'nested too deeply')})") from None
    if not isinstance(obj, dict):
        raise UserError(f'{at}: expected a JSON object such as {{"id": "a", "prompt": "..."}}, '
                        f"got {type(obj).__name__ if obj is not None else 'null'}")
    unknown = sorted(set(obj) - set(KEYS))
    if unknown:
        raise UserError(f"{at}: unknown key(s) {', '.join(map(repr, unknown))}: a line has id and one of "
                        "prompt, input_ids")
    rid = obj.get("id", n)
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        raise UserError(f"{at}: id must be a string or an integer")
    if ("prompt" in obj) == ("input_ids" in obj):
        raise UserError(f'{at} needs exactly one of "prompt" or "input_ids"')
    if "input_ids" in obj:
        ids = obj["input_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise UserError(f"{at}: input_ids must be a list of integer token ids")
        if not ids:
            raise UserError(f"{at}: the prompt is empty")
        return PromptRow(n, str(rid), input_ids=ids)
    if not isinstance(obj["prompt"], str) or not obj["prompt"]:
        raise UserError(f"{at}: prompt must be a non-empty string")
    return PromptRow(n, str(rid), text=obj["prompt"])


def encode_prompts(rows: list[PromptRow], tokenizer, vocab_size: int,
                   where: str = "prompts") -> list[tuple[str, list[int]]]:
    """(id, token ids) per row: text through the tokenizer, every id inside the vocabulary."""
    out = []
    for r in rows:
        if r.input_ids is None:
            if tokenizer is None:
                raise UserError("text prompts need a tokenizer in the checkpoint directory; give input_ids")
            ids = list(tokenizer.encode(r.text))
            if not ids:
                raise UserError(f"{where}:{r.line}: the prompt encodes to no tokens")
        else:
            ids = r.input_ids
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise UserError(f"{where}:{r.line}: token id {bad} is outside the vocabulary (0..{vocab_size - 1})")
        out.append((r.id, ids))
    return out

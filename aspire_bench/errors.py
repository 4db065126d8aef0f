"""Errors a user can fix. The CLI prints their message as one line (no traceback) and exits 2."""
from __future__ import annotations


class UserError(Exception):
    """Bad input: the message names the problem and the fix."""


class CheckpointError(UserError):
    pass


class ConfigError(UserError):
    pass


class DatasetUnavailable(UserError):
    pass


class OutOfMemoryBudget(UserError):
    pass


class StoreError(UserError):
    """The results store (or a file given as one) cannot be opened, read or written."""


def validation_message(err, where: str) -> str:
    """One line from a pydantic ValidationError: where, the first bad field's location and why
    (the count of further problems, if any), so the user can fix them one run at a time."""
    errors = err.errors(include_url=False)
    first = errors[0]
    loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"]).lstrip(".")
    kind, msg, got = first["type"], first["msg"].rstrip("."), first.get("input")
    msg = {"extra_forbidden": "unknown key (a typo?)", "missing": "required but missing"}.get(kind, msg)
    msg = msg.removeprefix("Value error, ")
    quiet = kind in ("missing", "extra_forbidden", "value_error") or isinstance(got, (dict, list))
    shown = "" if quiet else f" (got {got!r})"
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {loc or 'the document'}: {msg}{shown}{more}"


def did_you_mean(word: str, choices) -> str:
    """' (did you mean X?)' for the closest of `choices` to a misspelt `word`, or ''."""
    import difflib
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""

"""A progress bar with live tokens/s (rich), quiet when output is not a terminal."""
from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class TokenProgress:
    def __init__(self, total: int, label: str, disable: bool = False):
        self._p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                           TextColumn("{task.fields[rate]} tok/s"), TimeElapsedColumn(),
                           transient=False, disable=disable)
        self._task = self._p.add_task(label, total=total, rate="-")

    def __enter__(self):
        self._p.__enter__()
        return self

    def __exit__(self, *exc):
        return self._p.__exit__(*exc)

    def advance(self, n: int) -> None:
        self._p.advance(self._task, n)
        task = self._p.tasks[self._task]
        if task.elapsed:
            self._p.update(self._task, rate=f"{task.completed / task.elapsed:,.0f}")

"""A progress bar with live tokens/s (rich), on stderr so that stdout holds only results."""
from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class TokenProgress:
    def __init__(self, total: int, label: str, disable: bool = False):
        self._p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                           TextColumn("{task.fields[rate]} tok/s"), TimeElapsedColumn(),
                           transient=False, disable=disable, console=stderr_console())
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


def stderr_console() -> Console:
    """Progress and status output: stderr, so `aspire-bench ... > out.md` and `| tee` get results only."""
    return Console(stderr=True)

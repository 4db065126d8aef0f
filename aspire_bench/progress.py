"""A progress bar with live tokens/s (rich), on stderr so that stdout holds only results.

In a terminal the bar redraws in place. Elsewhere (a CI log, `2> err.log`) a redrawn bar would show
only once it is finished, so a 30-minute prefill would be 30 silent minutes: there the bar is a plain
line every LOG_INTERVAL_S seconds and one at the end."""
from __future__ import annotations

import time
from datetime import timedelta

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

LOG_INTERVAL_S = 30.0  # a log's progress lines: at most one per this many seconds, and the last
_clock = time.monotonic


class TokenProgress:
    def __init__(self, total: int, label: str, disable: bool = False):
        self._console = stderr_console()
        self._lines = not disable and not self._console.is_terminal
        self._p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                           TextColumn("{task.fields[rate]} tok/s"), TimeElapsedColumn(),
                           transient=False, disable=disable or self._lines, console=self._console)
        self._task = self._p.add_task(label, total=total, rate="-")
        self._label, self._total, self._done = label, total, 0
        self._start = self._logged = 0.0

    def __enter__(self):
        self._start = self._logged = _clock()
        self._p.__enter__()
        return self

    def __exit__(self, *exc):
        if self._lines:
            self._line(_clock())
        return self._p.__exit__(*exc)

    def advance(self, n: int) -> None:
        self._p.advance(self._task, n)
        self._done += n
        task = self._p.tasks[self._task]
        if task.elapsed:
            self._p.update(self._task, rate=f"{task.completed / task.elapsed:,.0f}")
        if self._lines:
            now = _clock()
            if now - self._logged >= LOG_INTERVAL_S:
                self._line(now)

    def _line(self, now: float) -> None:
        self._logged = now
        elapsed = now - self._start
        rate = f"{self._done / elapsed:,.0f}" if elapsed > 0 else "-"
        self._console.print(f"{self._label} {self._done}/{self._total} {rate} tok/s "
                            f"{timedelta(seconds=round(elapsed))}", highlight=False, soft_wrap=True, markup=False)


def stderr_console() -> Console:
    """Progress and status output: stderr, so `aspire-bench ... > out.md` and `| tee` get results only."""
    return Console(stderr=True)

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
        self._p, self._lines = stderr_bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                          TextColumn("{task.fields[rate]} tok/s"), TimeElapsedColumn(),
                                          disable=disable)
        self._task = self._p.add_task(label, total=total, rate="-")
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
        task = self._p.tasks[self._task]
        if task.elapsed:
            self._p.update(self._task, rate=f"{task.completed / task.elapsed:,.0f}")
        if self._lines:
            now = _clock()
            if now - self._logged >= LOG_INTERVAL_S:
                self._line(now)

    def _line(self, now: float) -> None:
        self._logged = now
        task, elapsed = self._p.tasks[self._task], now - self._start
        rate = f"{task.completed / elapsed:,.0f}" if elapsed > 0 else "-"
        log_line(self._p, f"{task.description} {task.completed:g}/{task.total:g} {rate} tok/s "
                          f"{timedelta(seconds=round(elapsed))}")


def stderr_console() -> Console:
    """Progress and status output: stderr, so `aspire-bench ... > out.md` and `| tee` get results only."""
    return Console(stderr=True)


def stderr_bar(*columns, disable: bool) -> tuple[Progress, bool]:
    """A rich bar on stderr, and whether its owner prints plain lines (log_line) instead: stderr is not
    a terminal, where a redrawn bar shows only once finished."""
    console = stderr_console()
    lines = not disable and not console.is_terminal
    return Progress(*columns, transient=False, disable=disable or lines, console=console), lines


def log_line(bar: Progress, text: str) -> None:
    """One plain progress line on the bar's console (no markup: labels may hold brackets)."""
    bar.console.print(text, highlight=False, soft_wrap=True, markup=False)

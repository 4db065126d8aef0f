"""A sweep cell and running one: what the sweep driver and every executor (local, Ray) share."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from . import records
from .records import RunRecord
from .runner import RunConfig, run


@dataclass(frozen=True)
class Cell:
    index: int  # position in the expansion order
    config: RunConfig
    group_key: str  # hash of the config without sweep.NOT_IN_GROUP; the group id adds the invocation

    @property
    def config_hash(self) -> str:
        return records.config_hash(self.config.identity())

    def group(self, invocation: str) -> str:
        return f"{invocation}-{self.group_key}"

    def label(self) -> str:
        c = self.config
        return f"{Path(c.model).name} {c.task} {c.context_len or '-'} b{c.batch_size} {c.decoder}"


@dataclass
class Sweep:
    name: str
    cells: list[Cell]
    max_retries: int = 0
    ray: dict = field(default_factory=dict)


def execute_cell(config: dict, sweep: str, group: str) -> RunRecord:
    """Run one cell and return its record (store=None: the driver writes). A UserError (a bad decoder
    setting, a context too long for the model) becomes a failed record at once, since retrying cannot
    fix it; any other exception propagates so the executor may retry it."""
    try:
        return run(RunConfig(**config), store=None, group=group, sweep=sweep, show_progress=False).record
    except UserError as e:
        return failed_record(config, sweep, group, e)


def failed_record(config: dict, sweep: str, group: str, error: BaseException | str) -> RunRecord:
    msg = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return records.failed(config, records.capture_environment(), msg, sweep=sweep, group=group)

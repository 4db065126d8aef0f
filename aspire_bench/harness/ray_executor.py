"""The `ray` sweep executor: one Ray task per cell, results returned to the driver, which alone stores.

Workers need the model checkpoints and datasets at the same paths (shared filesystem or the same image),
not the store: records come back as JSON. Ray is the optional extra `aspire-bench[ray]`.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable

from ..errors import UserError
from .cells import Cell, Sweep, execute_cell, failed_record
from .records import RunRecord


def require_ray():
    try:
        import ray
    except ImportError as e:
        raise UserError("the ray executor needs Ray: pip install 'aspire-bench[ray]'") from e
    return ray


def resources(cell: Cell, sweep: Sweep) -> dict:
    """What one cell asks Ray for: GPUs for a cuda cell (Ray then sets CUDA_VISIBLE_DEVICES, so the
    cell's `cuda` is its own GPU), CPUs otherwise; `ray: {num_gpus, num_cpus}` in the sweep file."""
    opts = {"num_cpus": sweep.ray.get("num_cpus", 1)}
    if cell.config.device.startswith("cuda"):
        opts["num_gpus"] = sweep.ray.get("num_gpus", 1)
    return opts


def _attempt() -> int | None:
    """Which try of this task this is (1 = first). Ray keeps the count but exposes it only on its core
    worker, outside the public API: None when that changes."""
    try:
        import ray
        return ray._private.worker.global_worker.core_worker.get_current_task_attempt_number() + 1
    except Exception:  # noqa: BLE001
        return None


def _cell_task(config: dict, sweep: str, group: str, cell_fn: Callable[[dict, str, str], RunRecord]) -> str:
    """The body of one Ray task (on a worker): the record as JSON, a plain form for the driver."""
    import ray
    rec = cell_fn(config, sweep, group)
    rec.env.update(executor="ray", attempts=_attempt(), ray_node=ray.get_runtime_context().get_node_id())
    return json.dumps(rec.to_json(), default=str)


def _error_message(e: Exception) -> str:
    cause = getattr(e, "cause", None)  # RayTaskError carries the exception the cell raised
    if cause is not None:
        return f"{type(cause).__name__}: {cause}"
    first = str(e).strip().splitlines()
    return f"{type(e).__name__}: {first[0] if first else ''}"


def run_ray(cells: list[Cell], sweep: Sweep, invocation: str, on_done: Callable[[Cell, RunRecord], None], *,
            address: str | None = None, cell_fn: Callable[[dict, str, str], RunRecord] = execute_cell) -> None:
    """Submit every cell, then hand each record to on_done as its task finishes (completion order).

    Retries are Ray's: `max_retries` covers lost workers and, with retry_exceptions, errors a cell
    raises; a UserError comes back as a failed record on the first try (retrying cannot fix it)."""
    ray = require_ray()
    started = not ray.is_initialized()
    if started:
        if address:
            ray.init(address=address)
        else:  # a local instance sized for one machine's share, not every core
            ray.init(num_cpus=sweep.ray.get("local_num_cpus") or min(4, os.cpu_count() or 1),
                     include_dashboard=False)
    remote = ray.remote(_cell_task)
    pending: dict = {}
    try:
        for cell in cells:
            opts = dict(resources(cell, sweep), max_retries=sweep.max_retries, retry_exceptions=True)
            ref = remote.options(**opts).remote(cell.config.identity(), sweep.name, cell.group(invocation), cell_fn)
            pending[ref] = cell
        while pending:
            [ref], _ = ray.wait(list(pending), num_returns=1)
            cell = pending.pop(ref)
            try:
                rec = RunRecord.from_json(json.loads(ray.get(ref)))
            except ray.exceptions.RayError as e:  # every try failed, or the task was lost
                rec = failed_record(cell.config.identity(), sweep.name, cell.group(invocation), _error_message(e))
                rec.env.update(executor="ray", attempts=sweep.max_retries + 1)
            on_done(cell, rec)
    finally:
        for ref in pending:  # interrupted: do not leave cells running on a shared cluster
            ray.cancel(ref, force=True)
        if started:
            ray.shutdown()

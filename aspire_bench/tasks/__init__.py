"""Task registry. A task yields samples (prompt, reference, metadata) and scores generated text; it
knows nothing of engines, decoders or the harness.

Add a task: subclass Task in its own module, then register an instance in _build() below.
"""
from __future__ import annotations

from aspire_bench.errors import UserError

from .base import Sample, Task, encode_prompt
from .buckets import parse_bucket

__all__ = ["Sample", "Task", "describe_tasks", "encode_prompt", "get_task", "list_tasks",
           "parse_bucket"]

_REGISTRY: dict[str, Task] | None = None


def _build() -> dict[str, Task]:
    from .aime import AimeTask
    from .code_completion import CodeCompletionTask
    from .kv_retrieval import KVRetrievalTask
    from .longbench_v2 import LongBenchV2Task
    from .needle import NeedleTask

    tasks = [CodeCompletionTask(), NeedleTask(), KVRetrievalTask(), LongBenchV2Task(),
             AimeTask("aime24"), AimeTask("aime25"), AimeTask("aime")]
    return {t.name: t for t in tasks}


def _registry() -> dict[str, Task]:
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = _build()
    return _REGISTRY


def get_task(name: str) -> Task:
    reg = _registry()
    key = name.strip().lower().replace("_", "-")  # "LongBench_v2" -> "longbench-v2"
    if key not in reg:
        raise UserError(f"unknown task {name!r}; known tasks: {', '.join(reg)}")
    return reg[key]


def list_tasks() -> list[Task]:
    return list(_registry().values())


def describe_tasks() -> list[tuple[str, str]]:
    """(name, one-line description) per task, for `aspire-bench tasks`."""
    return [(t.name, t.description) for t in list_tasks()]

"""Task registry. A task yields samples (prompt, reference, metadata) and scores generated text; it
knows nothing of engines, decoders or the harness.

Add a task: subclass Task in its own module, then register an instance in _build() below; or, from
another package, declare it in the entry point group `aspire_bench.tasks` (docs/tasks.md).
"""
from __future__ import annotations

import inspect

from aspire_bench import plugins
from aspire_bench.errors import ConfigError, UserError, did_you_mean

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


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "-")  # "LongBench_v2" -> "longbench-v2"


_PLUGINS: dict | None = None


def _plugins() -> dict:
    """Entry points of task plug-ins by name; each is loaded (and kept in the registry) when first used."""
    global _PLUGINS
    if _PLUGINS is None:
        _PLUGINS = plugins.discover(plugins.TASKS, _registry(), "task", _key)
    return _PLUGINS


def _load_plugin(key: str) -> Task:
    ep = _plugins()[key]
    obj = plugins.load(ep, "task")
    task = obj() if inspect.isclass(obj) else obj
    if not isinstance(task, Task):
        raise ConfigError(f"the task plug-in {ep.name!r} of package {plugins.package_of(ep)} names {ep.value}, "
                          "which is not a Task (subclass aspire_bench.tasks.Task)")
    task.name = key
    _registry()[key] = task
    return task


def get_task(name: str) -> Task:
    reg, key = _registry(), _key(name)
    if key in reg:
        return reg[key]
    if key in _plugins():
        return _load_plugin(key)
    known = [*reg, *_plugins()]
    raise UserError(f"unknown task {name!r}{did_you_mean(name, known)}; known tasks: {', '.join(known)}")


def list_tasks() -> list[Task]:
    for key in _plugins():
        if key not in _registry():
            _load_plugin(key)
    return list(_registry().values())


def describe_tasks() -> list[tuple[str, str]]:
    """(name, one-line description) per task, for `aspire-bench tasks`."""
    return [(t.name, t.description) for t in list_tasks()]

"""Decoders and tasks from other packages: entry points in the groups `aspire_bench.decoders` and
`aspire_bench.tasks` (docs/adding-a-decoder.md, docs/tasks.md).

Entry points are listed without importing anything; a plug-in is loaded only when it is used, so a
broken one fails only the command that names it, with one line naming its package. A built-in name
always wins: a plug-in that reuses one is ignored with a one-line warning.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from importlib.metadata import EntryPoint, entry_points

from .errors import ConfigError

DECODERS = "aspire_bench.decoders"
TASKS = "aspire_bench.tasks"


def package_of(ep: EntryPoint) -> str:
    """The distribution that declares `ep` (its module's top package when the metadata lacks it)."""
    dist = getattr(ep, "dist", None)
    return dist.name if dist is not None else ep.value.split(":")[0].split(".")[0]


def discover(group: str, builtin: Iterable[str], what: str,
             normalize: Callable[[str], str] = lambda s: s) -> dict[str, EntryPoint]:
    """The plug-ins of `group` by (normalized) name, built-in names left out with a warning each."""
    builtin = set(builtin)
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=group):
        name = normalize(ep.name)
        if name in builtin:
            print(f"warning: the {what} plug-in {ep.name!r} of package {package_of(ep)} is ignored: a built-in "
                  f"{what} has that name (rename the entry point in that package)", file=sys.stderr)
        elif name in found and found[name].value != ep.value:
            print(f"warning: {what} plug-in {ep.name!r} is declared by both {package_of(found[name])} and "
                  f"{package_of(ep)}: using {package_of(found[name])}'s", file=sys.stderr)
        else:
            found.setdefault(name, ep)
    return found


def load(ep: EntryPoint, what: str):
    """The object an entry point names; any failure to import it is one line naming its package."""
    try:
        return ep.load()
    except Exception as e:  # noqa: BLE001 - a plug-in can fail in any way; none may crash the suite
        pkg = package_of(ep)
        detail = " ".join(f"{type(e).__name__}: {e}".split())
        raise ConfigError(f"the {what} plug-in {ep.name!r} of package {pkg} failed to load ({ep.value}: "
                          f"{detail}): fix or uninstall {pkg}") from None

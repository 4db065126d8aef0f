"""The package's layering, read from the source with `ast` (imports inside functions count too):
kernels < engine < decoders < harness < cli/report/gate (no layer imports a higher one), tasks import none
of engine/decoders/harness, only CLI modules import CLI modules, and no two modules import each other."""
from __future__ import annotations

import ast
from pathlib import Path

import aspire_bench

ROOT = Path(aspire_bench.__file__).parent
LAYERS = {"kernels": 0, "engine": 1, "models": 1, "decoders": 2, "harness": 3, "cli": 4, "cli_types": 4, "report": 4, "gate": 4,
          "gate_schema": 4, "lm_eval_cli": 4, "lm_eval_plugin": 4, "demo": 4,
          "models_cli": 4, "simulator": 4}
NOT_FROM_TASKS = ("engine", "decoders", "harness")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports (a `from pkg import sub` names the submodule when it is one)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def top(name: str) -> str:
    return name.split(".")[1] if "." in name else ""


def is_cli(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return last == "cli" or last.startswith("cli_") or last.endswith("_cli")


def test_the_import_reader_sees_relative_lazy_and_submodule_imports():
    g = graph()
    assert "aspire_bench.harness.records" in g["aspire_bench.harness.runner"]  # from . import records
    assert "aspire_bench.harness.ray_executor" in g["aspire_bench.harness.sweep"]  # inside a function
    assert "aspire_bench.engine" in g["aspire_bench.harness.runner"]  # from ..engine import Engine


def test_no_layer_imports_a_higher_one():
    bad = [f"{a} -> {b}" for a, deps in graph().items() for b in deps
           if top(a) in LAYERS and top(b) in LAYERS and LAYERS[top(b)] > LAYERS[top(a)]]
    assert bad == []


def test_tasks_import_no_engine_decoders_or_harness():
    bad = [f"{a} -> {b}" for a, deps in graph().items() if top(a) == "tasks" for b in deps
           if top(b) in NOT_FROM_TASKS]
    assert bad == []


def test_only_cli_modules_import_cli_modules():
    bad = [f"{a} -> {b}" for a, deps in graph().items() if not is_cli(a) for b in deps if is_cli(b)]
    assert bad == []


def test_no_two_modules_import_each_other():
    g = graph()
    # a package's __init__ importing its own submodules (re-exports, registries) is not a circle
    pairs = sorted({tuple(sorted((a, b))) for a, deps in g.items() for b in deps if a in g.get(b, ())
                    and not (b.startswith(a + ".") or a.startswith(b + "."))})
    assert pairs == []


def test_gate_and_report_share_through_the_harness_not_each_other():
    g = graph()
    bad = [f"{a} -> {b}" for a, deps in g.items() for b in deps
           if {top(a), top(b)} == {"gate", "report"}]
    assert bad == []


def test_every_name_imported_from_the_package_exists():
    """Imports inside functions run only when their code path does (a user's first ASPIRE run, a GPU,
    a plug-in): a name moved elsewhere must fail here, not in the field."""
    import importlib
    known = set(modules())
    missing = []
    for name, path in modules().items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            if base.split(".")[0] != "aspire_bench" or base not in known:
                continue
            try:
                module = importlib.import_module(base)
            except ImportError:  # optional dependencies (triton, ray, lm_eval) of a module
                continue
            missing += [f"{name}: {base}.{a.name}" for a in node.names
                        if not hasattr(module, a.name) and f"{base}.{a.name}" not in known]
    assert missing == []

"""Comments and docstrings say why, read from the source: a docstring of aspire_bench is at most
MAX_DOCSTRING_LINES lines (a longer explanation goes to docs/, linked in a few words), and no comment
or docstring of the package, benchmarks/ or scripts/ quotes a measured figure (a throughput, a
bandwidth, a time in ms or µs, a speedup such as 1.2x): a figure belongs in docs/ beside its date and
machine. Units of constants (`# bytes`, `# 64 KiB`) and shapes (`16k x 8`) are not figures."""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_DOCSTRING_LINES = 10
FIGURE = re.compile(
    r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s*(?:tok/s|tokens/s|[KMGT]i?B/s|[GT]FLOP/?s|GFLOPS|ms|µs|us)(?![\w/])"  # rates, times
    r"|(?<![\w.])\d+(?:\.\d+)?[x×](?!\w)",  # a speedup or slowdown: 1.3x, 2×
    re.IGNORECASE)


def docstrings(source: str):
    """(line, name, docstring) of the module, every class and every function, as written (not dedented)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                yield node.body[0].lineno, getattr(node, "name", "<module>"), doc


def long_docstrings(source: str) -> list[str]:
    return [f"{line}: {name} ({doc.count(chr(10)) + 1} lines)" for line, name, doc in docstrings(source)
            if doc.count("\n") + 1 > MAX_DOCSTRING_LINES]


def figures(source: str) -> list[str]:
    """Measured-looking figures in the comments and docstrings of `source`, as 'line: figure'."""
    texts = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    texts += [(line, doc) for line, _, doc in docstrings(source)]
    return [f"{line}: {m.group(0)}" for line, text in texts for m in FIGURE.finditer(text)]


def sources(*folders: str) -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for f in folders for p in sorted((ROOT / f).rglob("*.py"))}


def test_the_readers_find_long_docstrings_and_figures_but_not_units_or_shapes():
    src = ('"""Module.\n\nWhy it exists."""\n'
           'X = 1 << 20  # bytes; a 64 KiB run, 16k x 8, 512 x 512 fp32, flag 0x1F, v1.2, 3 s budget\n'
           'def f():\n    """' + "\n".join(f"line {i}" for i in range(11)) + '"""\n'
           'def g():\n    """Reads at 41.5 GB/s."""  # AR 32 tok/s, a step 18.4 ms, 1.3x faster, 2× AR\n')
    assert long_docstrings(src) == ["6: f (11 lines)"]
    assert figures(src) == ["18: 32 tok/s", "18: 18.4 ms", "18: 1.3x", "18: 2×", "18: 41.5 GB/s"]


def test_docstrings_are_at_most_ten_lines():
    bad = [f"{path}:{hit}" for path, src in sources("aspire_bench").items() for hit in long_docstrings(src)]
    assert bad == [], "move the long explanation to docs/ and link it:\n" + "\n".join(bad)


def test_no_measured_figure_in_comments_or_docstrings():
    bad = [f"{path}:{hit}" for path, src in sources("aspire_bench", "benchmarks", "scripts").items()
           for hit in figures(src)]
    assert bad == [], "figures belong in docs/ with their date and machine:\n" + "\n".join(bad)

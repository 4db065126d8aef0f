"""The README runs as written: every `bash` and `python` block of README.md (and the blocks of docs/
marked `<!-- runnable -->`) is executed at small sizes, in a fresh directory, as a new user would.

The sizes are rewritten as the README says (its section "Use"): context lengths to 1k (a window to
64-1024), batch sizes to 2, --limit to 2, --max-new-tokens to 8; bench runs one repeat without
tuning, step costs or calibration rounds; a checkpoint path becomes `tiny`, cuda cpu, bfloat16
float32, --data a fixture of the same format; `make` targets run as `make -n`."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "tasks"
FENCE = re.compile(r"(<!-- runnable -->\s*\n)?```(bash|sh|shell|python)\n(.*?)```", re.DOTALL)

# option -> its small value (a function of the written value)
SMALL = {
    "--context-len": lambda v: ",".join(dict.fromkeys("64-1024" if "-" in c else "1k" for c in v.split(","))),
    "--batch-size": lambda v: "2",
    "--limit": lambda v: "2",
    "--max-new-tokens": lambda v: "8",
    "--repeats": lambda v: "1",
    "--device": lambda v: "cpu",
    "--dtype": lambda v: "float32",
    "--model": lambda v: "tiny",  # no network: real models are tested in tests/models
    "--data": lambda v: str(FIXTURES / Path(v).name),
}
BENCH_EXTRA = ["--repeat", "1", "--limit", "2", "--no-tune", "--no-bound", "--no-calibration-rounds"]
PY_SMALL = {"context_len": '"1k"', "batch_size": "2", "limit": "2", "max_new_tokens": "8"}


def blocks(path: Path, everything: bool) -> list[tuple[str, str]]:
    """(language, code) of the fenced blocks of `path`: all of them, or only those marked runnable."""
    return [(lang, code) for marked, lang, code in FENCE.findall(path.read_text()) if everything or marked]


def commands(code: str) -> list[str]:
    """The command lines of a shell block: continuations joined, comments dropped."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        line = line.split(" #")[0].strip() if not line.lstrip().startswith("#") else ""
        if line:
            out.append(line)
    return out


def small(argv: list[str]) -> list[str]:
    argv = list(argv)
    for i, a in enumerate(argv[:-1]):
        if a in SMALL:
            argv[i + 1] = SMALL[a](argv[i + 1])
    if argv[:1] == ["bench"]:
        argv = [a for i, a in enumerate(argv) if not (a in ("--repeat", "--limit") or argv[i - 1] in ("--repeat", "--limit"))]
        argv += BENCH_EXTRA + (["--max-new-tokens", "8"] if "--max-new-tokens" not in argv else [])
    if argv[:2] == ["models", "get"]:  # no network in tests: tests/models fetches from a local wheel
        argv = ["models", "list"]
    if argv[:1] == ["calibrate"]:
        argv += ["--repeats", "1"]
    return argv


def small_python(code: str) -> str:
    for k, v in PY_SMALL.items():
        code = re.sub(rf"\b{k}=[^,)\n]+", f"{k}={v}", code)
    return code


def everything() -> list[tuple[str, str, str]]:
    found = [("README.md", lang, code) for lang, code in blocks(ROOT / "README.md", True)]
    for doc in sorted((ROOT / "docs").glob("*.md")):
        found += [(f"docs/{doc.name}", lang, code) for lang, code in blocks(doc, False)]
    return found


def test_the_rewrites_keep_what_is_written_and_shrink_sizes():
    assert small(["run", "--model", "/path/to/Qwen3-1.7B", "--context-len", "30-40k", "--device", "cuda"]) == \
        ["run", "--model", "tiny", "--context-len", "64-1024", "--device", "cpu"]
    assert small(["bench", "--context-len", "16k,32k", "--batch-size", "8"])[:5] == \
        ["bench", "--context-len", "1k", "--batch-size", "2"]
    assert small_python('run(context_len="4k", limit=4, parity=True)') == 'run(context_len="1k", limit=2, parity=True)'
    assert commands("# c\na \\\n  b  # why\nc\n") == ["a    b", "c"]


def test_every_readme_block_runs(cli, tmp_path):
    """The README's blocks in order, in a fresh directory: the runs of one command are what the next reads.
    Python blocks run in a new interpreter each; aspire-bench lines in a process of their own (`cli`)."""
    work = tmp_path / "fresh"
    work.mkdir()
    shutil.copytree(ROOT / "ci", work / "ci")  # as in a checkout
    (work / "prompts.jsonl").write_text('{"id": "a", "prompt": "def add(a, b):"}\n')
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ASPIRE_BENCH_THREADS": "1", "OMP_NUM_THREADS": "1",
           "COLUMNS": "100"}
    env.pop("ASPIRE_BENCH_STORE", None)
    ran = []
    for where, lang, code in everything():
        if lang == "python":
            r = subprocess.run([sys.executable, "-c", small_python(code)], check=False, cwd=work, env=env,
                               capture_output=True, text=True, timeout=900)
            assert r.returncode == 0, f"{where}: python block failed:\n{r.stderr[-3000:]}"
            ran.append("python")
            continue
        for line in commands(code):
            argv = shlex.split(line)
            if argv[0] == "make":
                r = subprocess.run(["make", "-n", *argv[1:]], check=False, cwd=ROOT, capture_output=True, text=True,
                                   timeout=60)
            else:
                assert argv[0] == "aspire-bench", f"{where}: a shell line that is not aspire-bench or make: {line}"
                r = cli(*small(argv[1:]), cwd=work, env={"ASPIRE_BENCH_THREADS": "1", "COLUMNS": "100"})
            assert r.returncode == 0, f"{where}: `{line}` failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
            assert "Traceback" not in r.stderr, f"{where}: `{line}`:\n{r.stderr[-3000:]}"
            ran.append(argv[1] if argv[0] == "aspire-bench" else "make")
    assert {"run", "bench", "runs", "show", "gate", "simulate", "python", "make"} <= set(ran)


def test_python_result_repr_is_short():
    from aspire_bench.harness.records import RunRecord
    from aspire_bench.harness.runner import RunResult
    rec = RunRecord(config={"decoder": "aspire", "task": "code-completion", "context_len": "4k", "batch_size": 4},
                    config_hash="h", env={}, aggregates={"decode_tok_s": 123.456, "speedup_vs_ar": 1.05},
                    requests=[None] * 1000, steps=[None] * 10000)
    text = repr(RunResult(3, rec, "./aspire_results.db"))
    assert len(text) < 300 and "run_id=3" in text and "store='./aspire_results.db'" in text
    assert "decode_tok_s=123.5" in text and "speedup_vs_ar=1.05" in text

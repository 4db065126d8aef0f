"""code-completion: next-line completion over a long context of unseen code (LongBench lcc style).

Offline: the context is one held-out standard-library package (aspire_bench.corpus, "heldout" split,
never seen by the bundled tiny model), its files concatenated in path order, each after a
"# file: <path>" line. A sample cuts this text at the start of a line in the middle of a file; the
prompt is exactly the requested number of tokens ending with the newline before the cut, the
reference the next `ref_lines` line(s), and the score LongBench's code_sim_score (edit similarity
line by line when ref_lines > 1). The exact length rule and the choice of cut lines: docs/tasks.md.
"""
from __future__ import annotations

import bisect
import functools
import random
import weakref
from dataclasses import dataclass

from aspire_bench import corpus
from aspire_bench.errors import UserError

from .base import Sample, Task, special_prefix
from .buckets import parse_bucket
from .exact_length import check_max_length
from .scoring import code_sim_score, edit_similarity

DEFAULT_CONTEXT = "4k"
DEFAULT_SAMPLES = 10
MIN_LINE_IN_FILE = 3


@dataclass
class _Line:
    start: int  # char offset in the package text
    file: str
    lineno: int  # 0-based line index in its file
    text: str
    is_header: bool


class _Package:
    """One package as a single text, its line table and (approximate) token start offsets."""

    def __init__(self, name: str, files: list, tokenizer):
        self.name = name
        parts, self.lines, pos = [], [], 0
        for f in files:
            body = f.text if f.text.endswith("\n") else f.text + "\n"
            header = f"# file: {f.relpath}\n"
            self.lines.append(_Line(pos, f.relpath, -1, header[:-1], True))
            pos += len(header)
            for k, line in enumerate(body.split("\n")[:-1]):
                self.lines.append(_Line(pos, f.relpath, k, line, False))
                pos += len(line) + 1
            parts.append(header + body)
        self.text = "".join(parts)
        self.starts = [ln.start for ln in self.lines]
        self.token_starts = _token_starts(tokenizer, parts)

    def tokens_before(self, char: int) -> int:
        return bisect.bisect_left(self.token_starts, char)


@functools.lru_cache(maxsize=1)
def _heldout_files() -> dict[str, list]:
    """Held-out files by package; cached: listing walks the whole stdlib (seconds), which never changes."""
    by_pkg: dict[str, list] = {}
    for f in corpus.list_files("heldout"):
        by_pkg.setdefault(f.package, []).append(f)
    return by_pkg


# Tokenized packages per live tokenizer: each build tokenizes ~1.2 MB of code.
_PACKAGES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _packages(tokenizer) -> list[_Package]:
    try:
        return _PACKAGES[tokenizer]
    except (KeyError, TypeError):
        pass
    by_pkg = _heldout_files()
    pkgs = [_Package(name, by_pkg[name], tokenizer) for name in corpus.HELDOUT_PACKAGES if name in by_pkg]
    try:
        _PACKAGES[tokenizer] = pkgs
    except TypeError:  # not weak-referenceable: no cache
        pass
    return pkgs


def _token_starts(tokenizer, parts: list[str]) -> list[int]:
    """Char offset (in the joined text) where each token starts, encoding the parts as one batch (in
    parallel). Only an estimate across part boundaries, which is all its callers need; estimated from
    the average token length when the tokenizer gives no offsets."""
    out, base = [], 0
    try:
        enc = tokenizer(parts, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    except (NotImplementedError, TypeError, ValueError, KeyError):
        enc = None
    for k, part in enumerate(parts):
        if enc is not None:
            out += [base + a for a, _ in enc[k]]
        else:
            n = len(tokenizer.encode(part, add_special_tokens=False))
            out += [base + round(j * len(part) / max(n, 1)) for j in range(n)]
        base += len(part)
    return out


def _candidates(pkg: _Package, need_tokens: int, ref_lines: int) -> list[int]:
    """Indices into pkg.lines where a cut may go: see the module rules; with a margin of estimated
    tokens before them (the exact count is settled in _fit)."""
    out = []
    for i, ln in enumerate(pkg.lines):
        if ln.is_header or ln.lineno < MIN_LINE_IN_FILE:
            continue
        end = i + ref_lines
        if end >= len(pkg.lines) or any(x.is_header for x in pkg.lines[i:end + 1]):
            continue  # the continuation, plus one more line, stays inside this file
        s = ln.text.strip()
        if not s or s.startswith("#"):
            continue
        if pkg.tokens_before(ln.start) >= need_tokens + 64:
            out.append(i)
    return out


def _fit(tokenizer, pkg: _Package, cut: int, need: int) -> tuple[list[int], int]:
    """The last `need` ids of the text before char `cut`, taken from the latest line start that leaves
    at least `need` tokens (see the module rule). Returns (ids, index of that line)."""
    def n_tokens(li):
        return len(tokenizer.encode(pkg.text[pkg.starts[li]:cut], add_special_tokens=False))

    cut_line = bisect.bisect_left(pkg.starts, cut)
    # Estimate from the token offsets, then correct by exact counts of the candidate text.
    est_char = pkg.token_starts[max(0, pkg.tokens_before(cut) - need)]
    li = max(0, min(cut_line - 1, bisect.bisect_right(pkg.starts, est_char) - 1))
    while li > 0 and n_tokens(li) < need:
        li -= 1
    while li + 1 < cut_line and n_tokens(li + 1) >= need:
        li += 1
    ids = tokenizer.encode(pkg.text[pkg.starts[li]:cut], add_special_tokens=False)
    if len(ids) < need:
        raise UserError(f"code-completion: package {pkg.name} has fewer than {need} tokens before the cut")
    return list(ids[len(ids) - need:]), li


class CodeCompletionTask(Task):
    name = "code-completion"
    description = ("next-line code completion over 4k/16k/32k tokens of an unseen stdlib package "
                   "(offline, exact length); edit similarity")
    default_max_new_tokens = 64
    buckets = ("4k", "16k", "32k")

    def __init__(self, ref_lines: int = 1):
        self.ref_lines = ref_lines

    def samples(self, tokenizer, *, limit=None, context_len=None, seed=0, data_path=None,
                max_length=None) -> list[Sample]:
        context_len = str(context_len or DEFAULT_CONTEXT)
        n = DEFAULT_SAMPLES if limit is None else limit
        lo, hi = parse_bucket(context_len)
        check_max_length(hi, max_length, context_len)
        head = special_prefix(tokenizer)
        packages = _packages(tokenizer)
        out, used, cand_cache = [], set(), {}
        for i in range(n):
            rng = random.Random(f"{self.name}|{seed}|{context_len}|{i}")
            n_tokens = lo if lo == hi else rng.randint(lo, hi)
            need = n_tokens - len(head)
            if need not in cand_cache:
                cand_cache[need] = [(p, c) for p in packages if (c := _candidates(p, need, self.ref_lines))]
            eligible = cand_cache[need]
            if not eligible:
                biggest = max((len(p.token_starts) for p in packages), default=0)
                raise UserError(f"code-completion: {n_tokens} tokens is longer than any held-out package "
                                f"with this tokenizer (largest: {biggest} tokens); use a shorter context")
            # Rotate through packages (seeded start), a seeded cut line within; never the same cut twice.
            pkg, cands = eligible[(i + seed) % len(eligible)]
            free = [c for c in cands if (pkg.name, c) not in used] or cands
            li = rng.choice(free)
            used.add((pkg.name, li))
            line = pkg.lines[li]
            ids, first = _fit(tokenizer, pkg, line.start, need)
            ref = "\n".join(x.text for x in pkg.lines[li:li + self.ref_lines])
            out.append(Sample(
                id=f"{self.name}-{context_len}-s{seed}-{i}", prompt_ids=list(head) + ids, reference=ref,
                metadata={"bucket": context_len, "n_prompt_tokens": n_tokens, "package": pkg.name,
                          "file": line.file, "line": line.lineno, "context_starts_in": pkg.lines[first].file}))
        return out

    def score(self, sample: Sample, text: str) -> float:
        return code_similarity(text, sample.reference)


def code_similarity(generated: str, reference: str) -> float:
    """One reference line: LongBench's code_sim_score. Several: edit similarity of the generation's first
    lines (as many as the reference has, after leading blank lines) with the reference, comparing stripped
    lines."""
    n = reference.count("\n") + 1
    if n == 1:
        return code_sim_score(generated, reference)
    gen = generated.lstrip("\r\n").split("\n")[:n]
    return edit_similarity("\n".join(x.strip() for x in gen), "\n".join(x.strip() for x in reference.split("\n")))

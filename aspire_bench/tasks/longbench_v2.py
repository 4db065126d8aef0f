"""LongBench v2: 503 four-choice questions over long documents (8k to 2M words).

Source: THUDM/LongBench-v2, split "train" (or --data: the repo's data.json, or .jsonl/.parquet rows).
Schema: _id, domain, sub_domain, difficulty, length, question, choice_A..choice_D, answer, context.
Prompt: the benchmark's own 0-shot template (THUDM/LongBench prompts/0shot.txt), one user message.
Truncation, as the original: a prompt over `max_length` tokens keeps its first and last halves.
"""
from __future__ import annotations

import re

from aspire_bench.errors import UserError

from .base import Sample, Task, encode_prompt
from .buckets import parse_bucket
from .data import load_records

HUB_ID, SPLIT = "THUDM/LongBench-v2", "train"
COLUMNS = ("_id", "question", "choice_A", "choice_B", "choice_C", "choice_D", "answer", "context")

TEMPLATE_0SHOT = """Please read the following text and answer the question below.

<text>
$DOC$
</text>

What is the correct answer to this question: $Q$
Choices:
(A) $C_A$
(B) $C_B$
(C) $C_C$
(D) $C_D$

Format your response as follows: "The correct answer is (insert answer here)"."""

_ANSWER_PAREN = re.compile(r"The correct answer is \(([A-D])\)")
_ANSWER_BARE = re.compile(r"The correct answer is ([A-D])")


def build_prompt(row: dict) -> str:
    fields = {"$DOC$": row["context"], "$Q$": row["question"], "$C_A$": row["choice_A"],
              "$C_B$": row["choice_B"], "$C_C$": row["choice_C"], "$C_D$": row["choice_D"]}
    out = TEMPLATE_0SHOT
    for key, value in fields.items():
        out = out.replace(key, str(value).strip())
    return out


def truncate_middle(tokenizer, text: str, max_length: int | None) -> tuple[str, int, bool]:
    """(text, its token count, truncated?): over `max_length` tokens, keep the first max_length//2 and
    the last max_length - max_length//2 tokens (decoded back to text, as the original does)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if max_length is None or len(ids) <= max_length:
        return text, len(ids), False
    head = max_length // 2
    kept = ids[:head] + ids[len(ids) - (max_length - head):]
    return tokenizer.decode(kept, skip_special_tokens=True), len(ids), True


def extract_choice(text: str) -> str | None:
    text = text.replace("*", "")  # markdown bold around the answer is not a different answer
    m = _ANSWER_PAREN.search(text) or _ANSWER_BARE.search(text)
    return m.group(1) if m else None


class LongBenchV2Task(Task):
    name = "longbench-v2"
    description = ("LongBench v2 long-document multiple choice (A-D), original 0-shot prompt, "
                   "middle truncation; buckets filter by prompt tokens (30-40k, 80-100k, ...)")
    default_max_new_tokens = 128  # the original's budget without chain of thought
    reads_data = True
    buckets = ("16k", "32k", "30-40k", "80-100k")

    def samples(self, tokenizer, *, limit=None, context_len=None, seed=0, data_path=None,
                max_length=None) -> list[Sample]:
        """Bucket rule: a window "lo-hi" keeps the samples whose prompt (after truncation to
        max_length, chat template included) has lo..hi tokens; a single size "X" keeps the samples
        whose prompt text has at least X tokens and truncates them to X (so all share one length)."""
        lo = hi = None
        if context_len is not None:
            lo, hi = parse_bucket(context_len)
            if lo == hi:
                max_length = lo if max_length is None else min(max_length, lo)
        rows = load_records(HUB_ID, split=SPLIT, data_path=data_path)
        out = []
        for i, row in enumerate(rows):
            if limit is not None and len(out) >= limit:
                break  # lazily: tokenizing every 1M-token document would take minutes
            missing = [c for c in COLUMNS if c not in row]
            if missing:
                raise UserError(f"LongBench-v2 row {i} lacks the columns {missing}; expected the schema "
                                f"{', '.join(COLUMNS)} (+ domain, sub_domain, difficulty, length)")
            text, n_text, truncated = truncate_middle(tokenizer, build_prompt(row), max_length)
            if lo is not None and lo == hi and n_text < lo:
                continue
            s = Sample(id=str(row["_id"]), messages=[{"role": "user", "content": text}],
                       reference=str(row["answer"]).strip())
            n = len(encode_prompt(tokenizer, s))
            if lo is not None and lo != hi and not lo <= n <= hi:
                continue
            s.metadata = {"n_prompt_tokens": n, "n_original_tokens": n_text, "truncated": truncated,
                          **{k: row.get(k) for k in ("domain", "sub_domain", "difficulty", "length")}}
            if context_len is not None:
                s.metadata["bucket"] = str(context_len)
            out.append(s)
        return out

    def score(self, sample: Sample, text: str) -> float:
        return float(extract_choice(text) == sample.reference)

"""AIME 2024 / 2025: 30 problems a year, each answer an integer in 0..999.

Hub sources (loaded through `datasets`, or any of the schemas below from --data):
  aime24: HuggingFaceH4/aime_2024, split "train" (id, problem, solution, answer, url, year)
  aime25: math-ai/aime25, split "test" (problem, answer, id)
Accepted row schemas: problem/answer (+ id), Problem/Answer (+ ID), question/answer.
"""
from __future__ import annotations

from aspire_bench.errors import UserError

from .base import Sample, Task, encode_prompt
from .data import load_records
from .scoring import last_boxed, parse_int

# The instruction the common reasoning models were evaluated with: the answer goes in \boxed{}.
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

SOURCES = {
    "aime24": [("HuggingFaceH4/aime_2024", None, "train")],
    "aime25": [("math-ai/aime25", None, "test")],
}
SOURCES["aime"] = SOURCES["aime24"] + SOURCES["aime25"]


def _field(row: dict, *names):
    for n in names:
        if row.get(n) is not None:
            return row[n]
    return None


def row_to_sample(row: dict, index: int, prefix: str) -> Sample:
    problem = _field(row, "problem", "Problem", "question")
    answer = _field(row, "answer", "Answer")
    if problem is None or answer is None:
        raise UserError(f"AIME row {index} has no problem/answer: expected the columns problem/answer, "
                        f"Problem/Answer or question/answer; found {sorted(row)}")
    rid = _field(row, "id", "ID", "_id")
    return Sample(
        id=f"{prefix}/{rid if rid is not None else index}",
        messages=[{"role": "user", "content": f"{str(problem).strip()}\n\n{INSTRUCTION}"}],
        reference=str(answer).strip(),
    )


class AimeTask(Task):
    default_max_new_tokens = 8192  # reasoning traces are long; the harness may cap it
    buckets: tuple = ()  # short prompts: no context-length buckets
    reads_data = True

    def __init__(self, name: str):
        self.name = name
        years = {"aime24": "2024", "aime25": "2025", "aime": "2024 and 2025"}[name]
        self.description = (f"AIME {years} competition math; answer in \\boxed{{}}, scored as an integer "
                            f"0..999 (exact match)")
        self.sources = SOURCES[name]

    def samples(self, tokenizer, *, limit=None, context_len=None, seed=0, data_path=None,
                max_length=None) -> list[Sample]:
        if context_len is not None:
            raise UserError(f"task {self.name} has short prompts and no context-length buckets; "
                            f"drop the context length for it")
        if data_path is not None:
            rows = [(self.name, r) for r in load_records("", split="", data_path=data_path)]
        else:
            rows = [(hub_id.split("/")[-1], r) for hub_id, config, split in self.sources
                    for r in load_records(hub_id, config=config, split=split)]
        out = []
        for i, (prefix, row) in enumerate(rows[:limit] if limit is not None else rows):
            s = row_to_sample(row, i, prefix)
            s.metadata = {"n_prompt_tokens": len(encode_prompt(tokenizer, s))}
            out.append(s)
        return out

    def score(self, sample: Sample, text: str) -> float:
        return score_aime(text, sample.reference)


def score_aime(text: str, reference) -> float:
    """1.0 when the last complete \\boxed{} holds the reference integer; no box, a non-integer or a value
    outside 0..999 scores 0."""
    pred = parse_int(last_boxed(text) or "")
    ref = parse_int(reference)
    return float(pred is not None and 0 <= pred <= 999 and pred == ref)

"""needle: multi-key needle-in-a-haystack retrieval (RULER's niah multikey idea), generated offline.

Several "The secret code for <key> is <7 digits>." needles sit at seeded depths in filler prose; the
question asks for one key's code. The prompt is exactly `context_len` tokens with the given tokenizer.
Scored by exact match at the start of the answer: the whitespace-normalised generation must begin with
the code, not followed by another digit (the prompt ends with "... is", so the code comes first).
"""
from __future__ import annotations

import random

from .base import Sample
from .exact_length import build_exact
from .filler import distinct_keys, sentences
from .scoring import starts_with_answer
from .synthetic import SyntheticTask

PREFIX = ("Some secret codes are hidden in the following text. Memorize them; you will be asked "
          "for one of them.\n\n")


class NeedleTask(SyntheticTask):
    name = "needle"
    description = ("synthetic multi-key needle retrieval at an exact token length (any bucket, offline); "
                   "exact match of the 7-digit code")
    default_max_new_tokens = 16
    buckets = ("4k", "16k", "32k")
    n_needles = 4

    def _rng(self, seed, n, i):
        return random.Random(f"{self.name}|{seed}|{n}|{i}")


    def _one(self, tokenizer, i, n_tokens, seed, bucket) -> Sample:
        rng = self._rng(seed, n_tokens, i)
        keys = distinct_keys(rng, self.n_needles)
        codes = [str(v) for v in rng.sample(range(1_000_000, 10_000_000), self.n_needles)]
        depths = [rng.uniform(0.05, 0.95) for _ in keys]
        asked = rng.randrange(self.n_needles)
        suffix = (f"\n\nWhat is the secret code for {keys[asked]} in the text above?\n"
                  f"Answer: The secret code for {keys[asked]} is")
        needles = [(d, f" The secret code for {k} is {v}.") for d, k, v in zip(depths, keys, codes)]
        built = build_exact(tokenizer, n_tokens, prefix=PREFIX, suffix=suffix, stream=sentences(rng),
                            specials=needles, remainder="trim", what=self.name)
        return Sample(
            id=f"{self.name}-{bucket}-s{seed}-{i}", prompt_ids=built["ids"], reference=codes[asked],
            metadata={"bucket": bucket, "n_prompt_tokens": n_tokens, "key": keys[asked],
                      "needles": dict(zip(keys, codes)),
                      "needle_depths": [round(off / n_tokens, 4) for off in built["special_token_offsets"]]})

    def score(self, sample: Sample, text: str) -> float:
        return float(starts_with_answer(text, sample.reference))

"""kv-retrieval: find one key's value in a JSON object of random UUID pairs (the "lost in the middle"
key-value retrieval setting), generated offline at an exact token length.

The remainder below one entry is filled with newline tokens before the closing brace (whitespace inside
the object; a cut entry would break the JSON). Scored by exact match at the start of the answer: the
prompt ends with an opening quote, so the whitespace-normalised generation must begin with the value.
"""
from __future__ import annotations

import random
import uuid
from collections.abc import Iterator

from .base import Sample
from .exact_length import build_exact
from .scoring import starts_with_answer
from .synthetic import SyntheticTask

PREFIX = ("Extract the value corresponding to the specified key in the JSON object below.\n\n"
          "JSON data:\n{")


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _entries(rng: random.Random) -> Iterator[str]:
    first = True
    while True:
        # The separator leads each entry, so whatever number of entries fits, the JSON stays valid.
        yield f'{"" if first else ","}\n    "{_uuid(rng)}": "{_uuid(rng)}"'
        first = False


class KVRetrievalTask(SyntheticTask):
    name = "kv-retrieval"
    description = ("synthetic key-value retrieval from a JSON object of UUIDs at an exact token length "
                   "(offline); exact match of the value")
    default_max_new_tokens = 48
    buckets = ("4k", "16k", "32k")


    def _one(self, tokenizer, i, n_tokens, seed, bucket) -> Sample:
        rng = random.Random(f"{self.name}|{seed}|{n_tokens}|{i}")
        key, value, depth = _uuid(rng), _uuid(rng), rng.uniform(0.05, 0.95)
        suffix = (f'\n}}\n\nKey: "{key}"\nThe value associated with the specified key is: "')
        built = build_exact(tokenizer, n_tokens, prefix=PREFIX, suffix=suffix, stream=_entries(rng),
                            specials=[(depth, f',\n    "{key}": "{value}"')], remainder="newline",
                            what=self.name)
        return Sample(
            id=f"{self.name}-{bucket}-s{seed}-{i}", prompt_ids=built["ids"], reference=value,
            metadata={"bucket": bucket, "n_prompt_tokens": n_tokens, "key": key,
                      "depth": round(built["special_token_offsets"][0] / n_tokens, 4)})

    def score(self, sample: Sample, text: str) -> float:
        return float(starts_with_answer(text, sample.reference))

"""The base of tasks whose samples are generated offline at exact token lengths (needle, kv-retrieval)."""
from __future__ import annotations

import random

from .base import Sample, Task
from .exact_length import sample_lengths

DEFAULT_CONTEXT = "4k"
DEFAULT_SAMPLES = 10


class SyntheticTask(Task):
    """A task whose samples are generated offline at exact token lengths; subclasses build one in `_one`."""

    def samples(self, tokenizer, *, limit=None, context_len=None, seed=0, data_path=None,
                max_length=None) -> list[Sample]:
        context_len = context_len or DEFAULT_CONTEXT
        n = DEFAULT_SAMPLES if limit is None else limit
        lengths = sample_lengths(context_len, n, lambda i: random.Random(f"{self.name}|len|{seed}|{i}"),
                                 max_length)
        return [self._one(tokenizer, i, L, seed, str(context_len)) for i, L in enumerate(lengths)]

    def _one(self, tokenizer, i: int, n_tokens: int, seed: int, bucket: str) -> Sample:
        raise NotImplementedError

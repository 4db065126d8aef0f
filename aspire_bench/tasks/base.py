"""The task interface: a task yields samples and scores generated text. Nothing here knows models."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sample:
    id: str
    prompt: str | None = None  # plain text prompt, or
    messages: list[dict] | None = None  # chat messages (through the tokenizer's chat template if it has one)
    prompt_ids: list[int] | None = None  # exact token ids: synthetic and code tasks need exact lengths
    reference: Any = None
    metadata: dict = field(default_factory=dict)  # e.g. {"bucket": "16k", "n_prompt_tokens": 16384}


class Task:
    """One benchmark. Subclasses set the class attributes and implement samples() and score()."""

    name: str = ""
    description: str = ""
    default_max_new_tokens: int = 128
    buckets: tuple = ()  # context lengths the task is meant for ("4k", "30-40k"); () = no buckets
    reads_data: bool = False  # whether samples() reads a local dataset (--data) at all

    def samples(self, tokenizer, *, limit=None, context_len=None, seed=0, data_path=None,
                max_length=None) -> list[Sample]:
        raise NotImplementedError

    def score(self, sample: Sample, text: str) -> float:
        """0..1 for one generated text (the completion only, without the prompt)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<Task {self.name}>"


def encode_prompt(tokenizer, sample: Sample) -> list[int]:
    """The token ids a model is fed for `sample`.

    Order of precedence: exact `prompt_ids`; else chat `messages` through the chat template (with the
    generation prompt) when the tokenizer has one; else the text (the prompt, or the messages' contents
    joined by blank lines for a base model without a template) encoded with the tokenizer's usual
    special tokens (e.g. BOS)."""
    if sample.prompt_ids is not None:
        return list(sample.prompt_ids)
    if sample.messages is not None:
        if getattr(tokenizer, "chat_template", None):
            out = tokenizer.apply_chat_template(sample.messages, add_generation_prompt=True, tokenize=True)
            # transformers 5 returns a BatchEncoding-like mapping, 4.x a plain list.
            if not isinstance(out, list):
                out = out["input_ids"]
            return list(out)
        text = "\n\n".join(m["content"] for m in sample.messages)
    elif sample.prompt is not None:
        text = sample.prompt
    else:
        raise ValueError(f"sample {sample.id} has no prompt, messages or prompt_ids")
    return list(tokenizer.encode(text))


def special_prefix(tokenizer) -> list[int]:
    """The ids the tokenizer puts before any text by default (e.g. [BOS]; [] for GPT-2-like ones).

    Exact-length prompts count them in their length. Trailing specials (an EOS some tokenizers append)
    are left out on purpose: a prompt that ends in EOS would ask the model to stop."""
    probe = "x"
    with_sp = list(tokenizer.encode(probe))
    without = list(tokenizer.encode(probe, add_special_tokens=False))
    for i in range(len(with_sp) - len(without) + 1):
        if with_sp[i:i + len(without)] == without:
            return with_sp[:i]
    return []

"""Requests of a run and one timed generate: what the runner and tuning share."""
from __future__ import annotations

from ..decoders import Request, get_decoder
from ..decoders.base import GenerationOutput
from ..engine import Engine
from ..errors import ConfigError
from ..progress import TokenProgress
from ..tasks import get_task
from ..tasks.base import encode_prompt
from ..tasks.buckets import parse_bucket


def cached_prefix(req) -> tuple:
    """What the prefix cache keeps a request's prompt under: all but its last token (decoders/loop.py _admit)."""
    return tuple(req.prompt_ids[:-1])


def build_requests(cfg, engine: Engine):
    """(task, samples, requests) of a RunConfig on this engine's tokenizer and context."""
    if engine.tokenizer is None:
        raise ConfigError(f"{cfg.model} has no tokenizer files; tasks need one")
    task = get_task(cfg.task)
    max_new = cfg.max_new_tokens or task.default_max_new_tokens
    if cfg.context_len:
        lo, _ = parse_bucket(cfg.context_len)
        if lo + max_new > engine.max_context:
            fix = "a larger rope scaling factor" if cfg.rope_scaling else "another model"
            raise ConfigError(
                f"context {cfg.context_len} ({lo} tokens) + {max_new} new tokens is longer than the model's "
                f"maximum context of {engine.max_context}: choose a shorter --context-len or {fix}")
    samples = task.samples(engine.tokenizer, limit=cfg.limit, context_len=cfg.context_len, seed=cfg.seed,
                           data_path=cfg.data, max_length=engine.max_context - max_new)
    if not samples:
        raise ConfigError(f"task {cfg.task} produced no samples for context {cfg.context_len!r}: "
                          "choose another --context-len")
    reqs = [Request(s.id, encode_prompt(engine.tokenizer, s), max_new) for s in samples]
    return task, samples, reqs


def generate(decoder, decoder_args, engine, reqs, params, batch_size, label, show) -> GenerationOutput:
    """One generate() over `reqs`, with a token progress bar labelled `label` when `show`. `decoder`: a
    decoder object (run as is: decoders keep no state between runs) or a name (built with decoder_args)."""
    dec = get_decoder(decoder, **decoder_args) if isinstance(decoder, str) else decoder
    with TokenProgress(sum(r.max_new_tokens for r in reqs), label, disable=not show) as bar:
        return dec.generate(engine, reqs, params, batch_size, progress=bar.advance)

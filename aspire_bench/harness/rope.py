"""RoPE scaling given for a run (`--rope-scaling`, a sweep's `rope_scaling`): how tables name it, and
the note that a run goes past the positions the model was trained on."""
from __future__ import annotations

from ..tasks.buckets import parse_bucket

NAMES = {"yarn": "YaRN", "linear": "linear", "dynamic": "dynamic NTK", "llama3": "llama3"}


def _kind(rope: dict) -> str:
    return str(rope.get("rope_type") or rope.get("type") or "?")


def label(rope: dict | None) -> str:
    """`yarn×2` ('' without scaling): what a table adds to a scaled cell's context."""
    if not rope:
        return ""
    factor = rope.get("factor")
    return _kind(rope) + (f"×{factor:g}" if isinstance(factor, (int, float)) else "")


def trained_length(cfg) -> int:
    """The positions the checkpoint was trained on: the context its scaling scales (ModelConfig)."""
    return int(cfg.rope.get("original_max_position_embeddings") or cfg.max_position_embeddings)


def beyond_trained(model: str, rope: dict | None, contexts, max_new_tokens: int) -> str | None:
    """A line naming the contexts whose prompt plus new tokens run past the model's trained positions
    under `rope` (None without scaling or when every context fits); a context past the scaled length
    too is left to its refusal."""
    if not rope:
        return None
    from ..engine.loading import read_config, resolve_model_path
    cfg = read_config(resolve_model_path(model), rope)
    trained = trained_length(cfg)
    spans = {c: (parse_bucket(c)[0], parse_bucket(c)[1] + max_new_tokens) for c in contexts if c is not None}
    past = [c for c, (lo, end) in spans.items() if end > trained and lo + max_new_tokens <= cfg.max_context]
    if not past:
        return None
    factor = rope.get("factor")
    scaling = NAMES.get(_kind(rope), _kind(rope)) + (f" ×{factor:g}" if isinstance(factor, (int, float)) else "")
    return (f"{', '.join(past)} {'runs' if len(past) == 1 else 'run'} beyond the model's trained {trained} "
            f"positions: {scaling}")

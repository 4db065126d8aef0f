"""The model runtime: checkpoint loading, KV cache, one forward over a mixed batch."""
from .batch import PAGE_MAX_SUM, TOKEN_MEAN, Capture, ForwardOutput, LayerTokenView, PageView, Row, TokenView  # noqa: F401  # noqa: F401
from .engine import SCATTERED_HEAD, Engine, scattered_positions  # noqa: F401
from .kv_cache import KVCache, Slot  # noqa: F401
from .loading import load_model, load_tokenizer, resolve_model_path  # noqa: F401

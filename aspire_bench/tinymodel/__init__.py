"""The bundled tiny Qwen3 model: trained by us on the stdlib corpus, shipped in `aspire_bench/assets/tiny`."""
from pathlib import Path

TINY_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny"

"""Engine: model + KV cache + attention backend; `forward(rows)` runs one mixed batch."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError
from ..kernels import get_backend
from ..kernels.base import AttentionMeta, RowMeta
from .batch import ForwardOutput, LayerTokenView, PageView, Row, TokenView, View
from .kv_cache import KVCache, Slot
from .loading import load_model, load_tokenizer, resolve_model_path
from .model import Transformer

# Of every run of consecutive positions a view reads, the first SCATTERED_HEAD (all of a shorter run)
# are "scattered": read before the hardware prefetcher picks up the stream, so they cost more per
# position than the rest of the run. A head per run, rather than a length threshold, keeps the extra
# cost falling smoothly as runs grow, which is how timed draft rows behave (docs/decoders.md gives the
# measurement). ASPIRE's single pages and Vegas's tokens are scattered in full; a long run, such as
# the recent pages or MagicDec's window, pays for its head only.
SCATTERED_HEAD = 32


def scattered_positions(positions: torch.Tensor | np.ndarray) -> int:
    """How many of `positions` (1-D, or one row per layer) are scattered: of each run of consecutive
    positions, its first SCATTERED_HEAD. Counted on the host only: on an accelerator, reading the view back
    would stall every step, and a gather there costs what a contiguous read does (0)."""
    if isinstance(positions, torch.Tensor):
        if positions.device.type != "cpu":
            return 0
        positions = positions.numpy()
    p = positions
    if p.size == 0:
        return 0
    if p.ndim == 2:  # one row per layer: a run never continues into the next layer
        p = (p + np.arange(p.shape[0])[:, None] * (int(p.max()) + 2)).ravel()
    breaks = np.flatnonzero(np.diff(p) != 1) + 1
    runs = np.diff(np.concatenate(([0], breaks, [p.size])))
    return int(np.minimum(runs, SCATTERED_HEAD).sum())


class Engine:
    def __init__(self, model: Transformer, tokenizer=None, attention_backend: str = "auto",
                 page_size: int = 16, prefill_chunk: int = 1024, name: str = "model",
                 dense_backend: str | None = None):
        self.model = model
        self.cfg = model.cfg
        self.tokenizer = tokenizer
        self.device = model.device
        self.dtype = model.dtype
        self.backend = get_backend(attention_backend, self.device.type)
        # auto | cpp | fused | eager (model.Transformer.prepare_dense); $ASPIRE_BENCH_DENSE when not given
        dense = dense_backend or os.environ.get("ASPIRE_BENCH_DENSE") or "auto"
        try:
            self.dense_backend = model.prepare_dense(dense)
        except ConfigError as e:
            if dense_backend is None and os.environ.get("ASPIRE_BENCH_DENSE"):  # say which setting it was
                raise ConfigError(f"ASPIRE_BENCH_DENSE={dense!r}: {e}; fix or unset the variable") from None
            raise
        self.page_size = page_size
        self.prefill_chunk = prefill_chunk
        self.name = name
        self.cache: KVCache | None = None
        self._scale = self.cfg.head_dim ** -0.5
        self._page_offsets = torch.arange(page_size, device=self.device)
        # token-id prefix -> its K/V ([layers, kv_heads, n, head_dim] each); None = off. Benchmarks
        # that replay the same prompts through several decoders turn it on to prefill each once.
        self.prefix_cache: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] | None = None

    @classmethod
    def from_pretrained(cls, model: str | Path, dtype: str = "float32", device: str = "cpu",
                        attention_backend: str = "auto", rope_scaling: dict | None = None, **kw) -> Engine:
        path = resolve_model_path(model)
        return cls(load_model(path, dtype, device, rope_scaling), load_tokenizer(path), attention_backend,
                   name=str(model), **kw)

    @property
    def max_context(self) -> int:
        return self.cfg.max_context

    # --- KV slots -------------------------------------------------------------------------------
    def reserve(self, capacity: int) -> KVCache:
        """(Re)allocate the KV pool for `capacity` positions in all (e.g. batch x max length)."""
        if self.cache is None or self.cache.capacity < capacity:
            self.cache = None  # free the old pool before allocating the new one
            c = self.cfg
            self.cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, capacity, self.dtype, self.device,
                                 self.page_size)
        self.cache.reset()
        return self.cache

    def alloc(self, max_len: int) -> Slot:
        return self.cache.alloc(max_len)

    def free(self, slot: Slot) -> None:
        self.cache.free(slot)

    def rollback(self, slot: Slot, length: int) -> None:
        self.cache.rollback(slot, length)

    # --- prefix cache -----------------------------------------------------------------------------
    def save_prefix(self, slot: Slot, ids) -> None:
        """Keep a copy of the KV of `ids` (the slot's first len(ids) positions)."""
        if self.prefix_cache is not None and slot.length >= len(ids):
            sl = slice(slot.base, slot.base + len(ids))
            self.prefix_cache[tuple(ids)] = (self.cache.k[:, :, sl].clone(), self.cache.v[:, :, sl].clone())

    def keep_prefixes(self, keep) -> None:
        """Forget every cached prefix but those in `keep` (tuples of ids)."""
        if self.prefix_cache is not None:
            for ids in [ids for ids in self.prefix_cache if ids not in keep]:
                del self.prefix_cache[ids]

    def has_prefix(self, ids) -> bool:
        """Whether the KV of `ids` is in the prefix cache."""
        return self.prefix_cache is not None and tuple(ids) in self.prefix_cache

    def restore_prefix(self, slot: Slot, ids) -> bool:
        """Write the cached KV of `ids` into the slot; False when it is not cached."""
        hit = self.prefix_cache.get(tuple(ids)) if self.prefix_cache is not None else None
        if hit is None:
            return False
        sl = slice(slot.base, slot.base + len(ids))
        self.cache.k[:, :, sl] = hit[0]
        self.cache.v[:, :, sl] = hit[1]
        slot.length = len(ids)
        return True

    # --- forward --------------------------------------------------------------------------------
    def _view_keys(self, view: View, row: Row) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(pool indices, slot positions, scattered count) of a sparse row: its view of the prefix, then
        its own tokens; the count as scattered_positions gives it for the view. On the host the
        positions are built in numpy: a handful of torch ops per row cost a few % of a draft step."""
        dev = self.device
        if dev.type == "cpu":
            if isinstance(view, PageView):
                pos = (view.pages.numpy()[:, None] * self.page_size + np.arange(self.page_size)).ravel()
                pos = pos[pos < row.start]
            elif isinstance(view, TokenView):
                pos = view.positions.numpy()
            else:
                raise TypeError(f"not a view: {view!r}")
            scattered = scattered_positions(pos)
            pos = torch.from_numpy(np.concatenate((pos, np.arange(row.start, row.start + row.n))))
            return pos + row.slot.base, pos, scattered
        if isinstance(view, PageView):
            pos = (view.pages.to(dev)[:, None] * self.page_size + self._page_offsets).flatten()
            pos = pos[pos < row.start]
        elif isinstance(view, TokenView):
            pos = view.positions.to(dev)
        else:
            raise TypeError(f"not a view: {view!r}")
        pos = torch.cat((pos, torch.arange(row.start, row.start + row.n, device=dev)))
        return pos + row.slot.base, pos, 0

    def _row_meta(self, row: Row, q_start: int) -> tuple[RowMeta, int, int, int]:
        """The row's attention metadata, its KV read (positions attended per layer, mean), the
        part of that read in scattered runs through a sparse view (per layer, mean) and the positions
        whose scores it captures (ForwardOutput.kv_captured)."""
        L = self.cfg.num_layers
        meta = RowMeta(q_start=q_start, n=row.n, base=row.slot.base, start=row.start)
        if isinstance(row.view, LayerTokenView) and row.view.positions.shape[0] != L:
            raise ValueError(f"a LayerTokenView needs one row of positions per layer ({L}), "
                             f"got {row.view.positions.shape[0]}")
        scattered = 0  # summed over layers
        if isinstance(row.view, LayerTokenView) and not row.full_layers:  # all layers' keys in a few ops
            own = torch.arange(row.start, row.start + row.n, device=self.device).expand(L, -1)
            pos = torch.cat((row.view.positions.to(self.device), own), dim=1)
            meta.sparse, meta.sparse_pos = list((pos + row.slot.base).unbind(0)), list(pos.unbind(0))
            scattered = scattered_positions(row.view.positions)
        elif isinstance(row.view, (list, LayerTokenView)):  # a view per layer; shared views resolved once
            resolved = {}
            keys = []
            for layer in range(L):
                view = row.view_at(layer)
                if view is not None and id(view) not in resolved:
                    resolved[id(view)] = self._view_keys(view, row)
                keys.append((None, None, 0) if view is None else resolved[id(view)])
            meta.sparse, meta.sparse_pos, per_layer = map(list, zip(*keys))
            scattered = sum(per_layer)
        elif row.view is not None:  # one view, full attention at full_layers (ASPIRE's refresh layer)
            idx, pos, in_runs = self._view_keys(row.view, row)
            full = row.full_layers
            meta.sparse = [None if layer in full else idx for layer in range(L)]
            meta.sparse_pos = [None if layer in full else pos for layer in range(L)]
            scattered = in_runs * sum(m is not None for m in meta.sparse)
        if row.capture is not None:
            meta.capture_layers = frozenset(row.capture.layers)
            meta.capture_queries = tuple(q % row.n for q in row.capture.queries)  # -1 = last
            meta.capture_reduce = row.capture.reduce
        full = row.start + row.n
        # scores are captured at full layers only (the backends refuse one through a view)
        captured = (len(set(meta.capture_queries)) * full * sum(0 <= layer < L for layer in meta.capture_layers)
                    if row.capture is not None else 0)
        if not meta.sparse:
            return meta, full, 0, round(captured / L)
        viewed = [int(idx.numel()) for idx in meta.sparse if idx is not None]  # per layer read through a view
        return meta, round((sum(viewed) + full * (L - len(viewed))) / L), round(scattered / L), round(captured / L)

    def forward(self, rows: list[Row]) -> ForwardOutput:
        dev = self.device
        tokens, positions, dest, metas, logit_rows, counts, reads, sparse, captured = [], [], [], [], [], [], [], [], []
        q = 0
        for row in rows:
            slot, start, n = row.slot, row.start, row.n
            if start > slot.length:
                raise ValueError(f"row starts at {start} beyond the slot's length {slot.length}")
            if start + n > slot.capacity:
                raise ValueError(f"row writes up to {start + n} beyond the slot's capacity {slot.capacity}")
            tokens.extend(row.tokens)
            positions.extend(range(start, start + n))
            dest.extend(range(slot.base + start, slot.base + start + n))
            meta, read, through_view, scored = self._row_meta(row, q)
            metas.append(meta)
            reads.append(read)
            sparse.append(through_view)
            captured.append(scored)
            if row.logits == "all":
                logit_rows.extend(range(q, q + n))
                counts.append(n)
            elif row.logits == "last":
                logit_rows.append(q + n - 1)
                counts.append(1)
            else:
                counts.append(0)
            q += n
        pos = torch.tensor(positions, device=dev)
        dest = torch.tensor(dest, device=dev)
        meta = AttentionMeta(rows=metas, num_tokens=q, page_size=self.page_size, scale=self._scale)
        logits, captures = self.model.forward(
            torch.tensor(tokens, device=dev), pos, dest, self.cache.k, self.cache.v, meta, self.backend,
            torch.tensor(logit_rows, device=dev, dtype=torch.long), dense=self.dense_backend)
        for row in rows:
            row.slot.length = row.start + row.n
        return ForwardOutput(logits=list(logits.split(counts)), captures=captures, kv_read=reads, kv_sparse=sparse,
                             kv_captured=captured)

"""The `full` strategy: uncompressed K/V in pool blocks, paged attention over them.

Arena layout: [layers, P, kv_heads, BLOCKS, block_size, head_dim] with P = 2 (K, V), or P = 1
for a latent (MLA) cache, whose values are the keys' first channels and are not stored. With
the block axis after the heads, one `index_select` over a sequence's token slots yields
[P, heads, tokens, dim] ready for attention, and one `index_copy_` writes the new tokens of the
whole batch.
"""

from __future__ import annotations

from typing import Any

import torch

from memory.pool import BLOCKS, ArenaSpec, BlockLayout

from .base import KVSpec, KVStrategy
from .kv import DTYPES, StepBatch, attention_runs
from .options import Option
from .registry import register


@register
class FullStrategy(KVStrategy):
    """Keys and values stored as they are computed (dtype configurable), paged."""

    name = "full"
    tolerance = 1e-5
    lossless = True
    options = (
        Option(
            "dtype", str, None, "dtype K and V are stored in", choices=tuple(DTYPES),
            none="the model's compute dtype", flag="--kv-dtype",  # --dtype is the compute dtype
        ),
    )  # fmt: skip

    @classmethod
    def _dtype(cls, spec: KVSpec, options: dict[str, Any]) -> torch.dtype:
        name = options["dtype"]  # checked against DTYPES by its declaration
        return spec.dtype if name is None else DTYPES[name]

    @classmethod
    def layout(cls, spec: KVSpec, block_size: int, options: dict[str, Any]) -> BlockLayout:
        shape = (
            spec.num_layers,
            spec.stored_parts,
            spec.num_kv_heads,
            BLOCKS,
            block_size,
            spec.head_dim,
        )
        return BlockLayout(block_size, (ArenaSpec("kv", cls._dtype(spec, options), shape),))

    def __init__(self, pool, spec: KVSpec, options: dict | None = None) -> None:
        super().__init__(pool, spec, options)
        arena = pool.arena("kv")
        num_layers, parts, heads, nb, bs, d = arena.shape
        # Per layer: [P, heads, all token slots, dim] — a view, so writes land in the arena.
        self._layers = [arena[i].view(parts, heads, nb * bs, d) for i in range(num_layers)]
        self._bytes_per_token = spec.elements_per_token * arena.dtype.itemsize
        self.scale = spec.scale

    def _prepare(self, batch: StepBatch) -> None:
        pool = self.pool
        seqs = list(zip(batch.seq_ids, self._past, batch.query_lens, strict=True))
        self._new_slots = torch.cat([pool.slot_ids(sid, p, p + n) for sid, p, n in seqs])
        # Each sequence's tokens as runs of consecutive slots: attention reads them in place.
        self._runs = [pool.slot_runs(sid, p + n) for sid, p, n in seqs]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        a = self._layers[layer]
        # k, v: [N, Hkv, D] -> [Hkv, N, D], written at the batch's slots (a latent cache's v is
        # its keys' first channels: not stored)
        a[0].index_copy_(1, self._new_slots, k.transpose(0, 1).to(a.dtype))
        if not self.spec.latent:
            a[1].index_copy_(1, self._new_slots, v.transpose(0, 1).to(a.dtype))

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        a = self._layers[layer]
        b = self._batch
        out = self._empty_out(q)
        for i, runs in enumerate(self._runs):
            # a[:, :, start:end]: [P, Hkv, S_r, D] views into the arena, no copy. When decode
            # growth left a sequence in several runs, the long first run (the prompt) stays a
            # view and the short tail runs are gathered into one piece: each piece costs an
            # attention call per layer, a small copy costs less than several calls.
            pieces = [a[:, :, s:e] for s, e in runs]
            if len(pieces) > 2:
                pieces = [pieces[0], torch.cat(pieces[1:], dim=2)]
            pieces = [self._cast(p, q.dtype) for p in pieces]
            rows = b.rows(i)
            out[rows] = attention_runs(
                q[rows], [self._split(p) for p in pieces], self._past[i], self.scale
            )
        return out

    def read(self, layer: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        a = self._layers[layer]
        ks, vs = [], []
        for runs in self._runs:
            k, v = self._split(torch.cat([a[:, :, s:e] for s, e in runs], dim=2))
            ks.append(k)
            vs.append(v)
        return ks, vs

    def _split(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored [P, Hkv, S, D] -> (k [Hkv, S, D], v [Hkv, S, Dv]); a latent cache's v is a
        view of its keys' first channels."""
        return (kv[0], kv[0][..., : self.spec.v_dim]) if self.spec.latent else (kv[0], kv[1])

    @staticmethod
    def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return x if x.dtype == dtype else x.to(dtype)

    def bytes_used(self) -> int:
        return self.pool.total_tokens() * self._bytes_per_token

"""The dense formats: K/V stored as computed, in one dtype, attended as views of the arena.

Arena layout: [layers, P, kv_heads, BLOCKS, block_size, head_dim] with P = 2 (K, V), or P = 1
for a latent (MLA) cache, whose values are the keys' first channels and are not stored. With
the block axis after the heads, one `index_select` over a sequence's token slots yields
[P, heads, tokens, dim] ready for attention, and one `index_copy_` writes the new tokens of the
whole batch.

`dense` stores the `dtype` option (by default the model's compute dtype: the `full` preset);
`fp32`, `bf16` and `fp16` are the same format with the dtype fixed.
"""

from __future__ import annotations

from typing import Any

import torch

from unikv.kernels import sparse as kernels
from unikv.kernels.dtypes import DTYPES
from unikv.kernels.operators import FnImplementation, OperatorSet
from unikv.kernels.operators import register as register_op
from unikv.memory.pool import BLOCKS, ArenaSpec, BlockLayout
from unikv.memory.tiers import TierKind

from .axes import FORMATS, Format, Step
from .kv import KVSpec, NativeStep, attention_one, attention_runs
from .options import Option


@FORMATS.register
class DenseFormat(Format):
    """Keys and values stored as they are computed (in the `dtype` option), paged."""

    name = "dense"
    help = "K and V as computed, in the dtype option (default: the model's compute dtype)"
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

    def __init__(self, pool, spec: KVSpec, opts: dict[str, Any]) -> None:
        super().__init__(pool, spec, opts)
        arena = pool.arena("kv")
        self._layers = self.arena_layers(arena)
        self._bytes_per_token = spec.elements_per_token * arena.dtype.itemsize
        self.scale = spec.scale
        # `attention.blocks`: a sparse selection's chosen blocks read in place (the C kernel),
        # else gathered and attended by PyTorch
        self.operators = OperatorSet(pool.device)
        self._in_place = arena.dtype == torch.float32 and not spec.latent
        self._cpu = arena.device.type == "cpu"  # where sparse.c runs
        # `native_step`: layer l's [P, Hkv, slots, D] arena lies l * this many bytes on
        self._layer_bytes = arena.stride(0) * arena.element_size()
        self._native = self._in_place and all(a.is_contiguous() for a in self._layers)
        self._place_cache: dict[int, tuple[int, int, int] | None] = {}  # `_place`, per arena
        self._every_cache: dict[int, torch.Tensor] = {}  # `_all_blocks`, per count
        self._ids_cache: dict = {}  # `_block_ids`, per sequence: (table, its version, ids)

    def prepare(self, step: Step) -> None:
        self.step = step
        # batch index -> where its blocks live, and their ids there (attend_tokens, `_places`)
        self._blocks: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        pool, bs, batch = self.pool, self.pool.block_size, step.batch
        seqs = list(zip(batch.seq_ids, step.past, batch.query_lens, strict=True))
        if max(batch.query_lens) <= bs:  # a decode step: one tensor of every sequence's slots
            slots = [s for sid, p, n in seqs for s in pool.slot_list(sid, p, p + n)]
            self._new_slots = torch.tensor(slots, dtype=torch.long, device=pool.device)
        else:
            self._new_slots = torch.cat([pool.slot_ids(sid, p, p + n) for sid, p, n in seqs])
        # A decode step (a few new tokens per sequence) reads every block in place through
        # `attention.blocks`, as a sparse selection's chosen ones: one C call per sequence and
        # layer, where PyTorch's attention costs more in dispatch and reads slower
        # (BENCHMARKS.md, "Decode attention in one C call")
        self._every: list[torch.Tensor] | None = None
        if self._in_place and self._cpu and max(batch.chunk_lens) <= DECODE_ROWS:
            self._every = [self._all_blocks(-(-(p + n) // bs)) for _, p, n in seqs]
        self._seqs, self._runs = seqs, None  # (`_kv_pieces` makes the runs when it reads them)
        if step.groups is None:
            return
        # Tiered: per sequence its pieces in token order, (tier, runs) read in place or
        # ("staged", index) filled by the prefetcher.
        self._pieces = []
        for (_, p, n), groups in zip(seqs, step.groups, strict=True):
            total = p + n
            pieces = [g if g[0] == "staged" else (g[0], _runs(g[1], bs)) for g in groups]
            # The last block may be partly filled: trim the last run of the last piece.
            kind, runs = pieces[-1]
            assert kind == TierKind.DEVICE, "the block being written is always on the device"
            s, e = runs[-1]
            runs[-1] = (s, e - (-(-total // bs) * bs - total))
            self._pieces.append(pieces)

    def _all_blocks(self, count: int) -> torch.Tensor:
        """Block positions 0 .. count - 1 for every KV head, int64 [Hkv, count] (every block,
        as a decode step reads them): made once per count and kept (read only)."""
        got = self._every_cache.get(count)
        if got is None:
            if len(self._every_cache) > 4096:
                self._every_cache.clear()
            h = self.spec.num_kv_heads
            got = self._every_cache[count] = torch.arange(count).expand(h, -1).contiguous()
        return got

    def native_step(self, step: Step) -> NativeStep | None:
        # A decode step of a float32 cache whose C attention serves: every layer's arena is one
        # [P, Hkv, slots, D] array, `layer_bytes` after the one before. Tiered, the host tier's
        # arena is read in place the same way; a step that stages blocks goes layer by layer.
        if self._every is None or not self._in_c():
            return None
        places, where = (), None
        if step.groups is not None:
            tiers = self._tier_places(step)
            if tiers is None:
                return None
            places, where = tiers
        a = self._layers[0]
        return NativeStep(
            kernels.attend_address(), a.data_ptr(), self._layer_bytes, a.shape[2],
            self.pool.block_size, self.scale, self._new_slots, step.batch.offsets, step.past,
            [self._places(i)[1] for i in range(len(self._every))], self._every,
            places=places, where=where,
        )  # fmt: skip

    def _in_c(self) -> bool:
        """Whether a decode step's attention can be the C kernel's, reading the arenas in place
        (not built here, or switched off: PyTorch's attention, layer by layer)."""
        return self._native and self._cpu and self.operators["attention.blocks"].active.name == "c"

    def sequential(self, past: int, steps: int) -> int:
        # Up to the end of the block being filled: each row writes its slot, and a sub-step's
        # attention reads the step's blocks masked past its row's position (sparse.c).
        if not self._in_c():
            return 1
        bs = self.pool.block_size
        return max(1, min(steps, bs - past % bs))

    def _tier_places(self, step: Step):
        """A tiered step's further arenas for `NativeStep.places` (the host tier's, read in
        place) and, per sequence, the place of each of its blocks (`NativeStep.where`); None
        when a block is staged or an arena is not plain memory laid out as the device's."""
        kinds = {kind for groups in step.groups for kind, _ in groups}
        if "staged" in kinds or step.in_place[TierKind.DEVICE][0].data_ptr() != (
            self._layers[0].data_ptr()
        ):
            return None
        others = sorted(kinds - {TierKind.DEVICE})
        index = {TierKind.DEVICE: 0} | {kind: g + 1 for g, kind in enumerate(others)}
        places = [self._place(step.in_place[kind]) for kind in others]
        if None in places:
            return None
        where = []
        for i, groups in enumerate(step.groups):
            group = self._places(i)[0]  # per block: its group in `groups`
            where.append(torch.tensor([index[kind] for kind, _ in groups])[group])
        return tuple(places), where

    def _place(self, views: list[torch.Tensor]) -> tuple[int, int, int] | None:
        """A tier's per-layer arena views as `NativeStep.places` describes them (layer 0's
        address, bytes to the next layer, slots), or None when they are not float32 CPU
        memory evenly spaced; worked out once per arena (a tier's arena does not move)."""
        key = views[0].data_ptr()
        if key not in self._place_cache:
            stride = views[1].data_ptr() - key if len(views) > 1 else 0
            plain = all(
                v.dtype == torch.float32 and v.is_contiguous() and v.device.type == "cpu"
                and v.data_ptr() == key + layer * stride
                for layer, v in enumerate(views)
            )  # fmt: skip
            self._place_cache[key] = (key, stride, views[0].shape[2]) if plain else None
        return self._place_cache[key]

    def new_keys(self) -> torch.Tensor:
        return torch.stack([a[0].index_select(1, self._new_slots).transpose(0, 1)
                            for a in self._layers])  # fmt: skip

    def _kv_pieces(self, layer: int, count: bool = True) -> list[list[torch.Tensor]]:
        """Per batch sequence, its [P, Hkv, S_r, D] pieces of `layer` in token order: views
        into the arenas (and, tiered, the prefetched staged tensors)."""
        step = self.step
        if step.groups is None:
            if self._runs is None:
                # Each sequence's tokens as runs of consecutive slots: read in place.
                self._runs = [self.pool.slot_runs(sid, p + n) for sid, p, n in self._seqs]
            a = self._layers[layer]
            out = []
            for runs in self._runs:
                # a[:, :, start:end]: [P, Hkv, S_r, D] views into the arena, no copy. When
                # growth left a sequence in several runs, long runs stay views and each stretch
                # of short runs between them is gathered into one piece: each piece costs an
                # attention call per layer, a small copy costs less than several calls, and a
                # long copy more than one call.
                out.append(_pieces(a, runs, LONG_RUN_SLOTS))
            return out
        staged = step.staged(layer, count)
        arenas = {tier: views[layer] for tier, views in step.in_place.items()}
        out = []
        for i, pieces in enumerate(self._pieces):
            kv = []
            for kind, what in pieces:
                if kind == "staged":
                    kv.append(staged[i][what])
                else:
                    kv.extend(arenas[kind][:, :, s:e] for s, e in what)
            out.append(kv)
        return out

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        a = self._layers[layer]
        # k, v: [N, Hkv, D] -> [Hkv, N, D], written at the batch's slots (a latent cache's v is
        # its keys' first channels: not stored)
        a[0].index_copy_(1, self._new_slots, k.transpose(0, 1).to(a.dtype))
        if not self.spec.latent:
            a[1].index_copy_(1, self._new_slots, v.transpose(0, 1).to(a.dtype))

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        if self._every is not None and q.dtype == torch.float32:
            return self.attend_tokens(layer, q, self.step, self._every)
        out = q.new_empty(*q.shape[:2], self.spec.v_dim)
        for i, pieces in enumerate(self._kv_pieces(layer)):
            pieces = [self._cast(p, q.dtype) for p in pieces]
            rows = self.step.batch.rows(i)
            out[rows] = attention_runs(
                q[rows], [self._split(p) for p in pieces], self.step.past[i], self.scale
            )
        return out

    def attend_tokens(self, layer: int, q: torch.Tensor, step: Step,
                      chosen: list[torch.Tensor | None]) -> torch.Tensor:  # fmt: skip
        """Only the chosen blocks are read: gathered per KV head from the arena (resident), or
        from wherever each lives (tiered: the device and host arenas in place, the staged
        tensors of the SSD tier's blocks); the whole cache is never read."""
        out = q.new_empty(*q.shape[:2], self.spec.v_dim)
        # The staged tensors (tiered: the SSD tier's blocks), fetched once for the layer.
        staged = step.staged(layer, True) if step.groups is not None else None
        whole = any(c is None for c in chosen)  # (not `None in`: that compares tensors)
        pieces = self._kv_pieces(layer, count=False) if whole else None
        bs = self.pool.block_size
        for i, blocks in enumerate(chosen):
            rows = step.batch.rows(i)
            if blocks is None:
                parts = [self._cast(p, q.dtype) for p in pieces[i]]
                out[rows] = attention_runs(q[rows], [self._split(p) for p in parts],
                                           step.past[i], self.scale)  # fmt: skip
                continue
            places = self._block_places(layer, i, staged)
            where, ids = self._places(i)  # per block of the sequence: its place, its index there
            if (
                self._in_place
                and q.dtype == torch.float32
                and all(a.dtype == torch.float32 and a.is_contiguous() for a in places)
            ):  # the C kernel reads each block where it lies
                got = self.operators["attention.blocks"](
                    q[rows], places, where, ids, blocks, bs, step.past[i], self.scale
                )
                if len(chosen) == 1:  # one sequence: its rows are the batch's
                    return got
                out[rows] = got
                continue
            kv = gather_blocks(places, None if where is None else where[blocks], ids[blocks], bs)
            out[rows] = self._attend_gathered(q[rows], kv, step.past[i])
        return out

    def _attend_gathered(self, q: torch.Tensor, kv: torch.Tensor, past: int) -> torch.Tensor:
        """Attention of one sequence's queries [T, Hq, D] over its gathered chosen blocks [P,
        Hkv, B * bs, D] (the window's blocks last, the last one maybe partly filled)."""
        n = q.shape[0]
        kv = self._cast(_trim(kv, past + n, self.pool.block_size), q.dtype)
        k, v = self._split(kv)
        return attention_one(q, k, v, k.shape[1] - n, self.scale)

    def stats(self) -> dict:
        kernels = self.operators.report()  # empty until a sparse selection has attended
        return {"kernels": kernels} if kernels else {}

    def _block_places(self, layer: int, i: int, staged: list | None) -> list[torch.Tensor]:
        """Where batch sequence `i`'s blocks of `layer` lie, [P, Hkv, slots, D] each: the
        device arena (resident), or per group of `step.groups[i]` a tier's arena read in place
        or a staged group's tensor (`staged`: the layer's staged tensors per batch sequence)."""
        if self.step.groups is None:
            return [self._layers[layer]]
        return [staged[i][what] if kind == "staged" else self.step.in_place[kind][layer]
                for kind, what in self.step.groups[i]]  # fmt: skip

    def _places(self, i: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Per block of batch sequence `i`: the index of the place it lives in (its group in
        `step.groups[i]`; None: resident, all in the device arena) and its block index there
        (a staged group's blocks are 0, 1, ... of its tensor); once per step."""
        if i not in self._blocks:
            dev = self._layers[0].device
            table = self.pool.table(self.step.batch.seq_ids[i])
            if self.step.groups is None:
                self._blocks[i] = (None, self._block_ids(table))
                return self._blocks[i]
            where: list[int] = []
            ids: list[int] = []
            for g, (kind, what) in enumerate(self.step.groups[i]):
                if kind == "staged":  # the next run of refs of one tier (the placement's group)
                    refs = table.refs[len(ids) :]
                    count = next((k for k, r in enumerate(refs) if r.tier != refs[0].tier),
                                 len(refs))  # fmt: skip
                    ids += range(count)
                else:
                    count = len(what)
                    ids += what
                where += [g] * count
            self._blocks[i] = (torch.tensor(where, device=dev), torch.tensor(ids, device=dev))
        return self._blocks[i]

    def forget(self, seq_id: int) -> None:
        self._ids_cache.pop(seq_id, None)

    def _block_ids(self, table) -> torch.Tensor:
        """A resident sequence's block ids as a tensor, made again only when its table changed
        (`BlockTable.version`: a new block every block_size tokens), not every decode step."""
        got = self._ids_cache.get(table.seq_id)
        if got is None or got[0] is not table or got[1] != table.version:
            ids = torch.tensor(table.block_ids(), device=self._layers[0].device)
            got = self._ids_cache[table.seq_id] = (table, table.version, ids)
        return got[2]

    def read(self, layer: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        ks, vs = [], []
        for pieces in self._kv_pieces(layer, count=False):
            k, v = self._split(torch.cat(pieces, dim=2))
            ks.append(k)
            vs.append(v)
        return ks, vs

    # ---- hooks of the placements and the selections --------------------------------------------

    def arena_layers(self, arena: torch.Tensor) -> list[torch.Tensor]:
        nl, parts, heads, nb, bs, d = arena.shape
        # Per layer: [P, heads, all token slots, dim] — a view, so writes land in the arena.
        return [arena[i].view(parts, heads, nb * bs, d) for i in range(nl)]

    @staticmethod
    def stage(data: dict[str, torch.Tensor]) -> torch.Tensor:
        """A staged group's "kv" slice as one run of tokens (runs on the prefetcher's thread)."""
        x = data["kv"]
        kv, h, nb, bs, d = x.shape
        return x.reshape(kv, h, nb * bs, d)  # [P, H, nb, bs, D] -> [P, H, nb * bs, D]

    def token_kv(self, seq_id: int, lo: int, hi: int) -> torch.Tensor:
        slots = self.pool.slot_ids(seq_id, lo, hi)
        return torch.stack([a.index_select(2, slots) for a in self._layers])  # [L, P, H, T, D]

    def compact(self, seq_id: int, lo: int, n: int, rel: torch.Tensor) -> None:
        m = lo + rel.shape[-1]
        slots = self.pool.slot_ids(seq_id, lo, n)  # the sinks stay where they are
        rel = rel.to(slots.device)  # a selection ranks on the CPU; the arena may be a GPU's
        for layer, a in enumerate(self._layers):  # [P, heads, slots, dim]: kept tokens move down
            x = a.index_select(2, slots)  # [P, Hkv, n - lo, D]
            idx = rel[layer][None, :, :, None].expand(x.shape[0], -1, -1, x.shape[-1])
            a.index_copy_(2, slots[: m - lo], x.gather(2, idx))

    def _split(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored [P, Hkv, S, D] -> (k [Hkv, S, D], v [Hkv, S, Dv]); a latent cache's v is a
        view of its keys' first channels."""
        return (kv[0], kv[0][..., : self.spec.v_dim]) if self.spec.latent else (kv[0], kv[1])

    @staticmethod
    def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return x if x.dtype == dtype else x.to(dtype)

    def bytes_used(self) -> int:
        return self.pool.total_tokens() * self._bytes_per_token


# The dense format with its dtype fixed. Rounded K and V on the contract's N(0, 1) data:
# attention within 2^-6 (bfloat16) and 2^-8 (float16).
@FORMATS.register
class Fp32Format(DenseFormat):
    name, help, fixed = "fp32", "K and V as float32", {"dtype": "float32"}


@FORMATS.register
class Bf16Format(DenseFormat):
    name, help, fixed = "bf16", "K and V as bfloat16", {"dtype": "bfloat16"}
    tolerance, lossless = 2**-6, False


@FORMATS.register
class Fp16Format(DenseFormat):
    name, help, fixed = "fp16", "K and V as float16", {"dtype": "float16"}
    tolerance, lossless = 2**-8, False


# A step of at most this many new tokens per sequence is attended by the C kernel over every
# block (`DenseFormat.prepare`); more rows are a prefill's, which PyTorch's flash attention
# computes faster (its work grows with the rows, the C kernel's reads do not).
DECODE_ROWS = 4
LONG_RUN_SLOTS = 128  # a run of at least this many slots is attended in place, never copied


def _pieces(a: torch.Tensor, runs: list[tuple[int, int]], long: int) -> list[torch.Tensor]:
    """A sequence's runs of slots in a layer's arena `a` [P, Hkv, slots, D] as attention
    pieces in token order: a run of `long` slots or more as a view, each stretch of shorter
    runs between them gathered into one tensor (a single short run stays a view)."""
    pieces: list[torch.Tensor] = []
    short: list[torch.Tensor] = []
    for s, e in runs:
        if e - s >= long:
            if short:
                pieces.append(short[0] if len(short) == 1 else torch.cat(short, dim=2))
                short = []
            pieces.append(a[:, :, s:e])
        else:
            short.append(a[:, :, s:e])
    if short:
        pieces.append(short[0] if len(short) == 1 else torch.cat(short, dim=2))
    return pieces


def _runs(ids: list[int], bs: int) -> list[tuple[int, int]]:
    """Block ids as (start_slot, end_slot) runs of consecutive slots."""
    runs: list[list[int]] = []
    for b in ids:
        if runs and runs[-1][1] == b * bs:
            runs[-1][1] += bs
        else:
            runs.append([b * bs, (b + 1) * bs])
    return [(s, e) for s, e in runs]


def gather_blocks(places: list[torch.Tensor], where: torch.Tensor | None, ids: torch.Tensor,
                  bs: int) -> torch.Tensor:  # fmt: skip
    """Blocks `ids` [Hkv, B] (block indices per head in their place: `places[where]`, or all
    in places[0] when `where` is None) of [P, Hkv, slots, D] places, whole and in order: [P,
    Hkv, B * bs, D]. One `index_select` per place, over a view with one row per (part, head,
    block)."""
    p, h, _, d = places[0].shape
    if where is None:
        a = places[0]
        base = (torch.arange(p * h, device=ids.device) * (a.shape[2] // bs)).view(p, h, 1)
        flat = a.reshape(p * h * (a.shape[2] // bs), bs * d)
        return flat.index_select(0, (ids + base).view(-1)).view(p, h, -1, d)
    nb = ids.shape[1]
    out = places[0].new_empty(p * h * nb, bs * d)  # one row per (part, head, block)
    dest = torch.arange(p * h * nb, device=ids.device).view(p, h, nb)  # rows of `out`
    parts = torch.arange(p, device=ids.device).view(p, 1) * h
    heads = torch.arange(h, device=ids.device).view(h, 1).expand(h, nb)
    for g, a in enumerate(places):
        m = where == g  # the chosen blocks that live in place g
        g_nb = a.shape[2] // bs
        flat = a.reshape(p * h * g_nb, bs * d)
        rows = ((parts + heads[m]) * g_nb + ids[m]).view(-1)
        if rows.numel():
            out.index_copy_(0, dest[:, m].reshape(-1), flat.index_select(0, rows))
    return out.view(p, h, nb * bs, d)


# ---- attention over a sparse selection's chosen blocks: in place (C), else gathered ----------


def attend_blocks_torch(
    q: torch.Tensor, places: list[torch.Tensor], where: torch.Tensor | None, ids: torch.Tensor,
    blocks: torch.Tensor, block_size: int, past: int, scale: float,
) -> torch.Tensor:  # fmt: skip
    """The reference of `attention.blocks`: the chosen blocks `blocks` [Hkv, B] (positions in
    the sequence's block list; per position its place `where`, None: places[0], and its block
    index `ids` there) gathered from their places (`gather_blocks`) and attended by
    `attention_one`. The list's last block, the window's, holds the step's own tokens."""
    where, ids = (None if where is None else where[blocks]), ids[blocks]
    kv = gather_blocks(places, where, ids, block_size)
    n = q.shape[0]
    kv = _trim(kv, past + n, block_size)
    return attention_one(q, kv[0], kv[1], kv.shape[2] - n, scale)


def _trim(kv: torch.Tensor, total: int, bs: int) -> torch.Tensor:
    """Gathered blocks [P, Hkv, B * bs, D] without the empty slots of the last (partly filled)
    block of a sequence of `total` tokens."""
    return kv[:, :, : kv.shape[2] - (-(-total // bs) * bs - total)]


register_op(FnImplementation(
    "attention.blocks", "c", kernels.attend_blocks, ("cpu",),
    lambda device, owner: kernels.unavailable(),
), preference=10)  # fmt: skip
register_op(
    FnImplementation("attention.blocks", "torch", attend_blocks_torch, ("*",)),
    preference=90, reference=True,
)  # fmt: skip

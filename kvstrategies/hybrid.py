"""The `hybrid_fp16_int4` strategy: channel-mixed quantized KV, attended on the packed form.

Per layer and KV head, a calibration (`calibration.py`) orders the head's channels by importance:
the first `fp16_share` stay fp16, the least important `low_share` get `low_bits`, the rest get
`bits` (int4 by default). Channels are stored in that order; queries are permuted the same way
and outputs permuted back, so attention never needs the original order.

- Keys are quantized per channel over the tokens of one pool block (outlier channels get their
  own range), values per token over each class of channels; min/max with fp16 scale and low.
- A block is quantized when it is complete. Until then its tokens stay fp16 in a small
  per-sequence side buffer (the "tail"), as do the first `sink_tokens` tokens of the sequence
  (attention sinks: excluded from block 0's key ranges and attended at fp16).
- Attention reads packed blocks directly (`hybrid_attend.c`, one call per layer and sequence;
  a PyTorch path that dequantizes a few blocks at a time does the same where the kernel is not
  available). The step's own new tokens are attended at full precision from the activations,
  as they are computed; they are stored quantized for later steps.

A latent (MLA) cache stores only its keys (the compressed latent and the RoPE part, quantized
as keys by the channel plan: per channel over a block); a value is the first `value_dim`
channels of the dequantized key. Attention then runs with the keys as values (the record has no
value fields, the kernel reads value rows from key rows) and keeps the output's first
`value_dim` channels; the `v_*` options do not apply.

Two formats: `hybrid` as configured (`PackedFormat`), `int8` with every channel at 8 bits (one
class: no calibration needed). Under a tiered placement its packed blocks move and are attended
where they are (`_parts`: device and, on a CPU, host records in place, the others as the
records the prefetcher staged), and the fp16 sinks of a published prompt are persisted beside
its block 0 (`SinkState`, read back in another process); under a pruned selection `compact`
re-packs the kept tokens.

One pool block holds, per layer and KV head, one byte record (`packed.Record`, the layout the
kernel reads; `packed.PackedCodec` writes and reads it). Bytes reported are the records of
quantized blocks plus the side buffers' fp16 tokens: every nibble, scale, low, fp16 channel and
window byte.
"""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from unikv.kernels import native as kernels
from unikv.kernels.operators import FnImplementation, OperatorSet
from unikv.kernels.operators import register as register_op
from unikv.memory.pool import BLOCKS, ArenaSpec, BlockLayout

from .axes import FORMATS, Format, PrefixState, Step
from .calibration import METHODS
from .kv import KVSpec, NativeHook, merge_partials
from .options import Option
from .packed import PackedCodec, channel_plan, record
from .quant import BITS, SCALES

# The kernel pays for itself on few query rows (decode, small chunks); a long prefill chunk is
# faster as dequantized blocks times matrix products, and its own tokens through flash attention.
_KERNEL_MAX_ROWS = 64
_DENSE_KERNEL_LIMIT = 1 << 16  # rows x dense tokens above which torch attends the new tokens


@dataclass(frozen=True, slots=True)
class _Seq:
    """One batch sequence's view of its storage for the current step."""

    nb: int  # packed blocks (complete before the step)
    ids: torch.Tensor  # their block ids, int64
    mask0: int  # leading tokens of the first packed block attended from the dense sinks
    lo: int  # dense tokens: [lo, hi) of the side buffer's token axis
    hi: int


def _option(name: str, type_: type, default: Any, help: str, **kw: Any) -> Option:
    """An option of this strategy: its errors say "allowed: ..." (as tests and users know them)."""
    return Option(name, type_, default, help, wording="allowed:", **kw)


@FORMATS.register
class PackedFormat(Format):
    """fp16 important channels + int4 (and optionally int2) packed channels, per pool block."""

    name = "hybrid"
    help = "fp16 important channels + int4 (and int2) packed channels"
    tolerance = 0.5  # |attend - exact| on the contract tests' N(0, 1) data
    # The contract runs int4 + fp16 channels: with int2 key channels (a quarter by default),
    # a latent cache's values (its keys) are partly int2 and attention ends up far off exact
    # on that data (0.76 with half of them at int2). test_hybrid.py checks the int2 classes
    # against the strategy's own reconstruction, on both kinds of spec.
    contract_options: ClassVar[dict[str, Any]] = {"low_share": 0.0}
    lossless = False
    compaction_requantizes = True  # `compact` re-packs the blocks it moves tokens into
    default_block_size = 64
    needs = frozenset({"channel_stats"})  # the channel plan comes from a calibration file
    # Group headers, shares and widths decide the bytes of a block; the calibration options
    # decide the channel order. A second value class costs per-token scales (0.5 bit/element),
    # so by default values are one int4 class.
    options: ClassVar[tuple[Option, ...]] = (
        _option("fp16_share", float, 0.0625, "key channels kept fp16, per layer and head "
                "(rounded so the main class packs into bytes)", low=0, high=1),
        _option("bits", int, 4, "bit width of the main channel class", choices=BITS),
        _option("low_share", float, 0.25, "least important key channels, stored at low_bits "
                "(a multiple of 4 channels)", low=0, high=1),
        _option("low_bits", int, 2, "bit width of the least important channels (at most bits)",
                choices=BITS),
        _option("v_fp16_share", float, 0.0, "value channels kept fp16", low=0, high=1,
                none="the keys' fp16_share"),
        _option("v_low_share", float, 0.0, "value channels stored at low_bits", low=0, high=1,
                none="the keys' low_share"),
        _option("scales", str, "fp8", "group headers: fp16 (scale + low, 32 bits) or fp8 "
                "(e4m3 scale + int8 zero point, 16 bits)", choices=SCALES),
        _option("sink_tokens", int, 4, "first tokens kept fp16 (at most the block size)",
                low=0, high=1024),
        _option("method", str, "score_error", "channel-importance method of the calibration",
                choices=METHODS),
        _option("calibration", Path, None, "calibration file",
                none="the per-model file in the cache dir"),
        _option("calibration_text", Path, None, "warm-up text of the calibration",
                none="the bundled warm-up text"),
        _option("calibration_samples", int, 100, "warm-up windows the calibration reads",
                low=1, high=100_000),
        _option("calibration_window", int, 256, "tokens per calibration window",
                low=2, high=1 << 20),
        _option("recalibrate", bool, False, "recompute the calibration file even if one exists"),
    )  # fmt: skip

    @classmethod
    def check_combination(cls, strategy: str, opts: dict[str, Any]) -> None:
        for key, base in (("v_fp16_share", "fp16_share"), ("v_low_share", "low_share")):
            if opts[key] is None:  # unset: the keys' share
                opts[key] = opts[base]
        if opts["low_bits"] > opts["bits"]:
            raise ValueError(
                f"strategy {strategy!r}: option low_bits = {opts['low_bits']} is wider "
                f"than bits = {opts['bits']}; allowed: low_bits <= bits"
            )
        for f, lw in (("fp16_share", "low_share"), ("v_fp16_share", "v_low_share")):
            if opts[f] + opts[lw] > 1:
                raise ValueError(
                    f"strategy {strategy!r}: options {f} + {lw} = "
                    f"{opts[f] + opts[lw]:g}; allowed: at most 1"
                )

    @classmethod
    def layout(cls, spec: KVSpec, block_size: int, options: dict[str, Any]) -> BlockLayout:
        rec = record(spec, block_size, options)
        shape = (spec.num_layers, BLOCKS, spec.num_kv_heads, rec.nbytes)
        return BlockLayout(block_size, (ArenaSpec("kv", torch.uint8, shape),))

    def __init__(self, pool, spec: KVSpec, opts: dict[str, Any]) -> None:
        super().__init__(pool, spec, opts)
        o = self.opts
        self.T = pool.block_size
        self.rec = record(spec, self.T, o)
        self.codec = PackedCodec(self.rec, spec.latent)
        self.S = o["sink_tokens"]
        self.plan = channel_plan(spec, o)
        self.scale = spec.scale
        self._arena = pool.arena("kv")  # [L, NB, H, REC] uint8
        dev = self._arena.device
        self._k_order = self.plan.k_order.to(dev).contiguous()  # [L, H, D], as C reads them
        self._k_inverse = self.plan.k_order.argsort(-1).to(dev)
        self._v_inverse = self.plan.v_order.argsort(-1).to(dev)
        self._v_order = self.plan.v_order.to(dev).contiguous()
        self._offsets = torch.tensor(self.rec.offsets, dtype=torch.long)
        # Per sequence: fp16 [L, P, H, S + T, D], sinks at [0, S), the block being filled after;
        # P = 2 (K, V), or 1 for a latent cache, where dense[-1] (the "values") is the keys.
        self._dense: dict[int, torch.Tensor] = {}
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # The step's completed blocks, packed at its end: (sinks in the first, layer, block
        # ids, keys, values [blocks, H, T, D]).
        self._completed: list[tuple] = []
        # A one-call step's new keys and values [L, N, H, D] (model order) where it completed
        # a block (`_complete_native`), else None
        self._native_new: tuple[torch.Tensor, torch.Tensor] | None = None
        # Kept from step to step (a decode loop's steps differ in a few numbers): per sequence
        # its packed blocks' ids (the list and its tensor), and the last `native_step`'s C
        # structure with the arrays that change every step (`_hook`).
        self._ids: dict[int, tuple[list[int], torch.Tensor]] = {}
        self._hook: tuple | None = None
        r = self.rec
        shape = {"T": r.T, "D": spec.head_dim, "NF": r.k[0], "NM": r.k[1], "NL": r.k[2],
                 "VF": r.v[0], "VM": r.v[1], "VL": r.v[2], "B": r.bits, "LB": r.low_bits,
                 "G": spec.query_group, "SF": int(r.scales == "fp8"),
                 "LAT": int(spec.latent), "DV": spec.v_dim}  # fmt: skip
        self.attention = PackedAttention(self, kernels.hybrid_kernel(shape) if dev.type == "cpu"
                                         else None)  # fmt: skip
        self.operators = OperatorSet(dev, owner=self.attention)
        self.prefix = self.sinks = SinkState(self)

    def _dense_buf(self, sid: int) -> torch.Tensor:
        buf = self._dense.get(sid)
        if buf is None:
            s = self.spec
            shape = (s.num_layers, s.stored_parts, s.num_kv_heads, self.S + self.T, s.head_dim)
            buf = self._dense[sid] = torch.zeros(
                shape, dtype=torch.float16, device=self._arena.device
            )
        return buf

    def prepare(self, step: Step) -> None:
        self.step = step
        self._batch, self._past, self._groups = step.batch, step.past, step.groups
        batch = step.batch
        self._pending.clear()
        self._completed.clear()
        self._native_new = None
        self._seqs = []
        if self._groups is not None:  # tiered: the device groups' block ids, once per step
            self._group_ids = [
                [None if kind == "staged" else _ids(what, self._arena) for kind, what in groups]
                for groups in self._groups
            ]
        for i, (sid, past) in enumerate(zip(batch.seq_ids, self._past, strict=True)):
            self._dense_buf(sid)
            nb = past // self.T
            ids = self.pool.table(sid).block_ids()[:nb]
            if self._groups is not None and any(g[0] != "device" for g in self._groups[i]):
                ids = list(range(nb))  # tiered, not all on the device: rows of `_packed`
            # Dense tokens: sinks + the block being filled; with no packed block yet the sinks
            # are simply the first tokens of that block.
            lo = 0 if nb else self.S
            hi = self.S + past - nb * self.T
            kept = self._ids.get(sid)
            if kept is None or kept[0] != ids:
                tensor = torch.tensor(ids, dtype=torch.int64, device=self._arena.device)
                kept = self._ids[sid] = (ids, tensor)
            self._seqs.append(_Seq(nb, kept[1], self.S if nb else 0, lo, hi))

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n, h, d = k.shape
        # Channels into stored order: [N, H, D] gathered along D by each head's permutation.
        kp = torch.gather(k.float(), 2, self._k_order[layer].expand(n, h, d))
        if self.spec.latent:  # values are the keys (their first channels, in model order)
            vp = kp
        else:
            vp = torch.gather(v.float(), 2, self._v_order[layer].expand(n, h, d))
        self._pending[layer] = (kp, vp)
        self._native_new = None  # the step runs layer by layer (after a refused native call)
        self._complete(layer, kp[None], vp[None])

    def _complete(self, layer0: int, kp: torch.Tensor, vp: torch.Tensor) -> None:
        """The blocks this step completes, of layers layer0, layer0 + 1, ... (their new keys
        and values kp, vp [layers, N, H, D] in stored order), into `_completed`. They are
        quantized at the step's end (`finish`, before the side buffers take the new tail): the
        packed blocks this step attends were all complete before it, and `read` takes the
        step's tokens from the side buffers and `_pending`."""
        b, S, T = self._batch, self.S, self.T
        layers, _, h, d = kp.shape
        for i, sid in enumerate(b.seq_ids):
            past, rows, n = self._past[i], b.rows(i), b.query_lens[i]
            first, done = past // T, (past + n) // T  # first block not packed
            if done == first:
                continue
            # A sequential step's rows before its last are in the side buffer already, in fp16,
            # as their own decode steps would have left them: the block is packed from there.
            skip = n - 1 if b.sequential else 0
            tail = past + skip - first * T
            need = (done - first) * T - tail  # new tokens that go into packed blocks
            dense = self._dense[sid][layer0 : layer0 + layers]  # [layers, P, H, S + T, D]
            parts = []  # keys, values of the completed blocks: [layers, nblk, H, T, D]
            for new, part in ((kp, 0), (vp, -1)):
                new = new[:, rows][:, skip : skip + need].transpose(1, 2)  # [layers, H, need, D]
                x = torch.cat([dense[:, part, :, S : S + tail].float(), new], 2)
                parts.append(x.view(layers, h, done - first, T, d).transpose(1, 2))
            mask0 = S if first == 0 else 0
            ids = self.pool.table(sid).block_ids()[first:done]
            self._completed += [(mask0, layer0 + j, ids, parts[0][j], parts[1][j])
                                for j in range(layers)]  # fmt: skip

    def _complete_native(self) -> None:
        """After a one-call step that completed blocks: `_complete` of every layer at once,
        from the step's new keys and values as `hybrid_layer` kept them (float32 [L, N, H, D],
        model order: gathered into stored order as `append` does)."""
        keys, values = self._native_new
        self._native_new = None
        n, h, d = keys.shape[1:]
        index = (order[:, None].expand(-1, n, h, d) for order in (self._k_order, self._v_order))
        kp, vp = (torch.gather(x, 3, i) for x, i in zip((keys, values), index, strict=True))
        self._complete(0, kp, vp)

    def _pack_completed(self) -> None:
        """Quantize the blocks this step completed, every layer's at once (one codec call
        instead of one per layer and sequence: a decode step that completes a block packed 30
        layers at 2 ms each), into their arena rows."""
        done = self._completed
        if not done:
            return
        dev = self._arena.device
        sinks, at = [], 0  # the blocks that are a sequence's first: its sinks are left out
        for mask0, _, _, kb, _ in done:
            if mask0:
                sinks.append(at)
            at += kb.shape[0]
        layers = [layer for _, layer, ids, _, _ in done for _ in ids]
        ids = [i for _, _, ids, _, _ in done for i in ids]
        self._write_blocks(
            torch.tensor(layers, device=dev), torch.tensor(ids, device=dev),
            torch.cat([kb for *_, kb, _ in done]), torch.cat([vb for *_, vb in done]),
            torch.tensor(sinks, dtype=torch.long, device=dev),
        )  # fmt: skip
        done.clear()

    def _write_blocks(
        self,
        layers: torch.Tensor,
        ids: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor,
        again: bool = False,
    ) -> None:
        """Blocks k, v [B, H, T, D] (stored order) packed into the arena rows (layers[i],
        ids[i]), in one codec call; `sinks`: the blocks whose first tokens are sinks, left out
        of their key ranges; `again`: re-packing values quantized once (`quantize`)."""
        recs = self.codec.quantize(k, v, self.S, again=again, sink_blocks=sinks)
        self._arena.index_put_((layers, ids), recs)  # [L, NB, H, REC] at (layer, block) pairs

    def _flush(self, layer: int) -> None:
        """Move this step's new tokens of `layer` into the side buffers (sinks, tail)."""
        kp, vp = self._pending.pop(layer)
        b = self._batch
        for i, sid in enumerate(b.seq_ids):
            past, n, rows = self._past[i], b.query_lens[i], b.rows(i)
            dense = self._dense[sid][layer]
            kv = (kp[rows].transpose(0, 1), vp[rows].transpose(0, 1))  # [H, n, D] each
            new = list(zip(dense, kv[: len(dense)], strict=True))  # a latent cache: keys only
            if past < self.S:  # sinks
                m = min(self.S, past + n) - past
                for part, x in new:
                    part[:, past : past + m] = x[:, :m]
            end = past + n
            start = max(past, end // self.T * self.T)  # the tail after this step
            # When a block was completed the old tail is packed now: the new tail starts at 0.
            dense_from = 0 if end // self.T > past // self.T else start - end // self.T * self.T
            m = end - start
            if m:
                at = self.S + dense_from
                for part, x in new:
                    part[:, at : at + m] = x[:, n - m :]

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        return self._attend(layer, q, None)

    def native_step(self, step: Step) -> NativeHook | None:
        # A resident step on a CPU whose C kernel serves, in which a block completes only with
        # a sequence's last new token, and each sequence's attention is one kernel call in
        # `attend_seq` too: `hybrid_attend.c`'s hybrid_layer then does each layer's `append`,
        # `attend` and end-of-step write in the one-call step, with the same numbers (over a
        # selection's choice: the packed blocks `attend_tokens` would gather, read in place),
        # keeping the step's keys for `new_keys`. A completed block's tokens go to no side-buffer
        # slot: with the step's keys and values, which it then keeps too, `finish` packs it as
        # `append` would (`_complete_native`). Why: such a step went layer by layer, 9-12 ms
        # more than the 4.4 of a SmolLM2 step, once per 64 tokens of the default strategy.
        if step.groups is not None or not self._hooks():
            return None
        lib = self.attention.kernel
        b, g, T, S = step.batch, self.spec.query_group, self.T, self.S
        tail: list[int] = []
        sink: list[int] = []
        completes = False
        for seq, past, n, chunk in zip(self._seqs, step.past, b.query_lens, b.chunk_lens,
                                       strict=True):  # fmt: skip
            ends = (past + n) // T != past // T  # it completes a block (its last row must)
            # (chunk: the rows of one kernel call)
            if (ends and (past + n) % T) or g * chunk > _KERNEL_MAX_ROWS:
                return None
            if g * chunk * (seq.hi - seq.lo + n) > _DENSE_KERNEL_LIMIT:
                return None
            at = S + past - seq.nb * T  # as `_flush` writes them (a completed block: nowhere)
            if ends and b.sequential:  # each row written as its own decode step writes it
                tail += [*range(at, at + n - 1), -1]
            else:
                tail += [-1] * n if ends else range(at, at + n)
            sink += [p if p < S else -1 for p in range(past, past + n)]
            completes = completes or ends
        seqs = self._seqs
        na = [s.hi - s.lo for s in seqs]
        # The same sequences, rows and packed blocks as the step before (a decode loop between
        # two completed blocks): its structure again, with this step's side-buffer counts and
        # slots. Why: building it anew (a dozen C arrays) took 80-115 us of the default
        # strategy's step at 64 tokens, more than it costs warm, as all Python after the
        # step's weights have streamed by.
        blocks = tuple((s.nb, s.ids.data_ptr()) for s in seqs)  # (mask0 and lo follow from nb)
        same = (tuple(b.seq_ids), tuple(b.query_lens), blocks)
        kept = self._hook
        if kept is not None and kept[0] == same:
            c, keep, arrays = kept[1], kept[2], kept[3]
            for array, values in zip(arrays, (na, tail, sink), strict=True):
                array[:] = values
            self._keep_values(c, completes)
            return NativeHook(kept[4], ctypes.addressof(c), b.offsets, (c, keep, seqs),
                              past=list(step.past))  # fmt: skip
        keep: list = []
        dense = [self._dense[sid] for sid in b.seq_ids]
        # the step's keys as written, for a selection that summarizes them (`new_keys`)
        h, d = self.spec.num_kv_heads, self.spec.head_dim
        self._new_keys = torch.empty(self.spec.num_layers, b.offsets[-1], h, d)
        self._new_values = torch.empty_like(self._new_keys)  # (kept where a block completes)
        c = kernels.HybridStep(
            self._arena.data_ptr(), self._arena.stride(0), self.rec.nbytes,
            self._offsets.data_ptr(), self.spec.num_kv_heads, g, len(seqs), self.scale,
            self._k_order.data_ptr(), self._v_order.data_ptr(), kernels.int64s(b.offsets, keep),
            kernels.int64s([s.ids.data_ptr() for s in seqs], keep),
            kernels.int64s([s.nb for s in seqs], keep),
            kernels.int64s([s.mask0 for s in seqs], keep),
            kernels.int64s([t.data_ptr() for t in dense], keep), S + T,
            kernels.int64s([s.lo for s in seqs], keep), kernels.int64s(na, keep),
            kernels.int64s(tail, keep), kernels.int64s(sink, keep), self._new_keys.data_ptr(),
        )  # fmt: skip
        arrays = keep[-3:]  # na, tail, sink: what a later step changes
        keep += [dense, self._new_keys, self._new_values]  # what the structure points into
        self._keep_values(c, completes)
        hook = kernels.address(lib, "hybrid_layer")
        self._hook = (same, c, keep, arrays, hook)
        return NativeHook(hook, ctypes.addressof(c), b.offsets, (c, keep, seqs),
                          past=list(step.past))  # fmt: skip

    def _hooks(self) -> bool:
        """Whether a step can be `hybrid_attend.c`'s hybrid_layer's: its C kernel built and
        serving (`attention.hybrid`), a cache of keys and values, the query group known."""
        if self.attention.kernel is None or self.spec.latent or self.spec.query_group < 1:
            return False
        return self.operators["attention.hybrid"].active.name == "c"

    def sequential(self, past: int, steps: int) -> int:
        # Up to the row that completes the block being filled: a block completes only with a
        # sequence's last row (the rule of `native_step`; `finish` packs it).
        return max(1, min(steps, self.T - past % self.T)) if self._hooks() else 1

    def _keep_values(self, c, completes: bool) -> None:
        """The step's values kept too where it completes a block (`finish` packs it)."""
        c.values = self._new_values.data_ptr() if completes else None
        self._native_new = (self._new_keys, self._new_values) if completes else None

    def new_keys(self) -> torch.Tensor:
        return self._new_keys

    def attend_tokens(self, layer: int, q: torch.Tensor, step: Step,
                      chosen: list[torch.Tensor | None]) -> torch.Tensor:  # fmt: skip
        """Only the chosen packed blocks are read: per KV head their records are gathered
        (from the device arena, or wherever each lives when tiered) into a small record tensor
        that the kernel (or PyTorch) attends as it would a sequence's own blocks; the fp16
        sinks and the side buffer's newest tokens are always read. Where the sinks' block is
        chosen by some heads and not others (a selection without sink blocks) the kernel's one
        sink mask cannot say so, and where heads read different numbers of packed blocks one
        record tensor cannot hold them: that layer then reads every block and attends the
        chosen tokens."""
        picked = []
        for pieces, seq, blocks in zip(self._parts(layer, count=True), self._seqs, chosen,
                                       strict=True):  # fmt: skip
            got = (pieces, seq) if blocks is None else self._chosen(pieces, seq, blocks)
            if got is None:
                return super().attend_tokens(layer, q, step, chosen)
            picked.append(got)
        return self._attend(layer, q, picked)

    def _chosen(self, pieces, seq: _Seq, blocks: torch.Tensor):
        """The records of the packed blocks among `blocks` [Hkv, B] (positions in the
        sequence's block list; those past its packed blocks are the side buffer's, read
        anyway) as one piece: (records [B', Hkv, REC], its `_Seq`), row b of head h being head
        h's b-th chosen block in order; None when the sink mask cannot be kept (see above)."""
        h = self.spec.num_kv_heads
        keep = blocks < seq.nb
        per_head = keep.sum(1)
        if bool((per_head != per_head[0]).any()):  # not a selection's shape (see `reads`)
            return None
        sel = blocks[keep].view(h, -1).sort(1).values  # [Hkv, B']: the same count per head
        first = sel[:, 0] == 0 if sel.shape[1] else sel.new_zeros(h, dtype=torch.bool)
        mask0 = seq.mask0 if bool(first.all()) else 0
        if seq.mask0 and bool(first.any()) and not mask0:
            return None
        nb, dev = sel.shape[1], sel.device
        heads = _arange(h, dev).view(h, 1)
        if len(pieces) == 1:  # one place (the device arena, or one staged group)
            recs, s = pieces[0]
            flat = recs.reshape(-1, recs.shape[-1])
            rows = (s.ids[sel] * h + heads).t().reshape(-1)  # (block, head) order
            out = flat.index_select(0, rows)
        else:  # tiered: each chosen block from the piece it lives in
            ids = torch.cat([s.ids for _, s in pieces])  # per position: its row in its piece
            piece = torch.cat([torch.full((s.nb,), j, device=dev)
                               for j, (_, s) in enumerate(pieces)])  # fmt: skip
            out = pieces[0][0].new_empty(nb * h, pieces[0][0].shape[-1])
            dest = _arange(nb * h, dev).view(nb, h).t()  # [Hkv, B'] rows of `out`
            where, rows_all = piece[sel], ids[sel] * h + heads
            for j, (recs, _) in enumerate(pieces):
                m = where == j
                if bool(m.any()):
                    flat = recs.reshape(-1, recs.shape[-1])
                    out.index_copy_(0, dest[m], flat.index_select(0, rows_all[m]))
        picked = _Seq(nb, _arange(nb, dev), mask0, seq.lo, seq.hi)
        return [(out.view(nb, h, -1), picked)], picked

    def _attend(self, layer: int, q: torch.Tensor, picked) -> torch.Tensor:
        """Attention of every batch sequence over its packed blocks (`picked`: per sequence
        the pieces and `_Seq` to read; None: all of them) and its fp16 tokens."""
        b = self._batch
        kp, vp = self._pending[layer]
        q = q.float().contiguous()
        out = q.new_empty(*q.shape[:2], self.spec.v_dim)  # [N, Hq, Dv]
        attend_seq = self.operators["attention.hybrid"]  # the C kernel, else PyTorch
        if picked is None:
            picked = list(zip(self._parts(layer, count=True), self._seqs, strict=True))
        for i, (sid, (pieces, seq)) in enumerate(zip(b.seq_ids, picked, strict=True)):
            rows = b.rows(i)
            dense = self._dense[sid][layer]  # [P, H, S + T, D]
            dk, dv = dense[0, :, seq.lo : seq.hi], dense[-1, :, seq.lo : seq.hi]
            # kp[rows], vp[rows]: [n, H, D], contiguous slices of the step's tokens
            attend_seq(
                self.attention, layer, pieces, q[rows], seq, dk, dv, kp[rows], vp[rows], out[rows]
            )
        # NOTE: the step's tokens move into the side buffers at end_step, not here: `read`
        # (a pruned selection's observers, the transformers adapter) may follow `attend`.
        return out.to(self.spec.dtype)

    def _parts(self, layer: int, count: bool) -> list[list[tuple[torch.Tensor, _Seq]]]:
        """Per batch sequence, its packed blocks of `layer` as pieces in token order: (records
        [*, H, REC], the `_Seq` of the piece's rows there). Resident, or tiered with every
        block on the device: one piece, the device arena. Tiered otherwise: one per group, read
        in place (the device arena; the host arena on a CPU) or staged by the prefetcher, so
        attention never copies the records it can read where they are."""
        if self._groups is None:
            arena = self._arena[layer]
            return [[(arena, seq)] for seq in self._seqs]
        staged = self.step.staged(layer, count)
        out = []
        for i, (groups, seq) in enumerate(zip(self._groups, self._seqs, strict=True)):
            if all(kind == "device" for kind, _ in groups):
                out.append([(self._arena[layer], seq)])
                continue
            pieces = []
            for (kind, what), ids in zip(groups, self._group_ids[i], strict=True):
                if kind == "staged":
                    recs = staged[i][what].contiguous()  # [nb, H, REC], as the kernel reads
                    ids = _arange(recs.shape[0], recs.device)
                else:
                    recs = self.step.in_place[kind][layer]
                mask0 = seq.mask0 if not pieces else 0
                pieces.append((recs, _Seq(len(ids), ids, mask0, 0, 0)))
            out.append(pieces)
        return out

    def _packed(self, layer: int, count: bool) -> list[torch.Tensor]:
        """Per batch sequence, the records [*, H, REC] its `_Seq.ids` index for `layer`: the
        device arena, or (tiered, some blocks elsewhere) its pieces gathered in order (what
        `read` reconstructs from; attention reads the pieces where they are)."""
        out = []
        for pieces, seq in zip(self._parts(layer, count), self._seqs, strict=True):
            if len(pieces) == 1 and pieces[0][1] is seq:  # the arena, rows `seq.ids`
                out.append(pieces[0][0])
            else:
                out.append(torch.cat([r.index_select(0, s.ids) for r, s in pieces]))
        return out

    def read(self, layer: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """What `attend` of this step sees, as K [H, S, D] and V [H, S, Dv] per sequence in
        model order (a latent cache's V: the first channels of its K)."""
        b = self._batch
        kp, vp = self._pending[layer]
        ks, vs = [], []
        records = self._packed(layer, count=False)
        for i, (sid, seq) in enumerate(zip(b.seq_ids, self._seqs, strict=True)):
            rows = b.rows(i)
            k, v = self._stored(layer, records[i], seq.ids, self._dense[sid], self._past[i])
            k = torch.cat([k, kp[rows].transpose(0, 1)], 1)
            v = torch.cat([v, vp[rows].transpose(0, 1)], 1)
            k, v = self._model_order(layer, k, v)
            ks.append(k)
            vs.append(v[..., : self.spec.v_dim] if self.spec.latent else v)
        return ks, vs

    def _stored(self, layer, recs, ids, dense, n) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's `n` stored tokens of `layer`, K and V [H, n, D] float in stored channel
        order: its packed blocks (rows `ids` of `recs`) with the fp16 sinks over their first
        tokens, then the fp16 tail of its side buffer `dense` [L, P, H, S + T, D]."""
        nb = n // self.T
        dense = dense[layer].float()
        pieces_k, pieces_v = [], []
        if nb:
            k, v = self.codec.dequantize(recs, ids)  # [B, H, T, D]
            h, d = k.shape[1], k.shape[3]
            k = k.transpose(0, 1).reshape(h, -1, d).clone()
            v = v.transpose(0, 1).reshape(h, -1, d).clone()
            k[:, : self.S], v[:, : self.S] = dense[0, :, : self.S], dense[-1, :, : self.S]
            pieces_k.append(k)
            pieces_v.append(v)
        tail = n - nb * self.T
        pieces_k.append(dense[0, :, self.S : self.S + tail])
        pieces_v.append(dense[-1, :, self.S : self.S + tail])
        return torch.cat(pieces_k, 1), torch.cat(pieces_v, 1)

    def _model_order(self, layer, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [H, S, D] from stored channel order back to the model's (a latent cache's V:
        its K)."""
        k = torch.gather(k, 2, self._k_inverse[layer][:, None, :].expand_as(k))
        if self.spec.latent:
            return k, k
        return k, torch.gather(v, 2, self._v_inverse[layer][:, None, :].expand_as(v))

    def finish(self) -> None:
        if self._native_new is not None:  # a one-call step that completed a block
            self._complete_native()
        self._pack_completed()
        for layer in list(self._pending):
            self._flush(layer)
        super().finish()

    def abort(self) -> None:
        self._pending.clear()
        self._completed.clear()
        self._native_new = None
        super().abort()

    # ---- hooks of the placements and the selections --------------------------------------------

    def arena_layers(self, arena: torch.Tensor) -> list[torch.Tensor]:
        return list(arena)  # per layer [NB, H, REC]

    def pool_blocks(self, past: int, new: int) -> int:
        return past // self.T  # the packed blocks; newer tokens are in the side buffer

    def _seq_tokens(self, seq_id: int, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored tokens of `seq_id` between steps from block `first` on, K and V
        [L, H, n - first * T, D] in stored channel order, every layer at once (one decode of
        all their blocks, not one per layer)."""
        n, T, S = self.pool.num_tokens(seq_id), self.T, self.S
        nb = n // T
        dense = self._dense[seq_id].float()  # [L, P, H, S + T, D]
        parts_k, parts_v = [], []
        if nb > first:
            layers, blocks = self._arena.shape[:2]
            ids = _ids(self.pool.table(seq_id).block_ids()[first:nb], self._arena)
            rows = (_arange(layers, ids.device)[:, None] * blocks + ids).flatten()
            k, v = self.codec.dequantize(self._arena.flatten(0, 1), rows)  # [L * B, H, T, D]
            h, d = k.shape[1], k.shape[3]
            k = k.view(layers, -1, h, T, d).transpose(1, 2).reshape(layers, h, -1, d)
            v = v.view(layers, -1, h, T, d).transpose(1, 2).reshape(layers, h, -1, d)
            if first == 0:  # the fp16 sinks over the first block's first tokens
                k, v = k.clone(), v.clone()
                k[:, :, :S], v[:, :, :S] = dense[:, 0, :, :S], dense[:, -1, :, :S]
            parts_k.append(k)
            parts_v.append(v)
        tail = n - nb * T
        parts_k.append(dense[:, 0, :, S : S + tail])
        parts_v.append(dense[:, -1, :, S : S + tail])
        return torch.cat(parts_k, 2), torch.cat(parts_v, 2)

    def token_kv(self, seq_id: int, lo: int, hi: int) -> torch.Tensor:
        first = lo // self.T  # only the blocks that hold [lo, hi) are decoded
        k, v = self._seq_tokens(seq_id, first)
        at = (lo - first * self.T, hi - first * self.T)

        def model_order(x: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
            x = x[:, :, at[0] : at[1]]  # [L, H, hi - lo, D], channels back to the model's
            return torch.gather(x, 3, inverse[:, :, None, :].expand_as(x))

        k = model_order(k, self._k_inverse)
        v = k if self.spec.latent else model_order(v, self._v_inverse)
        return torch.stack([k, v], 1)  # [L, 2, H, T, D]

    def compact(self, seq_id: int, lo: int, n: int, rel: torch.Tensor) -> None:
        """Kept tokens move down, re-packed: blocks from the first one that changes in any
        (layer, head) are dequantized, gathered and quantized again (earlier blocks keep their
        bytes), every layer in one call; what no longer fills a block goes to the fp16 side
        buffer."""
        T, m = self.T, lo + rel.shape[-1]
        rel = rel.to(self._arena.device)  # a selection ranks on the CPU; the arena may not
        moved = (rel != torch.arange(rel.shape[-1], device=rel.device)).flatten(0, 1).any(0)
        moved = moved.nonzero()
        first = lo + (int(moved[0]) if len(moved) else rel.shape[-1])  # first changed token
        f, nb = first // T, m // T  # blocks [f, nb) are written again
        k, v = self._seq_tokens(seq_id)  # [L, H, n, D]
        idx = rel[..., None].expand(-1, -1, -1, k.shape[-1])  # [L, H, m - lo, D]
        k = torch.cat([k[:, :, :lo], k[:, :, lo:].gather(2, idx)], 2)  # [L, H, m, D]
        v = k if self.spec.latent else torch.cat([v[:, :, :lo], v[:, :, lo:].gather(2, idx)], 2)
        if nb > f:
            layers, h, _, d = k.shape
            kb = k[:, :, f * T : nb * T].reshape(layers, h, nb - f, T, d).transpose(1, 2)
            vb = v[:, :, f * T : nb * T].reshape(layers, h, nb - f, T, d).transpose(1, 2)
            dev = self._arena.device
            sinks = _arange(layers, dev) * (nb - f) if f == 0 else _arange(0, dev)
            ids = _ids(self.pool.table(seq_id).block_ids()[f:nb], self._arena)
            # Values already quantized once: `again` keeps unchanged groups as they were.
            self._write_blocks(_arange(layers, dev).repeat_interleave(nb - f), ids.repeat(layers),
                               kb.flatten(0, 1), vb.flatten(0, 1), sinks, again=True)  # fmt: skip
        tail = m - nb * T
        dense = self._dense[seq_id]  # [L, P, H, S + T, D]
        for part, x in zip(dense.unbind(1), (k, v), strict=False):  # a latent cache: keys only
            part[:, :, self.S : self.S + tail] = x[:, :, nb * T : m]

    # ---- sequences and accounting ------------------------------------------------------------

    def forget(self, seq_id: int) -> None:
        self._dense.pop(seq_id, None)
        self._ids.pop(seq_id, None)
        self._hook = None  # it may point into the sequence's side buffer

    def bytes_used(self) -> int:
        s = self.spec
        per_dense_token = s.elements_per_token * 2  # fp16 (keys only when latent)
        packed, dense = set(), 0
        for sid in self._dense:
            table = self.pool.table(sid)
            if table is None:
                continue
            n = table.num_tokens
            nb = n // self.T
            packed.update((r.tier, r.block_id) for r in table.refs[:nb])
            dense += ((min(self.S, n) if nb else 0) + n - nb * self.T) * per_dense_token
        return len(packed) * self.pool.layout.page_bytes + dense

    def side_bytes(self) -> int:
        return sum(buf.numel() * buf.element_size() for buf in self._dense.values())

    def stats(self) -> dict:
        r = self.rec
        out = {"channels": {
            kind: {"fp16": c[0], f"int{r.bits}": c[1], f"int{r.low_bits}": c[2]}
            for kind, c in (("keys", r.k), ("values", r.v))
        }}  # fmt: skip
        if self.spec.latent:
            out["channels"]["values"] = f"the keys' first {self.spec.v_dim} channels"
        kernel = self.attention.kernel
        out["kernel"] = "c" if kernel is not None else f"torch ({kernels.KERNEL_ERROR})"
        out["kernels"] = self.operators.report()
        return out


# int8: every key channel at 8 bits over a block's tokens (per channel), every value at 8 bits
# per token; the packed record with one channel class and fp16 sinks (no calibration needed:
# with one class the order a calibration gives changes nothing).
@FORMATS.register
class Int8Format(PackedFormat):
    name = "int8"
    help = "int8 keys per channel, values per token (fp16 sinks)"
    needs = frozenset()
    fixed: ClassVar[dict[str, Any]] = {
        "fp16_share": 0.0, "bits": 8, "low_share": 0.0, "low_bits": 8, "v_fp16_share": 0.0,
        "v_low_share": 0.0, "scales": "fp16", "method": "score_error", "calibration": None,
        "calibration_text": None, "calibration_samples": 100, "calibration_window": 256,
        "recalibrate": False,
    }  # fmt: skip


class SinkState(PrefixState):
    """The fp16 sinks a sequence attaching shared packed blocks needs (block 0 leaves them out),
    remembered per first tokens; persisted beside block 0 by a tiered placement."""

    def __init__(self, fmt: PackedFormat) -> None:
        self.format, self.S = fmt, fmt.S
        self._cache: dict[tuple[int, ...], torch.Tensor] = {}  # first tokens -> sinks

    def published(self, seq_id: int, token_ids: list[int]) -> None:
        dense = self.format._dense
        if self.S and seq_id in dense and len(token_ids) >= self.format.T:
            # Sequences that attach these blocks need the fp16 sinks that block 0 leaves out.
            # The same first tokens have the same sinks: kept ones are only made the newest
            # (the engine publishes after every step: a copy of every layer's sinks, 92 KB
            # for SmolLM2, each time: `Scheduler.computed` 104 -> 18 us a step)
            key = tuple(token_ids[: self.S])
            kept = self._cache.pop(key, None)
            if kept is not None:
                self._cache[key] = kept
            else:
                self._remember(key, dense[seq_id][:, :, :, : self.S].clone())

    def can_attach(self, token_ids: list[int]) -> bool:
        # Without the sinks' fp16 KV the shared blocks cannot be attended.
        return not self.S or tuple(token_ids[: self.S]) in self._cache

    def to_bytes(self, token_ids: list[int]) -> bytes | None:
        # The sinks' fp16 K/V [L, P, H, S, D], raw bytes: what block 0 leaves out.
        sinks = self._cache.get(tuple(token_ids[: self.S])) if self.S else None
        if sinks is None:
            return None
        return sinks.cpu().contiguous().view(torch.uint8).numpy().tobytes()

    def from_bytes(self, token_ids: list[int], data: bytes) -> bool:
        s = self.format.spec
        shape = (s.num_layers, s.stored_parts, s.num_kv_heads, self.S, s.head_dim)
        if not self.S or len(data) != 2 * math.prod(shape):
            return False  # another shape's bytes (the hash names the layout: not expected)
        sinks = torch.frombuffer(bytearray(data), dtype=torch.float16).view(shape)
        self._remember(tuple(token_ids[: self.S]), sinks.to(self.format._arena.device))
        return True

    def _remember(self, key: tuple[int, ...], sinks: torch.Tensor) -> None:
        self._cache.pop(key, None)
        self._cache[key] = sinks
        while len(self._cache) > 64:
            self._cache.pop(next(iter(self._cache)))

    def attached(self, seq_id: int, token_ids: list[int]) -> None:
        if self.S:
            self.format._dense_buf(seq_id)[:, :, :, : self.S] = self._cache[
                tuple(token_ids[: self.S])
            ]


class PackedAttention:
    """Attention of one sequence over packed records: the C kernel (few query rows) or PyTorch
    dequantizing a few blocks at a time, merged with the dense tokens by log-sum-exp. The
    `attention.hybrid` operator's owner (`kernels.operators`)."""

    def __init__(self, fmt: PackedFormat, kernel) -> None:
        self.format, self.kernel = fmt, kernel

    def attend_seq(self, layer, pieces, q, seq, dk, dv, ck, cv, out, kernel: bool):
        """One sequence's attention written into `out` [n, Hq, Dv] (a view of the step's
        output): stored blocks (`pieces` of `_parts`: rows of one layer's records each) by the
        C kernel (`kernel`, few query rows) or PyTorch, the dense tokens (`dk`, `dv`) and the
        step's own tokens, merged by log-sum-exp."""
        f = self.format
        h, v_dim = f.spec.num_kv_heads, f.spec.v_dim
        n, g = q.shape[0], q.shape[1] // h
        kernel = kernel and g * n <= _KERNEL_MAX_ROWS
        if len(pieces) == 1 and kernel and g * n * (dk.shape[1] + n) <= _DENSE_KERNEL_LIMIT:
            recs, seq = pieces[0]
            self.call_kernel(layer, recs, q, seq, dk, dv, ck, cv, out)  # one call, in place
            return out
        # Each piece is one partial (output, log-sum-exp); the dense tokens go with the last
        # one, and so do the step's own tokens where the kernel takes them.
        fused = kernel and g * n * (dk.shape[1] + n) <= _DENSE_KERNEL_LIMIT
        qg = None if fused else self.queries(layer, q)
        parts = []
        for j, (recs, s) in enumerate(pieces):
            last = j == len(pieces) - 1
            pk, pv = (dk, dv) if last else (dk[:, :0], dv[:, :0])
            if kernel:
                cur = (ck, cv) if last and fused else (None, None)
                parts.append(self.call_kernel(layer, recs, q, s, pk, pv, *cur, None))
            else:
                parts.append(self.attend_torch(recs, qg, s.ids, pk, pv, s.mask0))
        if not fused:  # the step's own tokens (causal)
            parts.append(_attend_dense(qg, ck.transpose(0, 1), cv.transpose(0, 1), n))
        o, _ = merge_partials(parts)  # [H, G * n, D], stored value order
        o = torch.gather(o, 2, f._v_inverse[layer][:, None, :].expand_as(o))
        o = o[..., :v_dim]  # a latent cache attended with its keys as values: [H, G*n, Dv]
        out.copy_(o.reshape(h, g, n, v_dim).permute(2, 0, 1, 3).reshape(n, h * g, v_dim))
        return out

    def queries(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q: [n, Hq, D] -> [H, G * n, D], rows (g, t), channels in key order, scaled."""
        f = self.format
        n, hq, d = q.shape
        h = f.spec.num_kv_heads
        qg = q.view(n, h, hq // h, d).permute(1, 2, 0, 3).reshape(h, -1, d)
        qg = torch.gather(qg, 2, f._k_order[layer][:, None, :].expand_as(qg))
        return qg * f.scale

    def call_kernel(self, layer, recs, q, seq, dk, dv, ck, cv, out_raw):
        """The C kernel on one sequence; with `out_raw` it writes the final output there,
        otherwise it returns (out [H, G*n, D] in stored value order, lse [H, G*n])."""
        f = self.format
        r = f.rec
        n, hq, d = q.shape
        h = f.spec.num_kv_heads
        out = lse = None
        if out_raw is None:
            out = torch.empty(h, hq // h * n, d)
            lse = torch.empty(h, hq // h * n)
        self.kernel.hybrid_attend(
            recs.data_ptr(), seq.ids.data_ptr(), 0, -1, seq.nb, seq.mask0, r.nbytes,
            f._offsets.data_ptr(), h, hq // h, n, q.data_ptr(),
            f._k_order[layer].data_ptr(), f._v_order[layer].data_ptr(), f.scale,
            dk.data_ptr(), dv.data_ptr(), dk.shape[1], dk.stride(0) // d, kernels.ptr(ck),
            kernels.ptr(cv), h * d, 0 if ck is None else n, kernels.ptr(out_raw),
            kernels.ptr(out), kernels.ptr(lse),
        )  # fmt: skip
        return out, lse

    def attend_torch(self, recs, qg, ids, dk, dv, mask0, chunk: int = 32):
        """Stored part by PyTorch: `chunk` packed blocks dequantized at a time (never the whole
        cache), each attended with its log-sum-exp, then the dense tokens."""
        f = self.format
        parts = []
        for c in range(0, len(ids), chunk):
            k, v = f.codec.dequantize(recs, ids[c : c + chunk])  # [B, H, T, D]
            bsz, h, t, d = k.shape
            k = k.transpose(0, 1).reshape(h, bsz * t, d)
            v = k if f.spec.latent else v.transpose(0, 1).reshape(h, bsz * t, d)
            parts.append(_attend_full(qg, k, v, mask0 if c == 0 else 0))
        if dk.shape[1]:
            parts.append(_attend_full(qg, dk.float(), dv.float(), 0))
        if not parts:
            h, rows, d = qg.shape
            return qg.new_zeros(h, rows, d), qg.new_full((h, rows), float("-inf"))
        return merge_partials(parts)


def _ids(ids, like: torch.Tensor) -> torch.Tensor:
    """Block ids as an int64 tensor on `like`'s device."""
    return torch.tensor(list(ids), dtype=torch.int64, device=like.device)


@functools.lru_cache(maxsize=256)
def _arange(n: int, device: torch.device) -> torch.Tensor:
    """Rows 0..n-1 as an int64 tensor (cached: asked per layer and staged group)."""
    return torch.arange(n, dtype=torch.int64, device=device)


def _softmax_part(scores: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(normalized output, log-sum-exp) of scores [H, R, S] over values [H, S, D]."""
    lse = scores.logsumexp(-1)  # [H, R]
    p = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num_(0.0)
    return p @ v, lse


def _attend_full(q, k, v, mask0: int):
    """Rows q [H, R, D] (scaled) over all of k, v [H, S, D] but their first `mask0` tokens:
    (normalized output, log-sum-exp)."""
    if q.device.type != "cpu" or q.shape[1] * k.shape[1] < 4096:
        scores = q @ k.transpose(1, 2)  # [H, R, S]
        scores[..., :mask0] = float("-inf")
        return _softmax_part(scores, v)
    mask = None
    if mask0:
        mask = torch.zeros(q.shape[1], k.shape[1], dtype=q.dtype)
        mask[:, :mask0] = float("-inf")
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), 0.0, False, attn_mask=mask, scale=1.0
    )
    return out[0], lse[0]


def _attend_dense(q, k, v, n):
    """Causal attention of rows (g, t) of q [H, G*n, D] over the step's tokens k, v [H, n, D]."""
    h, rows, d = q.shape
    g = rows // n
    if q.device.type != "cpu":
        scores = q @ k.transpose(1, 2)  # [H, G*n, n]
        t = torch.arange(rows, device=q.device) % n
        scores.masked_fill_(torch.arange(n, device=q.device)[None, :] > t[:, None], float("-inf"))
        return _softmax_part(scores, v)
    # Flash attention with a plain causal mask: query heads as the head axis, K/V repeated.
    qh = q.view(1, h * g, n, d)  # rows (g, t) per KV head -> heads (h, g)
    kh = k.repeat_interleave(g, 0).unsqueeze(0)  # [1, H*G, n, D]
    vh = v.repeat_interleave(g, 0).unsqueeze(0)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qh, kh, vh, 0.0, True, scale=1.0
    )
    return out.reshape(h, rows, d), lse.reshape(h, rows)


def _c_available(device: torch.device, attention: Any) -> str | None:
    if device.type != "cpu":
        return "the C kernel is for CPU tiers"
    if attention is None or attention.kernel is None:
        return kernels.KERNEL_ERROR or "not built for this record shape"
    return None


# The C kernel first where its library is built for the format's record shape; PyTorch (the
# reference) everywhere. A breaker switches to PyTorch when the kernel raises or runs slow.
register_op(
    FnImplementation(
        "attention.hybrid",
        "c",
        lambda at, *a: at.attend_seq(*a, kernel=True),
        ("cpu",),
        _c_available,
    ),
    preference=10,
)
register_op(FnImplementation(
    "attention.hybrid", "torch", lambda at, *a: at.attend_seq(*a, kernel=False),
    ("*",),
), preference=90, reference=True)  # fmt: skip

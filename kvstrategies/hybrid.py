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

The class is the `packed` format of `kvstrategies.formats`: `hybrid` as configured, `int8` with
every channel at 8 bits (one class: no calibration needed). Under a tiered placement its packed
blocks move and are attended where they are (`_parts`: device and, on a CPU, host records in
place, the others as the records the prefetcher staged), and the fp16 sinks of a published
prompt are persisted beside its block 0 (`_prefix_state`, read back in another process by
`_load_prefix_state`); under a pruned selection `_compact` re-packs the kept tokens.

One pool block holds, per layer and KV head, one byte record with the fields listed in
`_Record` (the layout the kernel reads). Bytes reported are the records of quantized blocks plus
the side buffers' fp16 tokens: every nibble, scale, low, fp16 channel and window byte.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from unikv.kernels import native as kernels
from unikv.kernels.operators import FnImplementation, OperatorSet
from unikv.kernels.operators import register as register_op
from unikv.memory.pool import BLOCKS, ArenaSpec, BlockLayout

from .base import KVSpec, KVStrategy
from .calibration import METHODS
from .kv import StepBatch, merge_partials
from .options import Option
from .quant import BITS, SCALES, ChannelPlan, channel_counts, header_low, pack, quantize, unpack
from .registry import register

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


@dataclass(frozen=True, slots=True)
class _Record:
    """Byte layout of one (layer, block, KV head) record; sizes in bytes, in this order."""

    T: int
    k: tuple[int, int, int]  # key channels: (fp16, main width, low width)
    v: tuple[int, int, int]  # value channels
    bits: int
    low_bits: int
    scales: str = "fp16"  # group headers: fp16 scale + low, or fp8 scale + int8 zero point

    @property
    def fields(self) -> list[tuple[str, int]]:
        t, (kf, km, kl), (vf, vm, vl) = self.T, self.k, self.v
        hb = 2 if self.scales == "fp16" else 1  # bytes of one header entry
        return [
            # All channel-major: [channels][T], codes packed along the block's tokens.
            ("kfp", 2 * kf * t),  # f16 [kf][T]
            ("vfp", 2 * vf * t),  # f16 [vf][T]
            ("ksc", hb * 2 * (km + kl)),  # [2][km + kl]: scale, low (or zero) per key channel
            ("vsc", hb * 2 * self.v_classes * t),  # [2 * classes][T]: per token scale, low
            ("km", km * t * self.bits // 8),  # u8 [km][T * b / 8]
            ("kl", kl * t * self.low_bits // 8),
            ("vm", vm * t * self.bits // 8),
            ("vl", vl * t * self.low_bits // 8),
        ]

    @property
    def v_classes(self) -> int:
        """Quantized value classes present (main, low): each has per-token scales."""
        return (self.v[1] > 0) + (self.v[2] > 0)

    @property
    def offsets(self) -> list[int]:
        out, at = [], 0
        for _, size in self.fields:
            out.append(at)
            at += size
        return out

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.fields)


def _option(name: str, type_: type, default: Any, help: str, **kw: Any) -> Option:
    """An option of this strategy: its errors say "allowed: ..." (as tests and users know them)."""
    return Option(name, type_, default, help, wording="allowed:", **kw)


@register
class HybridStrategy(KVStrategy):
    """fp16 important channels + int4 (and optionally int2) packed channels, per pool block."""

    name = "hybrid_fp16_int4"
    axes = ("hybrid", "resident", "all")
    default_for = ("high",)  # a high-bandwidth chip wants a smaller cache (docs/configuration.md)
    tolerance = 0.5  # |attend - exact| on the contract tests' N(0, 1) data
    # The contract runs int4 + fp16 channels: with int2 key channels (a quarter by default),
    # a latent cache's values (its keys) are partly int2 and attention ends up far off exact
    # on that data (0.76 with half of them at int2). test_hybrid.py checks the int2 classes
    # against the strategy's own reconstruction, on both kinds of spec.
    contract_options: ClassVar[dict[str, Any]] = {"low_share": 0.0}
    lossless = False
    compaction_requantizes = True  # `_compact` re-packs the blocks it moves tokens into
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
    def check_combination(cls, opts: dict[str, Any]) -> None:
        for key, base in (("v_fp16_share", "fp16_share"), ("v_low_share", "low_share")):
            if opts[key] is None:  # unset: the keys' share
                opts[key] = opts[base]
        if opts["low_bits"] > opts["bits"]:
            raise ValueError(
                f"strategy {cls.name!r}: option low_bits = {opts['low_bits']} is wider "
                f"than bits = {opts['bits']}; allowed: low_bits <= bits"
            )
        for f, lw in (("fp16_share", "low_share"), ("v_fp16_share", "v_low_share")):
            if opts[f] + opts[lw] > 1:
                raise ValueError(
                    f"strategy {cls.name!r}: options {f} + {lw} = "
                    f"{opts[f] + opts[lw]:g}; allowed: at most 1"
                )

    @classmethod
    def _record(cls, spec: KVSpec, block_size: int, opts: dict[str, Any]) -> _Record:
        d, b, lb = spec.head_dim, opts["bits"], opts["low_bits"]
        k = channel_counts(d, opts["fp16_share"], opts["low_share"], b, lb)
        v = channel_counts(d, opts["v_fp16_share"], opts["v_low_share"], b, lb)
        if spec.latent:  # its values are its keys: no value channels of their own
            v = (0, 0, 0)
        if block_size * opts["low_bits"] % 8 or block_size * opts["bits"] % 8:
            raise ValueError(
                f"strategy 'hybrid_fp16_int4': block_size {block_size} must be a "
                "multiple of 4 (codes are packed along a block's tokens)"
            )
        if opts["sink_tokens"] > block_size:
            raise ValueError(
                f"strategy 'hybrid_fp16_int4': option sink_tokens = {opts['sink_tokens']}; "
                f"allowed: at most the block size ({block_size})"
            )
        return _Record(block_size, k, v, b, lb, opts["scales"])

    @classmethod
    def layout(cls, spec: KVSpec, block_size: int, options: dict[str, Any]) -> BlockLayout:
        rec = cls._record(spec, block_size, options)
        shape = (spec.num_layers, BLOCKS, spec.num_kv_heads, rec.nbytes)
        return BlockLayout(block_size, (ArenaSpec("kv", torch.uint8, shape),))

    def __init__(self, pool, spec: KVSpec, options: dict | None = None) -> None:
        super().__init__(pool, spec, options)
        o = self.opts
        self.T = pool.block_size
        self.rec = self._record(spec, self.T, o)
        self.S = o["sink_tokens"]
        self.plan = self.channel_plan(spec, o)
        self.scale = spec.scale
        self._arena = pool.arena("kv")  # [L, NB, H, REC] uint8
        dev = self._arena.device
        self._k_order = self.plan.k_order.to(dev)
        self._k_inverse = self.plan.k_order.argsort(-1).to(dev)
        self._v_inverse = self.plan.v_order.argsort(-1).to(dev)
        self._v_order = self.plan.v_order.to(dev)
        self._offsets = torch.tensor(self.rec.offsets, dtype=torch.long)
        # Per sequence: fp16 [L, P, H, S + T, D], sinks at [0, S), the block being filled after;
        # P = 2 (K, V), or 1 for a latent cache, where dense[-1] (the "values") is the keys.
        self._dense: dict[int, torch.Tensor] = {}
        self._sink_cache: dict[tuple[int, ...], torch.Tensor] = {}  # first tokens -> sinks
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._aranges: dict[tuple[int, torch.device], torch.Tensor] = {}
        r = self.rec
        shape = {"T": r.T, "D": spec.head_dim, "NF": r.k[0], "NM": r.k[1], "NL": r.k[2],
                 "VF": r.v[0], "VM": r.v[1], "VL": r.v[2], "B": r.bits, "LB": r.low_bits,
                 "G": spec.query_group, "SF": int(r.scales == "fp8"),
                 "LAT": int(spec.latent), "DV": spec.v_dim}  # fmt: skip
        self._kernel = kernels.hybrid_kernel(shape) if dev.type == "cpu" else None
        self.operators = OperatorSet(dev, owner=self)

    @staticmethod
    def channel_plan(spec: KVSpec, o: dict[str, Any]) -> ChannelPlan:
        """The stored channel order for checked options `o` (from their calibration file)."""
        from .calibration import ChannelStats
        from .quant import plan_from_scores

        shape = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
        if o["calibration"] is None:
            # No model to calibrate on (the transformers adapter, unit tests): channel order.
            flat = torch.arange(spec.head_dim, 0, -1, dtype=torch.float32).expand(shape)
            ks = vs = flat
        else:
            stats = ChannelStats.load(o["calibration"], spec.identity, shape)
            ks, vs = stats.scores(o["method"])
        return plan_from_scores(ks, ks if spec.latent else vs)

    # ---- storage -----------------------------------------------------------------------------

    def _dense_buf(self, sid: int) -> torch.Tensor:
        buf = self._dense.get(sid)
        if buf is None:
            s = self.spec
            shape = (s.num_layers, s.stored_parts, s.num_kv_heads, self.S + self.T, s.head_dim)
            buf = self._dense[sid] = torch.zeros(
                shape, dtype=torch.float16, device=self._arena.device
            )
        return buf

    def _prepare(self, batch: StepBatch) -> None:
        self._pending.clear()
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
            tensor = torch.tensor(ids, dtype=torch.int64, device=self._arena.device)
            self._seqs.append(_Seq(nb, tensor, self.S if nb else 0, lo, hi))

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        b = self._batch
        n, h, d = k.shape
        # Channels into stored order: [N, H, D] gathered along D by each head's permutation.
        kp = torch.gather(k.float(), 2, self._k_order[layer].expand(n, h, d))
        if self.spec.latent:  # values are the keys (their first channels, in model order)
            vp = kp
        else:
            vp = torch.gather(v.float(), 2, self._v_order[layer].expand(n, h, d))
        self._pending[layer] = (kp, vp)
        # Blocks completed by this step are quantized now: the packed blocks this step attends
        # were all complete before it, so writing them does not change this step's attention.
        for i, sid in enumerate(b.seq_ids):
            past, rows = self._past[i], b.rows(i)
            first = past // self.T  # first block not yet packed
            done = (past + b.query_lens[i]) // self.T
            if done == first:
                continue
            tail = past - first * self.T
            dense = self._dense[sid][layer]  # [P, H, S + T, D]
            need = (done - first) * self.T - tail  # new tokens that go into packed blocks
            # keys/values of the completed blocks: [H, nblk * T, D]
            kb = torch.cat(
                [dense[0, :, self.S : self.S + tail].float(), kp[rows][:need].transpose(0, 1)], 1
            )
            vb = torch.cat(
                [dense[-1, :, self.S : self.S + tail].float(), vp[rows][:need].transpose(0, 1)],
                1,
            )
            nblk = done - first
            kb = kb.view(h, nblk, self.T, d).transpose(0, 1)  # [nblk, H, T, D]
            vb = vb.view(h, nblk, self.T, d).transpose(0, 1)
            mask0 = self.S if first == 0 else 0
            recs = self._quantize(kb, vb, mask0)  # [nblk, H, REC]
            ids = self.pool.table(sid).block_ids()[first:done]
            idx = torch.tensor(ids, dtype=torch.long, device=self._arena.device)
            self._arena[layer].index_copy_(0, idx, recs)

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

    def _quantize(
        self, k: torch.Tensor, v: torch.Tensor, mask0: int, again: bool = False
    ) -> torch.Tensor:
        """Records [B, H, REC] uint8 of blocks k, v: [B, H, T, D] in stored channel order;
        `mask0` leading tokens of the first block are sinks, left out of its key ranges."""
        r = self.rec
        bsz, h, t, _ = k.shape
        parts = {"kfp": k[..., : r.k[0]].transpose(-1, -2).half()}  # [B, H, kf, T]
        parts["vfp"] = v[..., : r.v[0]].transpose(-1, -2).half()  # [B, H, vf, T]
        k_sc = []
        for (lo, hi), bits, name in zip(_classes(r.k), (r.bits, r.low_bits), "ml", strict=True):
            if hi == lo:
                parts["k" + name] = k.new_zeros(bsz, h, 0, dtype=torch.uint8)
                continue
            # Keys: per channel over the block's tokens, sinks left out of the range.
            kc = k[..., lo:hi].transpose(-1, -2)  # [B, H, C, T]
            codes, scale, low = quantize(kc, bits, -1, r.scales, skip=mask0, again=again)
            k_sc.append(torch.cat([_bytes1(scale), _bytes1(low)], -1))  # [B, H, C, 2 * hb]
            parts["k" + name] = pack(codes, bits)  # [B, H, C, T * bits / 8]
        # [B, H, C, 2 * hb] -> rows [scales][lows] of [B, H, 2, C * hb]
        ksc = torch.cat(k_sc, -2) if k_sc else k.new_zeros(bsz, h, 0, 2, dtype=torch.uint8)
        hb = ksc.shape[-1] // 2
        parts["ksc"] = ksc.view(bsz, h, -1, 2, hb).transpose(2, 3).reshape(bsz, h, 2, -1)
        v_sc = []
        for (lo, hi), bits, name in zip(_classes(r.v), (r.bits, r.low_bits), "ml", strict=True):
            if hi == lo:
                parts["v" + name] = v.new_zeros(bsz, h, 0, dtype=torch.uint8)
                continue
            # Values: per token over the class's channels.
            codes, scale, low = quantize(v[..., lo:hi], bits, -1, r.scales, again=again)
            v_sc += [_bytes1(scale), _bytes1(low)]  # rows of [B, H, 2 * classes, T * hb]
            parts["v" + name] = pack(codes.transpose(-1, -2), bits)  # [B, H, C, T * bits / 8]
        empty = v.new_zeros(bsz, h, 0, dtype=torch.uint8)
        parts["vsc"] = torch.stack([x.reshape(bsz, h, -1) for x in v_sc], -2) if v_sc else empty
        return torch.cat([_bytes(parts[name], bsz, h) for name, _ in r.fields], -1)

    def _records(self, recs: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K, V [B, H, T, D] (stored channel order) of rows `ids` of one layer's
        records `recs` [*, H, REC]."""
        r = self.rec
        raw = recs.index_select(0, ids)  # [B, H, REC]
        bsz, h, _ = raw.shape
        t, (kf, km, kl), (vf, vm, vl) = r.T, r.k, r.v
        f = {}
        for (name, size), at in zip(r.fields, r.offsets, strict=True):
            f[name] = raw[..., at : at + size]

        def half(x: torch.Tensor, *shape: int) -> torch.Tensor:
            return x.contiguous().view(torch.float16).view(bsz, h, *shape).float()

        def header(x: torch.Tensor, rows: int, n: int) -> torch.Tensor:
            """[B, H, rows, n] float: scale rows, then low rows (from fp16 or fp8 + zero)."""
            if not rows or not n:  # no quantized channel class (e.g. fp16_share = 1)
                return x.new_zeros((bsz, h, rows, n), dtype=torch.float32)
            x = x.contiguous().view(bsz, h, rows // 2, 2, -1)
            if r.scales == "fp16":
                return x.view(torch.float16).view(bsz, h, rows, n).float()
            scale = x[..., 0, :].view(torch.float8_e4m3fn).float()
            low = header_low(scale, x[..., 1, :].view(torch.int8))
            return torch.stack([scale, low], -2).view(bsz, h, rows, n)

        ksc = header(f["ksc"], 2, km + kl)
        kparts = [half(f["kfp"], kf, t).transpose(-1, -2)]
        at = 0  # key scale column of the class
        for n, bits, name in ((km, r.bits, "m"), (kl, r.low_bits, "l")):
            if n:
                codes = unpack(f["k" + name].reshape(bsz, h, n, -1), bits).float()  # [B, H, n, T]
                sc = ksc[..., at : at + n, None]  # [B, H, 2, n, 1]
                kparts.append((codes * sc[..., 0, :, :] + sc[..., 1, :, :]).transpose(-1, -2))
                at += n
        k = torch.cat(kparts, -1)
        if self.spec.latent:  # no value fields: the values are the keys
            return k, k
        vsc = header(f["vsc"], 2 * r.v_classes, t)
        vparts = [half(f["vfp"], vf, t).transpose(-1, -2)]
        at = 0  # value scale row of the class
        for n, bits, name in ((vm, r.bits, "m"), (vl, r.low_bits, "l")):
            if n:
                codes = unpack(f["v" + name].reshape(bsz, h, n, -1), bits).float()
                scale, low = vsc[..., at : at + 1, :], vsc[..., at + 1 : at + 2, :]
                vparts.append((codes * scale + low).transpose(-1, -2))
                at += 2
        return k, torch.cat(vparts, -1)

    # ---- attention ---------------------------------------------------------------------------

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        b = self._batch
        kp, vp = self._pending[layer]
        q = q.float().contiguous()
        out = self._empty_out(q)  # [N, Hq, Dv]
        attend_seq = self.operators["attention.hybrid"]  # the C kernel, else PyTorch
        parts = self._parts(layer, count=True)
        for i, (sid, seq) in enumerate(zip(b.seq_ids, self._seqs, strict=True)):
            rows = b.rows(i)
            dense = self._dense[sid][layer]  # [P, H, S + T, D]
            dk, dv = dense[0, :, seq.lo : seq.hi], dense[-1, :, seq.lo : seq.hi]
            # kp[rows], vp[rows]: [n, H, D], contiguous slices of the step's tokens
            attend_seq(self, layer, parts[i], q[rows], seq, dk, dv, kp[rows], vp[rows], out[rows])
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
        staged = self._staged(layer, count)
        out = []
        for i, (groups, seq) in enumerate(zip(self._groups, self._seqs, strict=True)):
            if all(kind == "device" for kind, _ in groups):
                out.append([(self._arena[layer], seq)])
                continue
            pieces = []
            for (kind, what), ids in zip(groups, self._group_ids[i], strict=True):
                if kind == "staged":
                    recs = staged[i][what].contiguous()  # [nb, H, REC], as the kernel reads
                    ids = self._arange(recs.shape[0], recs.device)
                else:
                    recs = self._tier_layers[kind][layer]
                mask0 = seq.mask0 if not pieces else 0
                pieces.append((recs, _Seq(len(ids), ids, mask0, 0, 0)))
            out.append(pieces)
        return out

    def _arange(self, n: int, device: torch.device) -> torch.Tensor:
        """Rows 0..n-1 as an int64 tensor (cached: asked per layer and staged group)."""
        key = (n, device)
        got = self._aranges.get(key)
        if got is None:
            got = self._aranges[key] = torch.arange(n, dtype=torch.int64, device=device)
        return got

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

    def _attend_seq(self, layer, pieces, q, seq, dk, dv, ck, cv, out, kernel: bool):
        """One sequence's attention written into `out` [n, Hq, Dv] (a view of the step's
        output): stored blocks (`pieces` of `_parts`: rows of one layer's records each) by the
        C kernel (`kernel`, few query rows) or PyTorch, the dense tokens (`dk`, `dv`) and the
        step's own tokens, merged by log-sum-exp."""
        h, v_dim = self.spec.num_kv_heads, self.spec.v_dim
        n, g = q.shape[0], q.shape[1] // h
        kernel = kernel and g * n <= _KERNEL_MAX_ROWS
        if len(pieces) == 1 and kernel and g * n * (dk.shape[1] + n) <= _DENSE_KERNEL_LIMIT:
            recs, seq = pieces[0]
            self._call_kernel(layer, recs, q, seq, dk, dv, ck, cv, out)  # one call, in place
            return out
        # Each piece is one partial (output, log-sum-exp); the dense tokens go with the last
        # one, and so do the step's own tokens where the kernel takes them.
        fused = kernel and g * n * (dk.shape[1] + n) <= _DENSE_KERNEL_LIMIT
        qg = None if fused else self._queries(layer, q)
        parts = []
        for j, (recs, s) in enumerate(pieces):
            last = j == len(pieces) - 1
            pk, pv = (dk, dv) if last else (dk[:, :0], dv[:, :0])
            if kernel:
                cur = (ck, cv) if last and fused else (None, None)
                parts.append(self._call_kernel(layer, recs, q, s, pk, pv, *cur, None))
            else:
                parts.append(self._attend_torch(recs, qg, s.ids, pk, pv, s.mask0))
        if not fused:  # the step's own tokens (causal)
            parts.append(_attend_dense(qg, ck.transpose(0, 1), cv.transpose(0, 1), n))
        o, _ = merge_partials(parts)  # [H, G * n, D], stored value order
        o = torch.gather(o, 2, self._v_inverse[layer][:, None, :].expand_as(o))
        o = o[..., :v_dim]  # a latent cache attended with its keys as values: [H, G*n, Dv]
        out.copy_(o.reshape(h, g, n, v_dim).permute(2, 0, 1, 3).reshape(n, h * g, v_dim))
        return out

    def _queries(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q: [n, Hq, D] -> [H, G * n, D], rows (g, t), channels in key order, scaled."""
        n, hq, d = q.shape
        h = self.spec.num_kv_heads
        qg = q.view(n, h, hq // h, d).permute(1, 2, 0, 3).reshape(h, -1, d)
        qg = torch.gather(qg, 2, self._k_order[layer][:, None, :].expand_as(qg))
        return qg * self.scale

    def _call_kernel(self, layer, recs, q, seq, dk, dv, ck, cv, out_raw):
        """The C kernel on one sequence; with `out_raw` it writes the final output there,
        otherwise it returns (out [H, G*n, D] in stored value order, lse [H, G*n])."""
        r = self.rec
        n, hq, d = q.shape
        h = self.spec.num_kv_heads
        out = lse = None
        if out_raw is None:
            out = torch.empty(h, hq // h * n, d)
            lse = torch.empty(h, hq // h * n)
        self._kernel.hybrid_attend(
            recs.data_ptr(), seq.ids.data_ptr(), seq.nb, seq.mask0, r.nbytes,
            self._offsets.data_ptr(), h, hq // h, n, q.data_ptr(),
            self._k_order[layer].data_ptr(), self._v_order[layer].data_ptr(), self.scale,
            dk.data_ptr(), dv.data_ptr(), dk.shape[1], dk.stride(0) // d, kernels.ptr(ck),
            kernels.ptr(cv), h * d, 0 if ck is None else n, kernels.ptr(out_raw),
            kernels.ptr(out), kernels.ptr(lse),
        )  # fmt: skip
        return out, lse

    def _attend_torch(self, recs, qg, ids, dk, dv, mask0, chunk: int = 32):
        """Stored part by PyTorch: `chunk` packed blocks dequantized at a time (never the whole
        cache), each attended with its log-sum-exp, then the dense tokens."""
        parts = []
        for c in range(0, len(ids), chunk):
            k, v = self._records(recs, ids[c : c + chunk])  # [B, H, T, D]
            bsz, h, t, d = k.shape
            k = k.transpose(0, 1).reshape(h, bsz * t, d)
            v = k if self.spec.latent else v.transpose(0, 1).reshape(h, bsz * t, d)
            parts.append(_attend_full(qg, k, v, mask0 if c == 0 else 0))
        if dk.shape[1]:
            parts.append(_attend_full(qg, dk.float(), dv.float(), 0))
        if not parts:
            h, rows, d = qg.shape
            return qg.new_zeros(h, rows, d), qg.new_full((h, rows), float("-inf"))
        return merge_partials(parts)

    def read(self, layer: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return self._reconstruct(layer)

    def _reconstruct(self, layer: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
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
            k, v = self._records(recs, ids)  # [B, H, T, D]
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

    def end_step(self) -> None:
        for layer in list(self._pending):
            self._flush(layer)
        super().end_step()

    def abort_step(self) -> None:
        self._pending.clear()
        super().abort_step()

    # ---- hooks of the tiered placement and the pruned selection ------------------------------

    def _arena_layers(self, arena: torch.Tensor) -> list[torch.Tensor]:
        return list(arena)  # per layer [NB, H, REC]

    def _pool_blocks(self, past: int, new: int) -> int:
        return past // self.T  # the packed blocks; newer tokens are in the side buffer

    def _in_place(self, tier: str) -> bool:
        # Host records are attended in place when the compute device reads host memory.
        return tier == "device" or (tier == "host" and not self.stage_host)

    @staticmethod
    def _stage(data: dict[str, torch.Tensor]) -> torch.Tensor:
        return data["kv"]  # [nb, H, REC]: attended as gathered records

    def _seq_tokens(self, seq_id: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All stored tokens of `seq_id` between steps, K and V [H, n, D], stored order."""
        n = self.pool.num_tokens(seq_id)
        ids = _ids(self.pool.table(seq_id).block_ids()[: n // self.T], self._arena)
        return self._stored(layer, self._arena[layer], ids, self._dense[seq_id], n)

    def _token_kv(self, seq_id: int, lo: int, hi: int) -> torch.Tensor:
        kv = []
        for layer in range(self.spec.num_layers):
            k, v = self._model_order(layer, *self._seq_tokens(seq_id, layer))
            kv.append(torch.stack([k[:, lo:hi], v[:, lo:hi]]))
        return torch.stack(kv)  # [L, 2, H, T, D]

    def _compact(self, seq_id: int, lo: int, n: int, rel: torch.Tensor) -> None:
        """Kept tokens move down, re-packed: blocks from the first one that changes in any
        (layer, head) are dequantized, gathered and quantized again (earlier blocks keep their
        bytes); what no longer fills a block goes to the fp16 side buffer."""
        T, m = self.T, lo + rel.shape[-1]
        moved = (rel != torch.arange(rel.shape[-1])).flatten(0, 1).any(0).nonzero()
        first = lo + (int(moved[0]) if len(moved) else rel.shape[-1])  # first changed token
        f, nb = first // T, m // T  # blocks [f, nb) are written again
        ids = _ids(self.pool.table(seq_id).block_ids()[f:nb], self._arena)
        dense = self._dense[seq_id]
        for layer in range(self.spec.num_layers):
            k, v = self._seq_tokens(seq_id, layer)  # [H, n, D]
            idx = rel[layer][..., None].expand(-1, -1, k.shape[-1])
            k = torch.cat([k[:, :lo], k[:, lo:].gather(1, idx)], 1)  # [H, m, D]
            v = k if self.spec.latent else torch.cat([v[:, :lo], v[:, lo:].gather(1, idx)], 1)
            if nb > f:
                h, d = k.shape[0], k.shape[-1]
                kb = k[:, f * T : nb * T].reshape(h, nb - f, T, d).transpose(0, 1)
                vb = v[:, f * T : nb * T].reshape(h, nb - f, T, d).transpose(0, 1)
                # Values already quantized once: `again` keeps unchanged groups as they were.
                recs = self._quantize(kb, vb, self.S if f == 0 else 0, again=True)
                self._arena[layer].index_copy_(0, ids, recs)
            tail = m - nb * T
            for part, x in zip(dense[layer], (k, v), strict=False):  # a latent cache: keys only
                part[:, self.S : self.S + tail] = x[:, nb * T : m]

    # ---- sequences and accounting ------------------------------------------------------------

    def free(self, seq_id: int) -> None:
        self._dense.pop(seq_id, None)
        super().free(seq_id)

    def _published(self, seq_id: int, token_ids: list[int]) -> None:
        if self.S and seq_id in self._dense and len(token_ids) >= self.T:
            # Sequences that attach these blocks need the fp16 sinks that block 0 leaves out.
            sinks = self._dense[seq_id][:, :, :, : self.S].clone()
            self._remember_sinks(tuple(token_ids[: self.S]), sinks)

    def _can_attach(self, token_ids: list[int]) -> bool:
        # Without the sinks' fp16 KV the shared blocks cannot be attended.
        return not self.S or tuple(token_ids[: self.S]) in self._sink_cache

    def _sink_shape(self) -> tuple[int, ...]:
        s = self.spec
        return (s.num_layers, s.stored_parts, s.num_kv_heads, self.S, s.head_dim)

    def _prefix_state(self, token_ids: list[int]) -> bytes | None:
        # The sinks' fp16 K/V [L, P, H, S, D], raw bytes: what block 0 leaves out.
        sinks = self._sink_cache.get(tuple(token_ids[: self.S])) if self.S else None
        if sinks is None:
            return None
        return sinks.cpu().contiguous().view(torch.uint8).numpy().tobytes()

    def _load_prefix_state(self, token_ids: list[int], data: bytes) -> bool:
        shape = self._sink_shape()
        if not self.S or len(data) != 2 * math.prod(shape):
            return False  # another shape's bytes (the hash names the layout: not expected)
        sinks = torch.frombuffer(bytearray(data), dtype=torch.float16).view(shape)
        self._remember_sinks(tuple(token_ids[: self.S]), sinks.to(self._arena.device))
        return True

    def _remember_sinks(self, key: tuple[int, ...], sinks: torch.Tensor) -> None:
        self._sink_cache.pop(key, None)
        self._sink_cache[key] = sinks
        while len(self._sink_cache) > 64:
            self._sink_cache.pop(next(iter(self._sink_cache)))

    def _attached(self, seq_id: int, token_ids: list[int]) -> None:
        if self.S:
            self._dense_buf(seq_id)[:, :, :, : self.S] = self._sink_cache[
                tuple(token_ids[: self.S])
            ]

    def _dense_tokens(self, seq_id: int) -> int:
        n = self.pool.num_tokens(seq_id)
        nb = n // self.T
        return (min(self.S, n) if nb else 0) + n - nb * self.T

    def bytes_used(self) -> int:
        s = self.spec
        per_dense_token = s.elements_per_token * 2  # fp16 (keys only when latent)
        packed, dense = set(), 0
        for sid in self._dense:
            table = self.pool.table(sid)
            if table is None:
                continue
            n = table.num_tokens
            packed.update((r.tier, r.block_id) for r in table.refs[: n // self.T])
            dense += self._dense_tokens(sid) * per_dense_token
        return len(packed) * self.pool.layout.page_bytes + dense

    def bytes_reserved(self) -> int:
        side = sum(buf.numel() * buf.element_size() for buf in self._dense.values())
        return super().bytes_reserved() + side

    def stats(self) -> dict:
        out = super().stats()
        r = self.rec
        out["channels"] = {
            kind: {"fp16": c[0], f"int{r.bits}": c[1], f"int{r.low_bits}": c[2]}
            for kind, c in (("keys", r.k), ("values", r.v))
        }
        if self.spec.latent:
            out["channels"]["values"] = f"the keys' first {self.spec.v_dim} channels"
        out["kernel"] = "c" if self._kernel is not None else f"torch ({kernels.KERNEL_ERROR})"
        out["kernels"] = self.operators.report()
        return out


def _ids(ids, like: torch.Tensor) -> torch.Tensor:
    """Block ids as an int64 tensor on `like`'s device."""
    return torch.tensor(list(ids), dtype=torch.int64, device=like.device)


def _classes(counts: tuple[int, int, int]) -> list[tuple[int, int]]:
    """Channel ranges [lo, hi) of the main and the low class after the fp16 channels."""
    nf, nm, nl = counts
    return [(nf, nf + nm), (nf + nm, nf + nm + nl)]


def _bytes1(x: torch.Tensor) -> torch.Tensor:
    """A header tensor [..., n, 1] (fp16, fp8 or int8) as raw bytes [..., n, itemsize]."""
    return x.contiguous().view(torch.uint8)


def _bytes(x: torch.Tensor, bsz: int, h: int) -> torch.Tensor:
    """A field as raw bytes [B, H, nbytes]."""
    if x.numel() == 0:
        return torch.zeros(bsz, h, 0, dtype=torch.uint8, device=x.device)
    x = x.contiguous()
    if x.dtype != torch.uint8:
        x = x.view(torch.uint8)
    return x.reshape(bsz, h, -1)


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


def _c_available(device: torch.device, strategy: Any) -> str | None:
    if device.type != "cpu":
        return "the C kernel is for CPU tiers"
    if strategy is None or strategy._kernel is None:
        return kernels.KERNEL_ERROR or "not built for this record shape"
    return None


# The C kernel first where its library is built for the strategy's record shape; PyTorch (the
# reference) everywhere. A breaker switches to PyTorch when the kernel raises or runs slow.
register_op(
    FnImplementation(
        "attention.hybrid",
        "c",
        lambda st, *a: st._attend_seq(*a, kernel=True),
        ("cpu",),
        _c_available,
    ),
    preference=10,
)
register_op(FnImplementation(
    "attention.hybrid", "torch", lambda st, *a: st._attend_seq(*a, kernel=False),
    ("*",),
), preference=90, reference=True)  # fmt: skip

"""Dynamic sparse attention: every token keeps its KV; each step reads only the blocks its
queries need (the `sparse` selection, issue 35).

Quest's rule (Tang et al., ICML 2024), for any model, without training: per block, layer and
KV head the selection keeps the per-channel minimum and maximum of its keys. For a query q the
largest q.k any key of the block can give is sum_d max(q_d min_d, q_d max_d) = q.c + |q|.r,
with c the channels' centre and r their half-range. A block is scored q.c + w |q|.r with
`range_weight` w: 1 is Quest's bound; the default 0.25 lost less PPL than the bound on every
development text (the bound over-rates blocks whose channels range widely). Per step, layer
and KV head, the group's query heads (and, for a chunk of several tokens, all its queries)
choose together: a block takes its largest score over them. The choice is the registry op
`sparse.choose` (the C kernel `unikv/kernels/sparse.c`, else `choose_torch`): one call per sequence
and layer.

What a step reads, per sequence, layer and KV head: the sink blocks (the first `sink_tokens`),
the recent window (the last `recent_window` stored tokens, from a block boundary, and the
step's own tokens), and the best-scoring blocks between them up to the budget (`budget_tokens`
stored tokens, or `budget_share` of them). Attention over exactly those tokens is the format's
(`Format.attend_tokens`: a dense format gathers them from the arena, others from what they
read). A sequence whose stored tokens fit the budget reads them all, and so does a prompt's prefill:
a step of more than `prefill_tokens` new tokens for a sequence, or a prompt chunk that more of
the prompt follows. Every other step selects: decode, and the short chunks `unikv eval ppl`
scores (a chunk's queries choose together, as a small decode batch does).

The summaries are kept here per sequence, on the device: each block's per-channel key minimum
and maximum (float32, [layers, KV heads, blocks, head dim] each) and, what choosing reads every
step, its centre and half-range in float16 (half the bytes; the half-range rounded up, so
Quest's bound stays a bound for keys within float16's range). They are computed after each
step from the step's keys as they were appended (for a packed format: before packing), and,
for blocks a sequence did not write (a shared or persisted prefix), once from the format's
stored keys. They follow the sequence, not its
blocks, so moves between tiers and swapping leave them valid.

Every format reads only the chosen blocks: the dense format gathers them from the arenas, the
packed ones (hybrid, int8) gather their records for the same attention kernel. Tiered, the
device and host blocks are read in place; of the SSD tier's (and any other staged tier's) the
placement stages ahead, per layer, only the blocks the sequence's last step read (`likely`:
selections are stable from step to step) and reads a block chosen anew when it is chosen.
DeepSeek's latent cache is scored the same way (its keys are the latent and rope parts the
absorbed queries dot with, so the bound holds). Measured by `benchmarks/sparse.py`
(BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from unikv.kernels import sparse as kernels
from unikv.kernels.operators import FnImplementation, OperatorSet
from unikv.kernels.operators import register as register_op

from .axes import SELECTIONS, Selection, Step
from .kv import StepBatch
from .options import Option


@dataclass(frozen=True, slots=True)
class _Plan:
    """What one sequence reads at one step: the sink blocks [0, lo), `room` of the candidates
    [lo, hi) (the blocks its queries choose), and the window [hi, end) to its last block."""

    lo: int
    hi: int
    room: int
    end: int
    stored_blocks: int
    read_blocks: int


@SELECTIONS.register
class SparseSelection(Selection):
    """Every token keeps its KV; each step reads the sinks, the recent window and the blocks
    whose key bounds score highest for its queries, up to a budget."""

    name = "sparse"
    help = "keep all KV; each step reads the blocks its queries need (Quest), up to a budget"
    options = (
        Option("budget_share", float, 0.125, "share of a sequence's stored tokens a step reads "
               "(sinks and recent window included)", low=0, low_open=True, high=1),
        Option("budget_tokens", int, None, "stored tokens a step reads (sinks and window "
               "included)", low=1, none="budget_share of the stored tokens"),
        Option("sink_tokens", int, 16, "first tokens always read (whole blocks)", low=0),
        Option("recent_window", int, 16, "newest stored tokens always read", low=0),
        Option("dense_layers", int, 2, "first layers that read everything (their attention is "
               "the least sparse; Quest: 2)", low=0),
        Option("range_weight", float, 0.25, "weight of a block's key range in its score: 1 is "
               "Quest's upper bound of q.k, 0 the block's centre alone", low=0, high=1),
        Option("prefill_tokens", int, 64, "a step of more new tokens than this for a sequence, "
               "or a prompt chunk that more of the prompt follows, reads everything (prefill)",
               low=0),
    )  # fmt: skip
    contract_options = {"budget_tokens": 20, "sink_tokens": 1, "recent_window": 1,
                        "dense_layers": 0}  # fmt: skip

    def __init__(self, pool, spec, opts: dict[str, Any], fmt, label: str) -> None:
        super().__init__(pool, spec, opts, fmt, label)
        self.bs = pool.block_size
        self._mins: dict[int, torch.Tensor] = {}  # seq -> [L, Hkv, blocks, D] float32
        self._maxs: dict[int, torch.Tensor] = {}
        # seq -> [L, Hkv, blocks, 2D]: the channels' centre, then their half-range (scoring
        # is then one matmul of [q, |q|] with it)
        self._bounds: dict[int, torch.Tensor] = {}
        self._known: dict[int, int] = {}  # seq -> tokens summarized
        self._keys: list[torch.Tensor | None] = [None] * spec.num_layers  # the step's keys
        self._unseen: dict[int, int] = {}  # batch index -> first stored token not summarized
        self._step: Step | None = None
        self._plans: list[_Plan | None] = []  # per batch sequence, this step
        self._last: dict[int, torch.Tensor] = {}  # seq -> blocks chosen at the middle layer
        # seq -> per layer the blocks its last step read ([Hkv, B]; None: all): `likely`
        self._recent: dict[int, list[torch.Tensor | None]] = {}
        self.last_read: list[list[torch.Tensor | None]] = []  # per layer, per batch sequence
        self.operators = OperatorSet(pool.device)  # `sparse.choose`: the C kernel, else torch
        self.counts = {"steps": 0, "sparse_reads": 0, "blocks_read": 0, "blocks_stored": 0,
                       "repeat_blocks": 0, "chosen_blocks": 0}  # fmt: skip

    # ---- the step --------------------------------------------------------------------------

    def prepare(self, step: Step) -> None:
        self._step = step
        self.last_read = [[] for _ in range(self.spec.num_layers)]
        self._plans = [self._plan(step, i) for i in range(len(step.batch.seq_ids))]
        # Stored tokens this selection did not see written (an attached prefix): summarized
        # from the format's keys, layer by layer, as the step reads them.
        self._unseen = {
            i: self._known.get(sid, 0)
            for i, (sid, past) in enumerate(zip(step.batch.seq_ids, step.past, strict=True))
            if self._known.get(sid, 0) < past
        }

    def appended(self, layer: int, k: torch.Tensor) -> None:
        self._keys[layer] = k  # summarized once the step commits (`after_step`)

    def reads(self, layer: int, q: torch.Tensor) -> list[torch.Tensor | None] | None:
        """Per batch sequence, the blocks each KV head reads this step, [Hkv, B] (the
        sequence's last block, with the step's own tokens, last); None: it reads everything."""
        step = self._step
        if self._unseen:
            self._summarize_stored(layer)
        if layer < self.opts["dense_layers"]:
            return None
        out: list[torch.Tensor | None] = []
        for i, plan in enumerate(self._plans):
            sid = step.batch.seq_ids[i]
            if plan is None:
                self._recent.pop(sid, None)
                out.append(None)
                continue
            read = self.operators["sparse.choose"](
                q[step.batch.rows(i)].float(), self._bounds[sid][layer], plan.lo, plan.hi,
                plan.room, plan.end, self.opts["range_weight"],
            )  # fmt: skip
            self._count(sid, layer, read[:, plan.lo : plan.lo + plan.room], plan)
            out.append(read)
            self._recent.setdefault(sid, [None] * self.spec.num_layers)[layer] = out[-1]
        self.last_read[layer] = out
        return out if any(x is not None for x in out) else None

    def after_step(self, step: Step) -> None:
        keys = self._keys
        self._keys = [None] * self.spec.num_layers
        for i in self._unseen:  # every layer summarized its stored tokens in `reads`
            self._known[step.batch.seq_ids[i]] = step.past[i]
        self._unseen = {}
        if any(k is None for k in keys):
            return
        k = torch.stack(keys).float()  # [L, N, Hkv, D]
        for i, (sid, past) in enumerate(zip(step.batch.seq_ids, step.past, strict=True)):
            if self._known.get(sid, 0) != past:  # not summarized up to here: from storage
                continue
            self._add(sid, k[:, step.batch.rows(i)], past)
        self.counts["steps"] += 1

    def likely(self, seq_id: int) -> list[set[int] | None] | None:
        """What the sequence's last step read, per layer: selections are stable from step to
        step (`selection_stability`), so a placement stages these ahead."""
        recent = self._recent.get(seq_id)
        if recent is None:
            return None
        return [None if r is None else set(r.unique().tolist()) for r in recent]

    def forget(self, seq_id: int) -> None:
        for d in (self._mins, self._maxs, self._bounds, self._known, self._last, self._recent):
            d.pop(seq_id, None)

    def before_step(self, batch: StepBatch) -> None:
        self._keys = [None] * self.spec.num_layers

    def stats(self) -> dict:
        c = self.counts
        return {
            "budget": self.opts["budget_tokens"] or f"{self.opts['budget_share']:.3g} of stored",
            # blocks read per (layer, KV head, sequence) step where it selected, against stored
            "blocks_read_share": c["blocks_read"] / c["blocks_stored"]
            if c["blocks_stored"]
            else 1.0,
            "sparse_reads": c["sparse_reads"],
            # of the blocks chosen at a step, the share chosen at the step before too
            "selection_stability": c["repeat_blocks"] / c["chosen_blocks"]
            if c["chosen_blocks"] else None,
            "summary_bytes": sum(m.nbytes * 2 + self._bounds[sid].nbytes
                                 for sid, m in self._mins.items()),
            "kernels": self.operators.report(),
        }  # fmt: skip

    # ---- choosing ----------------------------------------------------------------------------

    def _budget(self, stored: int) -> int:
        fixed = self.opts["budget_tokens"]
        return fixed if fixed is not None else int(self.opts["budget_share"] * stored)

    def _plan(self, step: Step, i: int) -> _Plan | None:
        """What batch sequence `i` reads this step, but for the blocks its queries choose;
        None when it reads everything (a prefill, or all it stores fits the budget)."""
        past, n = step.past[i], step.batch.query_lens[i]
        if step.batch.more_prompt[i] or n > self.opts["prefill_tokens"]:
            return None  # a prompt's prefill reads everything
        bs = self.bs
        sinks = -(-self.opts["sink_tokens"] // bs)  # blocks
        window = max(0, past - self.opts["recent_window"]) // bs  # first block of the window
        room = (self._budget(past) - sinks * bs - (past - window * bs)) // bs
        lo, hi = min(sinks, window), window  # the candidate blocks [lo, hi)
        if room >= hi - lo or hi <= lo:
            return None  # everything fits the budget
        room = max(room, 0)
        return _Plan(
            lo, hi, room, end=-(-(past + n) // bs),
            stored_blocks=-(-past // bs),
            read_blocks=lo + room + (-(-past // bs) - window),
        )  # fmt: skip

    def _count(self, sid: int, layer: int, chosen: torch.Tensor, plan: _Plan) -> None:
        """Blocks read against blocks stored, and how many of the chosen blocks the step
        before chose too (how stable selections are: what a prefetch can count on)."""
        c = self.counts
        c["sparse_reads"] += 1
        c["blocks_read"] += plan.read_blocks
        c["blocks_stored"] += plan.stored_blocks
        if layer != self.spec.num_layers // 2:  # stability is sampled at the middle layer
            return
        prev = self._last.get(sid)
        if prev is not None and prev.shape == chosen.shape:
            same = (chosen.unsqueeze(-1) == prev.unsqueeze(-2)).any(-1)  # per KV head (any order)
            c["repeat_blocks"] += int(same.sum()) // chosen.shape[0]
            c["chosen_blocks"] += chosen.shape[1]
        self._last[sid] = chosen

    # ---- summaries ---------------------------------------------------------------------------

    def _grow(self, sid: int, blocks: int, device: torch.device) -> None:
        have = self._mins.get(sid)
        if have is not None and have.shape[2] >= blocks:
            return
        cap = max(blocks, 2 * (have.shape[2] if have is not None else 4))
        shape = (self.spec.num_layers, self.spec.num_kv_heads, cap, self.spec.head_dim)
        mins = torch.full(shape, float("inf"), device=device)
        maxs = torch.full(shape, float("-inf"), device=device)
        bounds = torch.zeros(*shape[:3], 2 * shape[3], dtype=torch.float16, device=device)
        if have is not None:
            n = have.shape[2]
            mins[:, :, :n], maxs[:, :, :n] = have, self._maxs[sid]
            bounds[:, :, :n] = self._bounds[sid]
        self._mins[sid], self._maxs[sid], self._bounds[sid] = mins, maxs, bounds

    def _add(self, sid: int, k: torch.Tensor, start: int, layer: int | None = None) -> None:
        """Keys `k` [L, n, Hkv, D] of tokens [start, start + n) into the block summaries (of
        every layer, or of `layer` alone with k [1, n, Hkv, D])."""
        n = k.shape[1]
        if not n:
            return
        bs = self.bs
        self._grow(sid, -(-(start + n) // bs), k.device)
        mins, maxs, bounds = self._mins[sid], self._maxs[sid], self._bounds[sid]
        if layer is not None:
            mins, maxs = mins[layer : layer + 1], maxs[layer : layer + 1]
            bounds = bounds[layer : layer + 1]
        first, last = start // bs, (start + n - 1) // bs
        if first == last:  # one block (every decode step): one reduction
            mins[:, :, first] = torch.minimum(mins[:, :, first], k.amin(1))
            maxs[:, :, first] = torch.maximum(maxs[:, :, first], k.amax(1))
        else:
            idx = (torch.arange(start, start + n, device=k.device) // bs).view(1, 1, n, 1)
            idx = idx.expand(k.shape[0], k.shape[2], n, k.shape[3])
            kt = k.transpose(1, 2)  # [L, Hkv, n, D]
            mins.scatter_reduce_(2, idx, kt, "amin")
            maxs.scatter_reduce_(2, idx, kt, "amax")
        lo, hi, d = first, last + 1, mins.shape[-1]
        _store_bounds(bounds[:, :, lo:hi], mins[:, :, lo:hi], maxs[:, :, lo:hi], d)
        if layer is None:
            self._known[sid] = start + n

    def _summarize_stored(self, layer: int) -> None:
        """Summaries of `layer`'s stored tokens this selection did not see written (an
        attached prefix), from the keys the format reads (wherever the blocks live)."""
        step = self._step
        ks, _ = self.format.read(layer)
        for i, have in self._unseen.items():
            sid, past = step.batch.seq_ids[i], step.past[i]
            k = ks[i][:, have:past].float().transpose(0, 1).unsqueeze(0)  # [1, T, Hkv, D]
            self._add(sid, k, have, layer)


_HALF_MAX = 65504.0


def _store_bounds(out: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor, d: int) -> None:
    """Write blocks' centre and half-range (float32 `mins`, `maxs`) into the float16 summaries
    `out` [..., 2d]: half the bytes for `sparse.choose` to read every step. The half-range is
    widened by what rounding took from the centre and rounded up, so that q . c + |q| . r stays
    an upper bound of q . k over the block (range_weight = 1)."""
    c = (maxs + mins).mul_(0.5).clamp_(-_HALF_MAX, _HALF_MAX)
    half_c = c.to(torch.float16)
    r = (maxs - mins).mul_(0.5).add_((c - half_c.float()).abs_())
    # rounding to nearest takes off at most 2^-11 of a normal float16 and 2^-25 of a subnormal
    r.mul_(1 + 2**-10).add_(2**-24).clamp_(max=_HALF_MAX)
    out[..., :d] = half_c
    out[..., d:] = r


# ---- the choice as a registry op: the C kernel (`unikv/kernels/sparse.c`), else PyTorch ----


def choose_torch(
    q: torch.Tensor, bounds: torch.Tensor, lo: int, hi: int, room: int, end: int, alpha: float
) -> torch.Tensor:
    """Per KV head the blocks a step reads, [Hkv, lo + room + (end - hi)]: the sinks [0, lo),
    the `room` candidates of [lo, hi) with the largest score for any of the group's queries
    (q [rows, Hq, D]; bounds [Hkv, blocks, 2D] float16: centre, half-range), in ascending
    order, then the window [hi, end). The score: q . centre + alpha |q| . half-range (alpha =
    1: Quest's upper bound of q . k over the block). The reference `unikv/kernels/sparse.c`
    must agree with."""
    h = bounds.shape[0]
    t, hq, d = q.shape
    qg = q.float().view(t, h, hq // h, d).permute(1, 0, 2, 3).reshape(h, -1, d)
    qq = torch.cat([qg, qg.abs().mul_(alpha)], dim=-1)  # [Hkv, rows x group, 2D]
    score = (qq @ bounds[:, lo:hi].float().transpose(1, 2)).amax(1)
    chosen = score.topk(room, dim=-1, sorted=False).indices.sort(dim=-1).values.add_(lo)
    dev = bounds.device
    return torch.cat([torch.arange(lo, device=dev).expand(h, -1), chosen,
                      torch.arange(hi, end, device=dev).expand(h, -1)], dim=1)  # fmt: skip


register_op(FnImplementation(
    "sparse.choose", "c", kernels.choose_blocks, ("cpu",),
    lambda device, owner: kernels.unavailable(),
), preference=10)  # fmt: skip
register_op(
    FnImplementation("sparse.choose", "torch", choose_torch, ("*",)), preference=90, reference=True
)

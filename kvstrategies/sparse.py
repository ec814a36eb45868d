"""Dynamic sparse attention: every token keeps its KV; each step reads only the blocks its
queries need (the `sparse` selection, issue 35).

By default (`summary = "keys"`, `block_score = "lse"`) a step scores every stored token:
its key in 4 bits, per group of `key_group` tokens and channel a float16 minimum and step
(KIVI's per-channel quantization of keys), so a query's q.k is estimated per token
(`key_scores`) as q.m + (q.s).code, an integer dot once q.s is rounded to int8 for the group.
Per step, layer and KV head, the group's query heads (and, for a chunk of several tokens, all
its queries) choose together: a token takes its largest score over them, and a block its
tokens' log-sum-exp at the attention's scale (ranked by the sum of e^(scale (x - best)), about
the softmax mass the block takes, so that many strong tokens outweigh one). It chooses about
as well as the true attention does (on the shortest development text at 1/8: +0.89% against
the oracle's +0.90%, BENCHMARKS.md) and is the one setting that meets both PPL goals on every
development text, so it is the default. 34 bytes a token and KV head at head dim 64; the
query is rounded again for every group (128 tokens by default; groups of 16 gave no better
PPL and took 1.6 times as long to choose). The open group is quantized again as it fills, up
to its last tile (`sparse.quantize_keys`: the C kernel, else PyTorch, the same bytes); while a
sequence's steps choose nothing (all it stores fits the budget) its new keys are only kept,
and quantized when a choice (or `summaries`) first reads the group: the same bytes.

`summary = "centres"` is Quest's rule (Tang et al., ICML 2024) made finer: each block's keys
summarized in runs of `summary_tokens` tokens (2 by default: 8 summaries to a 16-token
block). A summary is its keys' per-channel centre c (the midpoint of their minimum and
maximum) and, when `range_weight` w > 0, their half-range r. For a query q the largest q.k
any of its keys can give is at most q.c + |q|.r; a summary is scored q.c + w |q|.r (w = 1:
Quest's bound) and a block by its best summary (`block_score = "max"`) or their log-sum-exp.
At the same bytes, finer summaries of the centre alone estimate a block's attention better
than coarser ones with their range; 2-token centres ranked by their largest were the default
until they were found to miss the 1/8 PPL goal on the shortest development text (+1.9%,
BENCHMARKS.md): the faster choice, kept as an option. The choice is the registry op
`sparse.choose` (the C kernel `unikv/kernels/sparse.c`, else `choose_torch`): one call per
sequence and layer.

What a step reads, per sequence, layer and KV head: the sink blocks (the first `sink_tokens`),
the recent window (the last `recent_window` stored tokens, from a block boundary, and the
step's own tokens), and the best-scoring blocks between them up to the budget (`budget_tokens`
stored tokens, or `budget_share` of them but never fewer than `budget_floor`: DeepSeek's
indexer reads a fixed 2,048 tokens, Quest's budgets are token counts too, and a shorter
sequence's attention costs little beside the weights). Attention over exactly those tokens is
the format's
(`Format.attend_tokens`: a dense format gathers them from the arena, others from what they
read). A sequence whose stored tokens fit the budget reads them all, and so does a prompt's prefill:
a step of more than `prefill_tokens` new tokens for a sequence, or a prompt chunk that more of
the prompt follows. Every other step selects: decode, and the short chunks `unikv eval ppl`
scores (a chunk's queries choose together, as a small decode batch does).

The summaries are kept here per sequence, on the device: the keys' codes, minima and steps
(above), or the centres as int8 codes with one
float32 scale per summary ([layers, KV heads, summaries, head dim] centres, then as many half-ranges
when w > 0, in the kernel's tiles of 16 summaries; the half-range widened by the centre's
rounding and rounded up, so Quest's bound stays a bound), with the float32 minimum and
maximum of the one summary still filling. Scoring quantizes the queries to int8 too: an
integer dot per summary. They are computed after each step from the step's keys as they
were appended (for a packed format: before packing), and, for blocks a sequence did not
write (a shared or persisted prefix), once from the format's stored keys. They follow the
sequence, not its blocks, so moves between tiers and swapping leave them valid.

Every format reads only the chosen blocks: the dense format gathers them from the arenas, the
packed ones (hybrid, int8) gather their records for the same attention kernel (in the one-call
decode step, `native_choice`, both read them in place). Tiered, the
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
from .kv import NativeChoice, StepBatch
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

    @property
    def width(self) -> int:
        """Blocks a KV head reads: the sinks, the chosen and the window."""
        return self.lo + self.room + self.end - self.hi


KEY_GROUP = 128  # summary = keys: tokens per minimum and step, by default
SUMMARY_TOKENS = 2  # summary = centres: tokens per centre, by default


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
        Option("budget_floor", int, 1024, "fewest stored tokens a step reads under "
               "budget_share: a shorter sequence reads them all (its attention costs little "
               "beside the weights, and choosing would only lose quality)", low=0),
        Option("sink_tokens", int, 16, "first tokens always read (whole blocks)", low=0),
        Option("recent_window", int, 16, "newest stored tokens always read", low=0),
        Option("dense_layers", int, 2, "first layers that read everything (their attention is "
               "the least sparse; Quest: 2)", low=0),
        Option("summary_tokens", int, SUMMARY_TOKENS, "summary = centres: tokens per centre (a "
               "block's score comes from its summaries', see block_score; fewer tokens: a finer "
               "estimate, more bytes to read)", low=1),
        Option("range_weight", float, 0.0, "summary = centres: weight of a centre's key range "
               "in its score: 1 is Quest's upper bound of q.k, 0 the centre alone (only the "
               "centre is kept)",
               low=0, high=1),
        Option("summary", str, "keys", "what a step scores the blocks from: centres, the "
               "per-channel centres of runs of summary_tokens keys (int8); keys, every token's "
               "key in 4 bits (per channel a minimum and a step for each key_group tokens), "
               "scored token by token: nearer the true attention, 34 bytes a token and KV "
               "head at head dim 64, as many as centres of 2 tokens, and more work to choose",
               choices=("centres", "keys")),
        Option("key_group", int, KEY_GROUP, "summary = keys: tokens that share a channel's minimum "
               "and step (fewer: a finer step, and the query rounded again for every group)",
               choices=(16, 32, 64, 128)),
        Option("block_score", str, "lse", "a block's score from its summaries' (each the "
               "largest over the queries): max, their largest (Quest); lse, their log-sum-exp "
               "at the attention's scale (about the softmax mass the block takes: many strong "
               "tokens outweigh one)", choices=("max", "lse")),
        Option("prefill_tokens", int, 64, "a step of more new tokens than this for a sequence, "
               "or a prompt chunk that more of the prompt follows, reads everything (prefill)",
               low=0),
    )  # fmt: skip
    contract_options = {"budget_tokens": 20, "sink_tokens": 1, "recent_window": 1,
                        "dense_layers": 0}  # fmt: skip

    def __init__(self, pool, spec, opts: dict[str, Any], fmt, label: str) -> None:
        super().__init__(pool, spec, opts, fmt, label)
        self.bs = pool.block_size
        if spec.head_dim % 4:  # the choice kernel's tiles hold 4 channels at a time
            raise ValueError(f"the sparse selection needs a head dim divisible by 4, not "
                             f"{spec.head_dim}")  # fmt: skip
        # Each block's tokens are summarized in runs of `summary_tokens` (`parts` per block,
        # the last one shorter where they do not divide the block); as keys, one per token
        self.keys = self.opts["summary"] == "keys"
        if self.keys and (spec.head_dim % 8 or spec.head_dim > 1024):
            raise ValueError(f"summary = keys needs a head dim divisible by 8, at most 1024, "
                             f"not {spec.head_dim}")  # fmt: skip
        if self.keys and self.opts["range_weight"] > 0:
            raise ValueError(f"range_weight = {self.opts['range_weight']} weighs the centres' "
                             f"ranges: it needs summary = centres (the default, keys, has no "
                             f"ranges)")  # fmt: skip
        if self.keys and self.opts["summary_tokens"] != SUMMARY_TOKENS:
            raise ValueError(f"summary_tokens = {self.opts['summary_tokens']} sizes the "
                             f"centres' runs: it needs summary = centres (keys score every "
                             f"token)")  # fmt: skip
        if not self.keys and self.opts["key_group"] != KEY_GROUP:
            raise ValueError(f"key_group = {self.opts['key_group']} groups 4-bit keys: it "
                             f"needs summary = keys")  # fmt: skip
        self.group = self.opts["key_group"]  # tokens per minimum and step (keys)
        self.sub = 1 if self.keys else min(self.opts["summary_tokens"], self.bs)
        self.parts = -(-self.bs // self.sub)
        # the block score's scale: 0 for the largest summary, the attention's for log-sum-exp
        self._temp = spec.scale if self.opts["block_score"] == "lse" else 0.0
        # seq -> [L, Hkv, summaries, 2D or D] int8: per summary the channels' centre, then
        # (range_weight > 0) their half-range, as codes; and [L, Hkv, summaries] float32: each
        # summary's scale (its values: codes x scale). Scoring dots [q, w |q|] with them.
        self._codes: dict[int, torch.Tensor] = {}
        self._scales: dict[int, torch.Tensor] = {}
        # seq -> both as lists of per-layer views (indexing a list costs less than a tensor,
        # and the choice runs per layer)
        self._layers: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        # seq -> the float32 minimum and maximum [2, L, Hkv, D] of the summary its newest
        # token is in (still filling: the next step's keys update it)
        self._open: dict[int, torch.Tensor] = {}
        # seq -> (summary = keys) the open group's float32 minimum and maximum [L, Hkv, 2, D]
        self._span: dict[int, torch.Tensor] = {}
        self._known: dict[int, int] = {}  # seq -> tokens summarized
        # seq (summary = keys) whose open group holds keys not yet quantized: copied into
        # `_open` alone at a step that chose nothing for it (`_settle` quantizes them before
        # any choice, or `summaries`, reads the group)
        self._stale: set[int] = set()
        self._keys: list[torch.Tensor | None] = [None] * spec.num_layers  # the step's keys
        self._unseen: dict[int, int] = {}  # batch index -> first stored token not summarized
        self._step: Step | None = None
        self._plans: list[_Plan | None] = []  # per batch sequence, this step
        self._last: dict[int, torch.Tensor] = {}  # seq -> blocks chosen at the middle layer
        # seq -> per layer the blocks its last step read ([Hkv, B]; None: all): `likely`
        self._recent: dict[int, list[torch.Tensor | None]] = {}
        self.last_read: list[list[torch.Tensor | None]] = []  # per layer, per batch sequence
        # `sparse.choose`, `.quantize_keys`, `.summarize`, `.add_keys`: the C kernels, else torch
        self.operators = OperatorSet(pool.device)
        self.counts = {"steps": 0, "sparse_reads": 0, "blocks_read": 0, "blocks_stored": 0,
                       "repeat_blocks": 0, "chosen_blocks": 0}  # fmt: skip

    # ---- the step --------------------------------------------------------------------------

    def prepare(self, step: Step) -> None:
        self._step = step
        self._native: NativeChoice | None = None  # the choice a native step was given
        self.last_read = [[] for _ in range(self.spec.num_layers)]
        self._plans = [self._plan(step, i) for i in range(len(step.batch.seq_ids))]
        for sid, plan in zip(step.batch.seq_ids, self._plans, strict=True):
            if plan is not None:  # this step's choice reads its codes
                self._settle(sid)
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

        def choose(i: int, sid: int, plan: _Plan) -> torch.Tensor:
            codes, scales = self._layers[sid]
            return self.operators["sparse.choose"](
                q[step.batch.rows(i)].float(), codes[layer], scales[layer], plan.lo, plan.hi,
                plan.room, plan.end, self.opts["range_weight"], self.parts, self._temp,
            )  # fmt: skip

        out = self._record(step, layer, choose)
        return out if any(x is not None for x in out) else None

    def _record(self, step: Step, layer: int, pick) -> list[torch.Tensor | None]:
        """Per batch sequence the blocks `layer` reads (`pick(i, sid, plan)` for one with a
        plan, None for one that reads everything), counted and kept for `likely`."""
        out: list[torch.Tensor | None] = []
        for i, plan in enumerate(self._plans):
            sid = step.batch.seq_ids[i]
            if plan is None:
                self._recent.pop(sid, None)
                out.append(None)
                continue
            read = pick(i, sid, plan)
            self._count(sid, layer, read, plan)
            out.append(read)
            self._recent.setdefault(sid, [None] * self.spec.num_layers)[layer] = read
        self.last_read[layer] = out
        return out

    def native_choice(self, step: Step) -> NativeChoice | None:
        """The step's choice for `gemv.c`'s one-call step: the same plans, summaries and C
        choice as `reads` makes layer by layer. None while stored tokens wait to be summarized
        from the format (`_unseen`: per layer, in Python) or the C choice is not serving."""
        if self._unseen or self.operators["sparse.choose"].active.name != "c":
            return None
        if all(plan is None for plan in self._plans):  # nothing to choose: every block read
            n = len(self._plans)
            self._native = NativeChoice(kernels.choose_address(), self.opts["dense_layers"], 0, 0,
                                        0.0, 0.0, [None] * n, [None] * n, [None] * n, _NO_BLOCKS,
                                        [0] * n)  # fmt: skip
            return self._native
        h, plans, codes, scales, at, row = self.spec.num_kv_heads, [], [], [], [], 0
        for i, plan in enumerate(self._plans):
            sid = step.batch.seq_ids[i]
            known = plan is not None
            plans.append((plan.lo, plan.hi, plan.room, plan.end) if known else None)
            codes.append(self._codes[sid] if known else None)
            scales.append(self._scales[sid] if known else None)
            at.append(row)
            row += h * plan.width if known else 0
        width = self._width()
        self._native = NativeChoice(
            kernels.choose_address(), self.opts["dense_layers"], self.parts, width,
            self.opts["range_weight"], self._temp, plans, codes, scales,
            torch.empty(self.spec.num_layers, max(row, 1), dtype=torch.int64), at,
        )  # fmt: skip
        return self._native

    def sequential(self, seq_id: int, past: int, steps: int) -> int:
        # Up to the first step that would choose: each before it reads every block, and its
        # keys are only kept (`_add_keys`), which a step of several rows does as its rows would.
        if self._known.get(seq_id, 0) != past or self.operators["sparse.choose"].active.name != "c":
            return 1  # stored tokens not summarized yet: `native_choice` would refuse
        n = 0
        while n < steps and self._plan_at(past + n, 1, False) is None:
            n += 1
        return max(n, 1)

    def _read_back(self, step: Step, choice: NativeChoice) -> None:
        """After a native step: what `reads` would have recorded layer by layer (counts,
        stability, `last_read`, `likely`), from the blocks the step chose."""
        h, layers, first = self.spec.num_kv_heads, self.spec.num_layers, choice.first
        if not choice.choosing:  # nobody chose: `_record`'s Nones
            for sid in step.batch.seq_ids:
                self._recent.pop(sid, None)
            for layer in range(first, layers):
                self.last_read[layer] = [None] * len(self._plans)
            return
        # per sequence with a plan, its choices at every layer from `first` on, [Hkv, width] each
        picked = [None if plan is None else choice.out[first:, at : at + h * plan.width]
                  .view(layers - first, h, plan.width).unbind(0)
                  for plan, at in zip(self._plans, choice.at, strict=True)]  # fmt: skip
        for layer in range(first, layers):
            self._record(step, layer, lambda i, sid, plan, j=layer - first: picked[i][j])

    def after_step(self, step: Step) -> None:
        keys, k = self._keys, None
        if self._native is not None and all(k is None for k in keys):  # one native call
            self._read_back(step, self._native)
            k = self.format.new_keys()  # [L, N, Hkv, D] float32
        elif all(k is not None for k in keys):
            k = torch.stack(keys).float()
        self._native = None
        self._keys = [None] * self.spec.num_layers
        for i in self._unseen:  # every layer summarized its stored tokens in `reads`
            self._known[step.batch.seq_ids[i]] = step.past[i]
        self._unseen = {}
        if k is None:
            return
        for i, (sid, past) in enumerate(zip(step.batch.seq_ids, step.past, strict=True)):
            if self._known.get(sid, 0) != past:  # not summarized up to here: from storage
                continue
            # a sequence that chose nothing this step (a short one) keeps its keys unquantized
            self._add(sid, k[:, step.batch.rows(i)], past, keep=self._plans[i] is None)
        self.counts["steps"] += 1

    def likely(self, seq_id: int) -> list[set[int] | None] | None:
        """What the sequence's last step read, per layer: selections are stable from step to
        step (`selection_stability`), so a placement stages these ahead."""
        recent = self._recent.get(seq_id)
        if recent is None:
            return None
        return [None if r is None else set(r.unique().tolist()) for r in recent]

    def forget(self, seq_id: int) -> None:
        for d in (self._open, self._span, self._codes, self._scales, self._layers, self._known,
                  self._last, self._recent):  # fmt: skip
            d.pop(seq_id, None)
        self._stale.discard(seq_id)

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
            "summary_bytes": sum(c.nbytes + self._scales[sid].nbytes + self._open[sid].nbytes
                                 + (self._span[sid].nbytes if sid in self._span else 0)
                                 for sid, c in self._codes.items()),
            "kernels": self.operators.report(),
        }  # fmt: skip

    # ---- choosing ----------------------------------------------------------------------------

    def _budget(self, stored: int) -> int:
        fixed = self.opts["budget_tokens"]
        if fixed is not None:
            return fixed
        return max(int(self.opts["budget_share"] * stored), self.opts["budget_floor"])

    def _plan(self, step: Step, i: int) -> _Plan | None:
        """What batch sequence `i` reads this step, but for the blocks its queries choose;
        None when it reads everything (a prefill, or all it stores fits the budget)."""
        return self._plan_at(step.past[i], step.batch.query_lens[i], step.batch.more_prompt[i])

    def _plan_at(self, past: int, n: int, more_prompt: bool) -> _Plan | None:
        """`_plan` of a sequence storing `past` tokens, with `n` new ones."""
        if more_prompt or n > self.opts["prefill_tokens"]:
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

    def _count(self, sid: int, layer: int, read: torch.Tensor, plan: _Plan) -> None:
        """Blocks read against blocks stored, and how many of the blocks chosen (`read`'s
        between the sinks and the window) the step before chose too (how stable selections
        are: what a prefetch can count on)."""
        c = self.counts
        c["sparse_reads"] += 1
        c["blocks_read"] += plan.read_blocks
        c["blocks_stored"] += plan.stored_blocks
        if layer != self.spec.num_layers // 2:  # stability is sampled at the middle layer
            return
        chosen = read[:, plan.lo : plan.lo + plan.room]
        prev = self._last.get(sid)
        if prev is not None and prev.shape == chosen.shape:
            same = (chosen.unsqueeze(-1) == prev.unsqueeze(-2)).any(-1)  # per KV head (any order)
            c["repeat_blocks"] += int(same.sum()) // chosen.shape[0]
            c["chosen_blocks"] += chosen.shape[1]
        self._last[sid] = chosen

    # ---- summaries ---------------------------------------------------------------------------

    def _width(self) -> int:
        """Bytes of codes per summary in the kernel's tiles: the centre (and half-range) in
        int8, or a key in 4 bits (`sparse_choose` tells the two forms apart by it)."""
        if self.keys:
            return self.spec.head_dim // 2
        return self.spec.head_dim * (2 if self.opts["range_weight"] > 0 else 1)

    def _index(self, token):
        """The summary token `token` is in (an int, or a tensor of them)."""
        return token // self.bs * self.parts + token % self.bs // self.sub

    def _grow(self, sid: int, summaries: int, device: torch.device) -> None:
        if self.keys:
            return self._grow_keys(sid, summaries, device)
        have = self._scales.get(sid)
        if have is not None and have.shape[2] >= summaries:
            return
        cap = max(summaries, 2 * (have.shape[2] if have is not None else 4 * self.parts))
        cap = -(-cap // kernels.TILE) * kernels.TILE  # whole tiles
        spec = self.spec
        width = spec.head_dim * (2 if self.opts["range_weight"] > 0 else 1)
        shape = (spec.num_layers, spec.num_kv_heads)
        codes = torch.zeros(*shape, cap // kernels.TILE, width // 4, kernels.TILE, 4,
                            dtype=torch.int8, device=device)  # fmt: skip
        scales = torch.zeros(*shape, cap, device=device)
        if have is not None:
            codes[:, :, : self._codes[sid].shape[2]] = self._codes[sid]
            scales[:, :, : have.shape[2]] = have
        else:
            self._open[sid] = torch.empty(
                2, spec.num_layers, spec.num_kv_heads, spec.head_dim, device=device
            )
        self._codes[sid], self._scales[sid] = codes, scales
        self._layers[sid] = (list(codes.unbind(0)), list(scales.unbind(0)))

    def _grow_keys(self, sid: int, tokens: int, device: torch.device) -> None:
        """Room for `tokens` keys: codes [L, Hkv, tiles, D / 8, 16, 4] uint8 (`tile_keys`),
        per group of `key_group` tokens the channels' minimum and step [L, Hkv, groups, 2, D]
        float16, and the open group's float32 keys [L, Hkv, key_group, D] (its minimum and
        step change as it fills)."""
        have = self._codes.get(sid)
        per = self.group // kernels.TILE  # tiles per group
        tiles = -(-tokens // self.group) * per
        if have is not None and have.shape[2] >= tiles:
            return
        cap = max(tiles, 2 * (have.shape[2] if have is not None else self.parts))
        cap = -(-cap // per) * per  # whole groups
        spec = self.spec
        shape, d = (spec.num_layers, spec.num_kv_heads), spec.head_dim
        codes = torch.zeros(*shape, cap, d // 8, kernels.TILE, 4, dtype=torch.uint8,
                            device=device)  # fmt: skip
        params = torch.zeros(*shape, cap // per, 2, d, dtype=torch.float16, device=device)
        if have is not None:
            codes[:, :, : have.shape[2]] = have
            params[:, :, : self._scales[sid].shape[2]] = self._scales[sid]
        else:
            self._open[sid] = torch.zeros(*shape, self.group, d, device=device)
            self._span[sid] = torch.zeros(*shape, 2, d, device=device)
        self._codes[sid], self._scales[sid] = codes, params
        self._layers[sid] = (list(codes.unbind(0)), list(params.unbind(0)))

    def _add_keys(self, sid: int, k: torch.Tensor, start: int, layer: int | None,
                  keep: bool = False) -> None:  # fmt: skip
        """`_add` for summary = keys: the groups tokens [start, start + n) fall in quantized
        again whole, as far as their last tile (the open one's earlier keys from `_open`);
        `keep` (a decode step within the open group): the keys only copied into `_open`."""
        g, n = self.group, k.shape[1]
        g0, last = start // g, start + n  # the first group written; the tokens known after
        have, end = start - g0 * g, last - g0 * g
        within = (last - 1) // g == g0  # all in the open group (a decode step): in place
        keep = keep and within and layer is None
        if not (keep and have):  # the open group changes or closes
            self._settle(sid)
        self._grow_keys(sid, last, k.device)
        codes, params, opened = self._codes[sid], self._scales[sid], self._open[sid]
        if keep:
            # Why: at a step that chooses nothing (a sequence whose stored tokens fit the
            # budget: every short one) the codes are read by no one, and keeping them up to
            # date each step read the group's keys again where a channel's range moved:
            # a quarter of a millisecond a step on 30 layers, all of it cache misses after
            # the weights stream by. The codes come out the same bytes when `_settle` makes
            # them (a group's codes are a function of its keys alone).
            opened[:, :, have:end] = k.transpose(1, 2)
            self._stale.add(sid)
            self._known[sid] = last
            return
        if layer is not None:
            codes, params, opened = (x[layer : layer + 1] for x in (codes, params, opened))
        span = self._span[sid] if layer is None else self._span[sid][layer : layer + 1]
        if within and layer is None:  # `sparse.add_keys`: copied and quantized in one call
            self.operators["sparse.add_keys"](k, opened, span, have, codes, params, g0)
            self._known[sid] = start + n
            return
        if within:
            opened[:, :, have:end] = k.transpose(1, 2)
            x = opened[:, :, :end]
        else:
            x = torch.empty(k.shape[0], k.shape[2], end, k.shape[3], device=k.device)
            x[:, :, :have] = opened[:, :, :have]
            x[:, :, have:end] = k.transpose(1, 2)
        o = last // g * g - g0 * g  # where the group still open after these tokens starts
        self._quantize(x, g0, codes, params, span, o)
        if not within:
            opened[:, :, : end - o] = x[:, :, o:end]
        if layer is None:
            self._known[sid] = start + n

    def _quantize(self, x: torch.Tensor, g0: int, codes: torch.Tensor, params: torch.Tensor,
                  span: torch.Tensor, o: int) -> None:  # fmt: skip
        """Keys x [L, Hkv, n, D] from group g0's first token on quantized whole (the C kernel's
        `sparse.quantize_keys`) into `codes` and `params`; the open group's (from token o of x
        on) minimum and maximum into `span`."""
        g, tile = self.group, kernels.TILE
        c, p = self.operators["sparse.quantize_keys"](x.flatten(0, 1), g)  # the C kernel's
        t0 = g0 * g // tile
        codes[:, :, t0 : t0 + c.shape[1]] = c.view(*x.shape[:2], *c.shape[1:])
        params[:, :, g0 : g0 + p.shape[1]] = p.view(*x.shape[:2], *p.shape[1:])
        if x.shape[2] > o:  # the open group's range, as `sparse.add_keys` keeps it
            span[:, :, 0], span[:, :, 1] = x[:, :, o:].amin(2), x[:, :, o:].amax(2)

    def _settle(self, sid: int) -> None:
        """The open group's keys kept by `keep` steps quantized (its codes, minima and steps,
        and the range `sparse.add_keys` goes on from): the bytes a step-by-step
        `sparse.add_keys` would have written. Nothing where no keys wait."""
        if sid not in self._stale:
            return
        self._stale.discard(sid)
        known, g = self._known[sid], self.group
        g0 = (known - 1) // g
        x = self._open[sid][:, :, : known - g0 * g]
        self._quantize(x, g0, self._codes[sid], self._scales[sid], self._span[sid], 0)

    def _add(self, sid: int, k: torch.Tensor, start: int, layer: int | None = None,
             keep: bool = False) -> None:  # fmt: skip
        """Keys `k` [L, n, Hkv, D] of tokens [start, start + n) into the summaries (of every
        layer, or of `layer` alone with k [1, n, Hkv, D]); `keep`: no choice reads them
        before the next step's `prepare` (summary = keys then only keeps them, `_add_keys`)."""
        n = k.shape[1]
        if not n:
            return
        if self.keys:
            return self._add_keys(sid, k, start, layer, keep)
        first, last = self._index(start), self._index(start + n - 1)
        self._grow(sid, last + 1, k.device)
        codes, scales, opened = self._codes[sid], self._scales[sid], self._open[sid]
        if layer is not None:
            codes, scales = codes[layer : layer + 1], scales[layer : layer + 1]
            opened = opened[:, layer : layer + 1]
        goes_on = bool(start) and self._index(start - 1) == first  # the open summary fills on
        ranged = self.opts["range_weight"] > 0
        if first == last:  # one summary (most decode steps): `sparse.summarize`, in place
            op = self.operators["sparse.summarize"] if layer is None else summarize_torch
            op(k, opened, goes_on, ranged, codes, scales, first)  # (a layer's views: torch)
        else:
            shape = (k.shape[0], k.shape[2], last - first + 1, k.shape[3])
            mins = torch.full(shape, float("inf"), device=k.device)
            maxs = torch.full_like(mins, float("-inf"))
            if goes_on:
                mins[:, :, 0], maxs[:, :, 0] = opened[0], opened[1]
            idx = self._index(torch.arange(start, start + n, device=k.device)) - first
            idx = idx.view(1, 1, n, 1).expand(k.shape[0], k.shape[2], n, k.shape[3])
            kt = k.transpose(1, 2)  # [L, Hkv, n, D]
            mins.scatter_reduce_(2, idx, kt, "amin")
            maxs.scatter_reduce_(2, idx, kt, "amax")
            opened[0], opened[1] = mins[:, :, -1], maxs[:, :, -1]
            c, scales[:, :, first : last + 1] = _summaries(mins, maxs, ranged)
            i = torch.arange(first, last + 1, device=k.device)
            _tile_rows(codes)[:, :, i // kernels.TILE, i % kernels.TILE] = c.unflatten(-1, (-1, 4))
        if layer is None:
            self._known[sid] = start + n

    def summaries(self, sid: int) -> torch.Tensor:
        """Sequence `sid`'s summaries as the scores see them, [L, Hkv, summaries, 2D or D]
        float32 (codes x scale; unfilled ones are zeros); as keys [L, Hkv, tokens, D] (the
        minimum + code x step of their tile)."""
        if self.keys:
            self._settle(sid)
            p = self._scales[sid].float().unsqueeze(3)  # [L, Hkv, groups, 1, 2, D]
            c = kernels.untile_keys(self._codes[sid]).float().unflatten(2, (-1, self.group))
            return (p[..., 0, :] + c * p[..., 1, :]).flatten(2, 3)
        return kernels.untile(self._codes[sid]).float() * self._scales[sid].unsqueeze(-1)

    def _summarize_stored(self, layer: int) -> None:
        """Summaries of `layer`'s stored tokens this selection did not see written (an
        attached prefix), from the keys the format reads (wherever the blocks live)."""
        step = self._step
        ks, _ = self.format.read(layer)
        for i, have in self._unseen.items():
            sid, past = step.batch.seq_ids[i], step.past[i]
            k = ks[i][:, have:past].float().transpose(0, 1).unsqueeze(0)  # [1, T, Hkv, D]
            self._add(sid, k, have, layer)


_NO_BLOCKS = torch.empty(0, 1, dtype=torch.int64)  # a native choice's `out` where none chooses
QMAX = 63  # a query code's largest magnitude (unikv/kernels/sparse.c says why)
KMAX = 127  # the same against 4-bit keys (unsigned codes: no offset to make room for)


def quantize_keys(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys x [..., G, D] float32 (a group of G tokens) as 4-bit codes [..., G, D] uint8
    (0 to 15) and per channel a float16 minimum m and step s ([..., D] each): a key is about
    m + code x s, within half a step (KIVI's per-channel quantization of keys: their channels
    differ in scale far more than their tokens)."""
    m = x.amin(-2).half()
    mf = m.float()
    s = ((x.amax(-2) - mf) / 15).half()
    sf = s.float().unsqueeze(-2)
    c = torch.where(sf > 0, (x - mf.unsqueeze(-2)) / sf, 0.0).round_().clamp_(0, 15)
    return c.to(torch.uint8), m, s


def quantize_key_tiles(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys x [rows, n, D] float32 in 4 bits per group of `group` tokens (`quantize_keys`; the
    last group may hold fewer) as `sparse_choose` reads them: codes [rows, tiles, D / 8, 16, 4]
    uint8 (`tile_keys`; tiles = n / 16 rounded up, a last tile padded with its last key) and
    per group its minima and steps [rows, groups, 2, D] float16. The registry op
    `sparse.quantize_keys` (the C kernel makes the same bytes in one pass)."""
    rows, n, d = x.shape
    pad = -n % group  # the last key again: the same minimum and maximum
    full = torch.cat([x, x[:, -1:].expand(rows, pad, d)], dim=1) if pad else x
    c, m, s = quantize_keys(full.reshape(rows, -1, group, d))
    codes = kernels.tile_keys(c.view(rows, -1, kernels.TILE, d)[:, : -(-n // kernels.TILE)])
    return codes, torch.stack((m, s), dim=2)


def add_keys_torch(
    k: torch.Tensor,
    opened: torch.Tensor,
    span: torch.Tensor,
    have: int,
    codes: torch.Tensor,
    params: torch.Tensor,
    group_index: int,
) -> None:
    """A decode step's keys k [L, n, Hkv, D] into the open group `group_index` of every
    layer's and KV head's 4-bit keys, in place: copied to tokens [have, have + n) of `opened`
    [L, Hkv, G, D] (the group's keys so far), their running minimum and maximum `span` [L,
    Hkv, 2, D] updated, and the group's first have + n keys quantized again
    (`quantize_key_tiles`), their tiles into `codes` [L, Hkv, tiles, D / 8, 16, 4] from the
    group's first tile and their minima and steps into `params` [L, Hkv, groups, 2, D]. The
    registry op `sparse.add_keys` (the C kernel writes the same bytes, incrementally)."""
    n, g = k.shape[1], opened.shape[2]
    opened[:, :, have : have + n] = k.transpose(1, 2)
    x = opened[:, :, : have + n]
    span[:, :, 0], span[:, :, 1] = x.amin(2), x.amax(2)
    c, p = quantize_key_tiles(x.flatten(0, 1), g)
    first = group_index * g // kernels.TILE
    codes[:, :, first : first + c.shape[1]] = c.view(*x.shape[:2], *c.shape[1:])
    params[:, :, group_index] = p.view(*x.shape[:2], *p.shape[2:])


def _summaries(
    mins: torch.Tensor, maxs: torch.Tensor, ranged: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summaries' centre and half-range (from float32 `mins`, `maxs` [..., D]) as int8 codes
    [..., 2D] and one float32 scale each ([...]), or their centre alone (`ranged` False:
    codes [..., D]): a quarter of float32's bytes for `sparse.choose` to read every step. The
    centre is rounded to the nearest code, which moves it by at most half a scale; the
    half-range grows by that and is rounded up, so that q . c + |q| . r stays an upper bound
    of q . k over the tokens summarized (range_weight = 1), at any magnitude."""
    c = (maxs + mins).mul_(0.5)
    top = c.abs().amax(-1) / 127
    if ranged:
        r = (maxs - mins).mul_(0.5)
        top = torch.maximum(top, r.amax(-1) / 126)  # room for r + scale / 2, rounded up
    div = torch.where(top > 0, top, 1.0).unsqueeze(-1)
    codes = (c / div).round_().clamp_(-127, 127)
    if ranged:  # 0.501: a margin for float32's rounding of r / scale
        codes = torch.cat([codes, (r / div).add_(0.501).ceil_().clamp_(0, 127)], -1)
    return codes.to(torch.int8), top


def _tile_rows(codes: torch.Tensor) -> torch.Tensor:
    """Summary tiles [..., tiles, w / 4, 16, 4] as rows [..., tiles, 16, w / 4, 4] (a view):
    summary i is row i % 16 of tile i // 16, 4 channels at a time."""
    return codes.transpose(-3, -2)


def summarize_torch(
    k: torch.Tensor,
    opened: torch.Tensor,
    goes_on: bool,
    ranged: bool,
    codes: torch.Tensor,
    scales: torch.Tensor,
    index: int,
) -> None:
    """Summary `index` of every layer and KV head after keys k [L, n, Hkv, D] (n tokens, all
    within it): its running minimum and maximum `opened` [2, L, Hkv, D] (continued where
    `goes_on`, else started anew), then its codes and scale from them (`_summaries`) into
    `codes` [L, Hkv, tiles, w / 4, 16, 4] and `scales` [L, Hkv, cap]; in place (views too).
    The registry op `sparse.summarize` (the C kernel writes the same bytes in one pass)."""
    mins, maxs = k.amin(1), k.amax(1)  # [L, Hkv, D]
    if goes_on:
        mins, maxs = torch.minimum(mins, opened[0]), torch.maximum(maxs, opened[1])
    opened[0], opened[1] = mins, maxs
    c, scales[:, :, index] = _summaries(mins, maxs, ranged)
    _tile_rows(codes)[:, :, index // kernels.TILE, index % kernels.TILE] = c.unflatten(-1, (-1, 4))


def quantize_queries(qa: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Query vectors [..., w] as integral float codes in [-QMAX, QMAX] and one scale each
    ([..., 1]: their largest magnitude / QMAX), rounded half to even: what the C kernel
    computes, so that both score alike bit for bit."""
    scale = qa.abs().amax(-1, keepdim=True) / QMAX
    codes = torch.where(scale > 0, qa / scale, 0.0).round_().clamp_(-QMAX, QMAX)
    return codes, scale


# ---- the choice as a registry op: the C kernel (`unikv/kernels/sparse.c`), else PyTorch ----


def choose_torch(
    q: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, lo: int, hi: int, room: int,
    end: int, alpha: float, parts: int = 1, temp: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    """Per KV head the blocks a step reads, [Hkv, lo + room + (end - hi)]: the sinks [0, lo),
    the `room` candidates of [lo, hi) with the largest `block_scores`, in ascending order,
    then the window [hi, end)."""
    return pick_blocks(block_scores(q, codes, scales, lo, hi, alpha, parts, temp), lo, hi, room,
                       end)  # fmt: skip


def block_scores(
    q: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, lo: int, hi: int, alpha: float,
    parts: int = 1, temp: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    """The candidates' scores [Hkv, hi - lo] for the group's queries (q [rows, Hq, D]; codes:
    int8 tiles of [Hkv, summaries, 2D or D], per summary the centre, then the half-range or
    nothing; scales [Hkv, summaries]). A summary's score: the largest over the queries of
    q . centre + alpha |q| . half-range (alpha = 1: Quest's upper bound of q . k over its
    tokens), with q quantized as `quantize_queries` does; a block's: its summaries' largest,
    or with `temp` > 0 their mass, the sum of e^(temp (x - M)) (M the KV head's best score; a
    term below e^-87 counts as e^-87): ranked as their log-sum-exp. `unikv/kernels/sparse.c`
    must choose as this does: bit for bit for the largest (every dot of codes is an exact
    integer in float32); for the mass its exp is a polynomial within about 2e-7 of this one, so
    only blocks whose masses tie that closely may differ."""
    if codes.dtype == torch.uint8:  # summary = keys
        score = key_scores(q, codes, scales, lo * parts, hi * parts).view(-1, hi - lo, parts)
    else:
        codes = kernels.untile(codes)  # [Hkv, S, w]
        h, _, w = codes.shape
        t, hq, d = q.shape
        qg = q.float().view(t, h, hq // h, d).permute(1, 0, 2, 3).reshape(h, -1, d)
        qq = torch.cat([qg, qg.abs().mul_(alpha)], dim=-1) if w == 2 * d else qg  # [Hkv, R, w]
        qc, qs = quantize_queries(qq)
        cand = codes[:, lo * parts : hi * parts].float()
        score = (qc @ cand.transpose(1, 2)).mul_(qs).amax(1) * scales[:, lo * parts : hi * parts]
        score = score.view(h, hi - lo, parts)
    if temp <= 0:
        return score.amax(-1)
    top = score.amax((1, 2), keepdim=True) * temp
    return (score * temp - top).clamp_(min=-87.0).exp_().sum(-1)


def key_scores(q: torch.Tensor, codes: torch.Tensor, params: torch.Tensor, s0: int,
               s1: int) -> torch.Tensor:  # fmt: skip
    """Tokens [s0, s1)'s scores [Hkv, s1 - s0] from their 4-bit keys (codes [Hkv, tiles, D / 8,
    16, 4] uint8, `kernels.tile_keys`; params [Hkv, groups, 2, D] float16, per group of
    tiles / groups tiles the channels' minimum m and step s): for each query of the group
    (q [rows, Hq, D]), per tile,
    q . m + A x (the integer dot of the codes with a, q x s rounded to int8 codes of scale A:
    its largest magnitude / KMAX; a x (1 / A), half to even); a token's score is the largest
    over the
    queries. `unikv/kernels/sparse.c` computes the same but for the order of q . m's sum."""
    t, hq, d = q.shape
    h, tile = codes.shape[0], kernels.TILE
    t0, t1 = s0 // tile, -(-s1 // tile)
    u = kernels.untile_keys(codes[:, t0:t1]).float().unflatten(1, (-1, tile))  # [H, n, 16, D]
    per = codes.shape[1] // params.shape[1]  # tiles per group
    p = params[:, torch.arange(t0, t1, device=params.device) // per].float()  # each tile's
    qg = q.float().view(t, h, hq // h, d).permute(1, 0, 2, 3).reshape(h, -1, 1, d)  # [H, R, 1, D]
    a = qg * p[:, None, :, 1]  # [H, R, n, D]
    scale = a.abs().amax(-1, keepdim=True) / KMAX
    inv = torch.where(scale > 0, 1 / scale, 0.0)  # as the kernel: a times 1 / scale
    ac = (a * inv).round_().clamp_(-KMAX, KMAX)
    bias = (qg * p[:, None, :, 0]).sum(-1, keepdim=True)  # [H, R, n, 1]
    dots = torch.einsum("hrnd,hnkd->hrnk", ac, u)  # exact: integers below 2^24
    score = (bias + scale * dots).amax(1).flatten(1)  # [H, n x 16]
    return score[:, s0 - t0 * tile : s1 - t0 * tile]


def pick_blocks(score: torch.Tensor, lo: int, hi: int, room: int, end: int) -> torch.Tensor:
    """Per KV head the sinks [0, lo), the `room` candidates with the largest `score` ([Hkv,
    hi - lo]: candidates [lo, hi)) in ascending order, then the window [hi, end)."""
    h, dev = score.shape[0], score.device
    chosen = score.topk(room, dim=-1, sorted=False).indices.sort(dim=-1).values.add_(lo)
    return torch.cat([torch.arange(lo, device=dev).expand(h, -1), chosen,
                      torch.arange(hi, end, device=dev).expand(h, -1)], dim=1)  # fmt: skip


def _register(op: str, c_fn, torch_fn) -> None:
    """`op`'s C kernel (`unikv/kernels/sparse.c`, on a CPU where it builds; preferred) and its
    PyTorch reference (any device)."""
    c = FnImplementation(op, "c", c_fn, ("cpu",), lambda device, owner: kernels.unavailable())
    register_op(c, preference=10)
    register_op(FnImplementation(op, "torch", torch_fn, ("*",)), preference=90, reference=True)


_register("sparse.choose", kernels.choose_blocks, choose_torch)
_register("sparse.quantize_keys", kernels.quantize_key_tiles, quantize_key_tiles)
_register("sparse.summarize", kernels.summarize, summarize_torch)
_register("sparse.add_keys", kernels.add_keys, add_keys_torch)

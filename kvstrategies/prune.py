"""Token pruning: evict the tokens a scorer ranks lowest, and compact the cache (issue 6).

Groundwork for the `learned_prune` strategy. What is here: the eviction and compaction
machinery over `full`'s layout, and the in-house baseline scorers that the learned head must
beat under the same interface, at the same kept ratio. What is not yet: the learned head and
its training (`unikv tune --kv_optimization=learned_prune`). Until the head lands, the class is
not in the registry's module list, so `auto` does not pick it; `PruneStrategy.create` builds it.

Eviction is per token, the same for every layer and KV head, so a sequence stays one run of
slots in its blocks: after a step, when a sequence holds at least one block of tokens more
than its budget (`kept_ratio` x tokens seen, never below sinks + recent window), the lowest
scored tokens between the first `sink_tokens` and the newest `recent_window` are dropped, the
kept ones are moved down to fill the holes (one gather per layer) and the freed trailing blocks
go back to the pool (`pool.truncate`): the reported bytes are real. Keys are stored after RoPE,
so kept tokens keep their positions; new tokens get their true positions from the engine.

Scorers (a token's score is per sequence; higher is kept):
- `streaming`: its position (StreamingLLM: sinks + the most recent tokens);
- `random`: drawn when written;
- `knorm`: minus its key norm, mean over layers and KV heads (kvpress's Knorm keeps low norms);
- `h2o`: attention it has received so far, summed over query rows, heads and layers;
- `tova`: attention it received from the step's last query (replaced every step);
- `surprisal`: its negative log-likelihood under the model when it was written (DESIGN.md's
  write-time rule: a surprising token is likely to be asked about). The model hands the cache
  every row's next-token distribution (`wants_token_logprobs`); eviction then waits for it.
Prefix sharing is off for pruned sequences: a compacted block no longer holds the tokens its
position says.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from engine.kv import StepBatch

from .full import FullStrategy

# Made by `unikv tune --kv_optimization=learned_prune --text ../shared/texts/GPL-2.txt --out DIR`
# for the packaged SmolLM2-135M-Instruct (its identity, with the weights digest, is checked).
SHIPPED_HEAD = Path(__file__).resolve().parent / "data" / "prune_head.pt"
SCORERS = ("head", "streaming", "random", "knorm", "h2o", "tova", "surprisal")


class PruneStrategy(FullStrategy):
    """Uncompressed K/V of the tokens a scorer keeps; attention over exactly those."""

    name = "learned_prune"
    tolerance = 1e-5  # over the kept tokens (see `read`)
    lossless = False
    options = {
        "dtype": None,
        "scorer": "streaming",
        "kept_ratio": 0.5,  # share of the tokens seen that keep their KV (0, 1]
        "sink_tokens": 4,  # first tokens always kept
        "recent_window": 64,  # newest tokens always kept
        "recent_share": 0.0,  # share of the budget given to the newest tokens (H2O: 0.5)
        "seed": 0,  # for the random scorer
        "head": None,  # head file (scorer "head"); None: the shipped one; or a PruneHead
        "aggregate": "max",  # how (layer, head) predictions make a token's score: max or mean
        # Head scorer: score = prediction - recency * log(age) + surprisal_weight * NLL. The
        # defaults were chosen on GPL-2 (the head's training text), never on GPL-3.
        "recency": 1.0,
        "surprisal_weight": 0.5,
    }

    @classmethod
    def create(cls, spec, config=None, options: dict | None = None, device="cpu"):
        """The strategy and its pool (what `kvstrategies.create` does for registered names)."""
        from .registry import create_with

        return create_with(cls, spec, config, options, device)

    @classmethod
    def check_options(cls, options: dict | None) -> dict[str, Any]:
        opts = super().check_options(options)
        if opts["scorer"] not in SCORERS:
            raise ValueError(
                f"strategy {cls.name!r}: option scorer = {opts['scorer']!r}; "
                f"allowed: {', '.join(SCORERS)}"
            )
        r = opts["kept_ratio"]
        if isinstance(r, bool) or not isinstance(r, int | float) or not 0 < r <= 1:
            raise ValueError(
                f"strategy {cls.name!r}: option kept_ratio = {r!r}; expected a number in (0, 1]"
            )
        rs = opts["recent_share"]
        if isinstance(rs, bool) or not isinstance(rs, int | float) or not 0 <= rs <= 1:
            raise ValueError(
                f"strategy {cls.name!r}: option recent_share = {rs!r}; expected a number in [0, 1]"
            )
        if opts["aggregate"] not in ("max", "mean"):
            agg = opts["aggregate"]
            raise ValueError(
                f"strategy {cls.name!r}: option aggregate = {agg!r}; allowed: max, mean"
            )
        for key in ("recency", "surprisal_weight"):
            w = opts[key]
            if isinstance(w, bool) or not isinstance(w, int | float) or w < 0:
                raise ValueError(f"strategy {cls.name!r}: option {key} = {w!r}; expected >= 0")
        for key in ("sink_tokens", "recent_window", "seed"):
            v = opts[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(
                    f"strategy {cls.name!r}: option {key} = {v!r}; expected an integer >= 0"
                )
        return opts

    def __init__(self, pool, spec, options: dict | None = None) -> None:
        super().__init__(pool, spec, options)
        o = self.opts
        self.scorer = o["scorer"]
        self._scores: dict[int, torch.Tensor] = {}  # per sequence, one per stored token
        self._pos: dict[int, torch.Tensor] = {}  # the position of each stored token
        self._seen: dict[int, int] = {}  # tokens each sequence has been fed
        self._gen = torch.Generator().manual_seed(o["seed"])
        self.head = None
        self._step_kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        if self.scorer == "head":
            from .prune_head import PruneHead

            h = o["head"] if o["head"] is not None else SHIPPED_HEAD
            shape = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
            self.head = h if isinstance(h, PruneHead) else PruneHead.load(h, spec.identity, shape)
        self.evicted = 0
        self._last_lens: dict[int, int] = {}
        self.wants_token_logprobs = self.scorer == "surprisal" or (
            self.scorer == "head" and o["surprisal_weight"] > 0
        )
        self._last_lp: dict[int, torch.Tensor] = {}  # each sequence's last next-token log-probs

    # ---- the step ----------------------------------------------------------------------------

    def _prepare(self, batch: StepBatch) -> None:
        super()._prepare(batch)
        for sid, past, n in zip(batch.seq_ids, self._past, batch.query_lens, strict=True):
            old = self._scores.get(sid, torch.empty(0))[:past]
            if self.scorer == "streaming":  # its position in the sequence
                new = torch.arange(n, dtype=torch.float32) + self._seen.get(sid, 0)
            elif self.scorer == "random":
                new = torch.rand(n, generator=self._gen)
            else:
                new = torch.zeros(n)
            self._scores[sid] = torch.cat([old, new])
            seen = self._seen.get(sid, 0)
            pos = torch.arange(seen, seen + n, dtype=torch.float32)
            self._pos[sid] = torch.cat([self._pos.get(sid, torch.empty(0))[:past], pos])
            if self.scorer == "tova":
                self._scores[sid].zero_()

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        super().append(layer, k, v)
        if self.head is not None:
            self._step_kv.append((k, v))  # scored once for all layers, at the end of the step
        if self.scorer == "knorm":
            norms = -k.float().norm(dim=-1).mean(dim=1) / self.spec.num_layers  # [N]
            b = self._batch
            for i, (sid, past) in enumerate(zip(b.seq_ids, self._past, strict=True)):
                self._scores[sid][past:] += norms[b.rows(i)]

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        out = super().attend(layer, q)
        if self.scorer in ("h2o", "tova"):
            self._observe(layer, q)
        return out

    def _observe(self, layer: int, q: torch.Tensor) -> None:
        """Add the attention each stored token receives from this step's queries (h2o: every
        query row; tova: the last one) to its score."""
        ks, _ = self.read(layer)
        b = self._batch
        g = q.shape[1] // self.spec.num_kv_heads
        for i, (k, past) in enumerate(zip(ks, self._past, strict=True)):
            qi = q[b.rows(i)]
            if self.scorer == "tova":
                qi = qi[-1:]
            t = qi.shape[0]
            kk = k.repeat_interleave(g, 0).float()  # [Hq, S, D]
            scores = torch.einsum("thd,hsd->hts", qi.float(), kk) * self.scale
            s = kk.shape[1]
            first = past + b.query_lens[i] - t  # position of the first query row kept
            mask = torch.arange(s)[None, :] > (first + torch.arange(t))[:, None]
            probs = scores.masked_fill(mask, -math.inf).softmax(-1)  # [Hq, T, S]
            self._scores[b.seq_ids[i]] += probs.sum((0, 1)) / self.spec.num_layers

    def _score_with_head(self) -> None:
        """One head call for every layer's new K/V of the step (30 small calls would cost more
        in dispatch than the MLP itself): predicted log attention, max (or mean) over a
        token's KV heads, mean over layers, added to the tokens' scores."""
        k = torch.stack([k for k, _ in self._step_kv])  # [L, N, Hkv, D]
        v = torch.stack([v for _, v in self._step_kv])
        self._step_kv = []
        layers = torch.arange(k.shape[0]).view(-1, 1, 1).expand(k.shape[:-1])
        with torch.no_grad():
            pred = self.head(torch.cat([k, v], dim=-1).float(), layers)  # [L, N, Hkv]
        pred = pred.amax(2) if self.opts["aggregate"] == "max" else pred.mean(2)
        pred = pred.mean(0)  # [N]
        b = self._batch
        for i, (sid, past) in enumerate(zip(b.seq_ids, self._past, strict=True)):
            self._scores[sid][past:] += pred[b.rows(i)]

    def end_step(self) -> None:
        b = self._batch
        if self.head is not None and self._step_kv:
            self._score_with_head()
        for sid, n in zip(b.seq_ids, b.query_lens, strict=True):
            self._seen[sid] = self._seen.get(sid, 0) + n
        super().end_step()
        if not self.wants_token_logprobs:  # else after the scores arrive (observe_logprobs)
            for sid in b.seq_ids:
                self._evict(sid)

    def observe_logprobs(self, batch: StepBatch, tokens: torch.Tensor, logprobs: torch.Tensor):
        """Surprisal scores of the step's tokens: token r+1's NLL is read off row r; a step's
        first token off the sequence's last row of the step before (0 for a sequence's first)."""
        for i, sid in enumerate(batch.seq_ids):
            rows = batch.rows(i)
            tok, lp = tokens[rows], logprobs[rows]
            nll = torch.zeros(tok.shape[0])
            prev = self._last_lp.get(sid)
            if prev is not None:
                nll[0] = -prev[tok[0]]
            nll[1:] = -lp[:-1].gather(1, tok[1:, None]).squeeze(1).cpu()
            n = tok.shape[0]
            if self.scorer == "surprisal":
                self._scores[sid][-n:] = nll
            else:  # the head's prediction plus the weighted surprisal
                self._scores[sid][-n:] += self.opts["surprisal_weight"] * nll
            self._last_lp[sid] = lp[-1].cpu()
            self._evict(sid)

    # ---- eviction and compaction -------------------------------------------------------------

    def budget(self, seq_id: int) -> int:
        """Tokens `seq_id` may keep now."""
        o = self.opts
        floor = o["sink_tokens"] + o["recent_window"]
        return max(floor, math.ceil(o["kept_ratio"] * self._seen[seq_id]))

    def _evict(self, seq_id: int) -> None:
        o, pool = self.opts, self.pool
        n = pool.num_tokens(seq_id)
        excess = n - self.budget(seq_id)
        # Amortized: after a prefill chunk at once, while decoding once a block's worth is due.
        if excess <= 0 or (excess < pool.block_size and self._last_lens.get(seq_id, 1) == 1):
            return
        recent = max(o["recent_window"], int(o["recent_share"] * self.budget(seq_id)))
        lo, hi = min(o["sink_tokens"], n), max(o["sink_tokens"], n - recent)
        middle = self._scores[seq_id][lo:hi]
        if self.head is not None and o["recency"]:
            # The head predicts how much attention a token draws from far queries; how much of
            # that is still ahead shrinks with its age, as a power law: score - r * log(age).
            age = self._seen[seq_id] - self._pos[seq_id][lo:hi]
            middle = middle - o["recency"] * torch.log1p(age)
        drop = torch.topk(middle, min(excess, middle.numel()), largest=False).indices + lo
        keep = torch.ones(n, dtype=torch.bool)
        keep[drop] = False
        kept = keep.nonzero().squeeze(1)
        slots = pool.slot_ids(seq_id, 0, n)
        src, dst = slots[kept], slots[: kept.numel()]
        for a in self._layers:  # [2, heads, slots, dim]: move the kept tokens down
            a.index_copy_(2, dst, a.index_select(2, src))
        pool.truncate(seq_id, kept.numel())
        self._scores[seq_id] = self._scores[seq_id][kept]
        self._pos[seq_id] = self._pos[seq_id][kept]
        self.evicted += n - kept.numel()

    # ---- hooks -------------------------------------------------------------------------------

    def abort_step(self) -> None:
        self._step_kv = []
        super().abort_step()

    def begin_step(self, batch: StepBatch) -> None:
        self._last_lens = dict(zip(batch.seq_ids, batch.query_lens, strict=True))
        super().begin_step(batch)

    def free(self, seq_id: int) -> None:
        self._scores.pop(seq_id, None)
        self._pos.pop(seq_id, None)
        self._last_lp.pop(seq_id, None)
        self._seen.pop(seq_id, None)
        super().free(seq_id)

    def match_prefix(self, seq_id: int, token_ids: list[int]) -> int:
        return 0  # compacted blocks do not hold the tokens their position says

    def publish(self, seq_id: int, token_ids: list[int]) -> None:
        return None

    def stats(self) -> dict:
        seen = sum(self._seen.values())
        return super().stats() | {
            "scorer": self.scorer,
            "tokens_evicted": self.evicted,
            "kept_ratio": self.pool.total_tokens() / seen if seen else 1.0,
        }

"""Token pruning: evict the tokens a scorer ranks lowest, and compact the cache (issue 6).

The `pruned` selection (`PrunedSelection`, over any format: the format reads tokens back for
the head, `Format.token_kv`, and compacts its blocks, `Format.compact`; the `learned_prune`
preset is it over the dense format): the eviction and compaction machinery, the
learned head's scorer (`prune_head.py`; trained by `unikv tune --kv_optimization=learned_prune`)
and the in-house baseline scorers it is measured against under the same interface, at the same
kept ratio.

Eviction is per layer and KV head (`granularity = "head"`, the default): every (layer, KV
head) keeps the same number of tokens, its own choice of them, so a sequence stays one run of
slots in its blocks. After a step, when a sequence holds at least one block of tokens more than
its budget (`kept_ratio` x tokens seen, never below sinks + recent window), each (layer, head)
drops its lowest scored tokens between the first `sink_tokens` and the newest ones (the recent
window), the kept ones are moved down to fill the holes (one gather per layer) and the freed
trailing blocks go back to the pool (`pool.truncate`): the reported bytes are real. Keys are
stored after RoPE, so kept tokens keep their positions; new tokens get their true positions
from the engine. With `granularity = "token"` every layer and head drops the same tokens (a
token's score: max over heads, mean over layers).

Query-aware (SnapKV's observation window, on by default): a prompt fed in chunks keeps all its
tokens until its last chunk is in (`wait_for_prompt`; the engine marks chunks that more of the
prompt follows, `StepBatch.more_prompt`), so eviction sees the question at the prompt's end.
The attention of the prompt's last `observe_window` rows on every stored token is its gain,
observed once per sequence; the `snapkv` scorer ranks by the gain alone, `head` and `surprisal`
keep `observe_share` of the middle's kept tokens by the gain and the rest by their own score.
A token the question needs thus survives however its own score ranks it (the passkey needle:
write-time scores do not know what will be asked).

Scorers (a score per layer, KV head and stored token; higher is kept):
- `head` (the default): the learned head's predicted log attention from later queries, plus
  `surprisal_weight` x the token's write-time NLL (below), minus `recency` x log(1 + age); the
  head runs only when an eviction is due, over the tokens it has not scored yet;
- `streaming`: its position (StreamingLLM: sinks + the most recent tokens);
- `random`: drawn when written;
- `knorm`: minus its key norm (kvpress's Knorm keeps low norms);
- `h2o`: attention it has received so far, summed over query rows and the heads of its group;
- `tova`: attention it received from the step's last query (replaced every step);
- `snapkv`: the gain above alone (SnapKV), 0 for tokens written after the prompt;
- `surprisal`: its negative log-likelihood under the model when it was written (the design's
  write-time rule: a surprising token is likely to be asked about). The model hands the cache
  every row's next-token distribution (`wants_token_logprobs`); eviction then waits for it
  (or, from a caller that never hands it, happens at the next step).
Prefix sharing is off for pruned sequences: a compacted block no longer holds the tokens its
position says.
"""

from __future__ import annotations

import logging
import math
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .axes import SELECTIONS, Selection, Step
from .kv import StepBatch
from .options import Option

log = logging.getLogger(__name__)

# Made by `unikv tune --kv_optimization=learned_prune --text benchmarks/texts/GPL-2.txt --out DIR`
# for the packaged SmolLM2-135M-Instruct (its identity, with the weights digest, is checked).
SHIPPED_HEAD = Path(resources.files(__package__) / "data" / "prune_head.pt")
SCORERS = ("head", "streaming", "random", "knorm", "h2o", "tova", "surprisal", "snapkv")
# Scorers whose rank the prompt's observation window adds to (the others are the pure baselines
# they are measured against; h2o and tova observe every step by themselves).
OBSERVING = ("head", "surprisal", "snapkv")
# A packed format's compaction quantizes the moved tokens again, and each pass adds rounding
# (int2 key groups with fp8 headers drift outward: 300 passes double a group's range). Evicting
# only once the budget is overrun by this share makes passes rare (every 2 / 16 of the tokens
# seen at kept_ratio 0.5: about 16 at 8K tokens instead of one per 16-token chunk).
REQUANTIZING_SLACK = 0.0625


def _check_head_file(strategy: str, head: Any) -> None:
    """A head given as a path must name a file (a PruneHead object is checked when loaded)."""
    if isinstance(head, str | Path) and not Path(head).is_file():
        raise ValueError(
            f"strategy {strategy!r}: option head = {str(head)!r}: pruning head file not "
            "found (make one with `unikv tune --kv_optimization=learned_prune`)"
        )


def _load_head(strategy: str, head, spec):
    """The given head (an error if it does not fit the model), or the shipped one; None when
    no head was given and the shipped one is for another model (a latent cache's always is):
    then the surprisal rule ranks, with a warning."""
    from .prune_head import HeadMismatch, PruneHead

    if spec.latent and head is not None:
        raise ValueError(
            f"strategy {strategy!r}: option head: a pruning head reads each token's key "
            "and value, a latent (MLA) cache stores one latent vector; leave head unset "
            "(surprisal ranks) or choose another scorer"
        )
    if isinstance(head, PruneHead):
        return head
    shape = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
    if head is not None:
        return PruneHead.load(head, spec.identity, shape)
    try:
        return PruneHead.load(SHIPPED_HEAD, spec.identity, shape)
    except HeadMismatch:
        log.warning(
            "learned_prune: the shipped pruning head is for the packaged SmolLM2, not this "
            "model; ranking by surprisal instead (train a head with "
            "`unikv tune --kv_optimization=learned_prune`)"
        )
        return None


@SELECTIONS.register
class PrunedSelection(Selection):
    """A scorer ranks tokens, the lowest lose their KV, the cache is compacted: the format
    reads tokens back for the head (`token_kv`) and compacts its blocks (`compact`)."""

    name = "pruned"
    help = "a scorer evicts the lowest ranked tokens; compacted"
    evicts = True
    options = (
        Option("scorer", str, "head", "what ranks tokens: the learned head, or a baseline",
               choices=SCORERS),
        Option("kept_ratio", float, 0.5, "share of the tokens seen that keep their KV",
               low=0, low_open=True, high=1),
        Option("sink_tokens", int, 4, "first tokens always kept", low=0),
        Option("recent_window", int, 64, "newest tokens always kept", low=0),
        Option("recent_share", float, 0.75, "share of the budget kept for the newest tokens "
               "(H2O: 0.5)", low=0, high=1),
        Option("seed", int, 0, "seed of the random scorer", low=0, flag="--prune-seed"),
        Option("head", object, None, "pruning head of the head scorer", none="the shipped head",
               check=_check_head_file, allowed_text="a pruning head file (or a PruneHead)",
               flag="--prune-head"),
        Option("granularity", str, "head", "head: each (layer, KV head) keeps its own tokens; "
               "token: every layer and head drops the same", choices=("head", "token")),
        # Head scorer: score = prediction + surprisal_weight * NLL - recency * log(1 + age).
        # Defaults chosen on GPL-2 (the head's training text) and passkey, never on GPL-3.
        Option("recency", float, 0.0, "head scorer: weight of minus log(1 + age)", low=0),
        Option("surprisal_weight", float, 0.5, "head scorer: weight of the token's write-time "
               "NLL", low=0),
        # Query-aware eviction (SnapKV's observation window): the prompt's last rows, its
        # question, show which earlier tokens it needs.
        Option("observe_window", int, 32, "head, surprisal and snapkv scorers: last prompt rows "
               "whose attention adds to the scores (0: off)", low=0),
        Option("observe_share", float, 0.75, "head and surprisal scorers: share of the kept "
               "middle tokens chosen by the observation window's attention, the rest by the "
               "scorer", low=0, high=1),
        Option("wait_for_prompt", bool, True, "evict once the whole prompt is in, not after "
               "each chunk of it (the peak holds the prompt; the question is seen)"),
        Option("evict_slack", float, None, "share of the budget a sequence may run over "
               "before tokens are evicted (fewer, larger compactions)", low=0, high=1,
               none=f"{REQUANTIZING_SLACK} where compaction re-packs quantized blocks, else 0"),
    )  # fmt: skip

    # Small budgets so the contract's short sequences are pruned; knorm differs per head.
    contract_options = {"scorer": "knorm", "sink_tokens": 2, "recent_window": 4}

    def __init__(self, pool, spec, opts: dict[str, Any], fmt, label: str) -> None:
        super().__init__(pool, spec, opts, fmt, label)
        o = self.opts
        self._step: Step | None = None
        self.scorer = o["scorer"]
        self._scores: dict[int, torch.Tensor] = {}  # per sequence, one per stored token
        self._pos: dict[int, torch.Tensor] = {}  # the position of each stored token
        self._seen: dict[int, int] = {}  # tokens each sequence has been fed
        self._gen = torch.Generator().manual_seed(o["seed"])
        self.head = None
        self._scored: dict[int, int] = {}  # per sequence: stored tokens the head has scored
        if self.scorer == "head":
            self.head = _load_head(label, o["head"], spec)
            if self.head is None:
                self.scorer = "surprisal"
        slack = o["evict_slack"]
        self._slack = (
            (REQUANTIZING_SLACK if fmt.compaction_requantizes else 0.0) if slack is None else slack
        )
        self.evicted = 0  # tokens evicted, and tokens fed, since the strategy was built
        self.seen_total = 0
        self._last_lens: dict[int, int] = {}
        self.wants_token_logprobs = self.scorer == "surprisal" or (
            self.scorer == "head" and o["surprisal_weight"] > 0
        )
        self._last_lp: dict[int, torch.Tensor] = {}  # each sequence's last next-token log-probs
        self._awaiting_lp: list[int] = []  # sequences whose eviction waits for log-probabilities
        self._more: dict[int, bool] = {}  # this step: whose prompt goes on in a later step
        self._observed: set[int] = set()  # sequences whose prompt's end has been observed
        self._ends: list[int] = []  # this step: batch positions whose prompt's end is observed
        self._gain: dict[int, torch.Tensor] = {}  # per sequence: the observation's [L, Hkv, S]

    # ---- the step ----------------------------------------------------------------------------
    # Per sequence, `_scores` and `_pos` (each stored token's position) are [layers, kv_heads,
    # stored tokens]: after per-head eviction the same slot holds other tokens in other heads.

    def prepare(self, step: Step) -> None:
        self._step, batch = step, step.batch
        shape = (self.spec.num_layers, self.spec.num_kv_heads)
        for sid, past, n in zip(batch.seq_ids, step.past, batch.query_lens, strict=True):
            seen = self._seen.get(sid, 0)
            pos = torch.arange(seen, seen + n, dtype=torch.float32)
            if self.scorer == "streaming":  # its position in the sequence
                new = pos
            elif self.scorer == "random":
                new = torch.rand(n, generator=self._gen)
            else:
                new = torch.zeros(n)
            old = self._scores.get(sid, torch.empty(*shape, 0))[..., :past]
            if self.scorer == "tova":  # only the newest query's attention counts
                old = torch.zeros_like(old)
            self._scores[sid] = torch.cat([old, new.expand(*shape, n)], dim=-1)
            old_pos = self._pos.get(sid, torch.empty(*shape, 0))[..., :past]
            self._pos[sid] = torch.cat([old_pos, pos.expand(*shape, n)], dim=-1)

    def appended(self, layer: int, k: torch.Tensor) -> None:
        if self.scorer == "knorm":
            norms = -k.float().norm(dim=-1).T  # [Hkv, N]
            b = self._step.batch
            for i, (sid, past) in enumerate(zip(b.seq_ids, self._step.past, strict=True)):
                self._scores[sid][layer, :, past:] = norms[:, b.rows(i)]

    def attended(self, layer: int, q: torch.Tensor) -> None:
        if self.scorer in ("h2o", "tova"):
            self._observe(layer, q, range(len(self._step.batch.seq_ids)))
        elif self._ends:
            self._observe(layer, q, self._ends)

    def hooks(self, step: Step) -> bool:
        # Per layer: knorm scores each new key, h2o and tova every step's attention, the
        # observing scorers the prompt's end (`_ends`); else a step (a decode step of the head
        # scorer, the default) has nothing to do per layer and may run as one native call.
        return self.scorer in ("knorm", "h2o", "tova") or bool(self._ends)

    def _observe(self, layer: int, q: torch.Tensor, which) -> None:
        """Add the attention each stored token receives from this step's queries, for the
        batch's sequences number `which`: h2o sums it over every query row and the query heads
        of its KV group; tova takes the last row; the observing scorers take the prompt's last
        `observe_window` rows (SnapKV): the mean over rows, the max over the group's heads, averaged
        with the max over a token's 3 neighbours each side (a needle is a phrase, not one token:
        its neighbours rank next, the token itself first), kept as the
        token's gain, log(1 + S x attention) (0 for uniform attention over S tokens); snapkv
        ranks by it, the others keep `observe_share` of the middle by it (see `_evict`)."""
        ks, _ = self.format.read(layer)
        b = self._step.batch
        hkv = self.spec.num_kv_heads
        g = q.shape[1] // hkv
        for i in which:
            k, past = ks[i], self._step.past[i]
            qi = q[b.rows(i)]
            if self.scorer == "tova":
                qi = qi[-1:]
            elif self.scorer in OBSERVING:
                qi = qi[-self.opts["observe_window"] :]
            t = qi.shape[0]
            kk = k.repeat_interleave(g, 0).float()  # [Hq, S, D]
            scores = torch.einsum("thd,hsd->hts", qi.float(), kk) * self.spec.scale
            s = kk.shape[1]
            first = past + b.query_lens[i] - t  # position of the first query row kept
            dev = scores.device
            mask = (
                torch.arange(s, device=dev)[None, :]
                > (first + torch.arange(t, device=dev))[:, None]
            )
            probs = scores.masked_fill(mask, -math.inf).softmax(-1)  # [Hq, T, S]
            if self.scorer in OBSERVING:
                seen = probs.mean(1).view(hkv, g, s).amax(1)  # [Hkv, S]
                seen = (seen + F.max_pool1d(seen[None], 7, stride=1, padding=3)[0]) / 2
                gain = torch.log1p(s * seen)
                sid = b.seq_ids[i]
                if sid not in self._gain:
                    self._gain[sid] = torch.zeros(*self._scores[sid].shape[:2], s)
                self._gain[sid][layer] = gain
                if self.scorer == "snapkv":
                    self._scores[sid][layer] += gain
            else:
                self._scores[b.seq_ids[i]][layer] += probs.sum(1).view(hkv, g, s).sum(1)

    def _score_with_head(self, seq_id: int) -> None:
        """Add the head's prediction (log attention per layer, KV head and token) to the scores
        of the tokens it has not scored yet: the newest ones, read back from the arena. Called
        only when an eviction is due, so while decoding one head call covers a block's worth
        of steps and every layer (one call per layer and step would cost more in dispatch than
        the MLP itself)."""
        n, done = self.pool.num_tokens(seq_id), self._scored.get(seq_id, 0)
        if n == done:
            return
        kv = self.format.token_kv(seq_id, done, n)  # [L, 2, H, T, D]
        kv = torch.cat([kv[:, 0], kv[:, 1]], dim=-1).float()  # [L, H, T, 2D]
        layers = torch.arange(kv.shape[0]).view(-1, 1, 1).expand(kv.shape[:-1])
        with torch.no_grad():
            self._scores[seq_id][..., done:] += self.head(kv, layers)
        self._scored[seq_id] = n

    def after_step(self, step: Step) -> None:
        b, self._step = step.batch, None
        for sid, n in zip(b.seq_ids, b.query_lens, strict=True):
            self._seen[sid] = self._seen.get(sid, 0) + n
            self.seen_total += n
        if self.scorer in OBSERVING and self.opts["observe_window"]:
            self._observed.update(
                sid for sid, n, more in zip(b.seq_ids, b.chunk_lens, b.more_prompt, strict=True)
                if n > 1 and not more
            )  # fmt: skip
        if self.wants_token_logprobs:  # after the scores arrive (observe_logprobs) ...
            self._awaiting_lp = list(b.seq_ids)  # ... or, from a caller that has none, next step
        else:
            for sid in b.seq_ids:
                self._evict(sid)

    def _query_first(self, middle: torch.Tensor, gain: torch.Tensor, free: int) -> torch.Tensor:
        """Scores of the middle with the tokens kept whatever they score set to +inf: first
        `observe_share` of the `free` slots (those past the sinks and the hard recent window)
        go to the tokens the prompt's question attended to most, then `recent_share` of the
        rest to the newest other tokens; the scorer ranks what is left."""
        o = self.opts
        if o["granularity"] == "token":
            gain = gain.amax(1, keepdim=True).mean(0, keepdim=True)
        gain = gain.expand_as(middle)
        free = max(0, min(free, middle.shape[-1]))
        asked = round(o["observe_share"] * free)
        keep = torch.zeros_like(middle, dtype=torch.bool)
        keep.scatter_(-1, torch.topk(gain, asked).indices, True)
        newest = int(o["recent_share"] * (free - asked))
        others = (~keep).flip(-1).cumsum(-1).flip(-1)  # other tokens at or after each slot
        keep |= ~keep & (others <= newest)
        return middle.masked_fill(keep, math.inf)

    def _waits(self, seq_id: int) -> bool:
        """Whether eviction waits: the sequence's prompt goes on in a later step."""
        return self.opts["wait_for_prompt"] and self._more.get(seq_id, False)

    def observe_logprobs(self, batch: StepBatch, tokens: torch.Tensor, logprobs: torch.Tensor):
        """Surprisal scores of the step's tokens: token r+1's NLL is read off row r; a step's
        first token off the sequence's last row of the step before (0 for a sequence's first)."""
        for i, sid in enumerate(batch.seq_ids):
            rows = batch.rows(i)
            tok, lp = tokens[rows].cpu(), logprobs[rows]
            n = tok.shape[0]
            nll = torch.empty(n)
            prev = self._last_lp.get(sid)
            nll[0] = 0.0 if prev is None else -float(prev[int(tok[0])])
            if n > 1:
                nll[1:] = -lp[:-1].gather(1, tok[1:, None].to(lp.device)).squeeze(1).cpu()
            if self.scorer == "surprisal":
                self._scores[sid][..., -n:] = nll
            else:  # the head's prediction plus the weighted surprisal
                self._scores[sid][..., -n:] += self.opts["surprisal_weight"] * nll
            self._last_lp[sid] = lp[-1].clone()  # not a view: the step's rows can go
            self._evict(sid)
        self._awaiting_lp = []

    # ---- eviction and compaction -------------------------------------------------------------

    def budget(self, seq_id: int) -> int:
        """Tokens `seq_id` may keep now (in every layer and KV head)."""
        return self._budget_at(self._seen[seq_id])

    def _budget_at(self, seen: int) -> int:
        o = self.opts
        return max(o["sink_tokens"] + o["recent_window"], math.ceil(o["kept_ratio"] * seen))

    def _due(self, stored: int, seen: int, new: int) -> bool:
        """Whether a sequence storing `stored` tokens of the `seen` it was fed evicts after a
        step of `new` tokens. Amortized: after a prefill chunk at once, while decoding once a
        block's worth is due, and never before the slack is used up (a packed format's
        compaction re-quantizes)."""
        budget = self._budget_at(seen)
        excess = stored - budget
        due = max(1, math.ceil(self._slack * budget))
        return not (excess < due or (excess < self.pool.block_size and new == 1))

    def sequential(self, seq_id: int, past: int, steps: int) -> int:
        # Decode steps of a scorer with nothing to do per layer, up to and with the first one
        # after which tokens are evicted: the eviction then comes after the same token, with
        # the same scores (the run's log-probabilities arrive with it, `observe_logprobs`).
        if self.scorer in ("knorm", "h2o", "tova") or seq_id not in self._seen:
            return 1
        if self._waits(seq_id) or self._awaiting_lp:
            return 1
        seen = self._seen[seq_id]
        for j in range(1, steps + 1):
            if self._due(past + j, seen + j, 1):
                return j
        return steps

    def _evict(self, seq_id: int) -> None:
        if self._waits(seq_id):
            return
        o, pool = self.opts, self.pool
        n = pool.num_tokens(seq_id)
        budget = self.budget(seq_id)
        excess = n - budget
        if not self._due(n, self._seen[seq_id], self._last_lens.get(seq_id, 1)):
            return
        if self.head is not None:
            self._score_with_head(seq_id)
        scores, pos = self._scores[seq_id], self._pos[seq_id]
        gain = self._gain.get(seq_id)
        if gain is not None:  # the prompt's question was observed
            gain = F.pad(gain, (0, n - gain.shape[-1]))  # tokens written since: no gain
            self._gain[seq_id] = gain
        lo = min(o["sink_tokens"], n)
        query_first = gain is not None and self.scorer != "snapkv" and o["observe_share"] > 0
        if query_first:  # the range is all but the hard recent window; shares are set below
            hi = max(lo, n - o["recent_window"])
        else:
            recent = max(o["recent_window"], int(o["recent_share"] * budget))
            hi = max(lo, n - recent)
        middle = scores[..., lo:hi]  # [L, Hkv, W]
        if self.head is not None and o["recency"]:
            # The head predicts how much attention a token draws from far queries; how much of
            # that is still ahead shrinks with its age, as a power law: score - r * log(age).
            middle = middle - o["recency"] * torch.log1p(self._seen[seq_id] - pos[..., lo:hi])
        if o["granularity"] == "token":
            middle = middle.amax(1, keepdim=True).mean(0, keepdim=True)  # [1, 1, W]
        if query_first:
            middle = self._query_first(middle, gain[..., lo:hi], budget - lo - (n - hi))
        drop = torch.topk(middle, min(excess, middle.shape[-1]), largest=False).indices + lo
        keep = torch.ones(*middle.shape[:2], n, dtype=torch.bool)
        keep.scatter_(-1, drop, False)
        m = n - drop.shape[-1]
        # Each (layer, head)'s kept slots in order: kept ones sort first, by position.
        order = torch.arange(n).expand_as(keep)
        kept = torch.where(keep, order, order + n).sort(-1).values[..., :m]
        kept = kept.expand(*scores.shape[:2], m)  # [L, Hkv, m]
        self.format.compact(seq_id, lo, n, kept[..., lo:] - lo)  # the sinks stay where they are
        pool.truncate(seq_id, m)
        self._scores[seq_id] = scores.gather(-1, kept)
        self._pos[seq_id] = pos.gather(-1, kept)
        if gain is not None:
            self._gain[seq_id] = gain.gather(-1, kept)
        self._scored[seq_id] = min(self._scored.get(seq_id, 0), m)
        self.evicted += n - m

    # ---- hooks -------------------------------------------------------------------------------

    def before_step(self, batch: StepBatch) -> None:
        for sid in self._awaiting_lp:  # no log-probabilities came (a caller without a model head)
            if sid in self._seen:
                self._evict(sid)
        self._awaiting_lp = []
        self._last_lens = dict(zip(batch.seq_ids, batch.chunk_lens, strict=True))
        self._more = dict(zip(batch.seq_ids, batch.more_prompt, strict=True))
        # Batch positions observed this step: once per sequence, at its prompt's end (rows, not
        # one decode token); worked out once per step, not per layer.
        self._ends = [
            i for i, (sid, n, more) in enumerate(zip(batch.seq_ids, batch.chunk_lens,
                                                     batch.more_prompt, strict=True))
            if n > 1 and not more and sid not in self._observed
        ] if self.scorer in OBSERVING and self.opts["observe_window"] else []  # fmt: skip

    def forget(self, seq_id: int) -> None:
        self._scores.pop(seq_id, None)
        self._pos.pop(seq_id, None)
        self._last_lp.pop(seq_id, None)
        self._seen.pop(seq_id, None)
        self._scored.pop(seq_id, None)
        self._observed.discard(seq_id)
        self._gain.pop(seq_id, None)

    def stats(self) -> dict:
        seen = sum(self._seen.values())
        return {
            "scorer": self.scorer,
            "tokens_evicted": self.evicted,
            "tokens_seen": self.seen_total,
            "kept_ratio": self.pool.total_tokens() / seen if seen else 1.0,  # live sequences
        }

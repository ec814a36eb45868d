"""The KV seam shared by any engine and any strategy: the step batch, the KV spec, the two cache
interfaces, attention over runs of slots with their log-sum-exp merge, and a minimal contiguous
cache.

Two interfaces, because two different callers use a cache:

- `KVCache` is what the *model* calls inside one forward step: `begin_step`, then `append` and
  `attend` per layer, then `end_step` (or `abort_step` on failure).
- `KVMemory` is what the *scheduler* calls between steps: `reserve` room before a step, `free`
  a finished sequence, match and publish prefixes, swap sequences out and in, read statistics.

A strategy implements both (it owns how KV is stored and how memory for it is held); the model
sees only `KVCache`, the scheduler only `KVMemory`. The seam lives here, below `engine/`, so a
strategy plugs into any engine that speaks it.

Tensors are *packed*: the new tokens of every sequence in the step are concatenated along the first
dimension in `StepBatch.seq_ids` order, so sequences of different lengths need no padding.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

if TYPE_CHECKING:
    from unikv.memory.stats import PoolReport


@dataclass(slots=True)
class StepBatch:
    """Which sequences take part in one forward step and how many new tokens each brings."""

    seq_ids: list[int]
    query_lens: list[int]
    # Per sequence: True where its prompt goes on in a later step (chunked prefill), so a
    # query-aware strategy waits for the prompt's end, its question, before it evicts.
    more_prompt: list[bool] | None = None
    # True: each sequence's rows are greedy decode steps run one after another in one native
    # call (`LlamaModel.decode`), row j's token the output of row j - 1 (`KVCache.sequential`)
    sequential: bool = False
    offsets: list[int] = field(init=False)  # start row of each sequence in the packed tensors

    def __post_init__(self) -> None:
        if len(self.seq_ids) != len(self.query_lens):
            raise ValueError("seq_ids and query_lens differ in length")
        if self.more_prompt is None:
            self.more_prompt = [False] * len(self.seq_ids)
        elif len(self.more_prompt) != len(self.seq_ids):
            raise ValueError("seq_ids and more_prompt differ in length")
        if len(set(self.seq_ids)) != len(self.seq_ids):
            raise ValueError(f"a sequence appears twice in one step: {self.seq_ids}")
        if any(n <= 0 for n in self.query_lens):
            raise ValueError(f"every sequence needs at least one new token: {self.query_lens}")
        self.offsets = [0]
        for n in self.query_lens:
            self.offsets.append(self.offsets[-1] + n)

    @property
    def num_tokens(self) -> int:
        """Total new tokens in the step (rows of the packed tensors)."""
        return self.offsets[-1]

    def rows(self, i: int) -> slice:
        """Rows of sequence number `i` (in batch order) in the packed tensors."""
        return slice(self.offsets[i], self.offsets[i + 1])

    @property
    def chunk_lens(self) -> list[int]:
        """Per sequence, its new tokens the model computes together, as one chunk: its
        `query_lens`, or 1 in a sequential step (each row its own decode step). What tells a
        prefill chunk (more than 1) from a decode step."""
        return [1] * len(self.seq_ids) if self.sequential else self.query_lens


@dataclass(frozen=True, slots=True)
class KVSpec:
    """The shape of a model's KV cache, as a strategy needs to know it."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32  # the compute dtype of queries and outputs
    identity: str = ""  # model identity for prefix hashes
    query_group: int = 0  # query heads per KV head, when known (kernels specialise on it)
    # Multi-head latent attention (DeepSeek): one "KV head" holding the compressed latent plus
    # the RoPE key part; a value is the first `value_dim` channels of the key and is not stored.
    latent: bool = False
    value_dim: int = 0  # channels of a value; 0: head_dim
    softmax_scale: float = 0.0  # 0: head_dim ** -0.5 (MLA's differs: qk_head_dim, YaRN mscale)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVSpec.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.value_dim <= (self.head_dim if self.latent else 1 << 30):
            raise ValueError(f"KVSpec.value_dim = {self.value_dim} does not fit the keys")

    @property
    def v_dim(self) -> int:
        """Channels of one value vector."""
        return self.value_dim or self.head_dim

    @property
    def scale(self) -> float:
        """The softmax scale of attention over these keys."""
        return self.softmax_scale or self.head_dim**-0.5

    @property
    def stored_parts(self) -> int:
        """Tensors stored per token and head: 2 (K, V), or 1 when values live in the keys."""
        return 1 if self.latent else 2

    @property
    def elements_per_token(self) -> int:
        """Stored K and V elements one token occupies over all layers."""
        per_head = self.head_dim if self.latent else self.head_dim + self.v_dim
        return self.num_layers * self.num_kv_heads * per_head


@dataclass(frozen=True, slots=True)
class NativeStep:
    """One step's KV cache as plain memory, for every layer at once (`KVCache.native_step`).

    Layer l's keys and values are one float32 array [2, Hkv, slots, D] (K, then V) at address
    `base + l * layer_bytes`; token slot s of a head holds one token (block b holds slots
    b * block_size ..). Row r of the step writes its key and value at slot `new_slots[r]`; then
    each sequence's queries attend its blocks `blocks[i]` [Hkv, B] (positions in its block list,
    every one of them), block position p lying at block index `ids[i][p]` of the arena, seeing
    positions up to `past[i]` + its row. A tiered cache's blocks may lie in further `places`
    too, each (layer 0's address, bytes to the next layer, slots) of a [2, Hkv, slots, D]
    float32 arena read in place (a host tier's): block position p then lies in place
    `where[i][p]` (0: the arena above; 1: `places[0]`; ...; `where[i]` None: all in the arena
    above). `attend` is the address of the C function that does that attention
    (`unikv/kernels/sparse.c`'s `sparse_attend`: its signature and numbers). The tensors are
    the cache's and live until `end_step`."""

    attend: int
    base: int
    layer_bytes: int
    slots: int
    block_size: int
    scale: float
    new_slots: torch.Tensor  # int64 [N]
    rows: list[int]  # each sequence's first row in the packed tensors, then N
    past: list[int]
    ids: list[torch.Tensor]  # per sequence, int64 [blocks]
    blocks: list[torch.Tensor]  # per sequence, int64 [Hkv, B]
    choice: NativeChoice | None = None  # a selection's per-layer choice (None: every block)
    places: tuple[tuple[int, int, int], ...] = ()  # further arenas read in place (tiered)
    where: list[torch.Tensor | None] | None = None  # per sequence, int64 [blocks]: its places


@dataclass(frozen=True, slots=True)
class NativeChoice:
    """A selection's choice of blocks inside a native step (`NativeStep.choice`).

    From layer `first` on, each sequence with a plan (lo, hi, room, end) reads, per KV head, the
    sink blocks [0, lo), the `room` blocks of [lo, hi) whose summaries score highest for its
    queries, and the window [hi, end), as `choose` (the address of `unikv/kernels/sparse.c`'s
    `sparse_choose`: its signature and numbers) picks them from `codes[i]` (int8 summaries
    [L, Hkv, tiles, width / 4, 16, 4], `parts` per block) and `scales[i]` ([L, Hkv, S]) with
    weight `alpha` on their ranges (a block's score: its summaries' largest, or with `temp` > 0
    their log-sum-exp at that scale); a sequence without a plan, and every layer before `first`,
    reads every block. The step writes each choice into `out` (int64 [L, row]) at `at[i]`
    ([Hkv, lo + room + end - hi]), for the selection to account for after the step. Where no
    sequence has a plan (every one short), the step has nothing to choose: `choosing` is
    False, and the graph runs as without a choice."""

    choose: int
    first: int
    parts: int
    width: int
    alpha: float
    temp: float
    plans: list[tuple[int, int, int, int] | None]
    codes: list[torch.Tensor | None]
    scales: list[torch.Tensor | None]
    out: torch.Tensor
    at: list[int]

    @property
    def choosing(self) -> bool:
        return any(p is not None for p in self.plans)


@dataclass(frozen=True, slots=True)
class NativeHook:
    """One step's KV cache as its own C code, for a native decode graph (`KVCache.native_step`,
    where the cache is not plain float32 arenas: a packed format).

    At every layer the graph calls `function(context, layer, q, k, v, n, out, threads)`
    (`unikv/kernels/gemv.c`'s layer_fn: its signature and numbers): it stores the step's new
    keys and values of that layer (float32 [N, Hkv, D] each, after RoPE) and writes the
    attention of q [N, Hq, D] into out [N, Hq, Dv] (over each sequence's blocks that `choice`
    picks at that layer, as for a `NativeStep`, or every block); it returns 0, or -1 (refused:
    the step is then run layer by layer, which rewrites whatever was written). `rows` is each
    sequence's first row, then N. `context` points into `keep`, which lives until
    `end_step`. `past` (each sequence's stored tokens before the step, all of which the
    function reads) lets the graph see that the attention is short (gemv.c's INSIDE_KEYS)."""

    function: int
    context: int
    rows: list[int]
    keep: tuple
    choice: NativeChoice | None = None  # a selection's per-layer choice (None: every block)
    past: list[int] | None = None


class KVCache(ABC):
    """The model-facing side: stores one step's keys/values per layer and attends over them."""

    @abstractmethod
    def begin_step(self, batch: StepBatch) -> None:
        """Start a step over room the scheduler reserved (before layer 0 runs)."""

    @abstractmethod
    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's new keys/values for `layer`. k, v: [N, Hkv, D] packed."""

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Causal attention of the step's queries over everything stored. q: [N, Hq, D]."""

    @abstractmethod
    def end_step(self) -> None:
        """Commit the step: stored lengths now include its tokens."""

    @abstractmethod
    def abort_step(self) -> None:
        """Forget the step after a failure: stored lengths stay as before `begin_step`."""

    # A cache that sets this gets `observe_logprobs` after each forward step (the model then
    # computes the next-token distribution of every row, not only of the rows it returns).
    wants_token_logprobs: bool = False

    def observe_logprobs(
        self, batch: StepBatch, tokens: torch.Tensor, logprobs: torch.Tensor
    ) -> None:
        """The step's token ids [N] and each row's next-token log-probabilities [N, V]."""
        return None

    def native_step(self) -> NativeStep | NativeHook | None:
        """The step begun by `begin_step`, described for a native decode graph that writes and
        attends every layer in one call (`NativeStep`: plain arenas; `NativeHook`: the cache's
        own C code per layer), or None (this default): the model then calls `append` and
        `attend` layer by layer. A cache describes a step only where those calls would do
        nothing but what the description says (no per-layer bookkeeping)."""
        return None

    def sequential(self, seq_id: int, steps: int) -> int:
        """How many (at most `steps`) of `seq_id`'s next decode steps, from its stored tokens
        on, this cache can run as one sequential step (`StepBatch.sequential`: a `NativeHook`
        whose function takes one row per sequence at a time, each row's KV the same bytes as
        its own decode step would write), 1 where none (this default)."""
        return 1


class KVMemory(ABC):
    """The scheduler-facing side: memory held for sequences between steps."""

    @abstractmethod
    def free(self, seq_id: int) -> None:
        """Release everything stored for `seq_id` (no-op for an unknown id)."""

    @abstractmethod
    def stored_tokens(self, seq_id: int) -> int:
        """Tokens whose KV is stored for `seq_id` (0 when unknown)."""

    @abstractmethod
    def bytes_used(self) -> int:
        """Bytes of KV actually stored (all sequences, all layers)."""

    @abstractmethod
    def bytes_reserved(self) -> int:
        """Bytes of KV memory held, including room not yet filled."""

    # ---- a store without a bounded pool keeps these defaults -----------------------------------

    def reserve(self, seq_id: int, num_tokens: int) -> bool:
        """Make room for `num_tokens` more tokens of `seq_id`; False (nothing changed) if full."""
        return True

    def can_admit(self, num_tokens: int) -> bool:
        """Whether a new sequence of `num_tokens` tokens should be admitted now."""
        return True

    def capacity_tokens(self) -> int | None:
        """The most tokens one sequence could ever hold (None: unbounded)."""
        return None

    def match_prefix(self, seq_id: int, token_ids: list[int]) -> int:
        """Attach cached KV of a prefix of `token_ids` to the new `seq_id`; return its length."""
        return 0

    def publish(self, seq_id: int, token_ids: list[int]) -> None:
        """Offer the stored KV of `seq_id` (holding `token_ids`) for prefix sharing."""
        return None

    def prefix_digest(self, limit: int) -> tuple[int, str, list[bytes]] | None:
        """(block size, content identity, up to `limit` newest cached block hashes): what a
        request router needs to send a prompt where its prefix is cached. None when this
        store shares no prefixes."""
        return None

    def swap_out(self, seq_id: int) -> bool:
        """Move `seq_id` off the compute device to make room; False if not possible."""
        return False

    def swap_in(self, seq_id: int) -> bool:
        """Bring a swapped-out `seq_id` back; False if it does not fit yet."""
        return True

    def record_preemption(self) -> None:
        """Note that a sequence was dropped to be recomputed later."""
        return None

    def close(self) -> None:
        """Release what the store holds besides memory (threads, files); idempotent."""
        return None

    def stats(self) -> KVReport:
        """Memory statistics for reports."""
        return KVReport(type(self).__name__, self.bytes_used(), self.bytes_reserved())


@dataclass(frozen=True)
class KVReport:
    """`KVMemory.stats()`: what a KV store holds, read by attribute (`as_dict()` for JSON).

    `format`, `placement` and `selection` are each axis's own readings (a pruning selection's
    evictions, a tiered placement's prefetch, a packed format's channel split and kernels), as
    the axis reports them; a store without axes leaves them empty.
    """

    strategy: str
    kv_bytes_used: int
    kv_bytes_reserved: int
    pool: PoolReport | None = None
    format: dict[str, Any] = field(default_factory=dict)
    placement: dict[str, Any] = field(default_factory=dict)
    selection: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """JSON-serializable form."""
        return {
            "strategy": self.strategy,
            "kv_bytes_used": self.kv_bytes_used,
            "kv_bytes_reserved": self.kv_bytes_reserved,
            "pool": self.pool.as_dict() if self.pool is not None else None,
            "format": self.format,
            "placement": self.placement,
            "selection": self.selection,
        }


log = logging.getLogger(__name__)

# Set once PyTorch's fused CPU attention refused the dispatch it was given (see `sdpa`).
_math_only = False


def sdpa(q, k, v, attn_mask=None, scale=None) -> torch.Tensor:
    """`F.scaled_dot_product_attention`, or its math kernel where the fused one cannot run:
    PyTorch 2.13's bfloat16 flash attention on a CPU with AMX, with its dispatch held to AVX2
    (`ATEN_CPU_CAPABILITY=avx2`, how the AVX2 path is reproduced here), fails with "pack_vnni2
    is only supported when avx512 is supported"; the math kernel then serves every later call."""
    global _math_only
    if not _math_only:
        try:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
        except RuntimeError as e:
            if "pack_vnni" not in str(e):
                raise
            log.warning("PyTorch's fused CPU attention cannot run here (%s); using its math "
                        "kernel", e)  # fmt: skip
            _math_only = True
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)


def values_in_keys(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `v` is a view of the first channels of `k`, as a latent (MLA) cache's values are.

    Attention then runs with `k` as the values and keeps the output's first channels: the
    equal-width case is the fast (flash) one, and the few extra channels (64 of 576 for
    DeepSeek-V3) cost less than the unfused path that a narrower value would take.
    """
    return (
        v.shape[-1] < k.shape[-1]
        and v.shape[:-1] == k.shape[:-1]
        and v.stride() == k.stride()
        and v.data_ptr() == k.data_ptr()
    )


def attention_one(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_past: int, scale: float
) -> torch.Tensor:
    """Grouped-query causal attention of one sequence's new queries over its stored KV.

    q: [T, Hq, D] new queries; k: [Hkv, S, D], v: [Hkv, S, Dv] with S = num_past + T (the new
    tokens last); Dv < D for a latent cache. Query t sees the `num_past` stored tokens and new
    tokens 0..t. Returns [T, Hq, Dv].
    """
    t, hq, d = q.shape
    hkv, s, _ = k.shape
    dv = v.shape[-1]
    g = hq // hkv
    if (t > 1 and q.device.type == "cpu" and q.dtype == torch.float32
            and (dv == d or values_in_keys(k, v))):  # fmt: skip
        return _prompt_chunk(q, k, v, num_past, scale)
    # Query heads of a KV group share its keys, so fold them into the query-length axis instead
    # of repeating K/V: rows are ordered (g, t).  q: [T, Hq, D] -> [1, Hkv, G*T, D]
    qg = q.view(t, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * t, d)
    mask = None
    if t > 1:
        # allowed[t, j] = j <= num_past + t
        dev = q.device
        allowed = (torch.arange(s, device=dev).unsqueeze(0)
                   <= (num_past + torch.arange(t, device=dev)).unsqueeze(1))  # fmt: skip
        mask = allowed.repeat(g, 1)  # [G*T, S]
    if values_in_keys(k, v):
        v = k
    out = sdpa(qg, k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, scale=scale)[..., :dv]
    # out: [1, Hkv, G*T, Dv] -> [T, Hq, Dv]
    return out.view(hkv, g, t, dv).permute(2, 0, 1, 3).reshape(t, hq, dv)


def _prompt_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_past: int, scale: float
) -> torch.Tensor:
    """`attention_one` of a prompt chunk (T > 1 queries, float32, CPU) as two parts merged by
    their log-sum-exp: every query over the `num_past` stored tokens (no mask), and over the
    chunk's own tokens causally (PyTorch's flash kernel told `is_causal`, query heads as heads,
    the chunk's K/V repeated per group: T tokens, not S). The one masked call it replaces
    expanded a [G*T, S] mask to floats and read it per tile: 1.12-1.24x slower for 1.5K-7.7K
    stored tokens before a 512-token chunk (SmolLM2's shape, 2 threads; BENCHMARKS.md, and
    benchmarks/prefill_attention.py for a whole prefill both ways)."""
    t, hq, d = q.shape
    hkv = k.shape[0]
    dv, g = v.shape[-1], hq // hkv
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if values_in_keys(k, v):
        v = k
    own_k, own_v = k[:, num_past:], v[:, num_past:]
    if g > 1:
        own_k, own_v = own_k.repeat_interleave(g, 0), own_v.repeat_interleave(g, 0)
    out, lse = flash(q.permute(1, 0, 2).unsqueeze(0), own_k.unsqueeze(0), own_v.unsqueeze(0),
                     0.0, True, scale=scale)[:2]  # fmt: skip
    out, lse = out[0].view(hkv, g, t, -1), lse[0].view(hkv, g, t)  # heads (h, g)
    if num_past:
        qg = q.view(t, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * t, d)  # rows (g, t)
        past, past_lse = flash(qg, k[None, :, :num_past], v[None, :, :num_past], 0.0, False,
                               scale=scale)[:2]  # fmt: skip
        out, _ = merge_partials(
            [(past[0].view(hkv, g, t, -1), past_lse[0].view(hkv, g, t)), (out, lse)]
        )
    return out[..., :dv].permute(2, 0, 1, 3).reshape(t, hq, dv)


def block_tokens(blocks: torch.Tensor, block_size: int, total: int) -> torch.Tensor:
    """Token positions [H, S] of the block indices `blocks` [H, B] of a sequence of `total`
    tokens, its last block (which may be partly filled) last."""
    offs = torch.arange(block_size, device=blocks.device)
    pos = (blocks.unsqueeze(-1) * block_size + offs).flatten(1)
    return pos[:, : pos.shape[1] - (-(-total // block_size) * block_size - total)]


def take_tokens(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Tokens `idx` [H, S'] of `x` [H, S, D], per head: [H, S', D]."""
    return x.gather(1, idx.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def attention_runs(
    q: torch.Tensor,
    runs: list[tuple[torch.Tensor, torch.Tensor]],
    num_past: int,
    scale: float,
) -> torch.Tensor:
    """`attention_one` over K/V held in several pieces, without concatenating them.

    runs: (k [Hkv, S_r, D], v [Hkv, S_r, Dv]) pairs (typically strided views into a paged
    arena) in token order, together S = num_past + T tokens. Each piece is attended separately
    and the partial results are merged with their log-sum-exp, as flash-decoding does; copying
    the pieces into one tensor would read and write every stored byte once more per layer.
    """
    if len(runs) == 1:
        return attention_one(q, runs[0][0], runs[0][1], num_past, scale)
    if q.device.type != "cpu":  # the split-softmax op used below is CPU's; elsewhere gather
        k = torch.cat([r[0] for r in runs], dim=1)
        if all(values_in_keys(*r) for r in runs):  # a latent cache: one copy, not two
            v = k[..., : runs[0][1].shape[-1]]
        else:
            v = torch.cat([r[1] for r in runs], dim=1)
        return attention_one(q, k, v, num_past, scale)
    t, hq, d = q.shape
    hkv = runs[0][0].shape[0]
    dv = runs[0][1].shape[-1]
    g = hq // hkv
    qg = q.view(t, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * t, d)  # rows (g, t)
    outs, lses = [], []
    start = 0
    for k, v in runs:
        s = k.shape[1]
        mask = None
        if start + s > num_past + 1 or (t > 1 and start + s > num_past):
            # This piece holds some of the step's own tokens: causal mask, as an additive float.
            pos = start + torch.arange(s, device=q.device)
            now = num_past + torch.arange(t, device=q.device)
            allowed = pos.unsqueeze(0) <= now.unsqueeze(1)  # [T, S_r]
            mask = torch.zeros(t, s, dtype=q.dtype, device=q.device)
            mask.masked_fill_(~allowed, float("-inf"))
            mask = mask.repeat(g, 1)
        out, lse = _attend_piece(qg, k.unsqueeze(0), v.unsqueeze(0), mask, scale)
        if mask is not None:
            # A query that sees nothing of this piece (it lies after the query) must add nothing;
            # the kernel's output for an all-masked row is not defined to be empty.
            blind = ~allowed.any(1).repeat(g)  # [G*T]
            if blind.any():
                out = out.masked_fill(blind[:, None], 0.0)
                lse = lse.masked_fill(blind, float("-inf"))
        outs.append(out)
        lses.append(lse)
        start += s
    out, _ = merge_partials(list(zip(outs, lses, strict=True)))  # [1, Hkv, G*T, Dv]
    return out.view(hkv, g, t, dv).permute(2, 0, 1, 3).reshape(t, hq, dv)


def _attend_piece(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normalized out [1, H, R, Dv], lse [1, H, R]) of q [1, H, R, D] over one piece k
    [1, H, S, D], v [1, H, S, Dv], with an additive float mask [R, S] or None. CPU only.

    CPU's flash op needs Dv == D; latent values (the keys' first channels) go through it with
    the keys as values, other narrower values through the unfused math (scores [R, S] at once).
    """
    dv = v.shape[-1]
    if values_in_keys(k, v):
        v = k
    if v.shape[-1] == k.shape[-1]:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=mask, scale=scale
        )
        return out[..., :dv], lse
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale  # [1, H, R, S]
    if mask is not None:
        scores += mask
    lse = scores.logsumexp(-1)
    p = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num_(0.0)
    return (p @ v.float()).to(q.dtype), lse


def merge_partials(
    parts: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over disjoint pieces of the keys: (normalized out [..., D], lse [...])
    per piece -> (out, lse) over all of them, each piece weighted by exp(lse_r - lse).
    A row that saw nothing in any piece (all lse -inf) comes out as zeros."""
    if len(parts) == 2:
        # The common case (e.g. host + device pieces) in 5 small ops instead of 9: the weight
        # of the first piece is sigmoid(lse1 - lse2); NaN (both -inf) means neither saw a key.
        (o1, l1), (o2, l2) = parts
        w = torch.sigmoid(l1 - l2).nan_to_num_(0.0).unsqueeze(-1)
        return torch.lerp(o2, o1, w), torch.logaddexp(l1, l2)
    lse = torch.stack([p[1] for p in parts])  # [P, ...]
    weights = torch.softmax(lse, dim=0).nan_to_num_(0.0).unsqueeze(-1)
    return (weights * torch.stack([p[0] for p in parts])).sum(0), lse.logsumexp(0)


class ContiguousKVCache(KVCache, KVMemory):
    """One growing buffer per sequence, [layers, Hkv, capacity, D] for keys and for values.

    The simplest correct store; the unified memory pool's paged strategies replace it. With
    `value_dim` it is a latent (MLA) cache: only keys are stored and a value is the first
    `value_dim` channels of its key (the `v` handed to `append` is ignored).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        scale: float | None = None,
        value_dim: int | None = None,
    ) -> None:
        if value_dim is not None and not 0 < value_dim <= head_dim:
            raise ValueError(f"value_dim = {value_dim}; allowed: 1 to head_dim ({head_dim})")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.value_dim = value_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.scale = scale if scale is not None else head_dim**-0.5
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}  # empty for a latent cache
        self._len: dict[int, int] = {}
        self._batch: StepBatch | None = None

    def _grow(self, seq_id: int, need: int) -> None:
        cap = self._k[seq_id].shape[2] if seq_id in self._k else 0
        if need <= cap:
            return
        new_cap = max(need, 2 * cap, 64)
        shape = (self.num_layers, self.num_kv_heads, new_cap, self.head_dim)
        n = self._len.setdefault(seq_id, 0)
        for bufs in (self._k,) if self.value_dim is not None else (self._k, self._v):
            buf = torch.empty(shape, dtype=self.dtype, device=self.device)
            if n:
                buf[:, :, :n] = bufs[seq_id][:, :, :n]
            bufs[seq_id] = buf

    def begin_step(self, batch: StepBatch) -> None:
        for sid, n in zip(batch.seq_ids, batch.query_lens, strict=True):
            self._grow(sid, self._len.get(sid, 0) + n)
        self._batch = batch

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        b = self._batch
        for i, sid in enumerate(b.seq_ids):
            n0, rows = self._len[sid], b.rows(i)
            t = b.query_lens[i]
            # k[rows]: [T, Hkv, D] -> buffer slot [Hkv, T, D]
            self._k[sid][layer, :, n0 : n0 + t] = k[rows].transpose(0, 1)
            if self.value_dim is None:
                self._v[sid][layer, :, n0 : n0 + t] = v[rows].transpose(0, 1)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        b = self._batch
        out = q.new_empty(*q.shape[:2], self.value_dim or self.head_dim)  # [N, Hq, Dv]
        for i, sid in enumerate(b.seq_ids):
            n0, rows, t = self._len[sid], b.rows(i), b.query_lens[i]
            k = self._k[sid][layer, :, : n0 + t]
            if self.value_dim is None:
                v = self._v[sid][layer, :, : n0 + t]
            else:
                v = k[..., : self.value_dim]
            out[rows] = attention_one(q[rows], k, v, n0, self.scale)
        return out

    def end_step(self) -> None:
        b = self._batch
        for sid, n in zip(b.seq_ids, b.query_lens, strict=True):
            self._len[sid] += n
        self._batch = None

    def abort_step(self) -> None:
        self._batch = None

    def free(self, seq_id: int) -> None:
        self._k.pop(seq_id, None)
        self._v.pop(seq_id, None)
        self._len.pop(seq_id, None)

    def stored_tokens(self, seq_id: int) -> int:
        return self._len.get(seq_id, 0)

    def _elem_bytes(self) -> int:
        parts = 1 if self.value_dim is not None else 2  # keys (and values)
        return parts * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def bytes_used(self) -> int:
        return sum(self._len.values()) * self._elem_bytes()

    def bytes_reserved(self) -> int:
        return sum(k.shape[2] for k in self._k.values()) * self._elem_bytes()

"""Serve a Hugging Face `transformers` model from any unikv strategy, as its `Cache` object.

`StrategyCache(strategy, num_layers)` plugs into `model(..., past_key_values=cache)` and
`model.generate(..., past_key_values=cache)`. Each layer's `update` writes the new keys/values
through the strategy into pool blocks and hands attention the stored keys/values of the whole
sequence, read back from the strategy (for `full`, the stored values themselves). It exists so
that any strategy can be checked against, and used with, transformers' own attention; unikv's
engine attends on the stored form directly and never goes through here.

Optional: it needs Hugging Face `transformers` >= 5.24 (the tested floor; the per-layer
`Cache(layers=...)` API it uses exists since 4.56), which is in the `hf`, `test` and `bench`
extras, not a
runtime dependency. Nothing in the runtime packages imports this module; importing it without
transformers raises an ImportError saying what to install.
"""

from __future__ import annotations

import torch

try:
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as e:  # optional: only the tests and benchmarks drive transformers models
    raise ImportError(
        "unikv.kvstrategies.hf_cache needs Hugging Face transformers>=5.24 "
        "(pip install 'unikv[hf]'); the unikv engine itself does not use it"
    ) from e

from .kv import StepBatch
from .strategy import KVStrategy


class _StrategyLayer(CacheLayerMixin):
    """One decoder layer's view of the shared strategy."""

    is_sliding = False
    is_compileable = False

    def __init__(self, owner: StrategyCache, layer: int) -> None:
        super().__init__()
        self.owner, self.layer = owner, layer
        self.is_initialized = False  # set by the mixin since 5.x; 4.56 has no such attribute

    def lazy_initialization(
        self, key_states: torch.Tensor, value_states: torch.Tensor | None = None
    ) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store [B, H, T, D] keys/values; return the sequence's stored [B, H, S, D]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.owner._update(self.layer, key_states, value_states)

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        # transformers < 5.x passes the query's cache positions, later ones its length.
        n = query_length if isinstance(query_length, int) else int(query_length.shape[0])
        return self.owner.stored() + n, 0

    def get_seq_length(self) -> int:
        return self.owner.seen

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # abstract in 4.56..4.57
        return -1


class StrategyCache(Cache):
    """A transformers `Cache` whose storage is a unikv `KVStrategy` (batch rows = sequences)."""

    def __init__(self, strategy: KVStrategy, num_layers: int, first_seq_id: int = 0) -> None:
        super().__init__(layers=[_StrategyLayer(self, i) for i in range(num_layers)])
        self.strategy, self.num_layers = strategy, num_layers
        self.first_seq_id = first_seq_id
        self.seen = 0  # tokens fed so far (positions), which may exceed what a strategy keeps
        self._seq_ids: list[int] = []

    def stored(self) -> int:
        """Tokens stored for the first sequence (all rows advance together)."""
        return self.strategy.stored_tokens(self.first_seq_id)

    def _update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        b, h, t, d = k.shape
        if layer == 0:
            self._seq_ids = [self.first_seq_id + i for i in range(b)]
            for sid in self._seq_ids:
                if not self.strategy.reserve(sid, t):
                    raise RuntimeError(f"no room in the pool for {t} tokens of sequence {sid}")
            self.strategy.begin_step(StepBatch(self._seq_ids, [t] * b))
        # [B, H, T, D] -> packed [B*T, H, D]
        self.strategy.append(
            layer, k.transpose(1, 2).reshape(b * t, h, d), v.transpose(1, 2).reshape(b * t, h, d)
        )
        keys, values = self.strategy.read(layer)  # per sequence [H, S, D]
        if layer == self.num_layers - 1:
            self.strategy.end_step()
            self.seen += t
        return torch.stack(keys).to(k.dtype), torch.stack(values).to(v.dtype)

    def free(self) -> None:
        """Release every sequence's blocks."""
        for sid in self._seq_ids:
            self.strategy.free(sid)

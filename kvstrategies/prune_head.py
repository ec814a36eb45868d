"""The pruning head of `learned_prune`: a small MLP that predicts, when a token's KV is written,
how much attention the token will receive later, per layer and KV head; and its training.

Input per (token, layer, KV head): the token's key and value for that head, as the cache
stores them (the key after RoPE), and a learned layer embedding; one MLP shared by all layers
and heads (3 layers, 144 -> 288 -> 288 -> 1: about 125K parameters for SmolLM2). Output: the
predicted log of the attention the token receives from later queries.

Target (training): the frozen model reads windows of text; for each token j, layer and KV
head, A_j = the mean over later queries i > j of the attention weight p(i, j), taking for
each query the largest weight over the query heads that share the KV head (the query head
that needs the token most decides). Tokens with fewer than `min_later` later queries in their
window are left out (their mean is too noisy). Loss: mean squared error on log(A_j + 1e-6).
Why this target: eviction removes a token for every later query at once, so what it costs is
the attention later queries would have paid it; max over the group because one head's need
is enough to keep it; the log because attention spans orders of magnitude.

The head file (`.pt`) records the model identity and the KV shape; loading it for another
model or shape is a `HeadMismatch` naming both.
"""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from unikv.storage.files import torch_save_atomic

from .kv import ContiguousKVCache, KVSpec

FORMAT = 1
EPS = 1e-6


class HeadMismatch(ValueError):
    """A head file made for another model or KV shape."""


class PruneHead(nn.Module):
    """MLP over (key, value) of one KV head -> predicted log attention. Shared by all layers
    with a layer embedding (the default), or one small MLP per layer (`per_layer`: the same
    parameter budget split 30 ways, hidden 25 for SmolLM2)."""

    def __init__(self, num_layers: int, head_dim: int, hidden: int = 288, layer_dim: int = 16,
                 per_layer: bool = False):  # fmt: skip
        super().__init__()
        self.num_layers, self.head_dim = num_layers, head_dim
        self.hidden, self.layer_dim, self.per_layer = hidden, layer_dim, per_layer
        d = 2 * head_dim
        if per_layer:

            def weight(*shape):  # per layer, scaled like nn.Linear's default init
                bound = shape[-2] ** -0.5
                return nn.Parameter(torch.empty(num_layers, *shape).uniform_(-bound, bound))

            self.w = nn.ParameterList(
                [weight(d, hidden), weight(hidden, hidden), weight(hidden, 1)]
            )
            self.b = nn.ParameterList(
                [nn.Parameter(torch.zeros(num_layers, n)) for n in (hidden, hidden, 1)]
            )
        else:
            self.layer_emb = nn.Embedding(num_layers, layer_dim)
            self.net = nn.Sequential(
                nn.Linear(d + layer_dim, hidden),
                nn.GELU(),
                nn.Linear(hidden, hidden),
                nn.GELU(),
                nn.Linear(hidden, 1),
            )
        # Inputs are normalised by fixed statistics measured on the training data.
        self.register_buffer("mean", torch.zeros(d))
        self.register_buffer("std", torch.ones(d))

    def forward(self, kv: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
        """kv: [..., 2 * head_dim] (key then value of one head); layer: [...] -> [...]."""
        x = (kv - self.mean) / self.std
        if not self.per_layer:
            return self.net(torch.cat([x, self.layer_emb(layer)], dim=-1)).squeeze(-1)
        for i, (w, b) in enumerate(zip(self.w, self.b, strict=True)):
            x = torch.einsum("...i,...ij->...j", x, w[layer]) + b[layer]
            if i < 2:
                x = F.gelu(x)
        return x.squeeze(-1)

    @torch.no_grad()
    def score(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Predicted log attention of new tokens: k, v [N, Hkv, D] -> [N, Hkv]."""
        kv = torch.cat([k, v], dim=-1).float()
        idx = torch.full(kv.shape[:-1], layer, dtype=torch.long)
        return self.forward(kv, idx)

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def save(self, path: str | os.PathLike[str], identity: str, num_kv_heads: int, meta: dict):
        """Write the head file atomically (a crash leaves the old file or none)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        blob = {
            "format": FORMAT, "identity": identity, "num_layers": self.num_layers,
            "num_kv_heads": num_kv_heads, "head_dim": self.head_dim, "hidden": self.hidden,
            "layer_dim": self.layer_dim, "per_layer": self.per_layer, "state": self.state_dict(),
            "meta": meta,
        }  # fmt: skip
        torch_save_atomic(blob, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str], identity: str, shape: tuple[int, int, int]):
        """The head in `path`, checked against the model identity and (layers, kv heads, dim)."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(
                f"pruning head file not found: {path} (make one with "
                "`unikv tune --kv_optimization=learned_prune --text FILE --out DIR`)"
            )
        try:
            blob = torch.load(path, weights_only=True)
            if blob.get("format") != FORMAT:
                raise ValueError(f"format {blob.get('format')!r}, expected {FORMAT}")
        except Exception as e:
            raise ValueError(f"{path} is not a unikv pruning head file ({e})") from None
        found = (blob["num_layers"], blob["num_kv_heads"], blob["head_dim"])
        if blob["identity"] != identity or found != tuple(shape):
            raise HeadMismatch(
                f"pruning head {path} was trained for {blob['identity']!r} with KV shape "
                f"{found} (layers, kv heads, head dim); this model is {identity!r} with "
                f"{tuple(shape)}: train one with `unikv tune --kv_optimization=learned_prune`"
            )
        head = cls(blob["num_layers"], blob["head_dim"], blob["hidden"], blob["layer_dim"],
                   blob.get("per_layer", False))  # fmt: skip
        head.load_state_dict(blob["state"])
        return head.eval()


# ---- training data ------------------------------------------------------------------------------


class TargetRecorder(ContiguousKVCache):
    """A plain cache that also keeps, per layer, the stored K/V and the attention each token
    receives from later queries (mean over queries of the max over the group's query heads).
    The engine prefills one training window through it (`engine.recording`)."""

    def __init__(self, spec: KVSpec, gap: int) -> None:
        super().__init__(spec.num_layers, spec.num_kv_heads, spec.head_dim, torch.float32)
        self.gap = gap
        self.kv: list[torch.Tensor] = []  # per layer [T, Hkv, 2D]
        self.target: list[torch.Tensor] = []  # per layer [T, Hkv]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        super().append(layer, k, v)
        self.kv.append(torch.cat([k, v], dim=-1).float())

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        out = super().attend(layer, q)
        sid = self._batch.seq_ids[0]
        t, hq, d = q.shape
        hkv = self.num_kv_heads
        k = self._k[sid][layer, :, :t].float()  # [Hkv, T, D]
        qg = q.float().view(t, hkv, hq // hkv, d)
        scores = torch.einsum("thgd,hsd->hgts", qg, k) * self.scale
        causal = torch.ones(t, t, dtype=torch.bool).triu(1)
        p = scores.masked_fill(causal, -math.inf).softmax(-1)  # [Hkv, G, T(query), T(key)]
        p = p.amax(1)  # max over the group's query heads: [Hkv, T, T]
        # Queries at least `gap` after the key: nearer ones are served by the recent window.
        far = torch.ones(t, t, dtype=torch.bool).tril(-self.gap)  # [query, key]: i >= j + gap
        later = far.sum(0)  # such queries per key
        received = (p * far).sum(1) / later.clamp(min=1)  # [Hkv, T]
        self.target.append(received.T)
        return out

    def samples(self, rng: random.Random, per_window: int, min_later: int):
        """(inputs [M, 2D], layer ids [M], log targets [M]) of `per_window` random tokens of
        the window that have at least `min_later` later queries."""
        usable = len(self.target[0]) - min_later
        pick = torch.tensor(sorted(rng.sample(range(usable), min(per_window, usable))))
        xs, ls, ys = [], [], []
        for layer, (kv, tgt) in enumerate(zip(self.kv, self.target, strict=True)):
            xs.append(kv[pick].reshape(-1, kv.shape[-1]))  # [P * Hkv, 2D]
            ys.append(torch.log(tgt[pick].reshape(-1) + EPS))
            ls.append(torch.full((xs[-1].shape[0],), layer, dtype=torch.long))
        return torch.cat(xs), torch.cat(ls), torch.cat(ys)


@dataclass(slots=True)
class TrainResult:
    head: PruneHead
    samples: int
    val_loss: float
    val_corr: float  # Pearson correlation of prediction and target on held-out windows
    baseline_loss: float  # predicting the per-layer mean: what the head must beat
    seconds: float


def fit(x: torch.Tensor, lay: torch.Tensor, y: torch.Tensor, windows: int, num_layers: int,
        head_dim: int, epochs: int = 6, lr: float = 2e-3, batch: int = 4096, seed: int = 0,
        progress: bool = False, per_layer: bool = False) -> TrainResult:  # fmt: skip
    """Train a head on recorded samples (inputs x [M, 2D], layer ids, log targets y) from
    `windows` windows in order; the last eighth of the windows is held out for the reported
    loss and correlation."""
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    per = x.shape[0] // windows  # samples per window
    n_val = max(1, windows // 8) * per
    xt, lt, yt, xv, lv, yv = (
        x[:-n_val],
        lay[:-n_val],
        y[:-n_val],
        x[-n_val:],
        lay[-n_val:],
        y[-n_val:],
    )
    if per_layer:  # the shared head's parameter budget, split over the layers
        head = PruneHead(num_layers, head_dim, hidden=25, per_layer=True)
    else:
        head = PruneHead(num_layers, head_dim)
    head.mean.copy_(xt.mean(0))
    head.std.copy_(xt.std(0).clamp(min=1e-3))
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=1e-4)
    steps = epochs * math.ceil(xt.shape[0] / batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)
    bar = tqdm(total=steps, desc="training head", unit="step", disable=not progress)
    for _ in range(epochs):
        perm = torch.randperm(xt.shape[0])
        for s in range(0, xt.shape[0], batch):
            idx = perm[s : s + batch]
            loss = F.mse_loss(head(xt[idx], lt[idx]), yt[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
    bar.close()
    head.eval()
    with torch.no_grad():
        pred = head(xv, lv)
        val = F.mse_loss(pred, yv).item()
        corr = torch.corrcoef(torch.stack([pred, yv]))[0, 1].item()
        means = torch.zeros(num_layers).index_add_(0, lt, yt) / torch.bincount(
            lt, minlength=num_layers
        )
        base = F.mse_loss(means[lv], yv).item()
    return TrainResult(head, xt.shape[0], val, corr, base, time.perf_counter() - t0)

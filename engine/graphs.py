"""A decode step's dense work as CUDA graphs, with the KV seam as their only break (issue 34).

What lives here: `StepGraphs` (a Llama model's layers for one batch bucket of rows as L + 1
captured regions) and the `model.layers` registry entry `graphs` (CUDA) that runs a step
through them. What does not: the ops a region is made of (`engine.fused`'s `qkv_ops` and
`out_ops`, each matmul, norm and rope through its own registry entry), attention (the KV
strategy's `append` and `attend`, run as they are between two regions).

Why: on a GPU a small model's decode step is bound by kernel launches, not by the device: a
Llama layer is about fifteen kernels (norms, three products, RoPE, SiLU, adds) and each costs
the Python, the dispatcher and the launch of one call. Captured once per batch bucket, a
region is one `replay()`; the CPU does the same job with one native call per step
(`engine.fused`), and both keep the strategy's attention a plug point.

The regions, as gemv.c's decode_layers splits a step: region 0 is layer 0's norm, QKV
projection and RoPE; region r (0 < r < L) is layer r - 1's output projection, residual, norm
and MLP and then layer r's norm, QKV projection and RoPE; region L is the last layer's output
half. Between region r and r + 1 the strategy appends layer r's keys and values and attends,
eagerly, and its output is copied into the static buffer region r + 1 reads.

Rows: a step of n rows runs in the smallest bucket (`BUCKETS`) that holds it; the rows past
n are padding (the positions and values an earlier step left, or zeros): every op of a region
works row by row, so they never reach the n real rows, and only the real rows go to the KV
seam. A step of more rows than the largest bucket (a long prefill chunk, where launches are a
small part) takes the eager path (`fused.layers_python`) inside the same call.

Captured on a bucket's first use, or by the warm-up before a server is ready
(`capture_buckets`: every bucket), after one eager run of every region on the model's side
stream (what PyTorch asks: cuBLAS's workspaces and every lazy initialization happen outside the
capture). When a breaker whose op runs in the regions switches its implementation, the graphs
are stale and every bucket's are captured again (`_graphs`, `_drop`). The captured numbers are
those of the same ops run eagerly on the bucket's rows; against the eager step of n rows, the
products may differ in their last bits (cuBLAS chooses its kernel by the row count).

Not yet run on a GPU (none was lent when it was written): tests/test_cuda.py holds its GPU
tests, tests/test_graphs.py runs the same code on the CPU without the capture.
"""

from __future__ import annotations

import logging
from bisect import bisect_left

import torch

from unikv.kernels.operators import FnImplementation, NotMine, register, switches
from unikv.settings.config import env_switch

from .fused import layers_python, out_ops, qkv_ops

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)  # batch sizes captured (vLLM's: 1, 2, 4, 8k)
OFF_ENV = "UNIKV_CUDA_GRAPHS"  # "0": the `graphs` entry is unavailable (vLLM's --enforce-eager)


def bucket(n: int) -> int | None:
    """The smallest bucket holding n rows, or None past the largest."""
    i = bisect_left(BUCKETS, n)
    return BUCKETS[i] if n >= 1 and i < len(BUCKETS) else None


class StepGraphs:
    """The layers of `model` for steps of up to `rows` rows (one bucket) as L + 1 regions around
    the KV seam, each captured as a CUDA graph (`capture=True`: a CUDA model) or run eagerly on
    the same static buffers (`capture=False`: what the CPU tests run, the same code but for
    the capture and the replay).

    Static buffers: x (the step's input rows), pos (their positions), attn (the attention of the
    layer before the region, written between regions); each region's outputs are its own
    tensors ((x, q, k, v) for r < L, (x,) for the last), kept, and read by the next region
    (x) and the KV seam (q, k, v)."""

    def __init__(self, model, rows: int, capture: bool, pool=None, stream=None) -> None:
        cfg = model.cfg
        dev, dtype = model.device, model.dtype
        self.model, self.rows, self.layers = model, rows, cfg.num_layers
        self.x = torch.zeros(rows, cfg.hidden_size, device=dev, dtype=dtype)
        self.pos = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.attn = torch.zeros(rows, cfg.num_heads, cfg.head_dim, device=dev, dtype=dtype)
        self.outs: list[tuple[torch.Tensor, ...]] = []
        self.graphs: list[torch.cuda.CUDAGraph] = []
        if capture:
            self._capture(pool, stream)
        else:  # every region once, so each has outputs for the next to read
            for r in range(self.layers + 1):
                self.outs.append(self._region(r))
        # The implementations the regions were made with (read after the capture: the breakers
        # it used first are in it), and the switch count they were checked at (`current`).
        self.serving = _serving(model)
        self.switches = switches()

    def current(self) -> bool:
        """Whether every breaker of the model still serves with the implementation the regions
        hold (checked only when some breaker anywhere has switched since the last check)."""
        now = switches()
        if now != self.switches:
            ops = self.model.operators
            if any(ops[op].active.name != name for op, name in self.serving.items()):
                return False
            self.switches = now
        return True

    def _region(self, r: int) -> tuple[torch.Tensor, ...]:
        """Region r's ops on the static buffers (and region r - 1's x)."""
        m = self.model
        x = self.x if r == 0 else self.outs[r - 1][0]
        if r > 0:
            x = out_ops(m, r - 1, x, self.attn)
        if r == self.layers:
            return (x,)
        return (x, *qkv_ops(m, r, x, self.pos))

    def _capture(self, pool, stream) -> None:
        """The warm-up and every capture on one side stream, the model's for all its buckets:
        cuBLAS keeps a workspace per stream (made on its first use, which must not happen
        inside a capture), and captures that share a pool should share their stream."""
        rope = self.model.rope
        side = stream if stream is not None else torch.cuda.Stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream())
        # (the stream is set here, outside each capture, so that a capture that fails, whose
        # own exit may stop before it sets the stream back, leaves the caller's stream as it was)
        with torch.cuda.stream(side):
            try:
                for r in range(self.layers + 1):  # warm-up, eagerly: lazy initializations
                    self.outs.append(self._region(r))
                self.outs.clear()
                for r in range(self.layers + 1):
                    self.graphs.append(self._record(r, pool, side))
            finally:
                rope._last = None
        torch.cuda.current_stream().wait_stream(side)

    def _record(self, r: int, pool, stream) -> torch.cuda.CUDAGraph:
        """Region r captured (its outputs appended to `outs`: what its replays write)."""
        graph = torch.cuda.CUDAGraph()
        # RotaryTable keeps the last positions' cos and sin: each region gathers its own
        # (inside its graph), and no eager call later reads a graph's tensors.
        self.model.rope._last = None
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            self.outs.append(self._region(r))
        return graph

    def _replay(self, r: int) -> None:
        if self.graphs:
            self.graphs[r].replay()
            return
        if r == 0:  # `pos` is the same tensor every step, with new values: gathered anew
            self.model.rope._last = None
        self.outs[r] = self._region(r)

    def run(self, x: torch.Tensor, positions: torch.Tensor, kv) -> torch.Tensor:
        """The step's rows x [n, hidden] (n <= rows) at `positions` through every layer, the
        strategy appending and attending between regions: the rows out [n, hidden]."""
        n = x.shape[0]
        self.x[:n].copy_(x)
        self.pos[:n].copy_(positions)
        for r in range(self.layers + 1):
            self._replay(r)
            if r == self.layers:
                break
            _, q, k, v = self.outs[r]
            try:
                kv.append(r, k[:n], v[:n])
                a = kv.attend(r, q[:n])
            except Exception as e:  # the cache's failure, not the graphs': no re-run eagerly
                raise NotMine(e) from e
            self.attn[:n].copy_(a.reshape(n, *self.attn.shape[1:]))
        return self.outs[self.layers][0][:n].clone()


def _serving(model) -> dict[str, str]:
    """The implementation each of the model's breakers serves with, but for the ops that call
    the regions rather than run inside them."""
    return {op: name for op, name in model.operators.serving().items()
            if op not in ("model.layers", "model.step")}  # fmt: skip


def _graphs(model, rows: int) -> StepGraphs:
    """The model's graphs for a bucket: captured on first use; when a breaker the regions use
    has switched its implementation (the graphs hold the kernels chosen when they were
    captured), every bucket's are dropped (`_drop`) and this one captured again."""
    kept = model.__dict__.get("_step_graphs", {})
    got = kept.get(rows)
    if got is not None and got.current():
        return got
    if got is not None:
        _drop(model)
    shared = model.__dict__.get("_graph_shared")  # (memory pool, stream): every bucket's
    if shared is None:
        shared = model.__dict__["_graph_shared"] = (torch.cuda.graph_pool_handle(),
                                                    torch.cuda.Stream(model.device))  # fmt: skip
    try:
        got = StepGraphs(model, rows, capture=True, pool=shared[0], stream=shared[1])
    except BaseException:
        _drop(model)  # its graphs captured so far share the stream with the other buckets'
        raise
    model.__dict__.setdefault("_step_graphs", {})[rows] = got
    return got


def _drop(model) -> None:
    """Every bucket's graphs, with their memory pool and stream, at once. PyTorch frees the
    cuBLAS workspace of a graph's capture stream when the graph is destroyed; the buckets share
    their stream (`_graphs`), so one bucket's graphs destroyed alone would leave the others
    replaying products into freed memory."""
    torch.cuda.synchronize(model.device)  # no replay still running on what is freed
    model.__dict__.pop("_step_graphs", None)
    model.__dict__.pop("_graph_shared", None)


def capture_buckets(model) -> int:
    """Capture every bucket's graphs not captured yet, where the model's step runs through
    them (its `model.layers` serves from `graphs`); the number of buckets captured. The
    warm-up's (engine.warmup): a server's first step at a new batch size would otherwise pay
    for its capture. A capture that fails is logged and left: the first step in that bucket
    tries again and, failing, falls back (the breaker)."""
    stack = getattr(model, "_stack", None)
    if getattr(getattr(stack, "active", None), "name", None) != "graphs":
        return 0
    done = 0
    # largest first, as vLLM: the smaller buckets' captures reuse its pool's memory
    with torch.inference_mode(), torch.cuda.device(model.device):
        for rows in reversed(BUCKETS):
            before = model.__dict__.get("_step_graphs", {}).get(rows)
            try:
                done += _graphs(model, rows) is not before  # (kept where still current)
            except Exception as e:  # (the step's own call will fall back)
                log.warning("CUDA graphs: capturing %d rows failed (%s); left to the step", rows, e)
                return done
    return done


def layers_graphs(model, x: torch.Tensor, positions: torch.Tensor, kv) -> torch.Tensor:
    """`model.layers` through the bucket's CUDA graphs (`StepGraphs`), or, for a step of more
    rows than the largest bucket, `layers_python` in the same call. A capture that fails
    raises before the strategy is touched: the breaker then serves the step eagerly. A failure
    of the strategy's `append` or `attend` is the call's (`NotMine`): it goes to the caller,
    and nothing is run again."""
    rows = bucket(x.shape[0])
    if rows is None:
        return layers_python(model, x, positions, kv)
    with torch.cuda.device(model.device):  # (a model on cuda:1 is captured and replayed there)
        return _graphs(model, rows).run(x, positions, kv)


def enabled() -> bool:
    """Whether `UNIKV_CUDA_GRAPHS` lets the entry serve: unset, "" or "1" (the default) yes,
    "0" no; ValueError for any other value (a typo must not pass for either)."""
    return env_switch(OFF_ENV, "CUDA steps run eagerly", "through CUDA graphs where they can")


def _available(device: torch.device, owner: object) -> str | None:
    if device.type != "cuda":
        return "CUDA only"
    if not enabled():
        return f"turned off ({OFF_ENV}=0)"
    if not torch.cuda.is_available():
        return "no CUDA device"
    if getattr(owner, "_qkv", None) is None:  # DeepSeek: MLA and MoE layers of its own
        return "Llama layers only"
    return None


def _register() -> None:
    register(FnImplementation("model.layers", "graphs", layers_graphs, ("cuda",), _available), 5)


_register()

__all__ = [
    "BUCKETS",
    "OFF_ENV",
    "StepGraphs",
    "bucket",
    "capture_buckets",
    "enabled",
    "layers_graphs",
]

"""The warm-up before an engine serves: one short request through the whole path.

A server's first request used to pay for what only the first one pays: page faults on the
weights, first touch of the KV arena, the C kernels loaded and their breakers calibrating,
PyTorch's first calls at each shape, on CUDA the capture of the step's graphs (engine.graphs:
every batch bucket's is captured here). `warm_up` runs one request of `prompt_tokens` prompt
tokens and `new_tokens` new ones (a prompt chunk and decode steps) before the server reports
ready (`unikv serve` and each replica run it at start-up; `serving.app.Server` waits for it
before it answers at all). Its blocks are never shared (no prefix lookup, nothing published or
persisted), and the scheduler forgets the speed it measured on those cold steps (the step
target would otherwise cut the first real prompts into small chunks).

What does not live here: the engine (`engine.engine`), the server's start-up (`serving.app`).
"""

from __future__ import annotations

import logging
import time

from unikv.kvstrategies.calibration import WARMUP_TEXT

from . import compute, graphs
from .sampling import SamplingParams

log = logging.getLogger(__name__)

PROMPT_TOKENS = 128
NEW_TOKENS = 4


async def warm_up(
    engine, prompt_tokens: int = PROMPT_TOKENS, new_tokens: int = NEW_TOKENS
) -> float:
    """Run the warm-up request on `engine` (an `engine.engine.Engine`); returns its seconds."""
    t0 = time.perf_counter()
    ids = engine.tokenizer.encode(WARMUP_TEXT.read_text(encoding="utf-8"))[:prompt_tokens]
    cap = engine.kv.capacity_tokens() if hasattr(engine.kv, "capacity_tokens") else None
    if cap is not None:  # a tiny device tier: a prompt it holds
        ids = ids[: max(1, min(len(ids), cap - new_tokens - 1))]
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    await engine.submit(ids, params, share_prefix=False).result()
    await compute.run(engine.scheduler.forget_timing)
    captured = await compute.run(graphs.capture_buckets, engine.model)  # CUDA: every bucket
    if captured:
        log.info("warm-up: CUDA graphs captured for %d batch sizes", captured)
    seconds = time.perf_counter() - t0
    log.info("warm-up: %d prompt tokens and %d new in %.2f s", len(ids), new_tokens, seconds)
    return seconds

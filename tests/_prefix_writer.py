"""Child process of the persistent prefix test: computes a prompt's KV, then waits to be killed.

    python tests/_prefix_writer.py STORE_DIR PROMPT_IDS_FILE

Runs the prompt (token ids, one line of integers) through an engine with the
`hierarchical_offload` strategy over the SSD tier at STORE_DIR, waits until the prompt's blocks
are written through, prints "persisted N" and sleeps until the parent SIGKILLs it: nothing is
closed cleanly, so what the parent reads was committed, not flushed at exit.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.assembly import create_kv  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.loading import load_model  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from memory.config import PoolConfig, TierConfig  # noqa: E402


def main(store: str, prompt_file: str) -> None:
    ids = [int(x) for x in Path(prompt_file).read_text().split()]
    model, tok = load_model("smollm2", progress=False)
    tiers = (TierConfig("device", 1 << 28), TierConfig("host", 1 << 28),
             TierConfig("ssd", 1 << 30, path=store))  # fmt: skip
    cfg = PoolConfig(block_size=16, tiers=tiers)
    opts = {"device_window": 64, "host_window": 64, "min_disk_hit_tokens": 0}
    spec = model.kv_spec()
    kv = create_kv("hierarchical_offload", spec, cfg, opts)

    async def run() -> None:
        engine = Engine(model, tok, kv=kv)
        await engine.generate(ids, SamplingParams(max_new_tokens=1, ignore_eos=True))

    asyncio.run(run())
    kv.writer.wait_writes()
    print(f"persisted {kv.writer.blocks_written}", flush=True)
    signal.pause()  # wait for the SIGKILL the test sends (no timed sleep)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

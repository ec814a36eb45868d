"""Child process of the remote-tier test: engine A computes a prompt, shares it, waits.

    python tests/_remote_writer.py REMOTE_URL SSD_DIR PROMPT_IDS_FILE

Runs the prompt (token ids, one line of integers) through an engine with the
`hierarchical_offload` strategy over its own SSD tier at SSD_DIR and the remote tier at
REMOTE_URL, waits until the prompt's blocks are written through to the server, prints
"shared N" and sleeps until the parent kills it.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from unikv.engine.assembly import create_kv  # noqa: E402
from unikv.engine.engine import Engine  # noqa: E402
from unikv.engine.loading import load_model  # noqa: E402
from unikv.engine.sampling import SamplingParams  # noqa: E402
from unikv.settings.config import PoolConfig, TierConfig  # noqa: E402


def main(url: str, ssd: str, prompt_file: str) -> None:
    ids = [int(x) for x in Path(prompt_file).read_text().split()]
    model, tok = load_model("smollm2", progress=False)
    tiers = (TierConfig("device", 1 << 28), TierConfig("host", 1 << 28),
             TierConfig("ssd", 1 << 30, path=ssd),
             TierConfig("remote", 1 << 30, path=url))  # fmt: skip
    cfg = PoolConfig(block_size=16, tiers=tiers)
    opts = {"device_window": 64, "host_window": 64, "min_disk_hit_tokens": 0}
    kv = create_kv("hierarchical_offload", model.kv_spec(), cfg, opts)

    async def run() -> None:
        engine = Engine(model, tok, kv=kv)
        await engine.generate(ids, SamplingParams(max_new_tokens=1, ignore_eos=True))

    asyncio.run(run())
    kv.pool.persistence.writer.wait_writes()
    kv.pool.persistence.remote_writer.wait_writes()
    print(f"shared {kv.pool.persistence.remote_writer.blocks_written}", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])

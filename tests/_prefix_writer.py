"""Child process of the persistent prefix test: computes a prompt's KV, then waits to be killed.

    python tests/_prefix_writer.py STORE_DIR PROMPT_IDS_FILE [STRATEGY [CALIBRATION]]

Runs the prompt (token ids, one line of integers) through an engine with the strategy
(default `hierarchical_offload`; a packed format's calibration file after it) over the SSD
tier at STORE_DIR, waits until the prompt's blocks are written through, prints "persisted N"
(blocks) and the generated token ids, and sleeps until the parent SIGKILLs it: nothing is
closed cleanly, so what the parent reads was committed, not flushed at exit.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from unikv.engine.assembly import create_kv  # noqa: E402
from unikv.engine.engine import Engine  # noqa: E402
from unikv.engine.loading import load_model  # noqa: E402
from unikv.engine.sampling import SamplingParams  # noqa: E402
from unikv.settings.config import PoolConfig, TierConfig  # noqa: E402


def main(store: str, prompt_file: str, name: str, calibration: str | None) -> None:
    ids = [int(x) for x in Path(prompt_file).read_text().split()]
    model, tok = load_model("smollm2", progress=False)
    tiers = (TierConfig("device", 1 << 28), TierConfig("host", 1 << 28),
             TierConfig("ssd", 1 << 30, path=store))  # fmt: skip
    cfg = PoolConfig(block_size=16, tiers=tiers)
    opts = {"device_window": 64, "host_window": 64, "min_disk_hit_tokens": 0}
    if calibration is not None:
        opts["calibration"] = calibration
    spec = model.kv_spec()
    kv = create_kv(name, spec, cfg, opts)

    async def run() -> list[int]:
        engine = Engine(model, tok, kv=kv)
        out = await engine.generate(ids, SamplingParams(max_new_tokens=12, ignore_eos=True))
        return out.token_ids

    tokens = asyncio.run(run())
    writer = kv.pool.persistence.writer
    writer.wait_writes()
    print(f"persisted {writer.blocks_written} {' '.join(map(str, tokens))}", flush=True)
    signal.pause()  # wait for the SIGKILL the test sends (no timed sleep)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], args[1], args[2] if len(args) > 2 else "hierarchical_offload",
         args[3] if len(args) > 3 else None)  # fmt: skip

"""Draw docs/architecture.png: unikv's layers (left) and a request's data flow (right).

Run from the repository root: `.venv/bin/python docs/architecture.py` (needs matplotlib, which
`make bench` installs). Describes layers and modules only, no details that move often.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = Path(__file__).resolve().parent / "architecture.png"

# One band per layer, top to bottom: (name, what it owns, band colour, height).
LAYERS = [
    (
        "cli/  +  serving/",
        "cli: the unikv command (run, eval, profile, tune,\n     calibrate, cache, serve)\n"
        "serving: OpenAI-compatible HTTP API, metrics,\n     health view, replicas + router",
        "#eeeeee",
        14,
    ),
    (
        "engine/",
        "engine.py    public async API, request lifecycle\n"
        "scheduler.py admission, planning, reservation,\n"
        "             preemption; stepping.py runs a step\n"
        "assembly.py  builds model + strategy + pool + stores\n"
        "             + expert cache from a config; closes\n"
        "             them in reverse order\n"
        "loading.py   models (GGUF, HF dirs); model, deepseek,\n"
        "             routing, tokenizer, sampling",
        "#dbe9f6",
        25,
    ),
    (
        "kvstrategies/",
        "kv.py  the seam: StepBatch, KVSpec,\n"
        "       KVCache (append / attend)  <- model\n"
        "       KVMemory (reserve / free / prefix / swap)\n"
        "strategy.py  one adapter over three objects:\n"
        "  format (dense, hybrid, int8) · placement (resident,\n"
        "  tiered) · selection (all, pruned, sparse); presets",
        "#e3f1dc",
        18,
    ),
    (
        "memory/  |  unikv/kernels/",
        "memory: UnifiedMemoryPool over tiers, blocks, block\n"
        "  tables, prefix sharing, budgets, stats, one health rule,\n"
        "  write-through and prefetch, experts\n"
        "kernels: operator registry + breaker, C kernels\n"
        "  per ISA (hybrid attention, GGUF gemv), dtypes",
        "#fbecd5",
        16,
    ),
    (
        "storage/",
        "BlockStore: LMDB, Redis, shared dir (CRC, recovery)",
        "#f3dfe8",
        8.5,
    ),
    (
        "settings/",
        "config files + env, chip profiles + probes, logs",
        "#f0f0f0",
        7,
    ),
]

GAP = 1.2
TOP = 95.5
LEFT_W = 47.0  # the "owns" column; the flow column starts after it
FLOW_X0, FLOW_X1 = 52.0, 98.0


def box(ax, x, y, w, h, text, fc="white", ec="#333333", size=10.5, weight="normal", ls="-"):
    """A rounded box with centred text; returns its centre."""
    ax.add_patch(
        FancyBboxPatch(
            (x, y),
            w,
            h,
            boxstyle="round,pad=0.25,rounding_size=0.8",
            fc=fc,
            ec=ec,
            lw=1.3,
            ls=ls,
        )
    )
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", size=size, weight=weight)
    return x + w / 2, y + h / 2


def arrow(ax, a, b, both=False, color="#222222", ls="-"):
    style = "<|-|>" if both else "-|>"
    ax.add_patch(
        FancyArrowPatch(
            a, b, arrowstyle=style, mutation_scale=14, lw=1.5, color=color, linestyle=ls
        )
    )


def main() -> None:
    fig = plt.figure(figsize=(15, 11), dpi=110)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 100)
    ax.set_ylim(0, 100)
    ax.axis("off")

    ax.text(2, 97.3, "unikv: layers and data flow", size=17, weight="bold", va="center")
    ax.text(
        FLOW_X0,
        97.3,
        "a request, top to bottom",
        size=12.5,
        style="italic",
        va="center",
    )

    bands = _bands(ax)
    fwd = _flow_engine(ax, bands)
    _flow_kv(ax, bands, fwd)
    fig.savefig(OUT)
    print(f"wrote {OUT}")


def _bands(ax) -> dict[str, tuple[float, float]]:
    """One band per layer with what it owns, and the arrow that says imports point down;
    each band's (bottom, top) by its first word."""
    bands = {}
    y = TOP
    for name, owns, colour, h in LAYERS:
        y0 = y - h
        ax.add_patch(
            FancyBboxPatch(
                (1.5, y0),
                97,
                h,
                boxstyle="round,pad=0,rounding_size=1.2",
                fc=colour,
                ec="#888888",
                lw=1.0,
                ls="-",
            )
        )
        ax.text(3, y - 2.2, name, size=13.5, weight="bold", va="top", family="monospace")
        ax.text(3, y - 6.0, owns, size=9.6, va="top", family="monospace", linespacing=1.35)
        bands[name.split()[0]] = (y0, y)
        y = y0 - GAP

    # Dependencies point down only.
    ax.annotate(
        "",
        xy=(LEFT_W + 1.6, bands["settings/"][0] + 2),
        xytext=(LEFT_W + 1.6, bands["cli/"][1] - 2),
        arrowprops=dict(arrowstyle="-|>", lw=2.2, color="#777777"),
    )
    ax.text(
        LEFT_W - 0.5,
        (bands["cli/"][1] + bands["settings/"][0]) / 2,
        "imports point down only (import-linter)",
        rotation=90,
        ha="center",
        va="center",
        size=9.5,
        color="#555555",
    )
    return bands


def _flow_engine(ax, bands) -> tuple[float, float]:
    """The request from HTTP through the engine to the model's forward pass (its box)."""
    w = FLOW_X1 - FLOW_X0
    mid = FLOW_X0 + w / 2

    # server
    s0, s1 = bands["cli/"]
    http = box(ax, FLOW_X0 + 6, s0 + 2, w - 12, s1 - s0 - 4, "HTTP request (OpenAI API)")

    # engine: async API -> scheduler -> model forward
    e0, e1 = bands["engine/"]
    bh = 5.6
    api = box(
        ax,
        FLOW_X0 + 2,
        e1 - 8.6,
        w - 4,
        bh,
        "Engine async API\nstream / generate / submit  ->  memory_report",
        weight="bold",
    )
    sched = box(
        ax,
        FLOW_X0 + 2,
        e1 - 17.2,
        w - 4,
        bh,
        "Scheduler: admit by budget, attach prefix,\nplan the step, reserve KV, preempt",
    )
    fwd = box(
        ax,
        FLOW_X0 + 2,
        e0 + 1.6,
        w - 4,
        bh,
        "model forward, layer by layer\n(packed tokens of every sequence)",
    )
    ax.text(
        mid + 1.5,
        e1 - 1.5,
        "or a request from a Python caller",
        size=9.5,
        style="italic",
        va="center",
    )
    arrow(ax, (http[0], s0 + 1.6), (api[0], e1 - 2.8))
    arrow(ax, (api[0], e1 - 8.8), (sched[0], e1 - 11.4))
    arrow(ax, (sched[0], e1 - 17.4), (fwd[0], e0 + 7.4))
    return fwd


def _flow_kv(ax, bands, fwd) -> None:
    """The step through the strategy's objects, the pool and its tiers."""
    w = FLOW_X1 - FLOW_X0
    k0, k1 = bands["kvstrategies/"]
    strat = box(
        ax,
        FLOW_X0 + 2,
        k0 + 1.6,
        w - 4,
        k1 - k0 - 4.4,
        "KVStrategy (one adapter), per step:\n"
        "reserve -> Reservation; selection.before_step;\n"
        "placement.place: which blocks are read where;\n"
        "format.append / format.attend per layer;\n"
        "commit; selection.after_step (evicts)",
        size=9.8,
    )
    arrow(ax, (fwd[0], bands["engine/"][0] + 1.4), (strat[0], k1 - 2.8))

    # memory: pool, device and host tiers
    m0, m1 = bands["memory/"]
    pool = box(
        ax,
        FLOW_X0 + 2,
        m1 - 8.5,
        w - 4,
        5.5,
        "UnifiedMemoryPool: blocks in tiers,\na block table per sequence, shared prefixes",
        weight="bold",
    )
    arrow(ax, (strat[0], k0 + 1.8), (pool[0], m1 - 2.8))
    tw = 12.0
    dev = box(ax, FLOW_X0 + 5, m0 + 1.8, tw, 4.4, "device tier", fc="#fff7e6")
    host = box(ax, FLOW_X1 - 5 - tw, m0 + 1.8, tw, 4.4, "host tier", fc="#fff7e6")
    arrow(ax, (dev[0] + tw / 2 + 0.4, dev[1]), (host[0] - tw / 2 - 0.4, host[1]), both=True)
    arrow(ax, (pool[0] - 8, m1 - 8.7), (dev[0], m0 + 6.5))
    arrow(ax, (pool[0] + 8, m1 - 8.7), (host[0], m0 + 6.5))

    # storage: SSD (LMDB) and remote
    t0, t1 = bands["storage/"]
    ssd = box(ax, FLOW_X1 - 5 - tw, t0 + 1.6, tw, 4.4, "SSD (LMDB)", fc="#fdf0f5")
    remote = box(ax, FLOW_X0 + 5, t0 + 1.6, tw, 4.4, "remote (Redis)", fc="#fdf0f5")
    arrow(ax, (host[0], m0 + 1.4), (ssd[0], t0 + 6.4), both=True)
    arrow(
        ax,
        (ssd[0] - tw / 2 - 0.4, ssd[1]),
        (remote[0] + tw / 2 + 0.4, remote[1]),
        both=True,
    )
    ax.text(
        host[0] - 1.5,
        t1 + 0.6,
        "write-through (down), prefetch (up)",
        ha="right",
        va="center",
        size=9,
        style="italic",
        color="#444444",
    )


if __name__ == "__main__":
    main()

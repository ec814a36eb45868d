"""Two builds of the C kernels against each other in one process: the decode step's time.

A change to `unikv/kernels/gemv.c` or `sparse.c` that moves a step by a few percent is lost in
this machine's drift between two runs (other tenants, clock speed: a step measured 4.5 ms one
minute and 5.2 ms the next). Here both builds are loaded into one process and alternate round
by round over the same model and cache: each round prefills `--context` tokens as a new
sequence, decodes `--steps` greedy steps (through `model.layers`, whichever path the strategy
takes) and frees it; the medians of the per-step times and their ratio are printed.

Each build is a directory holding its own `gemv.c`, `sparse.c` and `hybrid_attend.c` (a
missing one: the package's own; `hybrid_attend.c` is built for the strategy's record shape
when its format is packed); `--b` defaults to the package's sources, so

    cp unikv/kernels/*.c /tmp/before/   # then edit the package's
    python benchmarks/kernel_ab.py --a /tmp/before [--context 32] [--steps 40] [--rounds 10]
        [--strategy full] [--weights native] [--model smollm2 | FILE.gguf]

measures an edit against what it replaced (ratio below 1: the edit is faster). At long
contexts `--prefill-once` prefills one sequence once and decodes it further each round.

`--layouts` instead runs the package's one build over two loads of the model: A with the packed
weights in GGUF order (`engine.linear.INTERLEAVE` off), B interleaved by 16 rows where the int8
kernel's VNNI path reads them (gemv.c's ROWS16), so B / A is what the layout gives a step.
`--pages` likewise: A with the weights in the allocator's 4 KiB pages (`UNIKV_HUGE_PAGES=0`
while it loads), B in huge pages (`memory.hugepages`). `--stack` likewise: A with each layer
whose parts a GGUF holds in different formats (Q4_K_M's QKV with attn_v in Q6_K) decoded to
float32, B with its parts kept packed (`engine.linear.StackedLinear`). `--weight-prefetch` runs
one build over one load: A with the software prefetch of the weights that stream in order
(the VNNI path's interleaved groups, the float32 rows), B without (`gemv.weight_prefetch`;
the same bits).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import env_set, report  # noqa: E402
from benchmarks.decode_profile import cpu_name  # noqa: E402
from benchmarks.kv_quant_speed import build, context_ids, decode, prefill  # noqa: E402
from unikv.engine import linear  # noqa: E402
from unikv.engine.config import ModelLoadError  # noqa: E402
from unikv.engine.loading import load_model  # noqa: E402
from unikv.engine.model import weight_formats  # noqa: E402
from unikv.kernels import gemv, native, sparse  # noqa: E402
from unikv.memory import hugepages  # noqa: E402

PACKAGE = Path(gemv.__file__).parent


def _load(args):
    """The model of `--model` (a bad name or file: a one-line exit, not a traceback)."""
    try:
        return load_model(args.model, progress=False, weights=args.weights)
    except ModelLoadError as e:
        sys.exit(f"kernel_ab: {e}")


def _two_loads(args, switch: str) -> list:
    """The model loaded twice: A with `engine.linear`'s `switch` off, B with it on (its
    default, restored after)."""
    models = []
    try:
        for on in (False, True):
            setattr(linear, switch, on)
            models.append(_load(args))
    finally:
        setattr(linear, switch, True)
    return models


def load_build(folder: Path) -> tuple[dict, dict]:
    """The kernels of `folder` built and loaded: (gemv's state, sparse's state)."""
    if not folder.is_dir():
        sys.exit(f"kernel_ab: {folder} is not a folder (of gemv.c and/or sparse.c)")
    states = []
    for module, name in ((gemv, "gemv.c"), (sparse, "sparse.c")):
        source = folder / name if (folder / name).exists() else PACKAGE / name
        module.SOURCE, module._state = source, {}
        if module._load() is None:
            sys.exit(f"{source}: {module._state.get('error')}")
        states.append(module._state)
    return states[0], states[1]


def hybrid_libs(folders: list[Path], shapes: list[dict]) -> list | None:
    """Per build folder its hybrid_attend.c compiled for the record shape the strategy built
    (`shapes`: what `native.hybrid_kernel` was asked for), or None without a packed format."""
    if not shapes:
        return None
    libs, saved = [], native.SOURCE
    for folder in folders:
        own = folder / "hybrid_attend.c"
        native.SOURCE, native._libs = own if own.exists() else PACKAGE / "hybrid_attend.c", {}
        try:
            lib = native.hybrid_kernel(shapes[-1])
        finally:
            native.SOURCE = saved
        if lib is None:
            sys.exit(f"{folder}: hybrid_attend.c: {native.KERNEL_ERROR}")
        libs.append(lib)
    return libs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", type=Path, help="folder of build A's kernel sources")
    p.add_argument(
        "--layouts",
        action="store_true",
        help="one build, two loads of the model: A's packed weights in GGUF order, B's "
        "interleaved by 16 rows (where the VNNI path reads them)",
    )
    p.add_argument(
        "--pages",
        action="store_true",
        help="one build, two loads of the model: A's weights in 4 KiB pages, B's in huge pages",
    )
    p.add_argument(
        "--stack",
        action="store_true",
        help="one build, two loads of the model: A's layers of parts in different formats "
        "decoded to float32, B's kept packed (engine.linear.STACK)",
    )
    p.add_argument(
        "--weight-prefetch",
        action="store_true",
        help="one build, one load of the model: A with the software prefetch of the weights "
        "that stream in order (interleaved groups, float32 rows), B without "
        "(gemv.weight_prefetch)",
    )
    p.add_argument("--b", type=Path, default=PACKAGE, help="build B (default: the package's)")
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=10, help="rounds per build")
    p.add_argument("--strategy", default="full")
    p.add_argument("--weights", default="native")
    p.add_argument(
        "--model",
        default="smollm2",
        help="the model (a name or a GGUF file, as `unikv run --model` takes)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--prefill-once",
        action="store_true",
        help="prefill one sequence once and "
        "decode it further each round (long contexts: the context then grows by "
        "--steps a round)",
    )
    args = p.parse_args()
    two = args.layouts or args.pages or args.stack  # one build, two loads of the model
    if (args.a is not None) + args.layouts + args.pages + args.stack + args.weight_prefetch != 1:
        p.error("give one of --a (two builds), --layouts (two layouts of the weights), "
                "--pages (two kinds of pages), --stack (mixed layers decoded or packed) and "
                "--weight-prefetch (prefetch or not)")  # fmt: skip
    torch.set_num_threads(args.threads)
    if two or args.weight_prefetch:  # the package's one build for both
        args.a = args.b = PACKAGE
        gemv._load(), sparse._load()
        builds = [(gemv._state, sparse._state)] * 2
    if args.pages:
        models = []
        for value in ("0", "1"):
            with env_set(hugepages.ENV, value):
                models.append(_load(args))
        print(f"A: {models[0][0].huge_pages}; B: {models[1][0].huge_pages}")
    elif args.layouts:
        models = _two_loads(args, "INTERLEAVE")
        held = [
            sum(
                getattr(lin.weight, "rows16", None) is not None
                for layer in m.layers
                for lin in layer[1:3]
            )
            for m, _ in models
        ]
        print(f"A: {held[0]}, B: {held[1]} of the layers' first two linear layers interleaved")
    elif args.stack:
        models = _two_loads(args, "STACK")
        mb = [sum(w.bytes for w in weight_formats(m).values()) / 2**20 for m, _ in models]
        stacked = sum(isinstance(x, linear.StackedLinear) for layer in models[1][0].layers
                      for x in layer)  # fmt: skip
        print(f"A: {mb[0]:.0f} MiB of weights; B: {mb[1]:.0f} MiB, {stacked} layers of parts")
    elif args.weight_prefetch:
        models = [_load(args)] * 2
        chosen = gemv.weight_prefetch()  # this CPU's default, restored at the end
        print(f"A: software prefetch; B: none (this CPU's default: {'A' if chosen else 'B'})")
    else:
        builds = [load_build(args.a), load_build(args.b)]
        models = [_load(args)] * 2
    shapes, real = [], native.hybrid_kernel
    native.hybrid_kernel = lambda shape: shapes.append(shape) or real(shape)
    try:
        kvs = [build(m, tok, args.strategy) for m, tok in models[: 1 + two]]
    finally:
        native.hybrid_kernel = real
    kvs = kvs * (2 - two)  # one cache for two builds, or one per model
    tok = models[0][1]
    packed = None if two else hybrid_libs([args.a, args.b], shapes)
    # with --prefill-once the sequence grows by --steps a round (warm-up rounds included)
    need = args.context + (2 * args.rounds + 2) * args.steps * args.prefill_once
    context_length = models[0][0].cfg.context_length
    if need > context_length:
        for kv in set(kvs):
            kv.close()
        raise SystemExit(f"--context {args.context} with --prefill-once grows to {need} tokens "
                         f"over {2 * args.rounds + 2} rounds of --steps {args.steps}: more than "
                         f"the model's {context_length}; lower one of them")  # fmt: skip
    ids = context_ids(tok, args.context)
    times: list[list[float]] = [[], []]
    try:
        # with --prefill-once: one sequence per cache, `steps` more tokens of it each round
        firsts = None
        if args.prefill_once:
            first = prefill(models[0][0], kvs[0], ids, 0)
            firsts = [first, prefill(models[1][0], kvs[1], ids, 0) if two else first]
        for r in range(2 * args.rounds + 2):  # the first round of each: warm-up
            i = r % 2
            gemv._state, sparse._state = builds[i]
            if args.weight_prefetch:
                gemv.weight_prefetch(i == 0)
            model, kv = models[i][0], kvs[i]
            if packed:
                kv.format.attention.kernel = packed[i]
            if args.prefill_once:
                grown = r // 2 if two else r  # rounds this cache's sequence grew by
                t = decode(model, kv, firsts[i], len(ids) + grown * args.steps, args.steps, 0)
            else:
                first = prefill(model, kv, ids, r)
                t = decode(model, kv, first, len(ids), args.steps, r)
                kv.free(r)
            t /= args.steps
            if r >= 2:
                times[i].append(t)
    finally:
        for kv in set(kvs):
            kv.close()
        if args.weight_prefetch:
            gemv.weight_prefetch(chosen)
    a, b = (statistics.median(t) * 1e3 for t in times)
    rows = [{"build": str(args.a), "ms_per_step": a}, {"build": str(args.b), "ms_per_step": b}]
    report("kernel_ab", rows, ["build", "ms_per_step"],
           {"b_over_a": b / a, "cpu": cpu_name(), "settings": vars(args) | {
               "a": str(args.a), "b": str(args.b)}})  # fmt: skip
    print(f"B / A = {b / a:.3f} ({cpu_name()})")


if __name__ == "__main__":
    main()

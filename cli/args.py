"""Argument helpers every command shares (`serve` among them): the device and weights flags,
the strategy axes, a flag for every strategy option declared in `kvstrategies.options`, and the
checks and conversions of what they parse.
"""

from __future__ import annotations

import argparse

from unikv.engine.gguf_loader import WEIGHT_MODES
from unikv.kernels.dtypes import DTYPES
from unikv.kvstrategies.options import Option
from unikv.settings.config import list_profiles


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


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


MAX_DECODE_STEPS = 64  # the engine's (engine.engine.MAX_DECODE_STEPS; checked by a test)


def decode_steps_arg(text: str) -> int:
    """--decode-steps: an integer in 1 .. MAX_DECODE_STEPS."""
    value = positive_int(text)
    if value > MAX_DECODE_STEPS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_DECODE_STEPS}, got {value}")
    return value


DECODE_STEPS_HELP = (
    "decode steps a turn may run in one native call while every running request is a plain "
    "greedy or sampled decode and nothing waits (multi-step decoding: the same tokens; the "
    "Python between steps runs once for all of them; tokens stream in bursts of that many)"
)


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
    from unikv.kvstrategies import FORMATS, PLACEMENTS, SELECTIONS

    return {"format": FORMATS.names(), "placement": PLACEMENTS.names(),
            "selection": SELECTIONS.names()}  # fmt: skip


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


def check_kv_args(args: argparse.Namespace) -> None:
    """Fail on a bad config file or strategy name before the (slow) model load; folds the
    --kv-AXIS flags into args.strategy."""
    from unikv import kvstrategies
    from unikv.settings.config import load_config

    cfg = load_config(args.config)
    args.strategy = strategy_arg(args, cfg.strategy)
    name = args.strategy or cfg.strategy
    if name == "auto" or "+" in name:  # what auto (or an "auto" axis) will pick
        name = kvstrategies.choose(cfg, name, getattr(args, "chip", None))[0]
    opts = cfg.strategy_options if cfg.strategy in (name, "auto") or "+" in cfg.strategy else {}
    kvstrategies.get(name).check_options({**opts, **kv_options(args)})


def kv_options(args: argparse.Namespace) -> dict:
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


def add_model_flags(sp: argparse.ArgumentParser, strategy_options: bool = True) -> None:
    """The model and its KV strategy, shared by every command that loads one (`run`, `eval`,
    `serve`, ...): --model, --dtype, --weights, --strategy and the axes, --config, --device,
    --chip, and (unless `strategy_options` is False) a flag for every strategy option."""
    sp.add_argument(
        "--model", default="smollm2", help="model name or .gguf path (default: smollm2)"
    )
    sp.add_argument(
        "--dtype",
        default="float32",
        choices=sorted(DTYPES),
        help="compute dtype (default: float32)",
    )
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
        "--enforce-eager",
        action="store_true",
        help="on a CUDA device, run every step eagerly instead of through CUDA graphs (as vLLM's "
        "flag; the same as UNIKV_CUDA_GRAPHS=0); nothing changes on a CPU",
    )
    sp.add_argument(
        "--chip",
        default=None,
        help=f"chip profile: a shipped name ({', '.join(list_profiles())}) or a .toml path "
        "(default: the config file's chip, else cpu)",
    )
    if strategy_options:
        strategy_option_args(sp)


def apply_enforce_eager(args: argparse.Namespace) -> None:
    """--enforce-eager for this process: UNIKV_CUDA_GRAPHS=0, read when a CUDA model is built
    (engine.graphs). Either way a bad UNIKV_CUDA_GRAPHS is refused here, in one line."""
    import os

    eager = getattr(args, "enforce_eager", False)
    if not eager and "UNIKV_CUDA_GRAPHS" not in os.environ:
        return  # (the engine is imported when a command runs, not for every command)
    from unikv.engine import graphs

    if eager:
        os.environ[graphs.OFF_ENV] = "0"
    graphs.enabled()

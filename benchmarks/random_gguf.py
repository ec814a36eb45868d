"""A Llama GGUF of a larger shape with random weights, for speed figures beyond SmolLM2.

Why: the packaged SmolLM2-135M reads 2.2 MB of weights a layer, so a decode step's fixed
costs per layer (its attention, the threads' hand-offs) weigh on it as they would not on the
models people serve. The engine's share of the memory bandwidth (issue 34's yardstick) is
therefore also measured on a model of a real larger shape. No model hub is reachable, so the
weights are random: drawn at a trained model's scale (rows of unit norm on average), the norms
ones. Speed does not depend on the values, only on the shape and the formats; the tokens such a
model writes mean nothing, and no quality figure may come from it.

The file takes SmolLM2's tokenizer and vocabulary (49,152 tokens; the embedding is tied as in
SmolLM2 and Llama 3.2 1B), so both engines can tokenize and run it as they run the packaged
file. It is written in F16 beside the llama.cpp build (`benchmarks/llamacpp.py`'s cache) and
requantized from there with llama.cpp's own `llama-quantize` (Q4_1, Q8_0, F32...), so the bytes
unikv reads are the ones llama.cpp reads.

    python benchmarks/random_gguf.py [--shape llama-1b] [--kinds Q4_1 Q8_0]   # prints the paths
    python benchmarks/decode_profile.py --model PATH --weights native
    python benchmarks/vs_llamacpp.py --shape llama-1b --skip context
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import MODEL_SHAPES  # noqa: E402
from benchmarks.llamacpp import converted, find_or_build  # noqa: E402
from unikv.engine.gguf_loader import resolve_model_path  # noqa: E402

SHAPES = MODEL_SHAPES  # each with SmolLM2's vocabulary here, not its own
ARCH = "llama"


def write(path: Path, shape: str, seed: int = 0) -> None:
    """A random F16 GGUF of `shape` at `path` (SmolLM2's tokenizer and its other settings)."""
    hidden, ffn, layers, heads, kv_heads, _ = SHAPES[shape]
    d = hidden // heads
    source = gguf.GGUFReader(resolve_model_path("smollm2"))
    writer = gguf.GGUFWriter(str(path), ARCH)
    sizes = {
        f"{ARCH}.block_count": layers,
        f"{ARCH}.embedding_length": hidden,
        f"{ARCH}.feed_forward_length": ffn,
        f"{ARCH}.attention.head_count": heads,
        f"{ARCH}.attention.head_count_kv": kv_heads,
        f"{ARCH}.rope.dimension_count": d,
        "general.name": f"random {shape} (SmolLM2 vocabulary)",
        "general.file_type": 1,  # F16
    }
    for field in source.fields.values():
        name = field.name
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer's own
        value = sizes.get(name, field.contents())
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub)
    vocab = int(source.fields[f"{ARCH}.vocab_size"].contents())
    rng = np.random.default_rng(seed)

    def rand(rows: int, cols: int) -> np.ndarray:
        w = rng.standard_normal((rows, cols), dtype=np.float32)
        return (w * np.float32(1 / np.sqrt(cols))).astype(np.float16)

    ones = np.ones(hidden, dtype=np.float32)
    writer.add_tensor("token_embd.weight", rand(vocab, hidden))
    writer.add_tensor("output_norm.weight", ones)
    for i in range(layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", ones)
        writer.add_tensor(p + "ffn_norm.weight", ones)
        writer.add_tensor(p + "attn_q.weight", rand(heads * d, hidden))
        writer.add_tensor(p + "attn_k.weight", rand(kv_heads * d, hidden))
        writer.add_tensor(p + "attn_v.weight", rand(kv_heads * d, hidden))
        writer.add_tensor(p + "attn_output.weight", rand(hidden, heads * d))
        writer.add_tensor(p + "ffn_gate.weight", rand(ffn, hidden))
        writer.add_tensor(p + "ffn_up.weight", rand(ffn, hidden))
        writer.add_tensor(p + "ffn_down.weight", rand(hidden, ffn))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def files(shape: str, kinds: list[str], bin_dir: Path | None = None) -> dict[str, Path]:
    """`shape`'s random GGUF in each of `kinds` (llama-quantize types), written and converted
    once, then cached beside the llama.cpp build."""
    bin_dir = bin_dir or find_or_build()
    base = bin_dir.parent / f"random-{shape}.F16.gguf"
    if not base.exists():
        tmp = base.with_suffix(".tmp")
        print(f"random_gguf: writing {base} ...", file=sys.stderr, flush=True)
        write(tmp, shape)
        tmp.rename(base)
    return {k: base if k == "F16" else converted(base, k, bin_dir) for k in kinds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES))
    p.add_argument("--kinds", nargs="*", default=["Q4_1"],
                   help="llama-quantize types to convert the F16 file to")  # fmt: skip
    args = p.parse_args()
    for kind, path in files(args.shape, args.kinds).items():
        print(kind, path)


if __name__ == "__main__":
    main()

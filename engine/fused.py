"""A Llama layer's dense part as two native calls around the KV seam (issue 34).

What lives here: the registry entries of `layer.qkv` (norm, QKV projection, RoPE: x -> q, k, v)
and `layer.out` (output projection, residual, norm, SwiGLU MLP, residual: x, attn -> x), each
with two implementations: `native` (CPU: one call into `unikv/kernels/gemv.c` per op, `layer_qkv`
and `layer_out`) and `ops` (the reference: the same computation as torch ops, each matmul,
norm and rope through its own registry entry). What does not: the forward pass that calls them
(`engine.model`), the matmul kernels (`kernels.gemv`).

Why: at a few rows a decode step's time is mostly the fixed cost of each op (Python, torch's
dispatch, a breaker, an OpenMP fork per matmul), about a dozen per layer; the native entry
makes two calls per layer, and the strategy's `append` and `attend` stay the plug point between
them.

The native entry multiplies each linear layer with the kernel its own matmul entry has chosen
(`gemv` on float32 weights or packed blocks, `gemv_i8` on packed blocks), so it computes the
same products. A layer whose matmul entries chose anything else (PyTorch's int4 or bmm, after
a fallback, or on a machine without the kernel), a bf16 model, or more rows than a kernel takes
(`gemv` takes at most `gemv.MAX_ROWS`; `gemv_i8` and the K-quants' `gemv` fewer than
`gemv.GEMM_ROWS`, where their entries go on to a decoded float32 GEMM) goes through the ops
path inside the same call, so the caller never sees the difference.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from unikv.kernels import gemv
from unikv.kernels.native import int64s as _int64s
from unikv.kernels.operators import FnImplementation, register, switches
from unikv.kvstrategies.kv import NativeChoice, NativeHook, NativeStep

from . import linear
from .linear import NATIVE_FORMATS, Linear, StackedLinear, _blocks, i8_weight, layer_parts
from .quantized import K_FORMATS


def qkv_ops(model, li: int, x: torch.Tensor, positions: torch.Tensor):
    """Norm, QKV projection, RoPE of x [N, hidden] as torch ops: q [N, Hq, D], k, v [N, Hkv, D]."""
    cfg = model.cfg
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    n = x.shape[0]
    attn_norm, wqkv = model.layers[li][:2]
    h = model._rms(x, attn_norm, cfg.rms_norm_eps)
    # [N, (Hq + 2 Hkv) D] -> [N, Hq + 2 Hkv, D] -> q and k [N, Hq + Hkv, D], v [N, Hkv, D]
    qk, v = wqkv(h).view(n, hq + 2 * hkv, d).split([hq + hkv, hkv], dim=1)
    # NOTE: q and k rotated by one call
    q, k = model._rope(model.rope, qk, positions).split([hq, hkv], dim=1)
    if n > 1:  # one row's head slices are contiguous already
        q, k = q.contiguous(), k.contiguous()
    return q, k, v


def out_ops(model, li: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """x + wo(attn), then its norm through the SwiGLU MLP added back, as torch ops."""
    cfg = model.cfg
    _, _, wo, ffn_norm, wgu, wdown = model.layers[li]
    x = x + wo(attn.reshape(x.shape[0], -1))
    h = model._rms(x, ffn_norm, cfg.rms_norm_eps)
    gate, up = wgu(h).chunk(2, dim=-1)
    return x + wdown(F.silu(gate) * up)


def _kinds(lin: Linear | StackedLinear) -> list[tuple[int, int]] | None:
    """`_kind` of each part of a layer (one for a Linear), or None where a part has none."""
    kinds = [_kind(part) for part in layer_parts(lin)]
    return None if any(k is None for k in kinds) else kinds  # type: ignore[return-value]


def _kind(lin: Linear) -> tuple[int, int] | None:
    """(gemv.c's lin_t kind for this layer's chosen matmul entry, the most rows it takes), or
    None when that entry is not one gemv.c's layer calls can stand in for."""
    name = lin.op.active.name
    if lin.fmt == "float" and name == "gemv" and lin.weight.weight.dtype == torch.float32:
        return gemv.KIND_FLOAT, gemv.MAX_ROWS
    # from GEMM_ROWS rows on, the matmul entries multiply by a decoded GEMM (a prefill):
    # the ops path, whose entries do that
    if lin.fmt in K_FORMATS and name == "gemv":
        return gemv.KIND_K, gemv.GEMM_ROWS - 1
    if lin.fmt in NATIVE_FORMATS and name == "gemv_i8":
        return gemv.KIND_PACKED_I8, gemv.GEMM_ROWS - 1
    if lin.fmt in NATIVE_FORMATS and name == "gemv":
        return gemv.KIND_PACKED, gemv.MAX_ROWS
    return None


def _chain(lin: Linear | StackedLinear, kinds: list[tuple[int, int]], keep: list,
           chains: list) -> gemv.Lin:  # fmt: skip
    """gemv.c's lin_t of a layer: `_lin`, or a stack's parts chained (`gemv.chain`; the parts'
    Lins appended to `chains`, which the chain points into)."""
    parts = [_lin(part, k[0], keep) for part, k in zip(layer_parts(lin), kinds, strict=True)]
    chains.append(parts)
    return gemv.chain(parts)


def _lin(lin: Linear, kind: int, keep: list) -> gemv.Lin:
    """gemv.c's lin_t of `lin` for its matmul entry's kind; the tensors it points into are
    appended to `keep` (a weight interleaved later drops its GGUF-order forms: the description
    holds them until it is rebuilt)."""
    w = lin.weight
    if kind == gemv.KIND_FLOAT:
        keep.append(w.weight)
        return gemv.lin(kind, w.weight, w.out_features, w.in_features)
    if kind == gemv.KIND_PACKED_I8:
        blocks, head, rows16 = i8_weight(w)
        keep += (blocks, head)
        return gemv.lin(kind, blocks, w.out_features, w.in_features, w.qtype, head, rows16)
    blocks = w.form("blocks", _blocks)
    keep.append(blocks)
    return gemv.lin(kind, blocks, w.out_features, w.in_features, w.qtype)


def _epoch() -> tuple:
    """What a kept native description depends on besides the model: the breakers' switches
    (`operators.switches`), the packed weights' forms (`linear.forms_built`: interleaving a
    weight, or giving it another form, changes which tensors its kernel reads) and the kernel
    build loaded (gemv's state: a build without the VNNI path reads the GGUF order)."""
    return switches(), linear.forms_built, gemv._state


def _same(a: tuple | None, b: tuple) -> bool:
    return a is not None and a[0] == b[0] and a[1] == b[1] and a[2] is b[2]


class _Described:
    """One layer's gemv.Layer, built for the matmul entries its linear layers had chosen."""

    __slots__ = ("chains", "chosen", "keep", "layer", "max_rows", "seen")

    def __init__(self, model, li: int, chosen: tuple) -> None:
        cfg = model.cfg
        attn_norm, wqkv, wo, ffn_norm, wgu, wdown = model.layers[li]
        kinds = [_kinds(lin) for lin in (wqkv, wo, wgu, wdown)]
        self.chosen, self.layer, self.max_rows, self.seen = chosen, None, 0, None
        self.keep: list = []  # the tensors `layer` points into
        self.chains: list = []  # the Lins of stacked parts it points to (`_chain`)
        if any(k is None for k in kinds):
            return
        lins = [_chain(lin, k, self.keep, self.chains)
                for lin, k in zip((wqkv, wo, wgu, wdown), kinds, strict=True)]  # fmt: skip
        self.max_rows = min(k[1] for ks in kinds for k in ks)
        rope = model.rope
        self.layer = gemv.Layer(
            cfg.hidden_size, wdown.in_features, rope.cos.shape[0], cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim, cfg.rms_norm_eps, attn_norm.data_ptr(), ffn_norm.data_ptr(),
            rope.cos.data_ptr(), rope._sin_signed.data_ptr(), *lins,
        )  # fmt: skip


def _described(model, li: int) -> _Described:
    """Layer li's description, rebuilt when one of its matmul entries switched (a fallback), a
    weight's forms changed or another kernel build was loaded (`_epoch`): a step that goes
    layer by layer asks twice a layer, and compares three numbers."""
    cache = model.__dict__.setdefault("_native_layers", {})
    got = cache.get(li)
    now = _epoch()
    if got is not None and _same(got.seen, now):
        return got
    layers = model.layers[li]
    chosen = tuple(part.op.active.name for j in (1, 2, 4, 5) for part in layer_parts(layers[j]))
    got = cache[li] = _Described(model, li, chosen)
    got.seen = _epoch()  # after the build, which may have interleaved a weight
    return got


def _float32_cpu(model, x: torch.Tensor) -> bool:
    """Whether gemv.c's layer calls can take x at all (float32 rows of a float32 model, CPU)."""
    return x.dtype == torch.float32 and model.dtype == torch.float32 and x.device.type == "cpu"


def _usable(model, li: int, x: torch.Tensor) -> gemv.Layer | None:
    if not _float32_cpu(model, x):
        return None
    got = _described(model, li)
    return got.layer if got.layer is not None and x.shape[0] <= got.max_rows else None


def qkv_native(model, li: int, x: torch.Tensor, positions: torch.Tensor):
    layer = _usable(model, li, x) if positions.dtype == torch.int64 else None
    got = None if layer is None else gemv.layer_qkv(layer, x.contiguous(), positions.contiguous())
    return qkv_ops(model, li, x, positions) if got is None else got


def out_native(model, li: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    layer = _usable(model, li, x)
    got = None
    if layer is not None:
        got = gemv.layer_out(layer, x.contiguous(), attn.reshape(x.shape[0], -1).contiguous())
    return out_ops(model, li, x, attn) if got is None else got


def layers_python(model, x: torch.Tensor, positions: torch.Tensor, kv) -> torch.Tensor:
    """The step's rows x [N, hidden] through every layer in turn (`model._layer`: `layer.qkv`,
    the KV seam's `append` and `attend`, `layer.out`): the reference of `model.layers`."""
    for li in range(model.cfg.num_layers):
        x = model._layer(li, x, positions, kv)
    return x


def layers_native(model, x: torch.Tensor, positions: torch.Tensor, kv) -> torch.Tensor:
    """Every layer in one call into gemv.c (`decode_layers`) when the cache describes the step
    (`KVCache.native_step`: a decode step of a resident float32 `full` cache as plain arenas,
    or of a resident packed cache through its own C code) and every layer has its native
    description; else `layers_python`, in the same call."""
    plan = kv.native_step() if positions.dtype == torch.int64 else None
    layers = None if plan is None else _all_usable(model, x)
    got = None
    if layers is not None:
        got = gemv.decode_layers(layers, _kv_step(plan), x.contiguous(), positions.contiguous())
    return layers_python(model, x, positions, kv) if got is None else got


def step_python(model, tokens: torch.Tensor, positions: torch.Tensor, kv,
                rows: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """A step's logits the model's way: the tokens' embedding rows, `model.layers` (whichever
    entry serves it), the final norm and the output layer of `rows` (None: every row)."""
    x = model._stack(model, model.embed.rows(tokens), positions, kv)
    x = x if rows is None else x[rows]
    return model.lm_head(model._rms(x, model.norm, model.cfg.rms_norm_eps))


def step_native(model, tokens: torch.Tensor, positions: torch.Tensor, kv,
                rows: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """The whole step in one call into gemv.c (`decode_step`: the embedding lookup, every
    layer as `layers_native` runs them, the final norm and the output layer in the last of its
    parallel regions) where `model.layers` would take its native call and the output layer has
    a native description; else `step_python`, in the same call."""
    n = tokens.shape[0]
    m = n if rows is None else rows.shape[0]
    stack = model._stack
    native = getattr(stack, "active", None) is not None and stack.active.name == "native"
    desc = _step_desc(model, m) if native and positions.dtype == torch.int64 else None
    plan = kv.native_step() if desc is not None else None
    layers = None if plan is None else _stack_array(model, n)
    got = None
    if layers is not None:
        step, embeds = desc
        x = None if embeds else model.embed.rows(tokens).contiguous()
        rows = _every_row(n) if rows is None else rows.to(torch.int64).contiguous()
        got = gemv.decode_step(layers, _kv_step(plan), step, x, tokens.to(torch.int64).contiguous(),
                               positions.contiguous(), rows)  # fmt: skip
    return step_python(model, tokens, positions, kv, rows) if got is None else got


def decodes(model, n: int) -> bool:
    """Whether the model's side of `decode_native` serves n sequences: the native step
    (`model.step`'s native entry), an output layer and every layer described for n rows, and an
    embedding table gemv.c reads (each sub-step's input comes from it: not float32 weights').
    Cheap: the descriptions are kept (`_step_desc`, `_stack_array`)."""
    stack = model._stack
    if getattr(stack, "active", None) is None or stack.active.name != "native":
        return False
    if model.dtype != torch.float32 or model.device.type != "cpu":
        return False
    desc = _step_desc(model, n)
    return desc is not None and desc[1] and _stack_array(model, n) is not None


def decode_native(model, tokens: torch.Tensor, positions: torch.Tensor, kv, steps: int,
                  spec: torch.Tensor | None = None,
                  draws: torch.Tensor | None = None):  # fmt: skip
    """A sequential step begun on `kv` (`StepBatch.sequential`: `steps` rows per sequence)
    as `steps` decode steps in one call into gemv.c (`decode_steps`), the tokens
    int64 [N] the first one's and positions [N * steps] the step's rows': (tokens int64
    [steps, N], each step's argmax, or its draw under spec [N, 4] with draws [steps, N]
    (`gemv.decode_steps`), the next one's input; logits float32 [steps, N, vocab]),
    or None where the model's side (`decodes`), the cache's description (choosing no blocks)
    or gemv.c does not serve it all (the caller aborts the step: nothing was kept)."""
    n = tokens.shape[0]
    if not decodes(model, n):
        return None
    plan = kv.native_step()
    if plan is None or (plan.choice is not None and plan.choice.choosing):
        return None
    step, layers = _step_desc(model, n)[0], _stack_array(model, n)
    first, positions = tokens.to(torch.int64), positions.to(torch.int64).contiguous()
    out, logits, done = gemv.decode_steps(layers, _kv_step(plan), step, first, positions, steps,
                                          spec, draws)  # fmt: skip
    return (out[1:], logits) if done == steps else None


_EVERY_ROW = [torch.arange(n) for n in range(65)]


def _every_row(n: int) -> torch.Tensor:
    """0 .. n - 1 as int64 (every row's logits; read only): kept for the batch sizes of decode."""
    return _EVERY_ROW[n] if n < len(_EVERY_ROW) else torch.arange(n)


def _step_desc(model, rows: int):
    """(gemv.Step of the model's output layer, final norm and, where gemv.c reads its table,
    embedding; whether it has the embedding), or None when the output layer has no native
    description for `rows` rows. Kept until `_epoch` moves (a breaker switched, a weight's
    forms changed, another kernel build)."""
    if model.dtype != torch.float32 or model.device.type != "cpu":
        return None
    cached = model.__dict__.get("_native_step")
    if cached is None or not _same(cached[0], _epoch()):
        described = _describe_step(model)
        cached = model.__dict__["_native_step"] = (_epoch(), *described)
    _, step, embeds, most, _keep = cached
    return None if step is None or rows > most else (step, embeds)


def _describe_step(model):
    kind = _kind(model.lm_head)
    if kind is None:
        return None, False, 0, None
    keep = [model.norm]  # what the description points into
    head = _lin(model.lm_head, kind[0], keep)  # (interleaves a packed head first, where it would)
    step = gemv.Step(norm=model.norm.data_ptr(), eps=model.cfg.rms_norm_eps, head=head)
    w = model.embed.weight
    embeds = getattr(w, "qtype", None) in gemv.FORMAT_CODE and gemv.unavailable() is None
    if embeds:
        table = w.rows16 if w.rows16 is not None else w.q.blocks
        step.embed, step.embed_rows, step.embed_nb = table.data_ptr(), *table.shape[:2]
        step.embed_fmt = gemv.FORMAT_CODE[w.qtype] | (gemv.ROWS16 if w.rows16 is not None else 0)
        keep.append(table)
    table = getattr(w, "weight", None)  # a float32 table: its rows copied (decode_steps reads
    if not embeds and _float_table(table) and gemv.unavailable() is None:  # each step's in C)
        step.embed, step.embed_fmt = table.data_ptr(), gemv.F32_ROWS
        step.embed_rows, step.embed_nb = table.shape[0], table.shape[1] // 32
        keep.append(table)
        embeds = True
    return step, embeds, kind[1], keep


def _float_table(t) -> bool:
    """Whether `t` is a float32 embedding table gemv.c reads (rows of whole runs of 32)."""
    return (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() == 2
            and t.is_contiguous() and t.device.type == "cpu" and t.shape[1] % 32 == 0)  # fmt: skip


def _all_usable(model, x: torch.Tensor):
    """A ctypes array of every layer's gemv.Layer, or None when one of them cannot take x."""
    return _stack_array(model, x.shape[0]) if _float32_cpu(model, x) else None


def _stack_array(model, n: int):
    """`_all_usable` for n float32 rows on CPU (the caller checked the model and the rows).
    Built once and kept until `_epoch` moves (a breaker switched an implementation, a weight's
    forms changed, another kernel build): a step compares three numbers, not 4 breakers per
    layer."""
    cached = model.__dict__.get("_native_stack")
    if cached is None or not _same(cached[0], _epoch()):
        described = [_described(model, li) for li in range(model.cfg.num_layers)]
        layers = [d.layer for d in described]
        array, rows = None, 0
        if all(layer is not None for layer in layers):
            array = (ctypes.POINTER(gemv.Layer) * len(layers))(*map(ctypes.pointer, layers))
            rows = min(d.max_rows for d in described)
        # the descriptions are kept with the array: its pointers point into them
        cached = model.__dict__["_native_stack"] = (_epoch(), array, rows, described)
    return cached[1] if cached[1] is not None and n <= cached[2] else None


def _kv_step(plan: NativeStep | NativeHook) -> gemv.KVStep:
    """gemv.c's kv_step_t of `plan` (its arrays kept alive on the struct)."""
    keep: list = []
    choosing = plan.choice is not None and plan.choice.choosing  # a sequence has a plan
    choice = _choice(plan.choice, keep) if choosing else None
    if isinstance(plan, NativeHook):  # the cache's own function per layer
        past = None if plan.past is None else _int64s(plan.past, keep)
        step = gemv.KVStep(nseq=len(plan.rows) - 1, rows=_int64s(plan.rows, keep),
                           past=past, own=plan.function, own_ctx=plan.context)  # fmt: skip
        step.choice = None if choice is None else ctypes.addressof(choice)
        step._keep = (keep, plan)
        return step
    arrays = [_int64s(v, keep) for v in (plan.rows, plan.past, [b.shape[1] for b in plan.blocks],
              [t.data_ptr() for t in plan.ids], [b.data_ptr() for b in plan.blocks])]  # fmt: skip
    step = gemv.KVStep(
        plan.attend, plan.base, plan.layer_bytes, plan.slots, plan.block_size, len(plan.past),
        plan.scale, plan.new_slots.data_ptr(), *arrays,
        None if choice is None else ctypes.addressof(choice),
    )  # fmt: skip
    if plan.places:  # a tiered cache's further arenas, and where each block lies
        step.nplaces = len(plan.places)
        step.places = _int64s([v for place in plan.places for v in place], keep)
        step.where = _int64s([0 if w is None else w.data_ptr() for w in plan.where], keep)
    step._keep = (keep, plan)  # the arrays and tensors it points into
    return step


def _choice(c: NativeChoice, keep: list) -> gemv.Choice:
    """gemv.c's choice_t of `c` (its arrays appended to `keep`)."""

    def int64s(values):
        return _int64s(values, keep)

    def each(tensors, what):  # per sequence; 0 for one without a plan (never read)
        return int64s([0 if t is None else what(t) for t in tensors])

    plans = [v for p in c.plans for v in (p if p is not None else (-1, 0, 0, 0))]
    choice = gemv.Choice(
        c.choose, c.first, c.parts, c.width, c.alpha, c.temp, int64s(plans),
        each(c.codes, torch.Tensor.data_ptr), each(c.scales, torch.Tensor.data_ptr),
        each(c.codes, lambda t: t.stride(0) * t.element_size()),
        each(c.scales, lambda t: t.stride(0) * t.element_size()),
        each(c.codes, lambda t: t.stride(1)), each(c.scales, lambda t: t.stride(1)),
        c.out.data_ptr(), int64s(c.at), c.out.stride(0),
    )  # fmt: skip
    keep.append(choice)
    return choice


def _available(device: torch.device, owner: object) -> str | None:
    if device.type != "cpu":
        return "a CPU kernel"
    if getattr(owner, "dtype", torch.float32) != torch.float32:
        return "float32 models only"
    return gemv.unavailable()


def _available_stack(device: torch.device, owner: object) -> str | None:
    if getattr(owner, "_qkv", None) is None:  # DeepSeek: MLA and MoE layers of its own
        return "Llama layers only"
    return _available(device, owner)


def _register() -> None:
    for op, native, ops in (("layer.qkv", qkv_native, qkv_ops), ("layer.out", out_native, out_ops)):
        register(FnImplementation(op, "native", native, ("cpu",), _available), 5)
        register(FnImplementation(op, "ops", ops, ("*",)), 90, reference=True)
    op = "model.layers"
    register(FnImplementation(op, "native", layers_native, ("cpu",), _available_stack), 5)
    register(FnImplementation(op, "python", layers_python, ("*",)), 90, reference=True)
    op = "model.step"
    register(FnImplementation(op, "native", step_native, ("cpu",), _available_stack), 5)
    register(FnImplementation(op, "python", step_python, ("*",)), 90, reference=True)


_register()

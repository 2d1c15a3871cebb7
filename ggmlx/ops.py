"""Op constructors named like ggml (without the `ggml_` prefix), in ggml's argument order.

Shapes are ggml's `ne`: innermost first, 4 dims. Each constructor checks its shape rules
at build time and raises `ShapeError` naming the op and both shapes; no math happens here
(see `ggmlx.lower` for what each op computes).
"""
from __future__ import annotations

import math

import numpy as np

from ggmlx import types
from ggmlx.quants import ROW_KERNELS
from ggmlx.tensor import VIEW_OPS, Flag, Op, Tensor, new_tensor, pad_ne
from ggmlx.types import GGMLType

F32 = GGMLType.F32
I32 = GGMLType.I32

# rope modes (ggml.h)
ROPE_TYPE_NORMAL = 0
ROPE_TYPE_NEOX = 2
ROPE_TYPE_MROPE = 8        # ggml_rope_multi: Qwen2-VL's sections of t/h/w/e positions, NEOX pairs
ROPE_TYPE_IMROPE = 40      # Qwen3-VL's interleaved sections
ROPE_TYPE_VISION = 24      # Qwen2-VL's vision encoder: 2-D positions over the whole head

# glu ops (ggml_glu_op)
GLU_REGLU, GLU_GEGLU, GLU_SWIGLU, GLU_SWIGLU_OAI = "reglu", "geglu", "swiglu", "swiglu_oai"

SORT_ASC, SORT_DESC = "asc", "desc"


class ShapeError(ValueError):
    """Operands whose shapes or types an op cannot take."""


def _fail(op: str, msg: str, *ts: Tensor) -> None:
    shapes = ", ".join(f"{t.name or 'tensor'}{list(t.ne)} {t.type.name}" for t in ts)
    raise ShapeError(f"{op}: {msg} ({shapes})")


def _node(op: Op, t: GGMLType, ne, src, op_params=()) -> Tensor:
    return new_tensor(t, ne, op=op, src=src, op_params=op_params)


def _float(op: str, *ts: Tensor) -> None:
    for t in ts:
        if types.traits(t.type).is_quantized or t.type in (GGMLType.I32, GGMLType.I64):
            _fail(op, f"needs float operands, got {t.type.name}", *ts)


def can_repeat(b: Tensor, a: Tensor) -> bool:
    """True when b tiles a whole number of times into a (ggml_can_repeat)."""
    return all(bd > 0 and ad % bd == 0 or ad == bd == 0 for ad, bd in zip(a.ne, b.ne, strict=False))


# ---- element-wise ----------------------------------------------------------------------

def _binary(op: Op, a: Tensor, b: Tensor) -> Tensor:
    _float(op.value, a, b)
    if not can_repeat(b, a):
        _fail(op.value.lower(), "src1 must repeat into src0 (every ne0 % ne1 == 0)", a, b)
    return _node(op, F32, a.ne, (a, b))


def add(a: Tensor, b: Tensor) -> Tensor:
    """a + b; b broadcasts by tiling into a. -> a.ne, F32."""
    return _binary(Op.ADD, a, b)


def sub(a: Tensor, b: Tensor) -> Tensor:
    """a - b; b tiles into a. -> a.ne, F32."""
    return _binary(Op.SUB, a, b)


def mul(a: Tensor, b: Tensor) -> Tensor:
    """a * b; b tiles into a (e.g. a norm weight [n_embd] times [n_embd, n_tokens]). -> a.ne."""
    return _binary(Op.MUL, a, b)


def div(a: Tensor, b: Tensor) -> Tensor:
    """a / b; b tiles into a. -> a.ne, F32."""
    return _binary(Op.DIV, a, b)


def _unary(op: Op, a: Tensor, op_params=()) -> Tensor:
    _float(op.value.lower(), a)
    return _node(op, F32, a.ne, (a,), op_params)


def scale(a: Tensor, s: float, b: float = 0.0) -> Tensor:
    """s * a + b (ggml_scale / ggml_scale_bias). -> a.ne."""
    return _unary(Op.SCALE, a, (float(s), float(b)))


def sqr(a: Tensor) -> Tensor:
    """a * a. -> a.ne."""
    return _unary(Op.SQR, a)


def sqrt(a: Tensor) -> Tensor:
    """sqrt(a). -> a.ne."""
    return _unary(Op.SQRT, a)


def tanh(a: Tensor) -> Tensor:
    """tanh(a). -> a.ne."""
    return _unary(Op.TANH, a)


def clamp(a: Tensor, min: float, max: float) -> Tensor:
    """a clipped to [min, max]. -> a.ne."""
    if min > max:
        raise ValueError(f"clamp: min {min} > max {max}")
    return _unary(Op.CLAMP, a, (float(min), float(max)))


def sigmoid(a: Tensor) -> Tensor:
    """1 / (1 + exp(-a)). -> a.ne."""
    return _unary(Op.SIGMOID, a)


def softplus(a: Tensor) -> Tensor:
    """log(1 + exp(a)), a itself above 20 (ggml's threshold). -> a.ne."""
    return _unary(Op.SOFTPLUS, a)


def xielu(a: Tensor, alpha_n: float, alpha_p: float, beta: float, eps: float) -> Tensor:
    """xIELU (Apertus' FFN activation, ggml_xielu) with the file's raw alphas, constrained here
    as ggml does in float32 (an = beta + softplus(alpha_n), ap = softplus(alpha_p)):
    ap * a^2 + beta * a for a > 0, else (expm1(min(a, eps)) - a) * an + beta * a. -> a.ne."""
    def sp(v: float) -> np.float32:
        v32 = np.float32(v)
        return v32 if v32 > 20 else np.log(np.float32(1) + np.exp(v32))
    an, ap = np.float32(beta) + sp(alpha_n), sp(alpha_p)
    return _unary(Op.XIELU, a, (float(an), float(ap), float(np.float32(beta)), float(np.float32(eps))))


def relu(a: Tensor) -> Tensor:
    """max(a, 0). -> a.ne."""
    return _unary(Op.RELU, a)


def silu(a: Tensor) -> Tensor:
    """a * sigmoid(a). -> a.ne."""
    return _unary(Op.SILU, a)


def gelu(a: Tensor) -> Tensor:
    """tanh-approximated GELU, as ggml_gelu. -> a.ne."""
    return _unary(Op.GELU, a)


def gelu_quick(a: Tensor) -> Tensor:
    """a * sigmoid(1.702 a). -> a.ne."""
    return _unary(Op.GELU_QUICK, a)


def gelu_erf(a: Tensor) -> Tensor:
    """The exact GELU, 0.5 a (1 + erf(a / sqrt 2)) (Whisper's encoder). -> a.ne."""
    return _unary(Op.GELU_ERF, a)


def glu(a: Tensor, b: Tensor | None, op: str, swapped: bool = False) -> Tensor:
    """Gated linear unit. With b: act(a) * b (a.ne == b.ne). Without: a's ne0 halves are
    [x, g] and the result act(x) * g has ne0 / 2 (swapped: act(g) * x)."""
    if op not in (GLU_REGLU, GLU_GEGLU, GLU_SWIGLU):
        raise ValueError(f"glu: unknown op {op!r}")
    if b is None:
        _float("glu", a)
        if a.ne[0] % 2:
            _fail("glu", "fused glu needs an even ne0", a)
        return _node(Op.GLU, F32, (a.ne[0] // 2,) + a.ne[1:], (a,), (op, bool(swapped)))
    _float("glu", a, b)
    if a.ne != b.ne:
        _fail("glu", "split glu needs equal shapes", a, b)
    return _node(Op.GLU, F32, a.ne, (a, b), (op, bool(swapped)))


def swiglu_oai(a: Tensor, b: Tensor, alpha: float, limit: float) -> Tensor:
    """gpt-oss's clamped SwiGLU: x = min(a, limit), y = clamp(b, -limit, limit),
    x * sigmoid(alpha * x) * (y + 1). a.ne == b.ne -> a.ne."""
    _float("swiglu_oai", a, b)
    if a.ne != b.ne:
        _fail("swiglu_oai", "needs equal shapes", a, b)
    return _node(Op.GLU, F32, a.ne, (a, b), (GLU_SWIGLU_OAI, False, float(alpha), float(limit)))


def swiglu(a: Tensor) -> Tensor:
    """silu(first half of ne0) * second half. -> [ne0/2, ...]."""
    return glu(a, None, GLU_SWIGLU)


def swiglu_split(a: Tensor, b: Tensor) -> Tensor:
    """silu(a) * b. -> a.ne."""
    return glu(a, b, GLU_SWIGLU)


def geglu(a: Tensor) -> Tensor:
    """gelu(first half of ne0) * second half. -> [ne0/2, ...]."""
    return glu(a, None, GLU_GEGLU)


def geglu_split(a: Tensor, b: Tensor) -> Tensor:
    """gelu(a) * b. -> a.ne."""
    return glu(a, b, GLU_GEGLU)


# ---- normalization ---------------------------------------------------------------------

def rms_norm(a: Tensor, eps: float) -> Tensor:
    """a / sqrt(mean(a^2 over ne0) + eps). -> a.ne."""
    if eps < 0:
        raise ValueError(f"rms_norm: eps must be >= 0, got {eps}")
    return _unary(Op.RMS_NORM, a, (float(eps),))


def norm(a: Tensor, eps: float) -> Tensor:
    """(a - mean) / sqrt(var + eps) over ne0. -> a.ne."""
    if eps < 0:
        raise ValueError(f"norm: eps must be >= 0, got {eps}")
    return _unary(Op.NORM, a, (float(eps),))


# ---- matrix products and rows ----------------------------------------------------------

def mul_mat(a: Tensor, b: Tensor) -> Tensor:
    """a [K, M, A2, A3] (may be quantized) times b [K, N, B2, B3] -> F32 [M, N, B2, B3]:
    result[n, m] = dot(a row m, b row n). a broadcasts over dims 2 and 3 when B2 % A2 == 0
    (b channel i uses a channel i // (B2 / A2), as grouped-query attention needs)."""
    if a.ne[0] != b.ne[0]:
        _fail("mul_mat", "ne0 (the reduced dim) differs", a, b)
    if a.ne[2] == 0 or a.ne[3] == 0 or b.ne[2] % a.ne[2] or b.ne[3] % a.ne[3]:
        _fail("mul_mat", "src0 dims 2 and 3 must divide src1's", a, b)
    _float("mul_mat", b)
    return _node(Op.MUL_MAT, F32, (a.ne[1], b.ne[1], b.ne[2], b.ne[3]), (a, b))


def mul_mat_id(as_: Tensor, b: Tensor, ids: Tensor) -> Tensor:
    """Mixture-of-experts product. as_ [K, M, n_expert] stacked expert matrices; b
    [K, n_b, n_tokens] (n_b is 1 or n_used); ids I32 [n_used, n_tokens] chosen experts.
    -> F32 [M, n_used, n_tokens]: result[t, e] = as_[ids[t, e]] @ b[t, e % n_b]."""
    if as_.ne[3] != 1 or b.ne[3] != 1:
        _fail("mul_mat_id", "4-d operands are not supported", as_, b)
    if as_.ne[0] != b.ne[0]:
        _fail("mul_mat_id", "ne0 (the reduced dim) differs", as_, b)
    if ids.type != I32 or ids.ne[1] != b.ne[2] or ids.ne[2] != 1:
        _fail("mul_mat_id", "ids must be I32 [n_used, n_tokens]", ids, b)
    if b.ne[1] not in (1, ids.ne[0]):
        _fail("mul_mat_id", "b ne1 must be 1 or n_used", b, ids)
    return _node(Op.MUL_MAT_ID, F32, (as_.ne[1], ids.ne[0], b.ne[2], 1), (as_, b, ids))


def get_rows(a: Tensor, b: Tensor) -> Tensor:
    """Rows of a [ne0, n_rows, ne2, ne3] (may be quantized) picked by I32 b [n, ne2, ne3]:
    -> F32 [ne0, n, ne2, ne3]."""
    if b.type != I32:
        _fail("get_rows", "indices must be I32", b)
    if a.ne[2] != b.ne[1] or b.ne[3] != 1 or a.ne[3] != b.ne[2]:
        _fail("get_rows", "index dims 1, 2 must match src0 dims 2, 3", a, b)
    out_t = I32 if a.type == I32 else F32
    return _node(Op.GET_ROWS, out_t, (a.ne[0], b.ne[0], b.ne[1], b.ne[2]), (a, b))


def set_rows(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """a with rows c[i] replaced by b's row i (converted to a's type). a [ne0, n_rows, ...]
    is usually a state buffer (a KV cache layer; a block type is written by ggml's
    quantize_row_*_ref, ggmlx.quants.ROW_KERNELS); b F32 [ne0, n, ...]; c I32/I64 [n] for every
    ne2 slice, or [n, ne2] with its own rows per slice (ggml's broadcast; ne3 = 1 then).
    Indices outside [0, n_rows) are dropped, so padded tokens write nothing. -> a.ne, a.type."""
    if a.ne[0] != b.ne[0] or a.ne[2:] != b.ne[2:]:
        _fail("set_rows", "src and dst rows must match (ne0, ne2, ne3)", a, b)
    per_slice = c.ne[1] == b.ne[2] and c.ne[1] > 1 and b.ne[3] == 1 and c.ne[2] == c.ne[3] == 1
    if c.type not in (I32, GGMLType.I64) or c.ne[0] != b.ne[1] or (c.nrows() != 1 and not per_slice):
        _fail("set_rows", "indices must be I32/I64 [n_rows of src] or [n_rows of src, ne2 of src]", c, b)
    if types.traits(a.type).is_quantized and a.type not in ROW_KERNELS:
        _fail("set_rows", f"quantized destinations are {', '.join(t.name for t in ROW_KERNELS)}", a)
    return _node(Op.SET_ROWS, a.type, a.ne, (a, b, c))


# ---- rope, softmax, attention ----------------------------------------------------------

def rope_ext(a: Tensor, b: Tensor, c: Tensor | None, n_dims: int, mode: int, n_ctx_orig: int,
             freq_base: float, freq_scale: float, ext_factor: float, attn_factor: float,
             beta_fast: float, beta_slow: float) -> Tensor:
    """Rotary position embedding of a [head_dim, n_head, n_tokens, 1] at positions I32 b
    [n_tokens]; the first n_dims of head_dim rotate (NORMAL: adjacent pairs, NEOX: halves),
    optional c [n_dims/2] divides the frequencies; YaRN when ext_factor != 0. -> a.ne."""
    if mode not in (ROPE_TYPE_NORMAL, ROPE_TYPE_NEOX):
        raise ValueError(f"rope_ext: unsupported mode {mode}")
    if b.type != I32 or b.ne[0] != a.ne[2] or b.nrows() != 1:
        _fail("rope_ext", "positions must be I32 [ne2 of a]", a, b)
    if n_dims <= 0 or n_dims % 2 or n_dims > a.ne[0]:
        _fail("rope_ext", f"n_dims {n_dims} must be even and <= ne0", a)
    src: tuple[Tensor, ...] = (a, b)
    if c is not None:
        if c.ne[0] < n_dims // 2:
            _fail("rope_ext", "freq_factors needs n_dims/2 entries", c, a)
        src = (a, b, c)
    _float("rope_ext", a)
    params = (int(n_dims), int(mode), int(n_ctx_orig), float(freq_base), float(freq_scale),
              float(ext_factor), float(attn_factor), float(beta_fast), float(beta_slow))
    return _node(Op.ROPE, F32, a.ne, src, params)


def rope_multi(a: Tensor, b: Tensor, c: Tensor | None, n_dims: int, sections: tuple[int, int, int, int], mode: int,
               n_ctx_orig: int, freq_base: float, freq_scale: float, ext_factor: float, attn_factor: float,
               beta_fast: float, beta_slow: float) -> Tensor:
    """ggml_rope_multi (M-RoPE): as rope_ext with NEOX pairs, but each rotated pair takes its
    position from one of four streams, positions I32 b [4 * n_tokens] = t, h, w, e blocks of
    n_tokens. Pair i's stream: MROPE by sections (the first sections[0] pairs of each
    sum(sections) run t, the next h, w, then e); IMROPE interleaved (pair i % 3 cycles t, h, w
    within 3 * sections[k], else e). VISION: n_dims = ne0 / 2 pairs (i, i + n_dims) rotate the
    whole head, by sections, each section's frequencies starting again from the first. -> a.ne."""
    if mode not in (ROPE_TYPE_MROPE, ROPE_TYPE_IMROPE, ROPE_TYPE_VISION):
        raise ValueError(f"rope_multi: unsupported mode {mode}")
    counts = tuple(int(v) for v in sections)
    if len(counts) != 4 or min(counts) < 0 or not any(counts[:3]):
        _fail("rope_multi", f"sections {counts} must be 4 counts >= 0 with t, h or w > 0", a)
    if b.type != I32 or b.ne[0] != 4 * a.ne[2] or b.nrows() != 1:
        _fail("rope_multi", "positions must be I32 [4 * ne2 of a]", a, b)
    if n_dims <= 0 or n_dims % 2 or n_dims > a.ne[0] or sum(counts) > a.ne[0]:
        _fail("rope_multi", f"n_dims {n_dims} must be even and <= ne0, sections summing <= ne0", a)
    if mode == ROPE_TYPE_VISION and 2 * n_dims != a.ne[0]:
        _fail("rope_multi", f"vision mode rotates the whole head: n_dims {n_dims} must be ne0 / 2", a)
    src: tuple[Tensor, ...] = (a, b)
    if c is not None:
        if c.ne[0] < rope_pairs(n_dims, mode):
            _fail("rope_multi", "freq_factors needs n_dims/2 entries", c, a)
        src = (a, b, c)
    _float("rope_multi", a)
    params = (int(n_dims), int(mode), int(n_ctx_orig), float(freq_base), float(freq_scale),
              float(ext_factor), float(attn_factor), float(beta_fast), float(beta_slow), *counts)
    return _node(Op.ROPE, F32, a.ne, src, params)


def rope_pairs(n_dims: int, mode: int) -> int:
    """How many pairs a rope rotates: n_dims / 2, or n_dims in vision mode (the whole head)."""
    return n_dims if mode == ROPE_TYPE_VISION else n_dims // 2


def mrope_streams(n_dims: int, sections: tuple[int, ...], mode: int) -> np.ndarray:
    """The position stream (0 t, 1 h, 2 w, 3 e) each rotated pair of rope_multi reads."""
    total = sum(sections)
    s0, s1, s2 = sections[:3]
    out = np.empty(rope_pairs(n_dims, mode), np.int64)
    for i in range(len(out)):
        k = i % total
        if mode == ROPE_TYPE_IMROPE:
            out[i] = (1 if k % 3 == 1 and k < 3 * s1 else 2 if k % 3 == 2 and k < 3 * s2
                      else 0 if k % 3 == 0 and k < 3 * s0 else 3)
        else:
            out[i] = 0 if k < s0 else 1 if k < s0 + s1 else 2 if k < s0 + s1 + s2 else 3
    return out


def soft_max_ext(a: Tensor, mask: Tensor | None, scale: float, max_bias: float) -> Tensor:
    """softmax over ne0 of a*scale + mask (with ALiBi slopes when max_bias > 0). mask
    [ne0, >= ne1, ...] broadcasts over dims 2, 3 and may have extra (padding) rows. -> a.ne."""
    _float("soft_max_ext", a)
    src: tuple[Tensor, ...] = (a,)
    if mask is not None:
        _float("soft_max_ext", mask)
        if mask.ne[0] != a.ne[0] or mask.ne[1] < a.ne[1] or a.ne[2] % mask.ne[2] or a.ne[3] % mask.ne[3]:
            _fail("soft_max_ext", "mask must be [ne0, >= ne1] and broadcast over dims 2, 3", a, mask)
        src = (a, mask)
    return _node(Op.SOFT_MAX, F32, a.ne, src, (float(scale), float(max_bias)))


def soft_max(a: Tensor) -> Tensor:
    """softmax over ne0. -> a.ne."""
    return soft_max_ext(a, None, 1.0, 0.0)


def flash_attn_ext(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
                   max_bias: float, logit_softcap: float, sinks: Tensor | None = None) -> Tensor:
    """Fused attention. q [D, n_q, n_head, B], k [D, n_kv, n_head_kv, B], v [Dv, n_kv,
    n_head_kv, B] with n_head % n_head_kv == 0; mask [n_kv, >= n_q, ...]. Scores are
    q.k*scale, soft-capped when logit_softcap > 0, plus mask. `sinks` [n_head] (F32, like
    ggml_flash_attn_ext_add_sinks) adds one virtual key per head with that score and no value
    to the softmax. -> F32 [Dv, n_head, n_q, B] (note the permuted result, as in ggml)."""
    if q.ne[0] != k.ne[0] or k.ne[1] != v.ne[1] or k.ne[2] != v.ne[2]:
        _fail("flash_attn_ext", "q/k head dims or k/v lengths differ", q, k, v)
    if k.ne[2] == 0 or q.ne[2] % k.ne[2] or q.ne[3] != k.ne[3]:
        _fail("flash_attn_ext", "n_head must be a multiple of n_head_kv", q, k)
    src: tuple[Tensor, ...] = (q, k, v)
    if mask is not None:
        if mask.ne[0] != k.ne[1] or mask.ne[1] < q.ne[1] or q.ne[2] % mask.ne[2] or q.ne[3] % mask.ne[3]:
            _fail("flash_attn_ext", "mask must be [n_kv, >= n_q] and broadcast over dims 2, 3", mask, q, k)
        src = (q, k, v, mask)
    if sinks is not None:
        if mask is None or sinks.ne[0] != q.ne[2]:
            _fail("flash_attn_ext", "sinks need a mask and one value per head", sinks, q)
        src = src + (sinks,)
    return _node(Op.FLASH_ATTN_EXT, F32, (v.ne[0], q.ne[2], q.ne[1], q.ne[3]), src,
                 (float(scale), float(max_bias), float(logit_softcap)))


def map_custom1(a: Tensor, fn) -> Tensor:
    """fn applied to a's value (ggml_map_custom1): fn takes and returns an f32 array of
    a's numpy shape and must be JAX-traceable; its result must keep that shape. fn is part
    of the compiled-graph key (by identity, through its repr), so the same object reuses
    one executable. -> a.ne, F32."""
    _float("map_custom1", a)
    if not callable(fn):
        raise ValueError(f"map_custom1: fn must be callable, got {type(fn).__name__}")
    return _node(Op.MAP_CUSTOM1, F32, a.ne, (a,), (fn,))


# ---- shape ops and views ---------------------------------------------------------------

def reshape(a: Tensor, *ne: int) -> Tensor:
    """Same data, new shape (a must be contiguous, element counts equal). 1..4 dims."""
    ne4 = pad_ne(ne)
    if math.prod(ne4) != a.nelements():
        _fail("reshape", f"element count differs from {list(ne4)}", a)
    if not a.is_contiguous():
        _fail("reshape", "source must be contiguous (use cont first)", a)
    return _node(Op.RESHAPE, a.type, ne4, (a,))


def reshape_1d(a: Tensor, ne0: int) -> Tensor:
    return reshape(a, ne0)


def reshape_2d(a: Tensor, ne0: int, ne1: int) -> Tensor:
    return reshape(a, ne0, ne1)


def reshape_3d(a: Tensor, ne0: int, ne1: int, ne2: int) -> Tensor:
    return reshape(a, ne0, ne1, ne2)


def reshape_4d(a: Tensor, ne0: int, ne1: int, ne2: int, ne3: int) -> Tensor:
    return reshape(a, ne0, ne1, ne2, ne3)


def view_4d(a: Tensor, ne0: int, ne1: int, ne2: int, ne3: int, nb1: int, nb2: int, nb3: int,
            offset: int) -> Tensor:
    """A strided window into a's memory: element (i0..i3) is at byte offset + i0*nb0 +
    i1*nb1 + i2*nb2 + i3*nb3 of a (nb0 = a's element size); must stay inside a. Of a block
    type (a quantized KV cache; not a weight) the rows are whole blocks: ne0 a multiple of the
    block size, nb0 the block's bytes."""
    ne4 = pad_ne((ne0, ne1, ne2, ne3))
    esz = types.type_size(a.type)
    nb = (esz, int(nb1), int(nb2), int(nb3))
    if offset < 0 or any(s % esz for s in nb) or offset % esz:
        _fail("view", f"offset {offset} and strides {nb} must be multiples of {esz}", a)
    if types.traits(a.type).is_quantized:
        root = a
        while root.op in VIEW_OPS:
            root = root.src[0]
        if root.flags & Flag.WEIGHT:
            _fail("view", "views of block-quantized weights are not supported", a)
        if ne4[0] % types.block_size(a.type):
            _fail("view", f"ne0 = {ne4[0]} is not a multiple of the {a.type.name} block size", a)
    last = (offset + types.row_size(a.type, ne4[0]) + sum((n - 1) * s for n, s in zip(ne4[1:], nb[1:], strict=True))
            if min(ne4) > 0 else 0)
    span = types.row_size(a.type, a.ne[0]) * a.nrows()
    if last > span:
        _fail("view", f"window {list(ne4)} nb={list(nb)} offset={offset} ends at byte {last} > {span}", a)
    t = new_tensor(a.type, ne4, op=Op.VIEW, src=(a,), op_params=(nb, int(offset)))
    t.nb = nb
    t.view_offs = int(offset)
    return t


def view_1d(a: Tensor, ne0: int, offset: int) -> Tensor:
    esz = types.type_size(a.type)
    return view_4d(a, ne0, 1, 1, 1, ne0 * esz, ne0 * esz, ne0 * esz, offset)


def view_2d(a: Tensor, ne0: int, ne1: int, nb1: int, offset: int) -> Tensor:
    return view_4d(a, ne0, ne1, 1, 1, nb1, nb1 * ne1, nb1 * ne1, offset)


def view_3d(a: Tensor, ne0: int, ne1: int, ne2: int, nb1: int, nb2: int, offset: int) -> Tensor:
    return view_4d(a, ne0, ne1, ne2, 1, nb1, nb2, nb2 * ne2, offset)


def permute(a: Tensor, axis0: int, axis1: int, axis2: int, axis3: int) -> Tensor:
    """Dim i of a becomes dim axis_i of the result (ggml_permute); no data moves."""
    axes = (axis0, axis1, axis2, axis3)
    if sorted(axes) != [0, 1, 2, 3]:
        raise ValueError(f"permute: axes {axes} are not a permutation of 0..3")
    if types.traits(a.type).is_quantized and axis0 != 0:
        _fail("permute", "the rows of blocks of a block-quantized tensor must stay dim 0", a)
    ne = [0] * 4
    nb = [0] * 4
    for i, ax in enumerate(axes):
        ne[ax] = a.ne[i]
        nb[ax] = a.nb[i]
    t = new_tensor(a.type, ne, op=Op.PERMUTE, src=(a,), op_params=axes)
    t.nb = (nb[0], nb[1], nb[2], nb[3])
    return t


def transpose(a: Tensor) -> Tensor:
    """Swap dims 0 and 1 (a permuted view)."""
    return permute(a, 1, 0, 2, 3)


def _check_view_type(op: str, a: Tensor) -> None:
    if types.traits(a.type).is_quantized:
        _fail(op, "copies of block-quantized tensors are not supported", a)


def cont(a: Tensor) -> Tensor:
    """A contiguous copy of a (e.g. after permute). -> a.ne, a.type."""
    _check_view_type("cont", a)
    return _node(Op.CONT, a.type, a.ne, (a,))


def cont_2d(a: Tensor, ne0: int, ne1: int) -> Tensor:
    return reshape(cont(a), ne0, ne1)


def cpy(a: Tensor, b: Tensor) -> Tensor:
    """a's values converted into b's type and shape (equal element counts). -> b.ne, b.type."""
    _check_view_type("cpy", b)
    if a.nelements() != b.nelements():
        _fail("cpy", "element counts differ", a, b)
    return _node(Op.CPY, b.type, b.ne, (a, b))


def cast(a: Tensor, t: GGMLType) -> Tensor:
    """a converted to type t. -> a.ne."""
    if types.traits(t).is_quantized:
        _fail("cast", f"cannot cast to block type {GGMLType(t).name}", a)
    return _node(Op.CPY, t, a.ne, (a,))


def concat(a: Tensor, b: Tensor, dim: int) -> Tensor:
    """a and b joined along dim (all other dims equal)."""
    if not 0 <= dim < 4:
        raise ValueError(f"concat: dim {dim} out of range")
    if a.type != b.type or any(a.ne[i] != b.ne[i] for i in range(4) if i != dim):
        _fail("concat", f"dims other than {dim} (and types) must match", a, b)
    ne = list(a.ne)
    ne[dim] += b.ne[dim]
    return _node(Op.CONCAT, a.type, ne, (a, b), (int(dim),))


def repeat_4d(a: Tensor, ne0: int, ne1: int, ne2: int, ne3: int) -> Tensor:
    """a tiled to [ne0, ne1, ne2, ne3], each ne a multiple of a's (ggml_repeat_4d). -> that shape."""
    ne = (ne0, ne1, ne2, ne3)
    if any(n < 1 or n % m for n, m in zip(ne, a.ne, strict=True)):
        _fail("repeat_4d", f"every ne of {list(ne)} must be a positive multiple of a's", a)
    return _node(Op.REPEAT, a.type, ne, (a,))


def conv_output_size(ins: int, ks: int, s: int, p: int, d: int) -> int:
    """ggml_calc_conv_output_size."""
    return (ins + 2 * p - d * (ks - 1) - 1) // s + 1


def im2col(a: Tensor, b: Tensor, s0: int, s1: int, p0: int, p1: int, d0: int, d1: int, is_2D: bool,
           dst_type: GGMLType) -> Tensor:
    """The columns a convolution with kernel a reads from b: 1-D only (is_2D False), a
    [K, IC, OC] and b [L, IC, N] -> dst_type [IC K, OL, N], K fastest, b read at
    o s0 + k d0 - p0 (zero outside); ggml_conv_1d is this and one mul_mat."""
    if is_2D:
        raise ValueError("im2col: the 2-D form is not supported yet")
    if dst_type not in (F32, GGMLType.F16):
        raise ValueError(f"im2col: dst_type must be F32 or F16, got {GGMLType(dst_type).name}")
    if min(s0, d0) < 1 or p0 < 0:
        raise ValueError(f"im2col: stride {s0} and dilation {d0} must be >= 1, padding {p0} >= 0")
    _float("im2col", a, b)
    if b.ne[1] != a.ne[1] or b.ne[3] != 1:
        _fail("im2col", "b must be [L, IC, N] with a's IC", a, b)
    ol = conv_output_size(b.ne[0], a.ne[0], s0, p0, d0)
    if ol < 1:
        _fail("im2col", "the kernel does not fit the input", a, b)
    return _node(Op.IM2COL, dst_type, (a.ne[0] * a.ne[1], ol, b.ne[2], 1), (a, b),
                 (int(s0), int(s1), int(p0), int(p1), int(d0), int(d1), False))


def pad(a: Tensor, p0: int, p1: int, p2: int, p3: int) -> Tensor:
    """a followed by zeros: p_i more along dim i (ggml_pad). -> F32 [ne0 + p0, ne1 + p1, ...]."""
    if min(p0, p1, p2, p3) < 0:
        raise ValueError(f"pad: paddings must be >= 0, got {[p0, p1, p2, p3]}")
    _float("pad", a)
    ne = tuple(n + p for n, p in zip(a.ne, (p0, p1, p2, p3), strict=True))
    return _node(Op.PAD, F32, ne, (a,), (int(p0), int(p1), int(p2), int(p3)))


def sum_rows(a: Tensor) -> Tensor:
    """Sum over ne0. -> [1, ne1, ne2, ne3]."""
    _float("sum_rows", a)
    return _node(Op.SUM_ROWS, F32, (1,) + a.ne[1:], (a,))


def argsort(a: Tensor, order: str = SORT_ASC) -> Tensor:
    """Indices that sort each row (ne0) of a; stable, ties keep the lower index. -> I32 a.ne."""
    if order not in (SORT_ASC, SORT_DESC):
        raise ValueError(f"argsort: order must be 'asc' or 'desc', got {order!r}")
    _float("argsort", a)
    return _node(Op.ARGSORT, I32, a.ne, (a,), (order,))


def top_k(a: Tensor, k: int) -> Tensor:
    """Indices of the k largest entries of each row, largest first. -> I32 [k, ne1, ne2, ne3]."""
    if not 0 < k <= a.ne[0]:
        _fail("top_k", f"k={k} must be in [1, ne0]", a)
    _float("top_k", a)
    return _node(Op.TOP_K, I32, (k,) + a.ne[1:], (a,), (int(k),))



# ---- state-space models ----------------------------------------------------------------

def ssm_conv(sx: Tensor, c: Tensor) -> Tensor:
    """Mamba's short causal convolution: sx [d_conv - 1 + n_t, d_inner, n_s] (each channel's
    conv state followed by its n_t inputs), c [d_conv, d_inner] the per-channel kernels;
    out[i, t, s] = sum_k sx[t + k, i, s] * c[k, i]. -> F32 [d_inner, n_t, n_s]."""
    _float("ssm_conv", sx, c)
    d_conv, d_inner = c.ne[0], c.ne[1]
    n_t = sx.ne[0] - d_conv + 1
    if sx.ne[3] != 1 or c.ne[2] != 1 or c.ne[3] != 1:
        _fail("ssm_conv", "sx must be 3-D and c a matrix", sx, c)
    if sx.ne[1] != d_inner or n_t < 0:
        _fail("ssm_conv", "sx must be [d_conv - 1 + n_t, d_inner, n_s] for c [d_conv, d_inner]", sx, c)
    return _node(Op.SSM_CONV, F32, (d_inner, n_t, sx.ne[2], 1), (sx, c))


def ssm_scan(s: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, ids: Tensor) -> Tensor:
    """The selective scan of Mamba (A [d_state, n_head]: a decay per state element) and Mamba-2
    (A [1, n_head]: one scalar decay per head), per sequence i from state s[..., ids[i]]:
    h_t = exp(softplus(dt_t) A) h_{t-1} + B_t softplus(dt_t) x_t, y_t = C_t . h_t, with B and C
    shared by the n_head / n_group heads of a group. s [d_state, head_dim, n_head, n_slots],
    x [head_dim, n_head, n_seq_tokens, n_seqs], dt [n_head, n_seq_tokens, n_seqs],
    B, C [d_state, n_group, n_seq_tokens, n_seqs], ids I32 [n_seqs].
    -> F32 1-D [x's elements + d_state * head_dim * n_head * n_seqs]: y in x's shape, then
    each sequence's last state (ggml's layout, K = 1)."""
    _float("ssm_scan", s, x, dt, A, B, C)
    d_state, head_dim, n_head = s.ne[0], s.ne[1], s.ne[2]
    n_seq_tokens, n_seqs = x.ne[2], x.ne[3]
    if ids.type != I32 or ids.ne[1:] != (1, 1, 1) or ids.ne[0] != n_seqs:
        _fail("ssm_scan", "ids must be I32 [n_seqs]", ids, x)
    if x.ne[0] != head_dim or x.ne[1] != n_head:
        _fail("ssm_scan", "x must be [head_dim, n_head, n_seq_tokens, n_seqs] of s's head_dim, n_head", s, x)
    if dt.ne != (n_head, n_seq_tokens, n_seqs, 1):
        _fail("ssm_scan", "dt must be [n_head, n_seq_tokens, n_seqs]", dt, x)
    if A.ne[1] != n_head or A.ne[0] not in (1, d_state) or A.ne[2:] != (1, 1):
        _fail("ssm_scan", "A must be [d_state, n_head] or [1, n_head]", A, s)
    if B.ne != C.ne or B.ne[0] != d_state or B.ne[2:] != (n_seq_tokens, n_seqs) or n_head % B.ne[1]:
        _fail("ssm_scan", "B and C must be [d_state, n_group, n_seq_tokens, n_seqs], n_group dividing n_head",
              B, C, s)
    n = x.nelements() + d_state * head_dim * n_head * n_seqs
    return _node(Op.SSM_SCAN, F32, (n, 1, 1, 1), (s, x, dt, A, B, C, ids))


def gated_delta_net(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                    K: int = 1) -> Tensor:
    """The gated delta rule of Gated DeltaNet (Qwen3-Next, Qwen3.5) and Kimi's KDA, per head
    and sequence from state S [S_k, S_v] (stored as ggml does, v index outer):
    S = exp(g_t) S (KDA: row i scaled by exp(g_t[i])), d = beta_t (v_t - S^T k_t),
    S += k_t d^T, o_t = S^T q_t / sqrt(S_v). Heads of q and k tile over v's (head h reads
    q head h % H_k). q, k [S_k, H_k, n_tokens, n_seqs], v [S_v, H_v, n_tokens, n_seqs],
    g [1 or S_v, H_v, n_tokens, n_seqs], beta [1, H_v, n_tokens, n_seqs],
    state [S_v, S_v, H_v, n_seqs]. -> F32 1-D: o [S_v, H_v, n_tokens, n_seqs], then K state
    snapshots, most recent first (slot j = the state j tokens before the last; slots past
    n_tokens are zero), ggml_gated_delta_net's layout."""
    _float("gated_delta_net", q, k, v, g, beta, state)
    S_v, H_v, n_tokens, n_seqs = v.ne
    if q.ne != k.ne or q.ne[0] != S_v or q.ne[2:] != (n_tokens, n_seqs) or H_v % q.ne[1]:
        _fail("gated_delta_net", "q and k must be [S_v, H_k, n_tokens, n_seqs], H_k dividing v's H_v", q, k, v)
    if g.ne[0] not in (1, S_v) or g.ne[1:] != v.ne[1:]:
        _fail("gated_delta_net", "g must be [1 or S_v, H_v, n_tokens, n_seqs]", g, v)
    if beta.ne != (1,) + v.ne[1:]:
        _fail("gated_delta_net", "beta must be [1, H_v, n_tokens, n_seqs]", beta, v)
    if state.ne != (S_v, S_v, H_v, n_seqs):
        _fail("gated_delta_net", "state must be [S_v, S_v, H_v, n_seqs]", state, v)
    if K < 1:
        raise ValueError(f"gated_delta_net: K={K} snapshots, must be >= 1")
    n = v.nelements() + K * state.nelements()
    return _node(Op.GATED_DELTA_NET, F32, (n, 1, 1, 1), (q, k, v, g, beta, state), (int(K),))

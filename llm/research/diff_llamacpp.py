"""Node-by-node diff against llama.cpp (graph-dump debugging).

`python -m llm diff-llamacpp -m MODEL -p PROMPT [--nodes PATTERN]` runs the prompt through
llama.cpp (llama-cpp-python, the optional extra `.[compare]`) in a child process
(llm.research.llamacpp_child: a crash of llama.cpp is a LlamaCppCrashed here) with an eval
callback that reads every named tensor (the `ggml_tensor` struct through ctypes), runs the same tokens
through `LLM.trace`, and prints one row per node name present on both sides: shape,
cosine, max |d|, relative error (||ours - theirs|| / ||theirs||), marking the first node
whose error jumps. A name that sits on a different node than in llama.cpp shows up as a
shape mismatch or a jump to a large error. Names several nodes carry are matched in order
(`Qcur-0`, `Qcur-0#1`, as in llm.trace).

Both sides use an F32 KV cache and the same attention path (unfused by default, so the
attention probabilities `kq_soft_max-*` are compared too; `--flash-attn` for the fused one).
`--f32-twin` compares on the model's dequantized-F32 twin (written next to the GGUF cache),
where llama.cpp does (nearly) exact F32 math on the same weights.
"""
from __future__ import annotations

import ctypes
import fnmatch
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ggmlx.weights import NUMERICS
from llm.research import llamacpp_child
from llm.research.llamacpp_child import LlamaCppCrashed, llama_cpp_available

INSTALL_HINT = f"diff-llamacpp needs llama-cpp-python: {llamacpp_child.INSTALL_HINT}"
JUMP_FACTOR = 10.0
JUMP_FLOOR = 1e-4


@dataclass
class NodeDiff:
    name: str
    shape: tuple[int, ...]
    cosine: float
    max_abs: float
    rel_err: float
    note: str = ""
    jump: bool = False


def compare(ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray], kv_axes: dict[str, int | None] | None = None
            ) -> list[NodeDiff]:
    """One row per name in both (in our order). theirs may be longer along a KV axis
    (llama.cpp pads n_kv): it is cut to ours there."""
    rows = []
    for name, a in ours.items():
        if name not in theirs:
            continue
        b = theirs[name]
        ax = (kv_axes or {}).get(name)
        lead = b.shape[:b.ndim - a.ndim]
        if b.ndim > a.ndim and all(d == 1 for d in lead):
            b = b.reshape(b.shape[b.ndim - a.ndim:])
        if b.size != a.size:
            if ax is not None and b.ndim == a.ndim and b.shape[ax] > a.shape[ax]:
                b = np.take(b, np.arange(a.shape[ax]), axis=ax)
        if b.size != a.size:
            rows.append(NodeDiff(name, a.shape, float("nan"), float("inf"), float("inf"),
                                 f"shape differs: llama.cpp {list(b.shape)}"))
            continue
        x = a.astype(np.float64).ravel()
        y = b.astype(np.float64).reshape(-1)
        d = x - y
        ny = np.linalg.norm(y)
        nx = np.linalg.norm(x)
        cos = float(x @ y / (nx * ny)) if nx > 0 and ny > 0 else (1.0 if nx == ny == 0 else 0.0)
        rel = float(np.linalg.norm(d) / ny) if ny > 0 else float(np.linalg.norm(d))
        rows.append(NodeDiff(name, a.shape, cos, float(np.abs(d).max()) if d.size else 0.0, rel))
    mark_jump(rows)
    return rows


def mark_jump(rows: list[NodeDiff]) -> int | None:
    """Flag the first row whose relative error exceeds JUMP_FACTOR times every earlier one
    (floored at JUMP_FLOOR); returns its index."""
    worst = JUMP_FLOOR
    for i, r in enumerate(rows):
        if not r.rel_err <= JUMP_FACTOR * worst:     # also catches inf / nan
            r.jump = True
            return i
        worst = max(worst, r.rel_err)
    return None


def format_table(rows: list[NodeDiff], only_ours: Sequence[str] = (), only_theirs: Sequence[str] = ()) -> str:
    lines = [f"{'#':>4} {'node':28} {'shape':18} {'cosine':>10} {'max|d|':>10} {'rel err':>10}"]
    for i, r in enumerate(rows):
        mark = "  <-- first jump" if r.jump else ""
        note = f"  ({r.note})" if r.note else ""
        lines.append(f"{i:4d} {r.name:28} {str(list(r.shape)):18} {r.cosine:10.6f} {r.max_abs:10.3g} "
                     f"{r.rel_err:10.3g}{mark}{note}")
    if only_ours:
        more = " ..." if len(only_ours) > 20 else ""
        lines.append(f"only here ({len(only_ours)}): {', '.join(only_ours[:20])}{more}")
    if only_theirs:
        lines.append(f"only in llama.cpp ({len(only_theirs)}): {', '.join(only_theirs[:20])}"
                     f"{' ...' if len(only_theirs) > 20 else ''}")
    return "\n".join(lines)


def row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine of every row (axis 0, the token axis of [n_tokens, ...] nodes)."""
    x = a.reshape(a.shape[0], -1).astype(np.float64)
    y = b.reshape(b.shape[0], -1).astype(np.float64)
    return (x * y).sum(1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1))


def summarize(rows: list[NodeDiff], patterns: list[str]) -> dict[str, tuple[float, int]]:
    """pattern -> (min cosine, number of nodes) over the rows it matches."""
    out = {}
    for p in patterns:
        cs = [r.cosine for r in rows if fnmatch.fnmatchcase(r.name, p)]
        if cs:
            out[p] = (float(np.min(cs)), len(cs))
    return out


# ---- the F32 twin ----------------------------------------------------------------------

def write_f32_twin(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """The model with every tensor dequantized (ggml's reference dequantizer) and stored as
    F32, all metadata kept (general.file_type set to ALL_F32)."""
    from ggmlx import gguf, quants
    from ggmlx.types import GGMLType
    w = gguf.GGUFWriter()
    with gguf.GGUFReader(src) as f:
        for k, v in f.kv.items():
            if k == "general.file_type":
                w.add_kv(k, 0, f.kv_types[k])
            elif k != "general.alignment":
                w.add_kv(k, v, f.kv_types[k], f.kv_array_types.get(k))
        for name, t in f.tensors.items():
            x = t.data.view(np.float32) if t.type == GGMLType.F32 else quants.dequantize(t.data, t.type, t.ne)
            w.add_tensor(name, np.asarray(x, np.float32).reshape(tuple(reversed(t.ne))), GGMLType.F32, t.ne)
    tmp = Path(str(dst) + ".part")
    w.write(tmp)
    os.replace(tmp, dst)
    return Path(dst)


def f32_twin_path(src: str | os.PathLike) -> Path:
    """Where the twin of src is cached (made on first use)."""
    from ggmlx.flags import cache_root
    src = Path(src)
    st = src.stat()
    out = Path(cache_root()) / "twins" / f"{src.stem}.{st.st_size}.{int(st.st_mtime)}.f32.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        write_f32_twin(src, out)
    return out


# ---- llama.cpp through llama-cpp-python ------------------------------------------------

GGML_MAX_DIMS, GGML_MAX_OP_PARAMS, GGML_MAX_SRC, GGML_MAX_NAME = 4, 64, 10, 64
GGML_TYPE_F32, GGML_TYPE_F16 = 0, 1


class GGMLTensor(ctypes.Structure):
    """struct ggml_tensor (ggml.h) of the ggml bundled with llama-cpp-python."""
    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


def read_tensor(t: GGMLTensor) -> np.ndarray | None:
    """The values of an F32/F16 tensor in host memory, numpy order (reversed ne); None for
    other types."""
    dtype = {GGML_TYPE_F32: np.float32, GGML_TYPE_F16: np.float16}.get(t.type)
    if dtype is None or not t.data:
        return None
    ne = [int(t.ne[i]) for i in range(4)]
    nb = [int(t.nb[i]) for i in range(4)]
    size = np.dtype(dtype).itemsize
    span = sum((n - 1) * s for n, s in zip(ne, nb, strict=True)) + size
    raw = memoryview((ctypes.c_char * span).from_address(t.data)).cast("B")
    flat = np.frombuffer(raw, dtype, count=span // size)
    arr = np.lib.stride_tricks.as_strided(flat, shape=tuple(reversed(ne)), strides=tuple(reversed(nb)))
    return np.array(arr, np.float32)


def _log_sink(level, text, _user):
    """llama.cpp's log lines: dropped (its graph-build chatter would bury the table)."""


def run_llamacpp(model_path: str | os.PathLike, tokens: Sequence[int], patterns: Sequence[str], flash_attn: bool,
                 n_threads: int = 2, control_vector: np.ndarray | None = None
                 ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """llama.cpp's named tensors matching patterns ({name or name#k: values}) and its logits
    [n_tokens, n_vocab], for one decode of all tokens (F32 KV cache, all logits).
    control_vector: [n_layer, n_embd] rows added to l_out-il (llama_set_adapter_cvec).

    llama.cpp runs in a child process: LlamaCppCrashed if it dies there, LlamaCppMissing
    without llama-cpp-python."""
    llamacpp_child.require_llama_cpp()
    return llamacpp_child.call(_llamacpp_decode, str(model_path), list(tokens), list(patterns), flash_attn,
                               n_threads, control_vector, model_path=model_path)


def _llamacpp_decode(model_path: str, tokens: list[int], patterns: list[str], flash_attn: bool,
                     n_threads: int, control_vector: np.ndarray | None) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """run_llamacpp's work, in the child process (llama.cpp loaded in this process)."""
    import llama_cpp as lc

    seen: dict[str, int] = {}
    values: dict[str, np.ndarray] = {}

    def callback(t_ptr, ask, _user):
        t = GGMLTensor.from_address(t_ptr)
        name = t.name.decode("utf-8", "replace")
        if not any(fnmatch.fnmatchcase(name, p) for p in patterns):
            return False if ask else True
        if ask:
            return True
        v = read_tensor(t)
        if v is not None:
            k = seen.get(name, 0)
            seen[name] = k + 1
            values[name if k == 0 else f"{name}#{k}"] = v
        return True

    cb = lc.ggml_backend_sched_eval_callback(callback)
    log = lc.llama_log_callback(_log_sink)      # kept alive here while llama.cpp holds it
    lc.llama_log_set(log, None)
    lc.llama_backend_init()
    mparams = lc.llama_model_default_params()
    model = lc.llama_model_load_from_file(str(model_path).encode(), mparams)
    if not model:
        lc.llama_log_set(lc.llama_log_callback(), None)
        raise RuntimeError(f"llama.cpp could not load {model_path}")
    try:
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = max(256, len(tokens) + 8)
        cparams.n_batch = cparams.n_ubatch = max(512, len(tokens))
        cparams.n_threads = cparams.n_threads_batch = n_threads
        cparams.type_k = cparams.type_v = GGML_TYPE_F32
        cparams.flash_attn_type = 1 if flash_attn else 0
        cparams.n_outputs_max_per_seq = 0          # logits for every token, not one per sequence
        cparams.cb_eval = cb
        cparams.cb_eval_user_data = None
        ctx = lc.llama_init_from_model(model, cparams)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context")
        try:
            n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
            if control_vector is not None:
                n_layer, n_embd = control_vector.shape
                data = np.ascontiguousarray(control_vector[1:], np.float32)   # llama.cpp's buffer starts at layer 1
                ret = lc.llama_set_adapter_cvec(ctx, data.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                                  data.size, n_embd, 1, n_layer - 1)
                if ret != 0:
                    raise RuntimeError(f"llama_set_adapter_cvec returned {ret}")
            batch = lc.llama_batch_init(len(tokens), 0, 1)
            try:
                batch.n_tokens = len(tokens)
                for i, tok in enumerate(tokens):
                    batch.token[i] = tok
                    batch.pos[i] = i
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = 0
                    batch.logits[i] = True
                ret = lc.llama_decode(ctx, batch)
                if ret != 0:
                    raise RuntimeError(f"llama_decode returned {ret}")
                logits = np.stack([np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), (n_vocab,)).copy()
                                   for i in range(len(tokens))])
            finally:
                lc.llama_batch_free(batch)
        finally:
            lc.llama_free(ctx)
    finally:
        lc.llama_model_free(model)
        lc.llama_log_set(lc.llama_log_callback(), None)
    return values, logits


def diff(model_path: str, prompt: str | list[int], patterns: list[str], flash_attn: bool = False,
         n_threads: int = 2, numerics: str = "exact") -> tuple[list[NodeDiff], list[str], list[str], dict]:
    """(rows, names only here, names only in llama.cpp, extra: logits diff and tokens); our side
    runs with `numerics` (load_model's)."""
    import llm as llm_mod
    m = llm_mod.LLM(model_path, n_ctx=512, numerics=numerics, type_k="f32", type_v="f32")   # as llama.cpp's side
    tokens = m.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
    table = m.node_table(flash_attn)
    ours_names = [lb for lb in table if any(fnmatch.fnmatchcase(lb, p) for p in patterns)
                  and not lb.startswith(("k_cache_upd", "v_cache_upd"))]
    tr = m.trace(tokens, capture=ours_names, flash_attn=flash_attn)
    theirs, logits = run_llamacpp(model_path, tokens, patterns, flash_attn, n_threads)
    ours = {n: tr[n] for n in tr.names}
    kv_axes = {n: table[n].axis(table[n].kv_dim) for n in ours}
    rows = compare(ours, theirs, kv_axes)
    only_ours = [n for n in ours if n not in theirs]
    only_theirs = [n for n in theirs if n not in ours and " " not in n and not re.fullmatch(r"node_\d+(#\d+)?", n)]
    extra = {"tokens": tokens, "logits_max_abs": float(np.abs(tr.logits - logits).max()),
             "top1_agree": float(np.mean(tr.logits.argmax(-1) == logits.argmax(-1)))}
    return rows, only_ours, only_theirs, extra


def main(a) -> int:
    if not llama_cpp_available():
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    from llm import hub
    path = str(hub.resolve(a.model))
    if a.f32_twin:
        path = str(f32_twin_path(path))
    patterns = [p.strip() for p in a.nodes.split(",") if p.strip()]
    try:
        rows, only_ours, only_theirs, extra = diff(path, a.prompt, patterns, a.flash_attn, a.threads, a.numerics)
    except LlamaCppCrashed as e:
        print(f"diff-llamacpp: {e}", file=sys.stderr)
        return 1
    print(f"model: {path}\ntokens: {extra['tokens']}\nattention: {'fused' if a.flash_attn else 'unfused'}, "
          f"KV cache F32 on both sides, numerics {a.numerics} here")
    print(format_table(rows, only_ours, only_theirs))
    for p, (c, n) in summarize(rows, ["attn_norm-*", "ffn_out-*", "l_out-*", "result_output"]).items():
        print(f"min cosine {p:14} {c:.7f} (1 - cos = {1 - c:.2e}) over {n} nodes")
    print(f"logits: max |d| {extra['logits_max_abs']:.4g}, top-1 agreement {extra['top1_agree']:.3f}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("diff-llamacpp", help="compare every named node with llama.cpp's (needs llama-cpp-python)")
    from llm import hub
    p.add_argument("-m", "--model", default=hub.DEFAULT_MODEL)
    p.add_argument("-p", "--prompt", required=True)
    p.add_argument("--nodes", default="*", help="comma-separated fnmatch patterns of node names (default: all)")
    p.add_argument("--flash-attn", action="store_true", help="fused attention on both sides (no kq_soft_max nodes)")
    p.add_argument("--f32-twin", action="store_true", help="compare on the dequantized-F32 twin of the model")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--numerics", choices=NUMERICS, default="exact",
                   help="this engine's products (load_model's numerics): ggml to diff llama.cpp's quantized ones")
    p.set_defaults(fn=main)

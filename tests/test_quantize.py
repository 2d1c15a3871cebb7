"""llm quantize against llama.cpp's llama-quantize: the same types and the same bytes.

The references are hashes of llama.cpp's own output (llama-cpp-python's llama_model_quantize and
ggml_quantize_chunk), committed in tests/data/quantize/reference.json by
tests/data/quantize/make_reference.py; the inputs are rebuilt here from seeds, so no
llama-cpp-python is needed to run these tests.

- every quantizer on seeded rows (random at several scales, and edge rows: zeros, constants,
  ties, one outlier, tiny and large magnitudes, near powers of two), per row, and the weighted
  ones with two importance vectors;
- model_quantize on small models made to reach the type-choice rules (8 layers with GQA 4 for
  use_more_bits; tied embeddings with rows of 96 and 200 columns for the fallbacks and F16; an
  8-expert MoE with 3-d expert tensors; falcon with a fused QKV), for every file type
  llama-quantize offers: whole output files by sha256, and per tensor type and hash; with a
  seeded importance matrix and llama-quantize's provenance keys for 31 cases (the IQ1 / IQ2 file
  types among them);
- a split model, with --keep-split (two output files) and without (one);
- imatrix files (GGUF and legacy .dat) through the command;
- the refusals: unknown types, requantizing, a missing importance matrix, an imatrix for
  another model, an unwritable output.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from tiny_model import TinySpec, model_kv, model_tensors, vocab_kv

from ggmlx import gguf, quants
from ggmlx.native import search
from ggmlx.quants import kquants, nlquants
from ggmlx.types import GGMLType
from llm.quantize import (
    FTYPE_NAMES,
    LlamaFType,
    QuantizeError,
    QuantizeParams,
    model_quantize,
    parse_ftype,
    parse_ggml_type,
)

REF_PATH = Path(__file__).parent / "data" / "quantize" / "reference.json"
ROW_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
             "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ1_M", "TQ1_0", "TQ2_0", "MXFP4", "F16", "BF16")
# File types whose quantizers are not implemented yet (llama.cpp makes them without an imatrix).
NOT_IMPLEMENTED: set[str] = set()
# Every name llama-quantize takes, without its aliases (Q3_K = Q3_K_M, Q4_K = Q4_K_M, Q5_K = Q5_K_M).
FTYPES = tuple(n for n in FTYPE_NAMES if n not in ("Q3_K", "Q4_K", "Q5_K"))
QUICK = {("llama-gqa4", "Q4_K_M"), ("gemma3-tied", "Q3_K_M"), ("moe8", "MXFP4_MOE"), ("falcon-qkv", "IQ4_XS"),
         ("gemma3-tied", "Q4_0"), ("moe8", "Q2_K"), ("falcon-qkv", "Q6_K")}


def sha(data) -> str:
    return hashlib.sha256(np.ascontiguousarray(data).view(np.uint8).tobytes()).hexdigest()


@pytest.fixture(scope="module")
def ref() -> dict:
    return json.loads(REF_PATH.read_text())


# ---- inputs, rebuilt from seeds -------------------------------------------------------------


def quantizer_rows() -> np.ndarray:
    """float32 [n, 512]: seeded random rows at several scales, then edge rows."""
    rng = np.random.default_rng(20240)
    n = 512
    rows = [rng.standard_normal(n) * s for s in (1.0, 0.02, 1e-6, 3e4)]
    rows += [rng.laplace(size=n) * 0.05, rng.uniform(-1, 1, n), np.abs(rng.standard_normal(n)),
             -np.abs(rng.standard_normal(n)), rng.standard_normal(n) * np.exp(rng.standard_normal(n) * 2)]
    outlier = rng.standard_normal(n) * 0.01
    outlier[37] = 5.0
    half = rng.standard_normal(n)
    half[:128] = 0
    near_pow2 = np.ldexp(1.0 - rng.integers(0, 3, n) * 2.0 ** -24, rng.integers(-8, 8, n))
    rows += [np.zeros(n), np.full(n, 1.5), np.full(n, -2.0), np.tile([1.0, -1.0], n // 2),
             rng.integers(-8, 9, n).astype(np.float64), outlier, half, rng.standard_normal(n) * 1e-30,
             near_pow2 * np.where(rng.random(n) < 0.5, -1, 1), np.full(n, 3e-5)]
    return np.stack(rows).astype(np.float32)


def write_gguf(path: Path, kv: dict[str, object], tensors: dict[str, np.ndarray]) -> Path:
    w = gguf.GGUFWriter()
    for k, v in kv.items():
        w.add_kv(k, v)
    for k, v, vtype, atype in vocab_kv():
        w.add_kv(k, v, vtype, atype)
    for name, x in tensors.items():
        w.add_tensor(name, x)
    w.write(path)
    return path


def write_split(prefix: Path, kv: dict[str, object], tensors: dict[str, np.ndarray], n_split: int) -> Path:
    """A model split over n_split files as gguf-split writes it (keys in the first only)."""
    names = list(tensors)
    for i in range(n_split):
        w = gguf.GGUFWriter()
        if i == 0:
            for k, v in kv.items():
                w.add_kv(k, v)
            for k, v, vtype, atype in vocab_kv():
                w.add_kv(k, v, vtype, atype)
        w.add_kv("split.no", i, gguf.GGUFValueType.UINT16)
        w.add_kv("split.count", n_split, gguf.GGUFValueType.UINT16)
        w.add_kv("split.tensors.count", len(names), gguf.GGUFValueType.INT32)
        for name in names[i::n_split]:
            w.add_tensor(name, tensors[name])
        w.write(gguf.split_path(prefix, i, n_split))
    return Path(gguf.split_path(prefix, 0, n_split))


def _mat(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)


def _hparams(arch: str, n_layer: int, n_embd: int, n_ff: int, n_head_kv: int) -> dict[str, object]:
    return {"general.architecture": arch, "general.name": f"quantize test {arch}",
            f"{arch}.context_length": 256, f"{arch}.embedding_length": n_embd, f"{arch}.block_count": n_layer,
            f"{arch}.feed_forward_length": n_ff, f"{arch}.attention.head_count": 4,
            f"{arch}.attention.head_count_kv": n_head_kv}


def moe8_model(seed: int = 41, n_layer: int = 2, e: int = 256, f: int = 128, n_exp: int = 8):
    """A Mixtral-like llama with 8 experts (3-d expert tensors; down's 128 columns fall back)."""
    rng = np.random.default_rng(seed)
    kv = _hparams("llama", n_layer, e, f, 2)
    kv.update({"llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.rope.dimension_count": 64,
               "llama.expert_count": n_exp, "llama.expert_used_count": 2, "llama.vocab_size": 512})
    t = {"token_embd.weight": _mat(rng, 512, e), "output_norm.weight": np.ones(e, np.float32),
         "output.weight": _mat(rng, 512, e)}
    for il in range(n_layer):
        p = f"blk.{il}."
        t[p + "attn_norm.weight"] = np.ones(e, np.float32)
        t[p + "attn_q.weight"] = _mat(rng, e, e)
        t[p + "attn_k.weight"] = _mat(rng, 128, e)
        t[p + "attn_v.weight"] = _mat(rng, 128, e)
        t[p + "attn_output.weight"] = _mat(rng, e, e)
        t[p + "ffn_norm.weight"] = np.ones(e, np.float32)
        t[p + "ffn_gate_inp.weight"] = _mat(rng, n_exp, e)
        t[p + "ffn_gate_exps.weight"] = _mat(rng, n_exp, f, e)
        t[p + "ffn_up_exps.weight"] = _mat(rng, n_exp, f, e)
        t[p + "ffn_down_exps.weight"] = _mat(rng, n_exp, e, f)
    return kv, t


def falcon_model(seed: int = 42, n_layer: int = 4, e: int = 256, f: int = 512):
    """Falcon (its own output and FFN rules) with a fused attn_qkv (GQA 4)."""
    rng = np.random.default_rng(seed)
    kv = _hparams("falcon", n_layer, e, f, 1)
    kv["falcon.attention.layer_norm_epsilon"] = 1e-5
    t = {"token_embd.weight": _mat(rng, 512, e), "output_norm.weight": np.ones(e, np.float32),
         "output_norm.bias": np.zeros(e, np.float32), "output.weight": _mat(rng, 512, e)}
    for il in range(n_layer):
        p = f"blk.{il}."
        t[p + "attn_norm.weight"] = np.ones(e, np.float32)
        t[p + "attn_norm.bias"] = np.zeros(e, np.float32)
        t[p + "attn_qkv.weight"] = _mat(rng, e + 128, e)
        t[p + "attn_output.weight"] = _mat(rng, e, e)
        t[p + "ffn_up.weight"] = _mat(rng, f, e)
        t[p + "ffn_down.weight"] = _mat(rng, e, f)
    return kv, t


GEMMA3_TIED = TinySpec(arch="gemma3", n_layer=4, n_embd=96, n_head=4, n_head_kv=1, n_ff=200, seed=43)
LLAMA_GQA4 = TinySpec(n_layer=8, n_embd=256, n_head=4, n_head_kv=1, n_ff=256, seed=44)


def model_inputs(name: str) -> tuple[dict[str, object], dict[str, np.ndarray]]:
    if name == "llama-gqa4":
        return model_kv(LLAMA_GQA4), model_tensors(LLAMA_GQA4)
    if name in ("gemma3-tied", "gemma3-split"):
        return model_kv(GEMMA3_TIED), model_tensors(GEMMA3_TIED)
    if name == "moe8":
        return moe8_model()
    if name == "falcon-qkv":
        return falcon_model()
    raise KeyError(name)


MODELS = ("llama-gqa4", "gemma3-tied", "moe8", "falcon-qkv")


def build(name: str, out_dir: Path) -> Path:
    """The input GGUF of model `name` (the split model: its first shard)."""
    kv, tensors = model_inputs(name)
    if name == "gemma3-split":
        return write_split(out_dir / name, kv, tensors, 2)
    return write_gguf(out_dir / f"{name}.gguf", kv, tensors)


def seeded_imatrix(name: str, drop: tuple[str, ...] = ("blk.0.ffn_down.weight",)) -> dict[str, np.ndarray]:
    """An importance per column (and expert) for every matrix of model `name`, but `drop` (so the
    'no weights for this tensor' path is taken too): log-normal, seeded."""
    rng = np.random.default_rng(4242)
    out = {}
    for n, x in model_inputs(name)[1].items():
        if x.ndim >= 2 and n not in drop:
            out[n] = np.exp(rng.standard_normal(x.shape[-1] * (x.shape[0] if x.ndim == 3 else 1)) * 1.5
                            ).astype(np.float32)
    return out


IMATRIX_FILE, IMATRIX_DATASET, IMATRIX_CHUNKS = "imatrix.gguf", "calibration.txt", 3
IMATRIX_CASES = (*((m, f) for m in ("llama-gqa4",) for f in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K_S", "Q3_K_M",
                                                          "Q4_K_M", "Q5_K_S", "Q6_K", "IQ4_NL", "IQ4_XS")),
                 ("llama-gqa4", "IQ3_S"), ("llama-gqa4", "IQ3_M"), ("llama-gqa4", "IQ3_XS"), ("moe8", "IQ3_XS"),
                 ("moe8", "Q2_K"), ("moe8", "Q4_K_M"), ("moe8", "IQ4_XS"), ("gemma3-tied", "Q4_K_M"),
                 *(("llama-gqa4", f) for f in ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ1_S", "IQ1_M", "IQ3_XXS")),
                 ("moe8", "IQ2_XXS"), ("moe8", "IQ1_M"), ("gemma3-tied", "IQ1_S"), ("gemma3-tied", "IQ2_M"),
                 ("falcon-qkv", "IQ2_XS"))


# Cases whose imatrix covers every matrix (the others leave blk.0.ffn_down out, which llama.cpp
# refuses where that tensor gets a type that needs one: falcon-qkv IQ2_XS is kept as such a case).
FULL_IMATRIX = {("llama-gqa4", "IQ3_XXS"), ("llama-gqa4", "IQ1_M")}


def imatrix_params(model: str, ftype_name: str) -> QuantizeParams:
    """The params llama-quantize passes for `--imatrix imatrix.gguf` (the provenance keys too)."""
    params = case_params(ftype_name)
    params.imatrix = seeded_imatrix(model, () if (model, ftype_name) in FULL_IMATRIX else ("blk.0.ffn_down.weight",))
    params.kv_overrides = [("quantize.imatrix.file", IMATRIX_FILE), ("quantize.imatrix.dataset", IMATRIX_DATASET),
                           ("quantize.imatrix.entries_count", len(params.imatrix)),
                           ("quantize.imatrix.chunks_count", IMATRIX_CHUNKS)]
    return params


def row_imatrices() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(99)
    return {"lognormal": np.exp(rng.standard_normal(512) * 2).astype(np.float32),
            "sparse": np.where(rng.random(512) < 0.3, rng.random(512) * 10, 0).astype(np.float32)}


# Cases of the split model: (case name, ftype, keep_split).
SPLIT_CASES = (("Q4_K_M+keep_split", "Q4_K_M", True), ("Q8_0", "Q8_0", False))


def case_params(ftype_name: str, keep_split: bool = False, nthread: int = 2) -> QuantizeParams:
    ftype, only_copy = parse_ftype(ftype_name)
    return QuantizeParams(ftype=ftype, only_copy=only_copy, keep_split=keep_split, nthread=nthread)


def describe(paths: list[str]) -> dict:
    """What the reference holds for one case: each file's sha256 (in shard order), each tensor's
    type and the start of its hash (to say which tensor differs)."""
    files = [hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths]
    with gguf.GGUFReader(paths[0]) as r:
        tensors = {n: [ti.type.name, sha(ti.data)[:12]] for n, ti in r.tensors.items()}
    return {"files": files, "tensors": tensors}


# ---- the quantizers -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("type_name", ROW_TYPES)
def test_quantizer_rows_equal_llamacpp(ref, type_name):
    rows = quantizer_rows()
    ours = quants.quantize(rows, GGMLType[type_name])
    got = [sha(r) for r in ours]
    want = ref["rows"][type_name]
    bad = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
    assert not bad, f"{type_name}: rows {bad} differ from ggml_quantize_chunk's bytes"


# the IQ1/IQ2 grid searches take 2-5 s on these rows: the quick tier leaves them to CI
SLOW_QUANTIZERS = {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S"}


@pytest.mark.parametrize("type_name", [pytest.param(t.name, marks=pytest.mark.slow) if t.name in SLOW_QUANTIZERS
                                       else t.name for t in quants.IMATRIX_TYPES])
@pytest.mark.parametrize("imatrix_name", ["lognormal", "sparse"])
def test_imatrix_quantizer_rows_equal_llamacpp(ref, type_name, imatrix_name):
    ours = quants.quantize(quantizer_rows(), GGMLType[type_name], row_imatrices()[imatrix_name])
    want = ref["rows_imatrix"][imatrix_name][type_name]
    bad = [i for i, (r, w) in enumerate(zip(ours, want, strict=True)) if sha(r) != w]
    assert not bad, f"{type_name} with the {imatrix_name} imatrix: rows {bad} differ from ggml_quantize_chunk's"


def _search_groups(n: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Groups [n, m] for the scale searches: scaled normals, and the edge cases (all zero, below
    GROUP_MAX_EPS, flat, +a and -a both largest, zero weights)."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((n, m)) * rng.exponential(1, m)).astype(np.float32)
    x[:, 0], x[:, 1], x[:, 2] = 0, 1e-20, 3
    x[0, 3], x[1, 3] = -5, 5
    w = np.abs(rng.standard_normal((n, m))).astype(np.float32)
    w[:, 4] = 0
    return x, w


@pytest.mark.skipif(search.lib() is None, reason="the native library is not built")
@pytest.mark.parametrize("n", [16, 32])
def test_native_scale_searches_equal_numpys(monkeypatch, n):
    """The C searches (ggmlx/native/search.py) give the numpy searches' bits, which the byte
    tests above hold to ggml's; so both paths are ggml's."""
    x, w = _search_groups(n, 3000)
    cases = [(kquants.make_qx_quants, (x, nmax, ww)) for nmax in (4, 16, 32) for ww in (None, w)]
    cases += [(kquants.make_qkx2_quants, (x, w, *a)) for a in ((3, -0.5, 0.1, 15, True), (15, -1.0, 0.1, 20, False),
                                                                (31, -0.5, 0.1, 15, False))]
    cases += [(kquants.make_qkx3_quants, (x, w, nmax, -0.9, 0.05, 36)) for nmax in (3, 15, 31)]
    if n == 32:
        cases.append((nlquants._iq4_group_scales, (x, w)))
    native = [fn(*args) for fn, args in cases]
    monkeypatch.setattr(search, "lib", lambda: None)
    for (fn, args), got in zip(cases, native, strict=True):
        want = fn(*args)
        for a, b in zip(*((got, want) if isinstance(got, tuple) else ((got,), (want,))), strict=True):
            assert a.dtype == b.dtype and np.array_equal(a.view(np.uint32), b.view(np.uint32)), fn.__name__


@pytest.mark.skipif(search.lib() is None, reason="the native library is not built")
@pytest.mark.parametrize("type_name", ["IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S",
                                       "IQ1_S", "IQ1_M"])
def test_native_grid_searches_equal_numpys(monkeypatch, type_name):
    """Whole rows through the C neighbour and IQ4 searches and through numpy's: the same bytes."""
    x = np.random.default_rng(5).standard_normal((6, 512)).astype(np.float32)
    x[1, :256] = 0
    im = row_imatrices()["lognormal"]
    native = quants.quantize(x, GGMLType[type_name], im)
    monkeypatch.setattr(search, "lib", lambda: None)
    assert np.array_equal(native, quants.quantize(x, GGMLType[type_name], im))


def test_quantizer_round_trip_error_is_small():
    """A sanity check beside the hashes: each quantizer's bytes dequantize near the input."""
    x = np.random.default_rng(7).standard_normal((8, 512)).astype(np.float32)
    for name, bound in (("Q2_K", 0.45), ("Q3_K", 0.25), ("Q4_K", 0.12), ("Q5_K", 0.06), ("Q6_K", 0.03),
                        ("IQ4_NL", 0.12), ("IQ4_XS", 0.12), ("MXFP4", 0.2)):
        t = GGMLType[name]
        y = quants.dequantize(quants.quantize(x, t).reshape(-1), t, (512, 8))
        rel = np.sqrt(np.mean((y - x) ** 2) / np.mean(x ** 2))
        assert rel < bound, f"{name}: relative RMS error {rel:.3f}"


@pytest.mark.slow      # grid searches: ~4 s
def test_iq2_iq1_round_trip_error_is_small():
    """The IQ2 / IQ1 quantizers' bytes (with an importance matrix) dequantize near the input, by
    the importance-weighted error they minimise."""
    x = np.random.default_rng(7).standard_normal((8, 512)).astype(np.float32)
    im = row_imatrices()["lognormal"]
    for name, bound in (("IQ2_XXS", 0.3), ("IQ2_XS", 0.22), ("IQ2_S", 0.21), ("IQ1_S", 0.4), ("IQ1_M", 0.33)):
        t = GGMLType[name]
        y = quants.dequantize(quants.quantize(x, t, im).reshape(-1), t, (512, 8))
        rel = np.sqrt(np.sum(im * (y - x) ** 2) / np.sum(im * x ** 2))
        assert rel < bound, f"{name}: weighted relative RMS error {rel:.3f}"


@pytest.mark.parametrize("type_name", ["IQ2_XXS", "IQ2_XS", "IQ1_S"])
def test_iq_types_that_need_an_imatrix_refuse_without(type_name):
    """ggml_quantize_requires_imatrix: ggml asserts; quantize says so."""
    with pytest.raises(ValueError, match="requires an importance matrix"):
        quants.quantize(quantizer_rows(), GGMLType[type_name])


# ---- model_quantize on the test models ------------------------------------------------------------


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("quantize-inputs")
    return {name: build(name, d) for name in (*MODELS, "gemma3-split")}


def _check_case(ref_case: dict, inp: Path, out: Path, ftype_name: str, keep_split: bool = False) -> None:
    params = case_params(ftype_name, keep_split)
    if "error" in ref_case:
        with pytest.raises(QuantizeError) as e:
            model_quantize(inp, out, params)
        if "imatrix" in ref_case["error"]:
            assert "importance matrix" in str(e.value)
        assert not out.exists()
        return
    try:
        paths = model_quantize(inp, out, params)
    except QuantizeError as e:
        if ftype_name in NOT_IMPLEMENTED and "not implemented" in str(e):
            pytest.skip(f"{ftype_name}: {e}")
        raise
    got = describe(paths)
    if got["files"] != ref_case["files"]:
        bad = {n: (t, ref_case["tensors"].get(n)) for n, t in got["tensors"].items()
               if ref_case["tensors"].get(n) != t}
        missing = set(ref_case["tensors"]) - set(got["tensors"])
        pytest.fail(f"{inp.name} {ftype_name}: output differs from llama.cpp's; tensors (ours, llama.cpp): "
                    f"{dict(list(bad.items())[:6])}, missing {sorted(missing)[:6]}"
                    + ("" if bad or missing else " (the tensors agree: the metadata differs)"))


CASES = [pytest.param(m, f, marks=() if (m, f) in QUICK else pytest.mark.slow, id=f"{m}-{f}")
         for m in MODELS for f in FTYPES]


@pytest.mark.parametrize("model,ftype_name", CASES)
def test_model_quantize_equals_llamacpp(ref, inputs, tmp_path, model, ftype_name):
    _check_case(ref["models"][model][ftype_name], inputs[model], tmp_path / "out.gguf", ftype_name)


@pytest.mark.parametrize("case,ftype_name,keep_split", SPLIT_CASES)
def test_split_model_equals_llamacpp(ref, inputs, tmp_path, case, ftype_name, keep_split):
    _check_case(ref["models"]["gemma3-split"][case], inputs["gemma3-split"], tmp_path / "out", ftype_name,
                keep_split)


@pytest.mark.parametrize("model,ftype_name", [
    pytest.param(m, f, marks=() if (m, f) in {("llama-gqa4", "Q4_K_M"), ("moe8", "IQ4_XS"), ("llama-gqa4", "IQ2_XXS")}
                 else pytest.mark.slow,
                 id=f"{m}-{f}") for m, f in IMATRIX_CASES])
@pytest.mark.slow
def test_imatrix_model_quantize_equals_llamacpp(ref, inputs, tmp_path, model, ftype_name):
    want = ref["models_imatrix"][model][ftype_name]
    if "error" in want:         # llama.cpp refused: a tensor that needs the matrix has none in it
        assert "Missing importance matrix" in want["error"]
        with pytest.raises(QuantizeError, match="missing importance matrix for tensor"):
            model_quantize(inputs[model], tmp_path / "out.gguf", imatrix_params(model, ftype_name))
        assert not list(tmp_path.iterdir())
        return
    paths = model_quantize(inputs[model], tmp_path / "out.gguf", imatrix_params(model, ftype_name))
    got = describe(paths)
    bad = {n: (t, want["tensors"].get(n)) for n, t in got["tensors"].items() if want["tensors"].get(n) != t}
    assert got["files"] == want["files"], f"{model} {ftype_name} with an imatrix: (ours, llama.cpp) {bad}"


def test_imatrix_refusals(inputs, tmp_path):
    out = tmp_path / "out.gguf"
    wrong = imatrix_params("llama-gqa4", "Q4_K_M")
    wrong.imatrix["blk.1.attn_q.weight"] = wrong.imatrix["blk.1.attn_q.weight"][:100]
    with pytest.raises(QuantizeError, match="imatrix size 100 is different from tensor size 256 for blk.1.attn_q"):
        model_quantize(inputs["llama-gqa4"], out, wrong)
    other = imatrix_params("llama-gqa4", "Q4_K_M")
    other.imatrix = {"model.layers.0.mlp.weight": np.ones(256, np.float32)}
    with pytest.raises(QuantizeError, match="names none of the model's tensors"):
        model_quantize(inputs["llama-gqa4"], out, other)
    nan = imatrix_params("llama-gqa4", "Q4_K_M")
    nan.imatrix["blk.1.attn_q.weight"][3] = np.nan
    with pytest.raises(QuantizeError, match="non-finite"):
        model_quantize(inputs["llama-gqa4"], out, nan)
    missing = imatrix_params("llama-gqa4", "Q2_K_S")
    del missing.imatrix["blk.1.ffn_down.weight"]
    with pytest.raises(QuantizeError, match="missing importance matrix for tensor blk.1.ffn_down.weight"):
        model_quantize(inputs["llama-gqa4"], out, missing)
    assert not list(tmp_path.iterdir())


def test_include_exclude_weights_filter_the_imatrix():
    p = QuantizeParams(imatrix={"blk.0.attn_q.weight": np.ones(4), "blk.0.ffn_up.weight": np.ones(4)})
    p.include_weights = ["attn"]
    assert list(p.importance()) == ["blk.0.attn_q.weight"]
    p.include_weights, p.exclude_weights = [], ["attn"]
    assert list(p.importance()) == ["blk.0.ffn_up.weight"]
    p.exclude_weights = ["blk"]
    assert p.importance() is None       # nothing left: quantized as without an imatrix


def test_threads_do_not_change_the_bytes(inputs, tmp_path):
    one = model_quantize(inputs["llama-gqa4"], tmp_path / "a.gguf", case_params("Q3_K_M", nthread=1))
    four = model_quantize(inputs["llama-gqa4"], tmp_path / "b.gguf", case_params("Q3_K_M", nthread=4))
    assert Path(one[0]).read_bytes() == Path(four[0]).read_bytes()


# ---- names and refusals -------------------------------------------------------------------------


def test_type_names_as_llama_quantize_takes_them():
    assert parse_ftype("q4_k_m") == (LlamaFType.MOSTLY_Q4_K_M, False)
    assert parse_ftype("Q4_K") == (LlamaFType.MOSTLY_Q4_K_M, False)
    assert parse_ftype("15") == (LlamaFType.MOSTLY_Q4_K_M, False)
    assert parse_ftype("COPY") == (LlamaFType.ALL_F32, True)
    assert parse_ggml_type("q6_k") == GGMLType.Q6_K
    with pytest.raises(QuantizeError, match="invalid ftype 'Q4_K_X'"):
        parse_ftype("Q4_K_X")
    with pytest.raises(QuantizeError, match="invalid ggml_type 'q9_0'"):
        parse_ggml_type("q9_0")
    with pytest.raises(QuantizeError, match="NVFP4 is not implemented"):
        parse_ftype("nvfp4")
    with pytest.raises(QuantizeError, match="invalid output file type 99"):
        model_quantize("unused.gguf", "unused-out.gguf", QuantizeParams(ftype=99))      # type: ignore[arg-type]


def test_requantizing_needs_allow_requantize(inputs, tmp_path):
    q8 = model_quantize(inputs["gemma3-tied"], tmp_path / "q8.gguf", case_params("Q8_0"))[0]
    out = tmp_path / "q4.gguf"
    with pytest.raises(QuantizeError, match="requantizing from type Q8_0 is disabled"):
        model_quantize(q8, out, case_params("Q4_0"))
    assert not out.exists()
    params = case_params("Q4_0")
    params.allow_requantize = True
    model_quantize(q8, out, params)
    with gguf.GGUFReader(out) as r:
        assert r.tensors["blk.0.attn_q.weight"].type == GGMLType.Q4_0


def test_iq2_needs_an_importance_matrix(inputs, tmp_path):
    out = tmp_path / "iq2.gguf"
    with pytest.raises(QuantizeError, match="requires an importance matrix"):
        model_quantize(inputs["llama-gqa4"], out, case_params("IQ2_XXS"))
    assert not out.exists()


def test_unwritable_output_leaves_no_file(inputs, tmp_path):
    with pytest.raises(QuantizeError, match="cannot write"):
        model_quantize(inputs["gemma3-tied"], tmp_path / "missing-dir" / "out.gguf", case_params("Q8_0"))


def test_failure_midway_leaves_no_partial_file(inputs, tmp_path):
    """A tensor that cannot be quantized (out of range) after others were written: no output."""
    kv, tensors = model_inputs("gemma3-tied")
    tensors["blk.3.ffn_up.weight"] = tensors["blk.3.ffn_up.weight"] * np.float32(1e30)
    inp = write_gguf(tmp_path / "huge.gguf", kv, tensors)
    out = tmp_path / "out.gguf"
    with pytest.raises(QuantizeError, match="blk.3.ffn_up.weight"):
        model_quantize(inp, out, case_params("Q8_0"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["huge.gguf"]


# ---- the command (llm/cli/quantize.py, through its own parser) ----------------------------------


def _cli(*argv: str):
    import argparse

    from llm.cli import quantize as cli
    ap = argparse.ArgumentParser()
    cli.add_parser(ap.add_subparsers(dest="command", required=True))
    a = ap.parse_args(["quantize", *argv])
    return a.fn(a)


def test_cli_writes_llama_quantize_bytes(ref, inputs, tmp_path, capsys):
    out = tmp_path / "out.gguf"
    assert _cli(str(inputs["gemma3-tied"]), str(out), "q3_k_m", "--nthread", "2") == 0
    assert describe([str(out)])["files"] == ref["models"]["gemma3-tied"]["Q3_K_M"]["files"]
    assert "as Q3_K_M" in capsys.readouterr().err


def test_cli_flags_reach_the_params(inputs, tmp_path):
    out = tmp_path / "out.gguf"
    _cli(str(inputs["llama-gqa4"]), str(out), "Q4_K_M", "--leave-output-tensor", "--token-embedding-type", "q8_0",
         "--tensor-type", "ATTN_Q=q5_0", "--tensor-type", "ffn_down=f16", "--pure")
    with gguf.GGUFReader(out) as r:
        t = {n: ti.type.name for n, ti in r.tensors.items()}
    assert t["output.weight"] == "F32" and t["token_embd.weight"] == "Q8_0"
    assert t["blk.0.attn_q.weight"] == "Q5_0" and t["blk.0.ffn_down.weight"] == "F16"
    assert t["blk.0.attn_v.weight"] == "Q4_K"       # --pure: no Q6_K for the first layers' V


@pytest.mark.parametrize("argv,message", [
    (("Q4_K_X",), "invalid ftype 'Q4_K_X'"),
    (("Q4_K_M", "--output-tensor-type", "q9"), "invalid ggml_type 'q9'"),
    (("Q4_K_M", "--tensor-type", "attn_q"), "expected PATTERN=TYPE"),
    (("Q4_K_M", "--include-weights", "a", "--exclude-weights", "b"), "cannot be used together"),
    (("IQ2_XXS",), "requires an importance matrix"),
    (("Q4_K_M", "--imatrix", "missing.gguf"), "cannot read the imatrix"),
])
def test_cli_bad_input_is_a_usage_error(inputs, tmp_path, argv, message):
    from llm.cli.commands import _exit_code
    from llm.errors import UsageError
    out = tmp_path / "out.gguf"
    with pytest.raises(UsageError, match=message) as e:
        _cli(str(inputs["llama-gqa4"]), str(out), *argv)
    assert _exit_code(e.value) == 2 and "\n" not in str(e.value)
    assert not out.exists() and not list(tmp_path.iterdir())


def test_cli_refuses_existing_output_and_requantizing(inputs, tmp_path):
    from llm.errors import UsageError
    out = tmp_path / "out.gguf"
    _cli(str(inputs["gemma3-tied"]), str(out), "Q8_0")
    with pytest.raises(UsageError, match="exists"):
        _cli(str(inputs["gemma3-tied"]), str(out), "Q8_0")
    with pytest.raises(UsageError, match="input and output files are the same"):
        _cli(str(out), str(out), "Q4_0")
    with pytest.raises(UsageError, match="requantizing from type Q8_0 is disabled"):
        _cli(str(out), str(tmp_path / "q4.gguf"), "Q4_0")
    assert _cli(str(out), str(tmp_path / "q4.gguf"), "Q4_0", "--allow-requantize") == 0
    with pytest.raises(UsageError, match="cannot write"):
        _cli(str(out), str(tmp_path / "no-dir" / "q4.gguf"), "Q4_0", "--allow-requantize")


def test_cli_keep_split_names_the_shards(ref, inputs, tmp_path):
    _cli(str(inputs["gemma3-split"]), str(tmp_path / "out.gguf"), "Q4_K_M", "--keep-split")
    paths = [str(tmp_path / f"out-0000{i}-of-00002.gguf") for i in (1, 2)]
    assert describe(paths)["files"] == ref["models"]["gemma3-split"]["Q4_K_M+keep_split"]["files"]


# ---- importance matrix files ---------------------------------------------------------------------


def write_imatrix_gguf(path: Path, values: dict[str, np.ndarray], n_mat: dict[str, int], count: float,
                       with_metadata: bool = True) -> Path:
    """llama-imatrix's GGUF: <name>.in_sum2 [n_mat, ne0] = values * count, <name>.counts [n_mat, 1]."""
    w = gguf.GGUFWriter()
    w.add_kv("general.type", "imatrix")
    if with_metadata:
        w.add_kv("imatrix.datasets", [IMATRIX_DATASET])
        w.add_kv("imatrix.chunk_count", IMATRIX_CHUNKS)
        w.add_kv("imatrix.chunk_size", 512)
    for name, v in values.items():
        w.add_tensor(name + ".in_sum2", (v * np.float32(count)).reshape(n_mat[name], -1))
        w.add_tensor(name + ".counts", np.full((n_mat[name], 1), count, np.float32))
    w.write(path)
    return path


def write_imatrix_dat(path: Path, values: dict[str, np.ndarray], ncall: int) -> Path:
    """The legacy format: entries of (name, ncall, values * ncall), then chunk count and dataset."""
    parts = [np.int32(len(values)).tobytes()]
    for name, v in values.items():
        parts += [np.int32(len(name)).tobytes(), name.encode(), np.int32(ncall).tobytes(),
                  np.int32(v.size).tobytes(), (v * np.float32(ncall)).astype(np.float32).tobytes()]
    parts += [np.int32(IMATRIX_CHUNKS).tobytes(), np.int32(len(IMATRIX_DATASET)).tobytes(), IMATRIX_DATASET.encode()]
    path.write_bytes(b"".join(parts))
    return path


def _n_mat(model: str) -> dict[str, int]:
    return {n: (x.shape[0] if x.ndim == 3 else 1) for n, x in model_inputs(model)[1].items()}


def test_load_imatrix_reads_both_formats(tmp_path):
    from llm.quantize import load_imatrix
    values = {"a.weight": np.array([1, 2, 3, 4], np.float32), "b.weight": np.array([0.5, 8], np.float32)}
    n_mat = {"a.weight": 2, "b.weight": 1}
    g = load_imatrix(write_imatrix_gguf(tmp_path / "i.gguf", values, n_mat, 4.0))
    assert g.datasets == [IMATRIX_DATASET] and g.chunk_count == IMATRIX_CHUNKS
    assert all(np.array_equal(g.values[n], v) for n, v in values.items())
    zero = load_imatrix(write_imatrix_gguf(tmp_path / "z.gguf", values, n_mat, 0.0))
    assert np.array_equal(zero.values["a.weight"], np.ones(4, np.float32))      # no calls: weight 1
    d = load_imatrix(write_imatrix_dat(tmp_path / "i.dat", values, 8))
    assert d.datasets == [IMATRIX_DATASET] and d.chunk_count == IMATRIX_CHUNKS
    assert all(np.array_equal(d.values[n], v) for n, v in values.items())
    with pytest.raises(QuantizeError, match="missing imatrix metadata"):
        load_imatrix(write_imatrix_gguf(tmp_path / "m.gguf", values, n_mat, 1.0, with_metadata=False))
    (tmp_path / "empty.dat").write_bytes(np.int32(0).tobytes())
    with pytest.raises(QuantizeError, match="no data"):
        load_imatrix(tmp_path / "empty.dat")


def test_cli_imatrix_writes_llama_quantize_bytes(ref, inputs, tmp_path, monkeypatch):
    """--imatrix FILE: the weighted quantizers and llama-quantize's provenance keys (file,
    dataset, entries, chunks); the legacy .dat gives the same tensors."""
    monkeypatch.chdir(tmp_path)
    values = seeded_imatrix("moe8")
    write_imatrix_gguf(tmp_path / IMATRIX_FILE, values, _n_mat("moe8"), 4.0)
    _cli(str(inputs["moe8"]), "out.gguf", "IQ4_XS", "--imatrix", IMATRIX_FILE)
    want = ref["models_imatrix"]["moe8"]["IQ4_XS"]
    assert describe(["out.gguf"])["files"] == want["files"]
    write_imatrix_dat(tmp_path / "imatrix.dat", values, 2)
    _cli(str(inputs["moe8"]), "dat.gguf", "IQ4_XS", "--imatrix", "imatrix.dat")
    assert describe(["dat.gguf"])["tensors"] == want["tensors"]
    with gguf.GGUFReader("dat.gguf") as r:
        assert r.kv["quantize.imatrix.file"] == "imatrix.dat" and r.kv["quantize.imatrix.chunks_count"] == 3


@pytest.mark.slow
def test_cli_iq2_xxs_with_imatrix_writes_llama_quantize_bytes(ref, inputs, tmp_path, monkeypatch):
    """`llm quantize IN OUT IQ2_XXS --imatrix F`: llama_model_quantize's file (IQ2_XXS, its Q2_K /
    Q4_K / Q5_K mix and the provenance keys)."""
    monkeypatch.chdir(tmp_path)
    write_imatrix_gguf(tmp_path / IMATRIX_FILE, seeded_imatrix("llama-gqa4"), _n_mat("llama-gqa4"), 4.0)
    assert _cli(str(inputs["llama-gqa4"]), "out.gguf", "IQ2_XXS", "--imatrix", IMATRIX_FILE) == 0
    assert describe(["out.gguf"])["files"] == ref["models_imatrix"]["llama-gqa4"]["IQ2_XXS"]["files"]


def test_cli_imatrix_for_another_model_is_a_usage_error(inputs, tmp_path):
    from llm.errors import UsageError
    im = write_imatrix_gguf(tmp_path / "other.gguf", seeded_imatrix("falcon-qkv"), _n_mat("falcon-qkv"), 1.0)
    with pytest.raises(UsageError, match="imatrix size .* is different from tensor size"):
        _cli(str(inputs["llama-gqa4"]), str(tmp_path / "out.gguf"), "Q4_K_M", "--imatrix", str(im))
    assert not (tmp_path / "out.gguf").exists()

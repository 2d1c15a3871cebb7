"""llm.mtmd (libmtmd on ggmlx graphs) against llama.cpp's stored output.

tests/data/mtmd/ holds, per projector (gemma3; idefics3, mlp, mlp_norm and llava16 with llama text models;
qwen2vl_merger and qwen2.5vl_merger with qwen2vl ones; qwen3vl_merger; pixtral with a llama one;
internvl with a qwen2 one; lfm2 and llama4 with their own), a tiny text model, its mmproj, and llama.cpp's chunks, image
embeddings and last logits for two prompts over two committed test images
(benchmarks/reference/make_mmproj.py). Embeddings differ from llama.cpp's by ggml-cpu's fp16
GELU tables (<= 4.5e-4 relative; 8e-4 through llama4's three in a row); everything else is
F32 math in both, but the patch convolution, which ggml computes in F16.
"""
from __future__ import annotations

import base64
import dataclasses
import importlib.util
import io
import struct
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

import llm
from ggmlx import gguf
from ggmlx.tensor import Op
from llm import mtmd
from llm.errors import ModelLoadError
from llm.mtmd import context as mtmd_context
from llm.mtmd.image import ResizeAlgo, calc_size_preserved_ratio, resize_pillow
from llm.params import ParamError

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "mtmd"
MODEL, MMPROJ = DATA / "gemma3.gguf", DATA / "gemma3.mmproj.gguf"
TOL = 1e-3          # relative: max |ours - llama.cpp| / max |llama.cpp|


def gen():
    spec = importlib.util.spec_from_file_location("make_mmproj", ROOT / "benchmarks" / "reference" / "make_mmproj.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_mmproj", mod)
    spec.loader.exec_module(mod)
    return mod


def rel(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(np.asarray(a, np.float64) - ref).max() / np.abs(ref).max())


PROJECTORS = ["gemma3", "idefics3", "mlp", "mlp_norm", "llava16", "qwen2vl", "qwen2.5vl", "qwen3vl", "pixtral",
              "internvl", "lfm2", "llama4"]


@pytest.fixture(scope="module")
def ref() -> dict:
    return dict(np.load(DATA / "gemma3.npz"))


@pytest.fixture(scope="module", params=PROJECTORS)
def each(request) -> tuple:
    """(model, its MtmdContext, llama.cpp's arrays) per projector fixture."""
    name = request.param
    model = llm.load_model(DATA / f"{name}.gguf")
    return model, mtmd.init_from_file(DATA / f"{name}.mmproj.gguf", model), dict(np.load(DATA / f"{name}.npz"))


@pytest.fixture(scope="module")
def model():
    return llm.load_model(MODEL)


@pytest.fixture(scope="module")
def mctx(model):
    return mtmd.init_from_file(MMPROJ, model)


@pytest.fixture(scope="module")
def images() -> list[mtmd.Bitmap]:
    return [mtmd.Bitmap.from_file(p) for p in gen().IMAGES]


def prompt_chunks(mctx, images, k: int) -> list[mtmd.InputChunk]:
    text, which = gen().PROMPTS[k]
    return mctx.tokenize(text, [images[i] for i in which])


def new_ctx(model) -> llm.Context:
    """A context as large as the oracle's for this fixture (make_mmproj's N_CTX_OF)."""
    n = gen().N_CTX_OF.get(Path(model.path).name.removesuffix(".gguf"), gen().N_CTX)
    return llm.Context(model, n_ctx=n, n_batch=n, n_ubatch=n, flash_attn=False)


# ---- against llama.cpp -------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 1])
def test_chunks_and_embeddings_equal_llamacpp(each, images, k):
    """gemma3: <start_of_image> image <end_of_image>; idefics3: 2 x 2 slices, each after
    <fake_token_around_image><row_R_col_C>, a "\\n" after each row, then the overview; mlp:
    the image's 64 patch tokens alone; qwen2vl, qwen2.5vl and qwen3vl: <|vision_start|> image
    <|vision_end|>, a grid of merged tokens (4 x 3, 3 x 3) taking max(nx, ny) positions, for
    qwen3vl each token 2 x 64 wide (its DeepStack slice after the main merger's); pixtral: a grid
    of merged tokens (6 x 5, 3 x 3) with an [IMG_BREAK] embedding after each row but the last,
    then [IMG_END]; internvl: <img>, 2 x 2 tiles and the overview (16 tokens each), </img>; lfm2:
    <|image_start|> image (10 x 7, 8 x 8 tokens) <|image_end|>; llama4: <|image_start|>, 3 x 3
    or 2 x 2 tiles and the overview (16 tokens each), <|image_end|>."""
    model, mctx, ref = each
    chunks = prompt_chunks(mctx, images, k)
    types = {"text": 0, "image": 1}
    assert [types[c.type] for c in chunks] == list(ref[f"{k}_types"])
    assert [c.n_tokens for c in chunks] == list(ref[f"{k}_n_tokens"])
    assert [c.n_pos for c in chunks] == list(ref[f"{k}_n_pos"])
    for i, c in enumerate(chunks):
        if c.type == "text":
            assert c.tokens == list(ref[f"{k}_text_{i}"])       # BOS, <start_of_image> / <end_of_image>
        else:
            embd = mctx.encode_chunk(c)
            assert embd.shape == ref[f"{k}_embd_{i}"].shape and embd.shape[1] == model.hparams.n_embd_inp()
            assert rel(embd, ref[f"{k}_embd_{i}"]) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 1])
def test_eval_chunks_logits_and_n_past_equal_llamacpp(each, images, k):
    model, mctx, ref = each
    ctx = new_ctx(model)
    n_past = mctx.eval_chunks(ctx, prompt_chunks(mctx, images, k))
    assert n_past == int(ref[f"{k}_n_past"])
    assert rel(ctx.get_logits_ith(-1), ref[f"{k}_logits"]) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("name", PROJECTORS)
def test_an_f16_mmproj_equals_llamacpp(images, name):
    """Released mmproj files hold their matrices in F16: the first prompt with such a twin."""
    model = llm.load_model(DATA / f"{name}.gguf")
    mctx = mtmd.init_from_file(DATA / f"{name}-f16.mmproj.gguf", model)
    ref = dict(np.load(DATA / f"{name}-f16.npz"))
    chunks = prompt_chunks(mctx, images, 0)
    for i, c in enumerate(chunks):
        if c.type == "image":
            assert rel(mctx.encode_chunk(c), ref[f"0_embd_{i}"]) < TOL
    ctx = new_ctx(model)
    assert mctx.eval_chunks(ctx, chunks) == int(ref["0_n_past"])
    assert rel(ctx.get_logits_ith(-1), ref["0_logits"]) < TOL


@pytest.mark.slow
def test_qwen25vl_windows_grid_and_positions(images):
    """qwen2.5vl_merger: the 96 x 72 image is resized to 128 x 96 (4 x 3 merged tokens of 2 x 2
    patches of 16), two windows of 112 pixels (3 x 3 tokens, then 1 x 3): layers 0 and 2 attend
    within them (the blocks in window order, window_idx putting the tokens back), layer 1 over
    the whole image (n_wa_pattern 2). The text model reads token i at t = n_past, y = n_past +
    row, x = n_past + column; the image takes max(4, 3) positions."""
    model = llm.load_model(DATA / "qwen2.5vl.gguf")
    mctx = mtmd.init_from_file(DATA / "qwen2.5vl.mmproj.gguf", model)
    chunk = prompt_chunks(mctx, images, 0)[1]
    assert chunk.image is not None and chunk.image.pixels.shape == (3, 96, 128)
    assert (chunk.image.nx, chunk.image.ny, chunk.n_tokens, chunk.n_pos) == (4, 3, 12, 4)
    g = mctx.graph(128, 96)
    names = {n.name for n in g.gf.nodes}
    for il in (0, 1, 2):
        assert {f"{n}-{il}" for n in ("ln1", "Qcur", "Kcur", "Vcur", "Qcur_rope", "Kcur_rope", "kqv_out", "attn_out",
                                      "ffn_inp", "ffn_inp_normed", "ffn_gate", "ffn_swiglu", "ffn_out",
                                      "layer_out")} <= names
    assert {"ffn_up", "ffn_gelu", "ffn_down"} <= names                 # the merger
    inputs = {t.name: v for t, v in g.inputs.items()}
    assert inputs["window_idx"].tolist() == [0, 1, 2, 9, 3, 4, 5, 10, 6, 7, 8, 11]
    mask = inputs["window_mask"]                                        # 36 patches, then 12
    assert (mask[:36, :36] == 0).all() and (mask[36:, 36:] == 0).all() and (mask[:36, 36:] < -1e38).all()
    masked = [len(n.src) == 2 for n in g.gf.nodes if n.op == Op.SOFT_MAX]
    assert masked == [True, False, True]
    assert chunk.image.decoder_pos(10)[:, 6].tolist() == [10, 11, 12, 0]


@pytest.mark.slow
def test_the_image_is_attended_non_causally(model, mctx, images, ref):
    """Gemma 3 reads the image with causal attention off (mtmd_decode_use_non_causal):
    decoding it causally moves the logits far past the tolerance."""
    causal = dataclasses.replace(mctx.projector, non_causal=False)
    ctx = new_ctx(model)
    orig, mctx.projector = mctx.projector, causal
    try:
        mctx.eval_chunks(ctx, prompt_chunks(mctx, images, 0))
    finally:
        mctx.projector = orig
    assert rel(ctx.get_logits_ith(-1), ref["0_logits"]) > 10 * TOL      # 1.9e-2 against 1.9e-5
    assert ctx.memory.causal_attn          # switched back on after the image


@pytest.mark.slow
def test_encoder_nodes_carry_clip_cpps_names(mctx):
    g = mctx.graph(64, 64)
    names = {n.name for n in g.gf.nodes} | {g.inp_raw.name}
    for il in (0, 1):
        assert {f"{n}-{il}" for n in ("layer_inp_normed", "Qcur", "Kcur", "Vcur", "kqv_out", "attn_out", "ffn_inp",
                                      "ffn_inp_normed", "ffn_up", "ffn_up_b", "ffn_gelu", "ffn_down", "ffn_out",
                                      "layer_out", "norm_w")} <= names     # norm_b is renamed, as in clip.cpp
    assert {"inp_raw", "patch_bias", "pos_embed"} <= names
    assert mctx.graph(64, 64) is g                  # one graph per image shape


@pytest.mark.slow
def test_a_cached_image_runs_no_encoder(mctx, images):
    chunk = next(c for c in prompt_chunks(mctx, images, 0) if c.type == "image")
    first = mctx.encode_chunk(chunk)
    n = mctx.n_encode
    again = next(c for c in mctx.tokenize(f"other text {mtmd.default_marker()}", [images[0]]) if c.type == "image")
    assert np.array_equal(mctx.encode_chunk(again), first) and mctx.n_encode == n


# ---- bad input ---------------------------------------------------------------------------


def png_header(nx: int, ny: int) -> bytes:
    """A PNG that declares nx x ny pixels, with a tiny IDAT (a decompression bomb's header)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", nx, ny, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


@pytest.mark.slow
def test_a_decompression_bomb_is_refused_before_decoding():
    t0 = time.perf_counter()
    with pytest.raises(mtmd.MediaError, match="over the pixel limit, refused before decoding"):
        mtmd.Bitmap.from_bytes(png_header(30000, 30000))
    with pytest.raises(mtmd.MediaError, match="10000x10000 pixels is over the pixel limit"):
        mtmd.Bitmap.from_bytes(png_header(10000, 10000))      # under Pillow's limit, over ours
    assert time.perf_counter() - t0 < 1.0       # nothing of 2.7 GB was decoded
    with pytest.raises(mtmd.MediaError, match="over the pixel limit"):
        mtmd.Bitmap.from_array(np.zeros((1, 1), np.uint8).repeat(mtmd.MAX_PIXELS + 1, 0))


def test_corrupt_and_truncated_images_are_media_errors():
    png = (DATA / "test-image.png").read_bytes()
    with pytest.raises(mtmd.MediaError, match="cannot decode"):
        mtmd.Bitmap.from_bytes(png[: len(png) // 2], "half.png")
    with pytest.raises(mtmd.MediaError, match="not an image in a known format"):
        mtmd.Bitmap.from_bytes(b"GIF89a but not really" + bytes(40))
    with pytest.raises(mtmd.MediaError, match="no-such-file.png"):
        mtmd.Bitmap.from_file(DATA / "no-such-file.png")
    with pytest.raises(mtmd.MediaError, match="uint8"):
        mtmd.Bitmap.from_array(np.zeros((4, 4, 3), np.float32))


def test_image_formats_decode_to_the_same_pixels():
    from PIL import Image
    png = mtmd.Bitmap.from_file(DATA / "test-image.png")
    im = Image.fromarray(png.data)
    for fmt, lossless in (("BMP", True), ("WEBP", True), ("JPEG", False), ("GIF", False)):
        buf = io.BytesIO()
        im.save(buf, fmt, **({"lossless": True} if fmt == "WEBP" else {}))
        bm = mtmd.Bitmap.from_bytes(buf.getvalue(), fmt)
        assert bm.data.shape == png.data.shape, fmt
        assert np.array_equal(bm.data, png.data) == lossless, fmt
    frames = [Image.new("RGB", (8, 6), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    assert tuple(mtmd.Bitmap.from_bytes(buf.getvalue()).data[0, 0]) == (255, 0, 0)     # the first frame
    assert mtmd.Bitmap.from_array(png.data).id == png.id


def test_data_urls():
    png = (DATA / "test-image.png").read_bytes()
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    assert mtmd.Bitmap.from_url(url).id == mtmd.Bitmap.from_bytes(png).id
    with pytest.raises(mtmd.MediaError, match="not base64-encoded"):
        mtmd.Bitmap.from_url("data:image/png,rawbytes")
    with pytest.raises(mtmd.MediaError, match="base64 is invalid"):
        mtmd.Bitmap.from_url("data:image/png;base64,@@@")
    with pytest.raises(mtmd.MediaError, match="remote URLs are not fetched"):
        mtmd.Bitmap.from_url("https://example.com/cat.png")


def test_resize_is_pillows_resampling():
    """llama.cpp's resize_pillow is Pillow's fixed-point resampler: ours equals Pillow's output."""
    from PIL import Image
    rng = np.random.default_rng(5)
    for (w, h, nw, nh) in ((96, 72, 64, 48), (40, 40, 64, 64), (37, 23, 17, 33)):
        a = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        for algo, pil in ((ResizeAlgo.BILINEAR, Image.BILINEAR), (ResizeAlgo.BICUBIC, Image.BICUBIC)):
            assert np.array_equal(resize_pillow(a, nw, nh, algo), np.asarray(Image.fromarray(a).resize((nw, nh), pil)))


@pytest.mark.slow
def test_qwen3vl_deepstack_and_position_embeddings(images):
    """qwen3vl_merger: the learned 8 x 8 position grid resized (bilinear, corners aligned) to the
    image's 8 x 6 patches; layer 1's DeepStack merger gives each token's second half, which the
    text model adds after its layer 0 (deepstack_out-0): without it the logits move far."""
    model = llm.load_model(DATA / "qwen3vl.gguf")
    mctx = mtmd.init_from_file(DATA / "qwen3vl.mmproj.gguf", model)
    ref = dict(np.load(DATA / "qwen3vl.npz"))
    g = mctx.graph(128, 96)
    names = {n.name for n in g.gf.nodes}
    assert {"patch_bias", "inp_pos_emb", "ln1-2", "Qcur_rope-2", "ffn_gelu-2", "layer_out-2", "norm_w-1",
            "ffn_gelu-1", "ffn_down-1", "ffn_gelu"} <= names                 # ffn_*-1: DeepStack's merger
    taps = {t.name: v for t, v in g.inputs.items()}
    pe = np.arange(64, dtype=np.float64).reshape(8, 8) ** 1.5                # a smooth grid
    got = sum(pe.reshape(-1)[taps[f"pos_embd_rows_{k}"]] * taps[f"pos_embd_weights_{k}"].reshape(-1) for k in range(4))
    want = np.empty((6, 8))
    for yy in range(6):                              # bilinear, corners aligned: output y -> y * 7 / 5
        y = yy * 7 / 5
        y0 = min(int(y), 6)
        want[yy] = pe[y0] * (y0 + 1 - y) + pe[y0 + 1] * (y - y0)
    assert np.allclose(got.reshape(6, 8), want, rtol=1e-6)
    assert mctx.graph(96, 96).inputs.keys() != g.inputs.keys()              # 6 x 6 taps for the other image
    chunks = prompt_chunks(mctx, images, 0)
    img = chunks[1]
    embd = mctx.encode_chunk(img)
    mctx._embd[img.key] = np.concatenate([embd[:, :64], np.zeros_like(embd[:, 64:])], axis=1)
    try:
        ctx = new_ctx(model)
        mctx.eval_chunks(ctx, chunks)
    finally:
        del mctx._embd[img.key]
    assert rel(ctx.get_logits_ith(-1), ref["0_logits"]) > 10 * TOL


@pytest.mark.slow
def test_qwen3vlmoe_reads_the_deepstack_slices_too():
    """Qwen3-VL-MoE's text tower takes qwen3vl_merger images: its input is n_embd_inp wide and
    the slices after n_embd change the logits (the make_fixture model: 2 DeepStack layers)."""
    assert "qwen3vlmoe" in mtmd.PROJECTORS["qwen3vl_merger"].text_archs
    model = llm.load_model(ROOT / "tests" / "data" / "fixtures" / "qwen3vlmoe-F32.gguf")
    hp = model.hparams
    embd = np.random.default_rng(3).standard_normal((3, hp.n_embd_inp())).astype(np.float32)
    assert embd.shape[1] == 3 * hp.n_embd

    def logits(e: np.ndarray) -> np.ndarray:
        ctx = llm.Context(model, n_ctx=64, n_batch=64, n_ubatch=64, flash_attn=False)
        assert ctx.decode(llm.Batch(embd=e, logits=np.ones(3, bool))) == 0, ctx.last_error
        return np.array([ctx.get_logits_ith(i) for i in range(3)])
    plain = embd.copy()
    plain[:, hp.n_embd:] = 0
    assert np.abs(logits(embd) - logits(plain)).max() > 1.0


@pytest.mark.slow
def test_encoder_graphs_of_dynamic_sizes_are_bounded():
    """A qwen2.5vl encoder builds a graph per image size; the context keeps the last
    GRAPHS_KEPT sizes (each holds a window mask of n_patches^2 floats), the most recent reused."""
    model = llm.load_model(DATA / "qwen2.5vl.gguf")
    mctx = mtmd.init_from_file(DATA / "qwen2.5vl.mmproj.gguf", model)
    first = mctx.graph(64, 64)
    for i in range(mtmd_context.GRAPHS_KEPT):
        mctx.graph(96 + 32 * i, 64)
    assert len(mctx._graphs) == mtmd_context.GRAPHS_KEPT and mctx.graph(64, 64) is not first
    assert list(mctx._graphs)[-1] == (64, 64) and (96, 64) not in mctx._graphs        # the oldest went


def test_smart_resize_sizes():
    """img_tool::calc_size_preserved_ratio: sides rounded to the alignment, then scaled up to
    min_pixels or down to max_pixels keeping the aspect ratio (Qwen2.5-VL's 28-pixel blocks)."""
    assert calc_size_preserved_ratio(96, 72, align=32, min_pixels=8192, max_pixels=4194304) == (128, 96)
    assert calc_size_preserved_ratio(40, 40, align=32, min_pixels=8192, max_pixels=4194304) == (96, 96)
    assert calc_size_preserved_ratio(640, 427, align=28, min_pixels=6272, max_pixels=3211264) == (644, 420)
    assert calc_size_preserved_ratio(3000, 2000, align=28, min_pixels=6272, max_pixels=3211264) == (2184, 1456)
    assert calc_size_preserved_ratio(5, 2000, align=28, min_pixels=6272, max_pixels=3211264) == (28, 1988)


@pytest.mark.slow
def test_markers_must_pair_with_images_and_nothing_changes(model, mctx, images):
    m = mtmd.default_marker()
    with pytest.raises(mtmd.MediaError, match="2 media markers .* but 1 image"):
        mctx.tokenize(f"{m} and {m}", [images[0]])
    with pytest.raises(mtmd.MediaError, match="0 media markers .* but 1 image"):
        mctx.tokenize("no marker", [images[0]])
    ctx = new_ctx(model)
    chunks = mctx.tokenize(f"{m}" * 16, [images[0]] * 16)        # 16 x 18 positions > n_ctx 256
    n = mctx.n_encode
    with pytest.raises(mtmd.MediaError, match="the context holds 256"):
        mctx.eval_chunks(ctx, chunks)
    assert ctx.memory.seq_pos_max(0) == -1 and mctx.n_encode == n


@pytest.mark.slow
@pytest.mark.parametrize("n_batch, n_ubatch", [(5, 256), (256, 4)])
def test_an_image_split_over_batches_is_read_as_one(images, n_batch, n_ubatch):
    """The 12 tokens of a qwen2.5vl image share one position: decoded 5 at a time (batches) or
    4 (ubatches), each still sees the cells of the tokens before it in the grid, and only
    those, so the logits are llama.cpp's (one batch there)."""
    model = llm.load_model(DATA / "qwen2.5vl.gguf")
    mctx = mtmd.init_from_file(DATA / "qwen2.5vl.mmproj.gguf", model)
    ref = dict(np.load(DATA / "qwen2.5vl.npz"))
    ctx = llm.Context(model, n_ctx=256, n_batch=256, n_ubatch=n_ubatch, flash_attn=False)
    assert mctx.eval_chunks(ctx, prompt_chunks(mctx, images, 0), n_batch=n_batch) == int(ref["0_n_past"])
    assert rel(ctx.get_logits_ith(-1), ref["0_logits"]) < TOL


def rewrite_mmproj(src: Path, dst: Path, *, drop_key: str = "", drop_tensor: str = "",
                   set_kv: dict[str, object] | None = None) -> Path:
    """A copy of an mmproj without one key or tensor; set_kv: keys given another value (of the
    same type) or added (the type inferred)."""
    set_kv = set_kv or {}
    with gguf.GGUFReader(src) as f:
        w = gguf.GGUFWriter()
        for k, v in f.kv.items():
            if k != drop_key:
                w.add_kv(k, set_kv.get(k, v), f.kv_types[k], f.kv_array_types.get(k))
        for k, v in set_kv.items():
            if k not in f.kv:
                w.add_kv(k, v)
        for name, ti in f.tensors.items():
            if name != drop_tensor:
                w.add_tensor(name, np.array(ti.data.view(np.float32).reshape(tuple(reversed(ti.ne)))))
        w.write(dst)
    return dst


@pytest.mark.slow
def test_an_mlp_file_with_mm3_is_mlp_norm_and_its_norms_are_needed(tmp_path):
    """Yi-VL's files say "mlp"; clip.cpp reads one holding mm.3 as mlp_norm, as we do."""
    model = llm.load_model(DATA / "mlp_norm.gguf")
    src = DATA / "mlp_norm.mmproj.gguf"
    with gguf.GGUFReader(src) as f:
        assert f.kv["clip.projector_type"] == "mlp"
    assert mtmd.init_from_file(src, model).clip.hparams.projector == "mlp_norm"
    bad = rewrite_mmproj(src, tmp_path / "a.gguf", drop_tensor="mm.4.bias")
    with pytest.raises(ModelLoadError, match="a.gguf: missing tensor 'mm.4.bias'"):
        mtmd.init_from_file(bad, model)


@pytest.mark.slow
def test_llava16_pinpoints_tile_the_image_and_bad_ones_are_refused(tmp_path, images):
    """LLaVA 1.6: the 96 x 72 image in the 64 x 64 pinpoint, 2 x 2 tiles then the overview."""
    model = llm.load_model(DATA / "llava16.gguf")
    mctx = mtmd.init_from_file(DATA / "llava16.mmproj.gguf", model)
    chunks = mctx.tokenize("<__media__>", [images[0]])
    assert [c.type for c in chunks] == ["text"] + ["image"] * 5
    src = DATA / "llava16.mmproj.gguf"
    with gguf.GGUFReader(src) as f:
        w = gguf.GGUFWriter()
        for k, v in f.kv.items():
            w.add_kv(k, v[:-1] if k == "clip.vision.image_grid_pinpoints" else v, f.kv_types[k],
                     f.kv_array_types.get(k))
        for name, ti in f.tensors.items():
            w.add_tensor(name, np.array(ti.data.view(np.float32).reshape(tuple(reversed(ti.ne)))))
        w.write(tmp_path / "a.gguf")
    with pytest.raises(ModelLoadError, match="a.gguf: key .clip.vision.image_grid_pinpoints. must be an even number"):
        mtmd.init_from_file(tmp_path / "a.gguf", model)


@pytest.mark.slow
def test_a_qwen_mmproj_missing_a_part_is_refused_by_name(tmp_path):
    qwen25 = llm.load_model(DATA / "qwen2.5vl.gguf")
    bad = rewrite_mmproj(DATA / "qwen2.5vl.mmproj.gguf", tmp_path / "a.gguf", drop_key="clip.vision.n_wa_pattern")
    with pytest.raises(ModelLoadError, match="a.gguf: qwen2.5vl_merger needs 'clip.vision.n_wa_pattern'"):
        mtmd.init_from_file(bad, qwen25)
    bad = rewrite_mmproj(DATA / "qwen2.5vl.mmproj.gguf", tmp_path / "b.gguf", drop_tensor="v.patch_embd.weight.1")
    with pytest.raises(ModelLoadError, match="b.gguf: missing tensor 'v.patch_embd.weight.1'"):
        mtmd.init_from_file(bad, qwen25)
    qwen3 = llm.load_model(DATA / "qwen3vl.gguf")
    bad = rewrite_mmproj(DATA / "qwen3vl.mmproj.gguf", tmp_path / "c.gguf", drop_tensor="v.deepstack.1.fc1.weight")
    with pytest.raises(ModelLoadError, match=r"c.gguf: the projector gives 64 values per token; .*qwen3vl.gguf has "
                                             r"n_embd 64 and reads 128 per image token"):
        mtmd.init_from_file(bad, qwen3)
    with pytest.raises(ModelLoadError, match=r"feeds qwen3vl, qwen3vlmoe text models; .*qwen2.5vl.gguf is 'qwen2vl'"):
        mtmd.init_from_file(DATA / "qwen3vl.mmproj.gguf", qwen25)


@pytest.mark.slow
def test_a_pixtral_mmproj_missing_a_part_is_refused_by_name(tmp_path):
    model = llm.load_model(DATA / "pixtral.gguf")
    src = DATA / "pixtral.mmproj.gguf"
    bad = rewrite_mmproj(src, tmp_path / "a.gguf", drop_tensor="v.token_embd.img_break")
    with pytest.raises(ModelLoadError, match="a.gguf: missing tensor 'v.token_embd.img_break'"):
        mtmd.init_from_file(bad, model)
    bad = rewrite_mmproj(src, tmp_path / "b.gguf", drop_tensor="mm.input_norm.weight")
    with pytest.raises(ModelLoadError, match="b.gguf: 'mm.patch_merger.weight' and 'mm.input_norm.weight' come"):
        mtmd.init_from_file(bad, model)
    bad = rewrite_mmproj(src, tmp_path / "c.gguf", drop_key="clip.vision.spatial_merge_size")
    with pytest.raises(ModelLoadError, match="c.gguf: tensor 'mm.patch_merger.weight' has wrong shape"):
        mtmd.init_from_file(bad, model)


@pytest.mark.slow
def test_pixtral_encoder_nodes_carry_clip_cpps_names():
    model = llm.load_model(DATA / "pixtral.gguf")
    g = mtmd.init_from_file(DATA / "pixtral.mmproj.gguf", model).graph(96, 80)
    names = {n.name for n in g.gf.nodes}
    for il in (0, 1):
        assert {f"{n}-{il}" for n in ("layer_inp_normed", "Qcur", "Kcur", "Vcur", "Qcur_pos", "Kcur_pos", "kq_soft_max",
                                      "kqv_out", "attn_out", "ffn_inp", "ffn_inp_normed", "ffn_up", "ffn_gate",
                                      "ffn_swiglu", "ffn_out", "layer_out")} <= names
    assert {"pre_ln", "ffn_up", "ffn_gelu"} <= names
    assert {t.name for t in g.inputs} == {"pos_h", "pos_w"}
    assert g.out is not None and g.out.ne[:2] == (64, 6 * 5 + 4)


def test_internvl_tile_grids():
    """set_internvl_dhr_res_candidates and llava-uhd's select_best_resolution: the grid keeping
    most of the image, then wasting least."""
    from llm.mtmd.clip import ClipHParams, FfnOp
    from llm.mtmd.internvl import res_candidates, select_best_resolution
    hp = ClipHParams(projector="internvl", n_embd=32, n_ff=64, n_layer=2, n_head=4, n_head_kv=4, d_head=8,
                     projection_dim=64, eps=1e-6, image_size=32, patch_size=4, image_mean=(0.5,) * 3,
                     image_std=(0.5,) * 3, ffn_op=FfnOp.GELU, preproc_min_tiles=1, preproc_max_tiles=4)
    cands = res_candidates(hp)
    assert cands == [(32, 32), (32, 64), (32, 96), (32, 128), (64, 32), (64, 64), (96, 32), (128, 32)]
    assert select_best_resolution(96, 72, cands) == (64, 64)
    assert select_best_resolution(200, 40, cands) == (128, 32)
    assert select_best_resolution(33, 20, cands) == (64, 32)


@pytest.mark.slow
def test_an_internvl_mmproj_missing_a_part_is_refused_by_name(tmp_path):
    model = llm.load_model(DATA / "internvl.gguf")
    src = DATA / "internvl.mmproj.gguf"
    bad = rewrite_mmproj(src, tmp_path / "a.gguf", drop_tensor="mm.model.mlp.0.bias")
    with pytest.raises(ModelLoadError, match="a.gguf: missing tensor 'mm.model.mlp.0.bias'"):
        mtmd.init_from_file(bad, model)
    bad = rewrite_mmproj(src, tmp_path / "b.gguf", drop_tensor="v.class_embd")
    with pytest.raises(ModelLoadError, match="b.gguf: missing tensor 'v.class_embd'"):
        mtmd.init_from_file(bad, model)
    g = mtmd.init_from_file(src, model).graph(32, 32)
    names = {n.name for n in g.gf.nodes}
    assert {f"{n}-{il}" for n in ("attn_out_scaled", "ffn_out_scaled") for il in (0, 1)} <= names


@pytest.mark.slow
def test_lfm2_tiles_a_big_image_as_llamacpp():
    """A 1700 x 1300 picture: 3 x 2 tiles of 512 x 512, each after <|img_row_R_col_C|>, then
    <|img_thumbnail|> and the whole resized to 1152 x 832 (the 8 x 8 position grid resized,
    antialiased, to 72 x 52 patches)."""
    g = gen()
    model = llm.load_model(DATA / "lfm2.gguf")
    mctx = mtmd.init_from_file(DATA / "lfm2.mmproj.gguf", model)
    ref = dict(np.load(DATA / "lfm2.npz"))
    text, _ = g.TILED_PROMPT
    chunks = mctx.tokenize(text, [mtmd.Bitmap.from_bytes(g.big_image_bytes())])
    assert [c.type == "image" for c in chunks] == list(ref["2_types"] == 1)
    assert [c.n_tokens for c in chunks] == list(ref["2_n_tokens"]) == [11] + [64, 1] * 6 + [234, 5]
    for i, c in enumerate(chunks):
        if c.type == "text":
            assert c.tokens == list(ref[f"2_text_{i}"])
        else:
            assert rel(mctx.encode_chunk(c), ref[f"2_embd_{i}"]) < TOL
    n = g.N_CTX_OF["lfm2"]
    ctx = llm.Context(model, n_ctx=n, n_batch=n, n_ubatch=n, flash_attn=False)
    assert mctx.eval_chunks(ctx, chunks) == int(ref["2_n_past"])
    assert rel(ctx.get_logits_ith(-1), ref["2_logits"]) < TOL


@pytest.mark.slow
def test_an_lfm2_mmproj_missing_a_part_is_refused_by_name(tmp_path):
    model = llm.load_model(DATA / "lfm2.gguf")
    src = DATA / "lfm2.mmproj.gguf"
    bad = rewrite_mmproj(src, tmp_path / "a.gguf", drop_key="clip.vision.projector.scale_factor")
    with pytest.raises(ModelLoadError, match="a.gguf: lfm2 needs 'clip.vision.projector.scale_factor'"):
        mtmd.init_from_file(bad, model)
    bad = rewrite_mmproj(src, tmp_path / "b.gguf", drop_tensor="mm.1.bias")
    with pytest.raises(ModelLoadError, match="b.gguf: missing tensor 'mm.1.bias'"):
        mtmd.init_from_file(bad, model)


def test_llama4_tile_candidates():
    """set_llava_uhd_res_candidates(3): every x by y grid of 1..3 tiles but 1 x 1; the best keeps
    the whole 96 x 72 image (3 x 3) and wastes least on the 40 x 40 one (2 x 2)."""
    from llm.mtmd.clip import ClipHParams, FfnOp
    from llm.mtmd.internvl import select_best_resolution
    from llm.mtmd.llama4 import res_candidates
    hp = ClipHParams(projector="llama4", n_embd=32, n_ff=64, n_layer=2, n_head=4, n_head_kv=4, d_head=8,
                     projection_dim=64, eps=1e-5, image_size=32, patch_size=4, image_mean=(0.5,) * 3,
                     image_std=(0.5,) * 3, ffn_op=FfnOp.GELU, n_merge=2)
    cands = res_candidates(hp)
    assert cands == [(32, 64), (32, 96), (64, 32), (64, 64), (64, 96), (96, 32), (96, 64), (96, 96)]
    assert select_best_resolution(96, 72, cands) == (96, 96)
    assert select_best_resolution(40, 40, cands) == (64, 64)


@pytest.mark.slow
def test_llama4_encoder_nodes_and_positions():
    model = llm.load_model(DATA / "llama4.gguf")
    g = mtmd.init_from_file(DATA / "llama4.mmproj.gguf", model).graph(32, 32)
    names = {n.name for n in g.gf.nodes}
    assert {"patch_conv", "pos_embed", "pre_ln", "pixel_shuffle", "adapter_mlp", "projected"} <= names
    assert {f"{n}-{il}" for n in ("Qcur_pos", "Kcur_pos", "kq_soft_max", "ffn_gelu") for il in (0, 1)} <= names
    pos = {t.name: v for t, v in g.inputs.items()}
    assert list(pos["pos_h"][:10]) == [1] * 8 + [2, 2] and pos["pos_h"][-1] == 0 and pos["pos_h"][-2] == 8
    assert list(pos["pos_w"][:10]) == [1, 2, 3, 4, 5, 6, 7, 8, 1, 2] and pos["pos_w"][-1] == 0


def test_lfm2_tile_grids():
    """mtmd_image_preprocessor_lfm2: tiles past twice max_pixels (rounded half to even to whole
    blocks), the grid of 2..10 tiles nearest the aspect ratio, on a tie the larger one if the
    image covers more than half of it."""
    from llm.mtmd.clip import ClipHParams, FfnOp
    from llm.mtmd.lfm2 import grid_layout, should_tile
    hp = ClipHParams(projector="lfm2", n_embd=16, n_ff=32, n_layer=2, n_head=2, n_head_kv=2, d_head=8,
                     projection_dim=64, eps=1e-6, image_size=256, patch_size=16, image_mean=(0.5,) * 3,
                     image_std=(0.5,) * 3, ffn_op=FfnOp.GELU, n_merge=4, image_max_pixels=256 * 64 * 64)
    assert should_tile(hp, 1700, 1300) and not should_tile(hp, 1600, 1300) and not should_tile(hp, 96, 72)
    assert grid_layout(1700, 1300) == (3, 2)
    assert grid_layout(1000, 1000) == (2, 2)       # a tie with 3 x 3, whose half the image does not cover
    assert grid_layout(1300, 1300) == (3, 3)
    assert grid_layout(3000, 500) == (6, 1)
    assert grid_layout(500, 1000) == (1, 2)


@pytest.mark.slow
def test_an_mmproj_that_does_not_fit_names_both_files(model, tmp_path):
    with pytest.raises(ModelLoadError, match="no projector type"):
        mtmd.init_from_file(MODEL, model)
    other = llm.load_model(ROOT / "tests" / "data" / "fixtures" / "smollm3-F32.gguf")
    with pytest.raises(ModelLoadError, match=r"feeds gemma3 text models; .*smollm3-F32.gguf is 'smollm3'"):
        mtmd.init_from_file(MMPROJ, other)
    narrow = tmp_path / "narrow.mmproj.gguf"
    with gguf.GGUFReader(MMPROJ) as f:
        w = gguf.GGUFWriter()
        for k, v in f.kv.items():
            w.add_kv(k, v, f.kv_types[k], f.kv_array_types.get(k))
        for name, ti in f.tensors.items():
            x = np.array(ti.data.view(np.float32).reshape(tuple(reversed(ti.ne))))
            w.add_tensor(name, x[:, :48] if name == "mm.input_projection.weight" else x)
        w.write(narrow)
    with pytest.raises(ModelLoadError, match=r"narrow.mmproj.gguf: the projector gives 48 .*gemma3.gguf has n_embd 64"):
        mtmd.init_from_file(narrow, model)


# ---- the API -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vlm():
    return llm.LLM(MODEL, mmproj=MMPROJ, n_ctx=256)


def data_url(pixels: np.ndarray) -> str:
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.slow
def test_generate_with_an_image_starts_with_llamacpps_greedy_token(vlm, ref):
    text, _ = gen().PROMPTS[0]
    c = vlm.generate(text, images=[gen().IMAGES[0]], max_tokens=1, temperature=0)
    assert c.tokens == [int(ref["0_logits"].argmax())] and c.n_prompt_tokens == int(ref["0_n_past"])


@pytest.mark.slow
def test_a_second_question_about_the_image_encodes_nothing(vlm):
    """The encoder's cache is keyed by the image's content; the cells of the shared prefix
    (text and image) are kept, and give what a fresh decode of the prompt gives."""
    img = np.ascontiguousarray(mtmd.Bitmap.from_file(gen().IMAGES[0]).data[::-1])      # an image not seen yet
    first = vlm.generate(f"Look at this: {mtmd.default_marker()} What is it?", images=[img], max_tokens=4,
                         temperature=0)
    assert first.timings["n_encode"] == 1 and first.timings["encode_s"] > 0
    n = vlm.mtmd.n_encode
    t0 = time.perf_counter()
    second = vlm.generate(f"Look at this: {mtmd.default_marker()} What colour?", images=[mtmd.Bitmap.from_array(img)],
                          max_tokens=4, temperature=0)
    assert vlm.mtmd.n_encode == n and second.timings["n_encode"] == 0 and second.timings["encode_s"] == 0
    t_second = time.perf_counter() - t0
    vlm.reset()                                  # the cells are gone, the encoder's cache is not
    fresh = vlm.generate(f"Look at this: {mtmd.default_marker()} What colour?", images=[img], max_tokens=4,
                         temperature=0)
    assert fresh.tokens == second.tokens and vlm.mtmd.n_encode == n
    chat = vlm.chat([{"role": "user", "content": [{"type": "text", "text": "What is this? "},
                                                  {"type": "image_url", "image_url": {"url": data_url(img)}}]}],
                    max_tokens=2, temperature=0)
    assert chat.n_completion_tokens == 2 and vlm.mtmd.n_encode == n
    assert t_second < 30


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5vl", "qwen3vl"])
def test_generate_at_mrope_positions_starts_with_llamacpps_greedy_token(name):
    """LLM.generate with a Qwen-VL model: the images at M-RoPE positions in the Batcher's
    prefill (an image's cells outnumber its positions), llama.cpp's greedy first token and
    n_past; asked again, the kept cells and the encoder's cache answer the same."""
    ref = dict(np.load(DATA / f"{name}.npz"))
    vlm = llm.LLM(DATA / f"{name}.gguf", mmproj=DATA / f"{name}.mmproj.gguf", n_ctx=256)
    for k in (0, 1):
        text, which = gen().PROMPTS[k]
        c = vlm.generate(text, images=[gen().IMAGES[i] for i in which], max_tokens=3, temperature=0)
        assert c.tokens[0] == int(ref[f"{k}_logits"].argmax()) and c.n_prompt_tokens == int(ref[f"{k}_n_past"])
    n = vlm.mtmd.n_encode
    again = vlm.generate(text, images=[gen().IMAGES[i] for i in which], max_tokens=3, temperature=0)
    assert again.tokens == c.tokens and vlm.mtmd.n_encode == n


@pytest.mark.slow
def test_a_slot_counts_an_mrope_images_cells():
    """A qwen2.5vl image takes 12 cells at 4 positions: the prompt (38 positions) needs 46 cells,
    so a 40-cell slot refuses it up front and a 48-cell one ends after 2 tokens with "length"
    (both used to fail in decode, out of cells)."""
    text, _ = gen().PROMPTS[0]
    small = llm.LLM(DATA / "qwen2.5vl.gguf", mmproj=DATA / "qwen2.5vl.mmproj.gguf", n_ctx=40)
    with pytest.raises(ParamError, match=r"the prompt has 38 tokens \(46 cells with its images\); a slot holds 40"):
        small.generate(text, images=[gen().IMAGES[0]], max_tokens=20)
    c = llm.LLM(DATA / "qwen2.5vl.gguf", mmproj=DATA / "qwen2.5vl.mmproj.gguf", n_ctx=48).generate(
        text, images=[gen().IMAGES[0]], max_tokens=20, temperature=0)
    assert len(c.tokens) == 2 and c.finish_reason == "length"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3", "qwen2vl"])
def test_a_saved_sequence_holding_an_image_restores_its_logits(images, name, tmp_path):
    """llm.state of a context holding an image's cells (gemma3: attended non-causally; qwen2vl:
    at M-RoPE positions): a state file restores the last logits, and the whole state or the
    sequence's put in a fresh context give the next token the logits the original gives it."""
    model = llm.load_model(DATA / f"{name}.gguf")
    mctx = mtmd.init_from_file(DATA / f"{name}.mmproj.gguf", model)
    ctx = new_ctx(model)
    n_past = mctx.eval_chunks(ctx, prompt_chunks(mctx, images, 0))
    logits = ctx.get_logits_ith(-1).copy()
    ctx.state_save_file(tmp_path / "all.state", [])
    seq = ctx.state_seq_get_data(0)
    after = [mtmd.InputChunk("text", [int(np.argmax(logits))])]
    mctx.eval_chunks(ctx, after, n_past)
    want = ctx.get_logits_ith(-1).copy()
    full, one = new_ctx(model), new_ctx(model)
    full.state_load_file(tmp_path / "all.state")
    assert np.array_equal(full.get_logits_ith(-1), logits)
    one.state_seq_set_data(seq, 0)
    for c in (full, one):
        mctx.eval_chunks(c, after, n_past)
        assert np.array_equal(c.get_logits_ith(-1), want)


@pytest.mark.slow
def test_the_prompt_cache_keeps_no_prompt_holding_an_image(tmp_path):
    """Prompt-cache entries are keyed by tokens, and an image's placeholders are no tokens: a
    prompt with an image is neither stored nor restored (so another image there cannot match),
    while the same text alone is stored."""
    text = " and then" * 40

    def top3(m: llm.LLM, image: Path) -> np.ndarray:
        c = m.generate(f"hi {mtmd.default_marker()}{text}", images=[image], max_tokens=1, temperature=0,
                       logprobs=True, top_logprobs=3)
        return np.array(c.logprobs[0].top)

    m = llm.LLM(MODEL, mmproj=MMPROJ, n_ctx=256, prompt_cache=tmp_path / "pc")
    top3(m, gen().IMAGES[1])
    assert not list((tmp_path / "pc").glob("*/*.state"))
    other = top3(m, gen().IMAGES[0])        # the same text about another image: nothing of the first
    assert m.prompt_cache.hits == 0 and not list((tmp_path / "pc").glob("*/*.state"))
    assert np.allclose(other, top3(llm.LLM(MODEL, mmproj=MMPROJ, n_ctx=256), gen().IMAGES[0]), atol=1e-4)
    m.generate(f"hi{text}", max_tokens=2, temperature=0)
    assert len(list((tmp_path / "pc").glob("*/*.state"))) == 1


@pytest.mark.slow
def test_text_after_an_image_does_not_reuse_its_cells(vlm):
    """The batcher sees an image's positions as placeholder tokens; after an image prompt its
    record of the cells stops before the image, so a text prompt cannot match them."""
    vlm.generate(f"hi {mtmd.default_marker()}", images=[gen().IMAGES[1]], max_tokens=2, temperature=0)
    ids = vlm.tokenize("hi <start_of_image>") + [0] * 16        # the placeholders the batcher saw
    def top3() -> np.ndarray:
        c = vlm.generate(ids, max_tokens=1, temperature=0, logprobs=True, top_logprobs=3)
        return np.array(c.logprobs[0].top)
    after = top3()
    vlm.reset()
    # reading the image's cells as these tokens' would move the 2nd/3rd logprobs by ~2 (-48.4 vs -50.5)
    assert np.allclose(top3(), after, atol=1e-3)


@pytest.mark.slow
def test_bad_media_in_the_api_are_media_errors(vlm):
    msg = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]
    with pytest.raises(mtmd.MediaError, match=r"messages\[0\].content\[0\]: remote URLs are not fetched"):
        vlm.chat(msg)
    msg = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,%%"}}]}]
    with pytest.raises(mtmd.MediaError, match="base64 is invalid"):
        vlm.chat(msg)
    with pytest.raises(mtmd.MediaError, match="1 media marker .* but 2 images"):
        vlm.generate(f"one {mtmd.default_marker()}", images=gen().IMAGES, max_tokens=1)
    with pytest.raises(mtmd.MediaError, match=r"images\[0\]: not an image"):
        vlm.generate(f"one {mtmd.default_marker()}", images=[b"\x89PNG\r\n\x1a\n" + bytes(30)], max_tokens=1)
    text_only = llm.LLM(MODEL, n_ctx=64)
    with pytest.raises(ValueError, match="images need a vision projector"):
        text_only.generate(f"one {mtmd.default_marker()}", images=[gen().IMAGES[0]])


@pytest.mark.slow
def test_the_cli_generates_about_an_image(vlm, capsys):
    from llm import cli
    img = str(gen().IMAGES[0])
    rc = cli.main(["generate", "-m", str(MODEL), "--mmproj", str(MMPROJ), "--image", img, "-p", "What is it?",
                   "-n", "3", "--temp", "0", "-c", "128"])
    out = capsys.readouterr()
    want = vlm.generate(mtmd.default_marker() + "What is it?", images=[img], max_tokens=3, temperature=0)
    assert rc == 0 and out.out == want.text + "\n"
    assert cli.main(["generate", "-m", str(MODEL), "--image", img, "-p", "x"]) == 2
    assert "--image needs --mmproj" in capsys.readouterr().err

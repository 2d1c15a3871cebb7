"""LFM2-VL encoders: llama.cpp's tools/mtmd/models/siglip.cpp (clip_graph_siglip, PROJECTOR_TYPE_LFM2).

lfm2 (LFM2-VL, LFM2.5-VL): a SigLIP2 (NaFlex) ViT over an image of its own size - learned
positions on an n x n grid resized to the patch grid (ggml_interpolate, bilinear with
antialiasing), layer norms, GELU FFNs, post-LN - then pixel unshuffle (each n_merge x n_merge
block of patches one token, as idefics3) and the projector: an optional layer norm (eps 1e-5),
mm.1, GELU, mm.2. The image is resized (bilinear, keeping its aspect ratio) to multiples of
patch_size * n_merge within 64 to 256 tokens; one more than twice that many pixels is cut into
512 x 512 tiles instead (the grid of 2 to 10 tiles closest to its aspect ratio, the image
resized bilinearly into it and padded) followed by the resized image as a thumbnail. The text
model reads <|image_start|>, each tile after <|img_row_R_col_C|>, <|img_thumbnail|> and the
thumbnail, <|image_end|> (a small image: just the image between the two).
"""
from __future__ import annotations

import math

import numpy as np

from ggmlx import ops
from ggmlx.tensor import Tensor, new_input
from ggmlx.types import GGMLType
from llm.errors import ModelLoadError
from llm.mtmd.clip import (
    ClipGraph,
    ClipHParams,
    ClipKV,
    ClipModel,
    ClipTensor,
    FfnOp,
    Preprocessed,
    Projector,
    check_shape,
    ctn,
    load_vit_layers,
)
from llm.mtmd.image import PadStyle, ResizeAlgo, calc_size_preserved_ratio, resize
from llm.mtmd.siglip import patch_merge_permute

MIN_TOKENS, MAX_TOKENS = 64, 256    # clip.cpp's set_limit_image_tokens for lfm2
TILE_SIZE = 512                     # mtmd_image_preprocessor_lfm2's tiles, in pixels
MIN_TILES, MAX_TILES = 2, 10
MAX_PIXELS_TOLERANCE = 2.0          # an image this many times max_pixels (or more) is tiled
PROJ_NORM_EPS = 1e-5                # the projector's layer norm: PyTorch's default


def load_lfm2(model: ClipModel) -> int:
    hp = model.hparams
    merge = model.kv.get(ClipKV.PROJ_SCALE_FACTOR.key())
    if not isinstance(merge, int) or isinstance(merge, bool) or merge <= 1:
        raise ModelLoadError(f"{model.path}: lfm2 needs '{ClipKV.PROJ_SCALE_FACTOR.key()}' (an integer > 1), "
                             f"got {merge!r}")
    hp.n_merge = merge
    align = hp.patch_size * merge
    if TILE_SIZE % align:
        raise ModelLoadError(f"{model.path}: tiles of {TILE_SIZE} pixels are not whole blocks of {merge} x {merge} "
                             f"patches of {hp.patch_size}")
    hp.image_min_pixels, hp.image_max_pixels = MIN_TOKENS * align * align, MAX_TOKENS * align * align
    load_vit_layers(model)
    n_embd = hp.n_embd
    check_shape(model, model.need(ctn(ClipTensor.PATCH_EMBD)), (hp.patch_size, hp.patch_size, 3, n_embd))
    check_shape(model, model.get(ctn(ClipTensor.PATCH_BIAS, "bias"), False), (n_embd,))
    pos = model.need(ctn(ClipTensor.POS_EMBD))
    side = math.isqrt(pos.ne[1])
    if pos.ne[0] != n_embd or side * side != pos.ne[1]:
        raise ModelLoadError(f"{model.path}: '{pos.name}' must be [{n_embd}, n * n] (a square grid), got "
                             f"{list(pos.ne[:2])}")
    for t in (ClipTensor.LN_PRE, ClipTensor.LN_POST):
        check_shape(model, model.get(ctn(t), False), (n_embd,))
    n_in = n_embd * merge * merge
    check_shape(model, model.get(ctn(ClipTensor.MM_INP_NORM), False), (n_in,))
    check_shape(model, model.get(ctn(ClipTensor.MM_INP_NORM_B, "bias"), False), (n_in,))
    mm1 = model.need(ctn(ClipTensor.LLAVA_PROJ, "weight", 1))
    mm2 = model.need(ctn(ClipTensor.LLAVA_PROJ, "weight", 2))
    check_shape(model, mm1, (n_in, mm1.ne[1]))
    check_shape(model, model.need(ctn(ClipTensor.LLAVA_PROJ, "bias", 1)), (mm1.ne[1],))
    check_shape(model, mm2, (mm1.ne[1], mm2.ne[1]))
    check_shape(model, model.need(ctn(ClipTensor.LLAVA_PROJ, "bias", 2)), (mm2.ne[1],))
    return mm2.ne[1]


def n_tokens_lfm2(hp: ClipHParams, nx: int, ny: int) -> int:
    out = hp.patch_size * hp.n_merge
    return -(-nx // out) * -(-ny // out)


def should_tile(hp: ClipHParams, nx: int, ny: int) -> bool:
    """mtmd_image_preprocessor_lfm2::should_tile: the image rounded (half to even) to whole
    blocks holds more than MAX_PIXELS_TOLERANCE times max_pixels."""
    align = hp.patch_size * hp.n_merge
    h_bar = max(hp.patch_size, round(ny / align) * align)
    w_bar = max(hp.patch_size, round(nx / align) * align)
    return float(h_bar) * float(w_bar) > float(hp.image_max_pixels) * MAX_PIXELS_TOLERANCE


def grid_layout(nx: int, ny: int) -> tuple[int, int]:
    """get_grid_layout: the (columns, rows) of MIN_TILES..MAX_TILES tiles closest to the image's
    aspect ratio (float32); on a tie the later, larger grid when the image covers more than half
    of it. The grids in order of area (ties in area by first appearance)."""
    ratios: list[tuple[int, int]] = []
    for n in range(MIN_TILES, MAX_TILES + 1):
        for w in range(1, n + 1):
            for h in range(1, n + 1):
                if MIN_TILES <= w * h <= MAX_TILES and (w, h) not in ratios:
                    ratios.append((w, h))
    ratios.sort(key=lambda r: r[0] * r[1])
    aspect = np.float32(nx) / np.float32(ny)
    area = np.float32(nx * ny)
    best, best_diff = (1, 1), np.float32(np.finfo(np.float32).max)
    for w, h in ratios:
        diff = np.abs(aspect - np.float32(w) / np.float32(h))
        if diff < best_diff:
            best, best_diff = (w, h), diff
        elif diff == best_diff and area > np.float32(0.5) * np.float32(TILE_SIZE * TILE_SIZE * w * h):
            best = (w, h)
    return best


def preprocess_lfm2(model: ClipModel, proj: Projector, img: np.ndarray) -> Preprocessed:
    """mtmd_image_preprocessor_lfm2: one image resized into the token range, or the tiles of
    the refined image (row by row) with that image as the thumbnail after them."""
    hp = model.hparams
    ny, nx = img.shape[:2]
    ov_w, ov_h = calc_size_preserved_ratio(nx, ny, align=hp.patch_size * hp.n_merge,
                                           min_pixels=hp.image_min_pixels, max_pixels=hp.image_max_pixels)
    overview = resize(img, ov_w, ov_h, ResizeAlgo.BILINEAR, PadStyle.NONE)
    if not should_tile(hp, nx, ny):
        return Preprocessed([overview])
    gw, gh = grid_layout(nx, ny)
    refined = resize(img, TILE_SIZE * gw, TILE_SIZE * gh, ResizeAlgo.BILINEAR, PadStyle.CEIL, (0, 0, 0))
    tiles = [np.ascontiguousarray(refined[r * TILE_SIZE:(r + 1) * TILE_SIZE, c * TILE_SIZE:(c + 1) * TILE_SIZE])
             for r in range(gh) for c in range(gw)]
    return Preprocessed(tiles, grid_x=gw, grid_y=gh, overview=overview)


def antialias_taps(n_in: int, n_out: int) -> np.ndarray:
    """ggml-cpu's bilinear upscale with GGML_SCALE_FLAG_ANTIALIAS along one axis: float32
    [n_out, n_in], each output's triangle-filter weights (support widened by the downscale),
    not yet normalized."""
    sf = np.float32(n_out) / np.float32(n_in)
    support = max(np.float32(1.0), np.float32(1.0) / sf)
    invscale = np.float32(1.0) / support
    half = np.float32(0.5)
    out = np.zeros((n_out, n_in), np.float32)
    for i in range(n_out):
        x = (np.float32(i) + half) / sf
        lo, hi = max(int(x - support + half), 0), min(int(x + support + half), n_in)
        for s in range(lo, hi):
            out[i, s] = max(np.float32(1.0) - np.abs((np.float32(s) - x + half) * invscale), np.float32(0.0))
    return out


def build_pos_embd(g: ClipGraph) -> Tensor:
    """clip_graph::resize_position_embeddings (bilinear, antialiased): the learned n x n grid as
    it is for an n x n patch grid, else each patch's weighted mean of it, the weights an input
    [n n, n_patches] -> [n_embd, n_patches] in raster order."""
    pe = g.model.need(ctn(ClipTensor.POS_EMBD))
    side = math.isqrt(pe.ne[1])
    px, py = g.n_patches_x, g.n_patches_y
    if (px, py) == (side, side):
        return pe
    wx, wy = antialias_taps(side, px), antialias_taps(side, py)
    w = (wy[:, None, :, None] * wx[None, :, None, :]).reshape(py * px, side * side)     # [out y x, in y x]
    w = (w / w.sum(axis=1, dtype=np.float32, keepdims=True)).astype(np.float32)
    weights = new_input(GGMLType.F32, (side * side, px * py), "pos_embd_weights")
    g.inputs[weights] = w
    return ops.mul_mat(ops.cont(ops.transpose(pe)), weights)


def build_lfm2(g: ClipGraph) -> Tensor:
    m, hp = g.model, g.hparams
    n = hp.n_merge
    if g.n_patches_x % n or g.n_patches_y % n:
        raise ValueError(f"lfm2: an image of {g.nx}x{g.ny} is not whole {n}x{n} blocks of patches")
    cur = g.build_vit(g.build_inp(), g.n_patches, build_pos_embd(g))
    cur = patch_merge_permute(g, ops.reshape_2d(cur, hp.n_embd, g.n_patches), n)
    norm_w = m.get(ctn(ClipTensor.MM_INP_NORM), False)
    norm_b = m.get(ctn(ClipTensor.MM_INP_NORM_B, "bias"), False)
    if norm_w is not None:
        cur = ops.mul(ops.norm(cur, PROJ_NORM_EPS), norm_w)
    if norm_b is not None:
        cur = ops.add(cur, norm_b)
    return g.build_ffn(cur, m.need(ctn(ClipTensor.LLAVA_PROJ, "weight", 1)),
                       m.need(ctn(ClipTensor.LLAVA_PROJ, "bias", 1)), None, None,
                       m.need(ctn(ClipTensor.LLAVA_PROJ, "weight", 2)),
                       m.need(ctn(ClipTensor.LLAVA_PROJ, "bias", 2)), FfnOp.GELU, -1)


LFM2 = Projector(name="lfm2", text_archs=frozenset({"lfm2", "lfm2moe"}), load=load_lfm2, build=build_lfm2,
                 n_output_tokens=n_tokens_lfm2, resize_algo=ResizeAlgo.BILINEAR, preprocess=preprocess_lfm2,
                 img_beg="<|image_start|>", img_end="<|image_end|>", tok_ov_img_start=("<|img_thumbnail|>",),
                 sli_img_start_tmpl="<|img_row_%d_col_%d|>")

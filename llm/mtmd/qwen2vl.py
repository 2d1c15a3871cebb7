"""Qwen-VL encoders: llama.cpp's tools/mtmd/models/qwen2vl.cpp (clip_graph_qwen2vl).

qwen2.5vl_merger (Qwen2.5-VL): the image is resized (bicubic, keeping its aspect ratio) to
multiples of 2 patches within the projector's pixel range (8 to 4096 merged tokens), so its
size varies and each size gets its own graph. Two temporal patch kernels (a still image is
both frames) give the patch embeddings, which are reordered so each 2 x 2 block of patches is
consecutive; a ViT with RMS norms, SiLU-gated FFNs and a 2-D rope (rope_multi in vision
mode: half the rotated pairs at the patch's row, half at its column) attends over the whole
image in every n_wa_pattern-th layer and within windows of 112 pixels in the others (the
blocks are permuted window by window, and a block-diagonal mask keeps each window to
itself); the post-LN and the merger MLP (mm.0, GELU, mm.2) turn each 2 x 2 block into one
token, returned in raster order. The text model reads the image between <|vision_start|>
and <|vision_end|> at M-RoPE positions: the image's first position for t, the token's row
and column (from it) for h and w.

qwen2vl_merger (Qwen2-VL) is the same graph with layer norms and no windows.

qwen3vl_merger (Qwen3-VL; models/qwen3vl.cpp): the same patches with a patch bias and learned
position embeddings (an n x n grid resized bilinearly, corners aligned, to the image's), layer
norms, fused QKV, plain GELU FFNs and no windows. DeepStack: some layers' outputs also go
through their own merger (norm, fc1, GELU, fc2), and each token's embedding is the main
merger's followed by theirs, which the text model adds after its first layers.
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
from llm.mtmd.image import ResizeAlgo, calc_size_preserved_ratio, resize

MERGE = 2                   # clip.cpp's qwen graphs merge 2 x 2 patches (merge_ratio); no other spatial_merge_size
ATTN_WINDOW_SIZE = 112      # pixels; clip.cpp's default, Qwen2.5-VL's mmproj files carry none
ROPE_THETA = 10000.0
QWEN25VL_NAME = "qwen2.5vl_merger"


def load_qwen2vl(model: ClipModel) -> int:
    """qwen2vl_merger and qwen2.5vl_merger: the window pattern is Qwen2.5-VL's (required there);
    Qwen2-VL attends over the whole image in every layer (clip.cpp gives it no window inputs)."""
    hp = model.hparams
    merge = model.kv.get(ClipKV.SPATIAL_MERGE_SIZE.key(), MERGE)
    if merge != MERGE:
        raise ModelLoadError(f"{model.path}: '{ClipKV.SPATIAL_MERGE_SIZE.key()}' = {merge}; the qwen2vl graph "
                             f"merges {MERGE} x {MERGE} patches")
    hp.n_merge = MERGE
    windows = hp.projector == QWEN25VL_NAME
    pattern = model.kv.get(ClipKV.WIN_ATTN_PATTERN.key(), None if windows else 0)
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 0:
        raise ModelLoadError(f"{model.path}: {hp.projector} needs '{ClipKV.WIN_ATTN_PATTERN.key()}' (an integer "
                             f">= 0), got {pattern!r}")
    if pattern and not windows:
        raise ModelLoadError(f"{model.path}: '{ClipKV.WIN_ATTN_PATTERN.key()}' = {pattern}: {hp.projector} has no "
                             f"windowed attention")
    if pattern and ATTN_WINDOW_SIZE // hp.patch_size // MERGE == 0:
        raise ModelLoadError(f"{model.path}: patches of {hp.patch_size} pixels are too large for windows of "
                             f"{ATTN_WINDOW_SIZE}")
    hp.n_wa_pattern = pattern
    # set_limit_image_tokens(8, 4096)
    area = hp.patch_size * hp.patch_size * MERGE * MERGE
    hp.image_min_pixels, hp.image_max_pixels = 8 * area, 4096 * area
    if hp.d_head % 4:
        raise ModelLoadError(f"{model.path}: the vision rope splits a head in 4 sections; head_dim is {hp.d_head}")
    load_vit_layers(model)
    for il, layer in enumerate(model.layers):
        for t, b in ((ClipTensor.ATTN_Q, layer.q_b), (ClipTensor.ATTN_K, layer.k_b), (ClipTensor.ATTN_V, layer.v_b)):
            if b is None:
                raise ModelLoadError(f"{model.path}: missing tensor '{ctn(t, 'bias', il)}'")
    for name in (ctn(ClipTensor.PATCH_EMBD), ctn(ClipTensor.PATCH_EMBD_1)):
        check_shape(model, model.need(name), (hp.patch_size, hp.patch_size, 3, hp.n_embd))
    for name in (ctn(ClipTensor.PATCH_BIAS, "bias"), ctn(ClipTensor.CLASS_EMBD, "")):
        if model.get(name, False) is not None:
            raise ModelLoadError(f"{model.path}: a qwen2vl encoder has no '{name}'")
    check_shape(model, model.get(ctn(ClipTensor.LN_POST), False), (hp.n_embd,))
    mm0 = model.need(ctn(ClipTensor.LLAVA_PROJ, "weight", 0))
    mm2 = model.need(ctn(ClipTensor.LLAVA_PROJ, "weight", 2))
    check_shape(model, mm0, (MERGE * MERGE * hp.n_embd, mm0.ne[1]))
    check_shape(model, model.need(ctn(ClipTensor.LLAVA_PROJ, "bias", 0)), (mm0.ne[1],))
    check_shape(model, mm2, (mm0.ne[1], hp.projection_dim))
    check_shape(model, model.need(ctn(ClipTensor.LLAVA_PROJ, "bias", 2)), (hp.projection_dim,))
    return hp.projection_dim


def grid_qwen2vl(hp: ClipHParams, nx: int, ny: int) -> tuple[int, int]:
    """The merged tokens per row and column of an nx x ny image (clip_n_output_tokens_x/_y)."""
    return nx // hp.patch_size // MERGE, ny // hp.patch_size // MERGE


def n_tokens_qwen2vl(hp: ClipHParams, nx: int, ny: int) -> int:
    gx, gy = grid_qwen2vl(hp, nx, ny)
    return gx * gy


def preprocess_dyn_size(model: ClipModel, proj: Projector, img: np.ndarray) -> Preprocessed:
    """mtmd_image_preprocessor_dyn_size: resized to multiples of patch_size * n_merge within
    [image_min_pixels, image_max_pixels], keeping the aspect ratio."""
    hp = model.hparams
    nx, ny = calc_size_preserved_ratio(img.shape[1], img.shape[0], align=hp.patch_size * hp.n_merge,
                                       min_pixels=hp.image_min_pixels, max_pixels=hp.image_max_pixels)
    return Preprocessed([resize(img, nx, ny, proj.resize_algo, proj.resize_pad, proj.pad_color)])


def window_index(hp: ClipHParams, gx: int, gy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """clip.cpp's window inputs for a grid of gx x gy merged tokens: window_idx (raster token ->
    its row in window order), inv_window_idx (the reverse) and window_mask [n_pos, n_pos] over
    the patches in window order (0 within a window, the lowest float elsewhere)."""
    grid_window = ATTN_WINDOW_SIZE // hp.patch_size // MERGE
    mpow = MERGE * MERGE
    idx = np.zeros(gx * gy, np.int32)
    inv = np.zeros(gx * gy, np.int32)
    mask = np.full((gx * gy * mpow, gx * gy * mpow), np.finfo(np.float32).min, np.float32)
    dst = 0
    for y in range(0, gy, grid_window):
        for x in range(0, gx, grid_window):
            dst0 = dst
            for yy in range(y, min(y + grid_window, gy)):
                for xx in range(x, min(x + grid_window, gx)):
                    idx[yy * gx + xx] = dst
                    inv[dst] = yy * gx + xx
                    dst += 1
            mask[dst0 * mpow:dst * mpow, dst0 * mpow:dst * mpow] = 0.0
    return idx, inv, mask


def patch_positions(gx: int, gy: int, idx: np.ndarray) -> np.ndarray:
    """int32 [4, n_pos]: each patch's (row, column, row, column), the patches in the graph's
    order (2 x 2 blocks, the blocks moved to their rows idx)."""
    by, bx, dy, dx = np.meshgrid(np.arange(gy), np.arange(gx), np.arange(MERGE), np.arange(MERGE), indexing="ij")
    row, col = (MERGE * by + dy).reshape(-1), (MERGE * bx + dx).reshape(-1)
    ptr = np.arange(row.size)
    remap = idx[ptr // (MERGE * MERGE)] * (MERGE * MERGE) + ptr % (MERGE * MERGE)
    pos = np.zeros((4, row.size), np.int32)
    pos[:, remap] = np.stack([row, col, row, col])
    return pos


def build_inp_temporal(g: ClipGraph) -> Tensor:
    """clip_graph_qwen2vl::build_inp_with_temporal_merge for a still image: both temporal
    kernels over the same frame -> [n_embd, n_patches] in raster order."""
    m = g.model
    return ops.add(g.conv_2d_patches(m.need(ctn(ClipTensor.PATCH_EMBD)), g.inp_raw),
                   g.conv_2d_patches(m.need(ctn(ClipTensor.PATCH_EMBD_1)), g.inp_raw))


def merge_order(g: ClipGraph, cur: Tensor) -> Tensor:
    """[n_embd, n_patches] in raster order -> each 2 x 2 block of patches consecutive (row by
    row within it), the blocks in raster order."""
    gx, gy = g.n_patches_x // MERGE, g.n_patches_y // MERGE
    cur = ops.cont(ops.permute(ops.reshape_4d(cur, g.n_embd * MERGE, gx, MERGE, gy), 0, 2, 1, 3))
    return ops.reshape_2d(cur, g.n_embd, g.n_patches)


def vision_rope(g: ClipGraph, cur: Tensor, positions: Tensor) -> Tensor:
    """The 2-D rope of a head of d_head: rope_multi in vision mode, 4 sections of d_head / 4."""
    return ops.rope_multi(cur, positions, None, n_dims=g.d_head // 2, sections=(g.d_head // 4,) * 4,
                          mode=ops.ROPE_TYPE_VISION, n_ctx_orig=32768, freq_base=ROPE_THETA, freq_scale=1.0,
                          ext_factor=0.0, attn_factor=1.0, beta_fast=32.0, beta_slow=1.0)


def build_qwen2vl(g: ClipGraph) -> Tensor:
    m, hp = g.model, g.hparams
    n_embd, px, py, n_pos = g.n_embd, g.n_patches_x, g.n_patches_y, g.n_patches
    if px % MERGE or py % MERGE:
        raise ValueError(f"qwen2vl: an image of {g.nx}x{g.ny} is not whole {MERGE}x{MERGE} blocks of patches")
    gx, gy = px // MERGE, py // MERGE
    use_window = hp.n_wa_pattern > 0
    rms = hp.projector == QWEN25VL_NAME          # Qwen2-VL's are layer norms

    inpL = ops.reshape_3d(merge_order(g, build_inp_temporal(g)), n_embd, n_pos, 1)

    positions = new_input(GGMLType.I32, (4 * n_pos,), "positions")
    idx = np.arange(gx * gy, dtype=np.int32)
    pre_w = m.get(ctn(ClipTensor.LN_PRE), False)
    if pre_w is not None:
        inpL = g.build_norm(inpL, pre_w, m.get(ctn(ClipTensor.LN_PRE, "bias"), False), rms, -1)
    window_mask: Tensor | None = None
    if use_window:
        idx, inv, mask = window_index(hp, gx, gy)
        inv_window_idx = new_input(GGMLType.I32, (gx * gy,), "inv_window_idx")
        window_mask = new_input(GGMLType.F32, (n_pos, n_pos), "window_mask")
        g.inputs[inv_window_idx], g.inputs[window_mask] = inv, mask
        inpL = ops.get_rows(ops.reshape_2d(inpL, n_embd * MERGE * MERGE, gx * gy), inv_window_idx)
        inpL = ops.reshape_3d(inpL, n_embd, n_pos, 1)
    g.inputs[positions] = patch_positions(gx, gy, idx)

    for il, layer in enumerate(m.layers):
        full_attn = not use_window or (il + 1) % hp.n_wa_pattern == 0
        cur = g.cb(g.build_norm(inpL, layer.ln_1_w, layer.ln_1_b, rms, il), "ln1", il)
        assert layer.q_b is not None and layer.k_b is not None and layer.v_b is not None    # load_qwen2vl
        q = ops.add(ops.mul_mat(layer.q_w, cur), layer.q_b)
        k = ops.add(ops.mul_mat(layer.k_w, cur), layer.k_b)
        v = ops.add(ops.mul_mat(layer.v_w, cur), layer.v_b)
        q = g.cb(ops.reshape_3d(q, g.d_head, g.n_head, n_pos), "Qcur", il)
        k = g.cb(ops.reshape_3d(k, g.d_head, g.n_head, n_pos), "Kcur", il)
        v = g.cb(ops.reshape_3d(v, g.d_head, g.n_head, n_pos), "Vcur", il)
        q = g.cb(vision_rope(g, q, positions), "Qcur_rope", il)
        k = g.cb(vision_rope(g, k, positions), "Kcur_rope", il)
        cur = g.build_attn(layer.o_w, layer.o_b, q, k, v, il, kq_mask=None if full_attn else window_mask)
        cur = g.cb(cur, "attn_out", il)
        cur = ops.add(cur, inpL)
        inpL = g.cb(cur, "ffn_inp", il)
        cur = g.cb(g.build_norm(cur, layer.ln_2_w, layer.ln_2_b, rms, il), "ffn_inp_normed", il)
        cur = g.build_ffn(cur, layer.ff_up_w, layer.ff_up_b, layer.ff_gate_w, layer.ff_gate_b,
                          layer.ff_down_w, layer.ff_down_b, hp.ffn_op, il)
        cur = g.cb(cur, "ffn_out", il)
        inpL = g.cb(ops.add(inpL, cur), "layer_out", il)
    post_w = m.get(ctn(ClipTensor.LN_POST), False)
    if post_w is not None:
        inpL = g.build_norm(inpL, post_w, m.get(ctn(ClipTensor.LN_POST, "bias"), False), rms, hp.n_layer)

    # the merger: each 2 x 2 block one token
    cur = ops.reshape_3d(inpL, n_embd * MERGE * MERGE, gx * gy, 1)
    def mm(s: str, il: int) -> Tensor:
        return m.need(ctn(ClipTensor.LLAVA_PROJ, s, il))
    cur = g.build_ffn(cur, mm("weight", 0), mm("bias", 0), None, None, mm("weight", 2), mm("bias", 2), FfnOp.GELU, -1)
    if use_window:
        window_idx = new_input(GGMLType.I32, (gx * gy,), "window_idx")
        g.inputs[window_idx] = idx
        cur = ops.get_rows(ops.reshape_2d(cur, hp.projection_dim, gx * gy), window_idx)
    return ops.reshape_2d(cur, hp.projection_dim, gx * gy)


QWEN2VL = Projector(name="qwen2vl_merger", text_archs=frozenset({"qwen2vl"}), load=load_qwen2vl,
                    build=build_qwen2vl, n_output_tokens=n_tokens_qwen2vl, n_output_grid=grid_qwen2vl,
                    resize_algo=ResizeAlgo.BICUBIC, preprocess=preprocess_dyn_size,
                    img_beg="<|vision_start|>", img_end="<|vision_end|>")
QWEN25VL = Projector(name=QWEN25VL_NAME, text_archs=frozenset({"qwen2vl"}), load=load_qwen2vl,
                     build=build_qwen2vl, n_output_tokens=n_tokens_qwen2vl, n_output_grid=grid_qwen2vl,
                     resize_algo=ResizeAlgo.BICUBIC, preprocess=preprocess_dyn_size,
                     img_beg="<|vision_start|>", img_end="<|vision_end|>")


def deepstack_layers(model: ClipModel) -> list[int]:
    """The layers with a DeepStack merger (clip_layer::has_deepstack), in order."""
    return [il for il in range(model.hparams.n_layer)
            if model.get(ctn(ClipTensor.DEEPSTACK_FC1, "weight", il), False) is not None]


def load_qwen3vl(model: ClipModel) -> int:
    hp = model.hparams
    merge = model.kv.get(ClipKV.SPATIAL_MERGE_SIZE.key(), MERGE)
    if merge != MERGE:
        raise ModelLoadError(f"{model.path}: '{ClipKV.SPATIAL_MERGE_SIZE.key()}' = {merge}; the qwen3vl graph "
                             f"merges {MERGE} x {MERGE} patches")
    hp.n_merge = MERGE
    area = hp.patch_size * hp.patch_size * MERGE * MERGE
    hp.image_min_pixels, hp.image_max_pixels = 8 * area, 4096 * area
    if hp.d_head % 4:
        raise ModelLoadError(f"{model.path}: the vision rope splits a head in 4 sections; head_dim is {hp.d_head}")
    n_embd, n_ff = hp.n_embd, hp.n_ff
    for name in (ctn(ClipTensor.PATCH_EMBD), ctn(ClipTensor.PATCH_EMBD_1)):
        check_shape(model, model.need(name), (hp.patch_size, hp.patch_size, 3, n_embd))
    check_shape(model, model.need(ctn(ClipTensor.PATCH_BIAS, "bias")), (n_embd,))
    pos = model.need(ctn(ClipTensor.POS_EMBD))
    side = math.isqrt(pos.ne[1])
    if pos.ne[0] != n_embd or side * side != pos.ne[1]:
        raise ModelLoadError(f"{model.path}: '{pos.name}' must be [{n_embd}, n * n] (a square grid), got "
                             f"{list(pos.ne[:2])}")
    shapes = {ClipTensor.LN_1: (n_embd,), ClipTensor.LN_2: (n_embd,), ClipTensor.ATTN_QKV: (n_embd, 3 * n_embd),
              ClipTensor.ATTN_OUTPUT: (n_embd, n_embd), ClipTensor.FFN_UP: (n_embd, n_ff),
              ClipTensor.FFN_DOWN: (n_ff, n_embd)}
    for il in range(hp.n_layer):
        for t, ne in shapes.items():
            check_shape(model, model.need(ctn(t, "weight", il)), ne)
            check_shape(model, model.need(ctn(t, "bias", il)), (ne[-1],))
        check_shape(model, model.get(ctn(ClipTensor.FFN_GATE, "weight", il), False), (n_embd, n_ff))
    n_in = MERGE * MERGE * n_embd
    for il in deepstack_layers(model):
        check_shape(model, model.need(ctn(ClipTensor.DEEPSTACK_NORM, "weight", il)), (n_in,))
        check_shape(model, model.need(ctn(ClipTensor.DEEPSTACK_NORM, "bias", il)), (n_in,))
        fc1 = model.need(ctn(ClipTensor.DEEPSTACK_FC1, "weight", il))
        check_shape(model, fc1, (n_in, fc1.ne[1]))
        check_shape(model, model.need(ctn(ClipTensor.DEEPSTACK_FC1, "bias", il)), (fc1.ne[1],))
        check_shape(model, model.need(ctn(ClipTensor.DEEPSTACK_FC2, "weight", il)), (fc1.ne[1], hp.projection_dim))
        check_shape(model, model.need(ctn(ClipTensor.DEEPSTACK_FC2, "bias", il)), (hp.projection_dim,))
    check_shape(model, model.get(ctn(ClipTensor.LN_POST), False), (n_embd,))
    mm0 = model.need(ctn(ClipTensor.LLAVA_PROJ, "weight", 0))
    check_shape(model, mm0, (n_in, mm0.ne[1]))
    check_shape(model, model.need(ctn(ClipTensor.LLAVA_PROJ, "bias", 0)), (mm0.ne[1],))
    check_shape(model, model.need(ctn(ClipTensor.LLAVA_PROJ, "weight", 2)), (mm0.ne[1], hp.projection_dim))
    check_shape(model, model.need(ctn(ClipTensor.LLAVA_PROJ, "bias", 2)), (hp.projection_dim,))
    return hp.projection_dim * (1 + len(deepstack_layers(model)))


def bilinear_taps(side: int, nx: int, ny: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml_interpolate(BILINEAR | ALIGN_CORNERS) of a side x side grid to nx x ny as its
    four taps per output cell (raster order): the source rows (y0 x0, y0 x1, y1 x0, y1 x1)
    int32 [4, nx ny] and their weights float32 [4, 1, nx ny], in float32 as ggml-cpu."""
    def axis(n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        sf = np.float32(n_out - 1) / np.float32(side - 1) if n_out > 1 and side > 1 else \
            np.float32(n_out) / np.float32(side)
        v = np.arange(n_out, dtype=np.float32) / sf
        v0 = np.floor(v).astype(np.int64)
        lo, hi = np.clip(v0, 0, side - 1), np.clip(v0 + 1, 0, side - 1)
        return lo, hi, np.clip(v - lo.astype(np.float32), np.float32(0), np.float32(1))
    x0, x1, dx = axis(nx)
    y0, y1, dy = axis(ny)
    one = np.float32(1)
    idx = [np.add.outer(y * side, x).reshape(-1) for y, x in ((y0, x0), (y0, x1), (y1, x0), (y1, x1))]
    wts = [np.outer(wy, wx).reshape(-1) for wy, wx in ((one - dy, one - dx), (one - dy, dx), (dy, one - dx), (dy, dx))]
    return np.stack(idx).astype(np.int32), np.stack(wts).astype(np.float32)[:, None, :]


def build_pos_embd(g: ClipGraph) -> Tensor:
    """clip_graph::resize_position_embeddings: the learned grid as it is when the image's patch
    grid is that size, else resized to it -> [n_embd, n_patches] in raster order."""
    pe = g.model.need(ctn(ClipTensor.POS_EMBD))
    side = math.isqrt(pe.ne[1])
    px, py = g.n_patches_x, g.n_patches_y
    if (px, py) == (side, side):
        return pe
    idx, wts = bilinear_taps(side, px, py)
    out: Tensor | None = None
    for k in range(4):
        rows = new_input(GGMLType.I32, (px * py,), f"pos_embd_rows_{k}")
        weight = new_input(GGMLType.F32, (1, px * py), f"pos_embd_weights_{k}")
        g.inputs[rows], g.inputs[weight] = idx[k], wts[k]
        tap = ops.mul(ops.get_rows(pe, rows), weight)
        out = tap if out is None else ops.add(out, tap)
    assert out is not None
    return out


def build_qwen3vl(g: ClipGraph) -> Tensor:
    m, hp = g.model, g.hparams
    n_embd, px, py, n_pos = g.n_embd, g.n_patches_x, g.n_patches_y, g.n_patches
    if px % MERGE or py % MERGE:
        raise ValueError(f"qwen3vl: an image of {g.nx}x{g.ny} is not whole {MERGE}x{MERGE} blocks of patches")
    gx, gy = px // MERGE, py // MERGE

    def w(t: ClipTensor, il: int = -1, s: str = "weight") -> Tensor:
        return m.need(ctn(t, s, il))

    inp = merge_order(g, build_inp_temporal(g))
    inp = g.cb(ops.add(inp, w(ClipTensor.PATCH_BIAS, s="bias")), "patch_bias")
    inpL = g.cb(ops.add(inp, merge_order(g, build_pos_embd(g))), "inp_pos_emb")
    positions = new_input(GGMLType.I32, (4 * n_pos,), "positions")
    g.inputs[positions] = patch_positions(gx, gy, np.arange(gx * gy, dtype=np.int32))
    pre_w = m.get(ctn(ClipTensor.LN_PRE), False)
    if pre_w is not None:
        inpL = g.build_norm(inpL, pre_w, m.get(ctn(ClipTensor.LN_PRE, "bias"), False), False, -1)

    deepstack: Tensor | None = None
    ds_layers = deepstack_layers(m)
    view = n_embd * inpL.nb[0]          # one of Q, K, V in a row of the fused product
    for il in range(hp.n_layer):
        cur = g.cb(g.build_norm(inpL, w(ClipTensor.LN_1, il), w(ClipTensor.LN_1, il, "bias"), False, il), "ln1", il)
        cur = ops.add(ops.mul_mat(w(ClipTensor.ATTN_QKV, il), cur), w(ClipTensor.ATTN_QKV, il, "bias"))
        q, k, v = (ops.view_3d(cur, g.d_head, g.n_head, n_pos, g.d_head * cur.nb[0], cur.nb[1], j * view)
                   for j in range(3))
        q, k, v = g.cb(q, "Qcur", il), g.cb(k, "Kcur", il), g.cb(v, "Vcur", il)
        q = g.cb(vision_rope(g, q, positions), "Qcur_rope", il)
        k = g.cb(vision_rope(g, k, positions), "Kcur_rope", il)
        cur = g.cb(g.build_attn(w(ClipTensor.ATTN_OUTPUT, il), w(ClipTensor.ATTN_OUTPUT, il, "bias"), q, k, v, il),
                   "attn_out", il)
        cur = ops.add(cur, inpL)
        inpL = g.cb(cur, "ffn_inp", il)
        cur = g.cb(g.build_norm(cur, w(ClipTensor.LN_2, il), w(ClipTensor.LN_2, il, "bias"), False, il),
                   "ffn_inp_normed", il)
        gate = m.get(ctn(ClipTensor.FFN_GATE, "weight", il), False)
        gate_b = m.get(ctn(ClipTensor.FFN_GATE, "bias", il), False)
        cur = g.build_ffn(cur, w(ClipTensor.FFN_UP, il), w(ClipTensor.FFN_UP, il, "bias"), gate, gate_b,
                          w(ClipTensor.FFN_DOWN, il), w(ClipTensor.FFN_DOWN, il, "bias"), hp.ffn_op, il)
        cur = g.cb(cur, "ffn_out", il)
        cur = g.cb(ops.add(inpL, cur), "layer_out", il)
        if il in ds_layers:
            feat = ops.reshape_3d(cur, n_embd * MERGE * MERGE, gx * gy, 1)
            feat = g.build_norm(feat, w(ClipTensor.DEEPSTACK_NORM, il), w(ClipTensor.DEEPSTACK_NORM, il, "bias"),
                                False, il)
            feat = g.build_ffn(feat, w(ClipTensor.DEEPSTACK_FC1, il), w(ClipTensor.DEEPSTACK_FC1, il, "bias"), None,
                               None, w(ClipTensor.DEEPSTACK_FC2, il), w(ClipTensor.DEEPSTACK_FC2, il, "bias"),
                               FfnOp.GELU, il)
            deepstack = feat if deepstack is None else ops.concat(deepstack, feat, 0)
        inpL = cur
    post_w = m.get(ctn(ClipTensor.LN_POST), False)
    if post_w is not None:
        inpL = g.build_norm(inpL, post_w, m.get(ctn(ClipTensor.LN_POST, "bias"), False), False, hp.n_layer)

    cur = ops.reshape_3d(inpL, n_embd * MERGE * MERGE, gx * gy, 1)
    cur = g.build_ffn(cur, w(ClipTensor.LLAVA_PROJ, 0), w(ClipTensor.LLAVA_PROJ, 0, "bias"), None, None,
                      w(ClipTensor.LLAVA_PROJ, 2), w(ClipTensor.LLAVA_PROJ, 2, "bias"), FfnOp.GELU, -1)
    if deepstack is not None:
        cur = ops.concat(cur, deepstack, 0)
    return ops.reshape_2d(cur, cur.ne[0], gx * gy)


QWEN3VL = Projector(name="qwen3vl_merger", text_archs=frozenset({"qwen3vl", "qwen3vlmoe"}), load=load_qwen3vl,
                    build=build_qwen3vl, n_output_tokens=n_tokens_qwen2vl, n_output_grid=grid_qwen2vl,
                    resize_algo=ResizeAlgo.BICUBIC, preprocess=preprocess_dyn_size,
                    img_beg="<|vision_start|>", img_end="<|vision_end|>")

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
"""
from __future__ import annotations

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

MERGE = 2                   # clip.cpp merges 2 x 2 patches (merge_ratio) whatever spatial_merge_size says
ATTN_WINDOW_SIZE = 112      # pixels; clip.cpp's default, Qwen2.5-VL's mmproj files carry none
ROPE_THETA = 10000.0


def load_qwen25vl(model: ClipModel) -> int:
    hp = model.hparams
    merge = model.kv.get(ClipKV.SPATIAL_MERGE_SIZE.key(), MERGE)
    if merge != MERGE:
        raise ModelLoadError(f"{model.path}: '{ClipKV.SPATIAL_MERGE_SIZE.key()}' = {merge}; the qwen2vl graph "
                             f"merges {MERGE} x {MERGE} patches")
    hp.n_merge = MERGE
    pattern = model.kv.get(ClipKV.WIN_ATTN_PATTERN.key())
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 0:
        raise ModelLoadError(f"{model.path}: qwen2.5vl_merger needs '{ClipKV.WIN_ATTN_PATTERN.key()}' (an integer "
                             f">= 0), got {pattern!r}")
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


def build_qwen2vl(g: ClipGraph) -> Tensor:
    m, hp = g.model, g.hparams
    n_embd, px, py, n_pos = g.n_embd, g.n_patches_x, g.n_patches_y, g.n_patches
    if px % MERGE or py % MERGE:
        raise ValueError(f"qwen2vl: an image of {g.nx}x{g.ny} is not whole {MERGE}x{MERGE} blocks of patches")
    gx, gy = px // MERGE, py // MERGE
    use_window = hp.n_wa_pattern > 0

    # both temporal kernels over the same frame, then each 2 x 2 block of patches consecutive
    inp = ops.add(g.conv_2d_patches(m.need(ctn(ClipTensor.PATCH_EMBD)), g.inp_raw),
                  g.conv_2d_patches(m.need(ctn(ClipTensor.PATCH_EMBD_1)), g.inp_raw))
    inp = ops.cont(ops.permute(ops.reshape_4d(inp, n_embd * MERGE, gx, MERGE, gy), 0, 2, 1, 3))
    inpL = ops.reshape_3d(inp, n_embd, n_pos, 1)

    positions = new_input(GGMLType.I32, (4 * n_pos,), "positions")
    idx = np.arange(gx * gy, dtype=np.int32)
    pre_w = m.get(ctn(ClipTensor.LN_PRE), False)
    if pre_w is not None:
        inpL = g.build_norm(inpL, pre_w, m.get(ctn(ClipTensor.LN_PRE, "bias"), False), True, -1)
    window_mask: Tensor | None = None
    if use_window:
        idx, inv, mask = window_index(hp, gx, gy)
        inv_window_idx = new_input(GGMLType.I32, (gx * gy,), "inv_window_idx")
        window_mask = new_input(GGMLType.F32, (n_pos, n_pos), "window_mask")
        g.inputs[inv_window_idx], g.inputs[window_mask] = inv, mask
        inpL = ops.get_rows(ops.reshape_2d(inpL, n_embd * MERGE * MERGE, gx * gy), inv_window_idx)
        inpL = ops.reshape_3d(inpL, n_embd, n_pos, 1)
    g.inputs[positions] = patch_positions(gx, gy, idx)

    def rope(cur: Tensor) -> Tensor:
        return ops.rope_multi(cur, positions, None, n_dims=g.d_head // 2, sections=(hp.d_head // 4,) * 4,
                              mode=ops.ROPE_TYPE_VISION, n_ctx_orig=32768, freq_base=ROPE_THETA, freq_scale=1.0,
                              ext_factor=0.0, attn_factor=1.0, beta_fast=32.0, beta_slow=1.0)

    for il, layer in enumerate(m.layers):
        full_attn = not use_window or (il + 1) % hp.n_wa_pattern == 0
        cur = g.cb(g.build_norm(inpL, layer.ln_1_w, layer.ln_1_b, True, il), "ln1", il)
        assert layer.q_b is not None and layer.k_b is not None and layer.v_b is not None    # load_qwen25vl
        q = ops.add(ops.mul_mat(layer.q_w, cur), layer.q_b)
        k = ops.add(ops.mul_mat(layer.k_w, cur), layer.k_b)
        v = ops.add(ops.mul_mat(layer.v_w, cur), layer.v_b)
        q = g.cb(ops.reshape_3d(q, g.d_head, g.n_head, n_pos), "Qcur", il)
        k = g.cb(ops.reshape_3d(k, g.d_head, g.n_head, n_pos), "Kcur", il)
        v = g.cb(ops.reshape_3d(v, g.d_head, g.n_head, n_pos), "Vcur", il)
        q = g.cb(rope(q), "Qcur_rope", il)
        k = g.cb(rope(k), "Kcur_rope", il)
        cur = g.build_attn(layer.o_w, layer.o_b, q, k, v, il, kq_mask=None if full_attn else window_mask)
        cur = g.cb(cur, "attn_out", il)
        cur = ops.add(cur, inpL)
        inpL = g.cb(cur, "ffn_inp", il)
        cur = g.cb(g.build_norm(cur, layer.ln_2_w, layer.ln_2_b, True, il), "ffn_inp_normed", il)
        cur = g.build_ffn(cur, layer.ff_up_w, layer.ff_up_b, layer.ff_gate_w, layer.ff_gate_b,
                          layer.ff_down_w, layer.ff_down_b, hp.ffn_op, il)
        cur = g.cb(cur, "ffn_out", il)
        inpL = g.cb(ops.add(inpL, cur), "layer_out", il)
    post_w = m.get(ctn(ClipTensor.LN_POST), False)
    if post_w is not None:
        inpL = g.build_norm(inpL, post_w, m.get(ctn(ClipTensor.LN_POST, "bias"), False), True, hp.n_layer)

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


QWEN25VL = Projector(name="qwen2.5vl_merger", text_archs=frozenset({"qwen2vl"}), load=load_qwen25vl,
                     build=build_qwen2vl, n_output_tokens=n_tokens_qwen2vl, n_output_grid=grid_qwen2vl,
                     resize_algo=ResizeAlgo.BICUBIC, preprocess=preprocess_dyn_size,
                     img_beg="<|vision_start|>", img_end="<|vision_end|>")

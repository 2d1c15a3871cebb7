"""Pixtral encoders: llama.cpp's tools/mtmd/models/pixtral.cpp (clip_graph_pixtral).

pixtral (Pixtral 12B, Mistral Small 3.x): the image is resized (bicubic, keeping its aspect
ratio) to multiples of patch_size * n_merge within 8 to 1024 merged tokens, so each size gets
its own graph. A ViT with RMS norms (a pre-LN, no learned positions), SiLU-gated FFNs and a
2-D rope (build_rope_2d: the first half of each head rotates at the patch's row, the second
half at its column with the odd frequencies) reads the patches; Mistral Small 3.1's patch
merger (when the file has it: an RMS norm, then each n_merge x n_merge block of patches
unfolded into one row and projected) shrinks the grid; a GELU MLP (mm.1, mm.2) projects to the
text width, and the [IMG_BREAK] embedding (v.token_embd.img_break) follows each row of tokens
but the last, inside the image's embeddings. The text model reads the image and then the
text [IMG_END].
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
    Projector,
    check_shape,
    ctn,
    load_vit_layers,
    positive_int,
)
from llm.mtmd.image import ResizeAlgo
from llm.mtmd.qwen2vl import preprocess_dyn_size

ROPE_THETA = 10000.0
MIN_TOKENS, MAX_TOKENS = 8, 1024        # clip.cpp's set_limit_image_tokens for pixtral


def load_pixtral(model: ClipModel) -> int:
    """The spatial merge is 1 unless the file says otherwise; the patch merger and its norm
    come together (Mistral Small 3.1) or not at all (Pixtral 12B)."""
    hp = model.hparams
    hp.n_merge = merge = positive_int(model, ClipKV.SPATIAL_MERGE_SIZE, 1)
    area = hp.patch_size * hp.patch_size * merge * merge
    hp.image_min_pixels, hp.image_max_pixels = MIN_TOKENS * area, MAX_TOKENS * area
    if hp.d_head % 4:
        raise ModelLoadError(f"{model.path}: the 2-D rope rotates pairs in each half of a head; head_dim is "
                             f"{hp.d_head}")
    load_vit_layers(model)
    n_embd = hp.n_embd
    check_shape(model, model.need(ctn(ClipTensor.PATCH_EMBD)), (hp.patch_size, hp.patch_size, 3, n_embd))
    check_shape(model, model.get(ctn(ClipTensor.PATCH_BIAS, "bias"), False), (n_embd,))
    for t in (ClipTensor.LN_PRE, ClipTensor.LN_POST):
        check_shape(model, model.get(ctn(t), False), (n_embd,))
    merger = model.get(ctn(ClipTensor.MM_PATCH_MERGER), False)
    norm = model.get(ctn(ClipTensor.MM_INP_NORM), False)
    if (merger is None) != (norm is None):
        raise ModelLoadError(f"{model.path}: '{ctn(ClipTensor.MM_PATCH_MERGER)}' and "
                             f"'{ctn(ClipTensor.MM_INP_NORM)}' come together")
    if merger is not None:
        check_shape(model, merger, (n_embd * merge * merge, n_embd))
        check_shape(model, norm, (n_embd,))
    elif merge > 1:
        raise ModelLoadError(f"{model.path}: '{ClipKV.SPATIAL_MERGE_SIZE.key()}' = {merge} needs the patch "
                             f"merger '{ctn(ClipTensor.MM_PATCH_MERGER)}'")
    mm1 = model.need(ctn(ClipTensor.LLAVA_PROJ, "weight", 1))
    mm2 = model.need(ctn(ClipTensor.LLAVA_PROJ, "weight", 2))
    check_shape(model, mm1, (n_embd, mm1.ne[1]))
    check_shape(model, model.get(ctn(ClipTensor.LLAVA_PROJ, "bias", 1), False), (mm1.ne[1],))
    check_shape(model, mm2, (mm1.ne[1], mm2.ne[1]))
    check_shape(model, model.get(ctn(ClipTensor.LLAVA_PROJ, "bias", 2), False), (mm2.ne[1],))
    check_shape(model, model.need(ctn(ClipTensor.TOK_IMG_BREAK)), (mm2.ne[1],))
    return mm2.ne[1]


def n_tokens_pixtral(hp: ClipHParams, nx: int, ny: int) -> int:
    """The merged tokens and one [IMG_BREAK] after each row but the last."""
    gx, gy = nx // hp.patch_size // hp.n_merge, ny // hp.patch_size // hp.n_merge
    return gx * gy + gy - 1


def patch_merger(g: ClipGraph, cur: Tensor) -> Tensor:
    """Mistral Small 3.1's merger: RMS norm, each n x n block of patches unfolded (ggml_im2col
    with a dummy kernel: a row of n_embd x n x n, the block's x fastest, then its y, then the
    channel), then mm.patch_merger -> [n_embd, blocks]."""
    m, n = g.model, g.hparams.n_merge
    n_embd, px, py = g.n_embd, g.n_patches_x, g.n_patches_y
    gx, gy = px // n, py // n
    cur = ops.mul(ops.rms_norm(cur, g.eps), m.need(ctn(ClipTensor.MM_INP_NORM)))
    cur = ops.cont(ops.permute(ops.reshape_4d(cur, n_embd * n, gx, n, gy), 0, 2, 1, 3))    # [c kx, ky, ox, oy]
    cur = ops.cont(ops.permute(ops.reshape_3d(cur, n_embd, n * n, gx * gy), 1, 0, 2, 3))   # [kx ky, c, blocks]
    cur = ops.reshape_2d(cur, n * n * n_embd, gx * gy)
    return ops.mul_mat(m.need(ctn(ClipTensor.MM_PATCH_MERGER)), cur)


def build_pixtral(g: ClipGraph) -> Tensor:
    m, hp = g.model, g.hparams
    px, py, n_pos, n = g.n_patches_x, g.n_patches_y, g.n_patches, hp.n_merge
    if px % n or py % n:
        raise ValueError(f"pixtral: an image of {g.nx}x{g.ny} is not whole {n}x{n} blocks of patches")
    pos_h = new_input(GGMLType.I32, (n_pos,), "pos_h")
    pos_w = new_input(GGMLType.I32, (n_pos,), "pos_w")
    g.inputs[pos_h] = (np.arange(n_pos) // px).astype(np.int32)
    g.inputs[pos_w] = (np.arange(n_pos) % px).astype(np.int32)

    cur = g.build_vit(g.build_inp(), n_pos, None, rms=True,
                      add_pos=lambda x, _: g.build_rope_2d(x, pos_h, pos_w, ROPE_THETA, interleave_freq=True))
    cur = ops.reshape_2d(cur, g.n_embd, n_pos)
    if m.get(ctn(ClipTensor.MM_PATCH_MERGER), False) is not None:
        cur = patch_merger(g, cur)
    cur = g.build_ffn(cur, m.need(ctn(ClipTensor.LLAVA_PROJ, "weight", 1)),
                      m.get(ctn(ClipTensor.LLAVA_PROJ, "bias", 1), False), None, None,
                      m.need(ctn(ClipTensor.LLAVA_PROJ, "weight", 2)),
                      m.get(ctn(ClipTensor.LLAVA_PROJ, "bias", 2), False), FfnOp.GELU, -1)

    # [IMG_BREAK] after each row of tokens: rows [n_embd_text, gx + 1, gy], the last break dropped
    gx, gy = px // n, py // n
    n_text = cur.ne[0]
    brk = ops.repeat_4d(ops.reshape_4d(m.need(ctn(ClipTensor.TOK_IMG_BREAK)), n_text, 1, 1, 1), n_text, 1, gy, 1)
    rows = ops.concat(ops.reshape_3d(cur, n_text, gx, gy), brk, 1)
    return ops.cont(ops.view_2d(rows, n_text, gx * gy + gy - 1, rows.nb[1], 0))


PIXTRAL = Projector(name="pixtral", text_archs=frozenset({"llama", "mistral3"}), load=load_pixtral,
                    build=build_pixtral, n_output_tokens=n_tokens_pixtral, resize_algo=ResizeAlgo.BICUBIC,
                    preprocess=preprocess_dyn_size, img_end="[IMG_END]")

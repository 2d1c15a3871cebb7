"""SigLIP encoders: llama.cpp's tools/mtmd/models/siglip.cpp (clip_graph_siglip).

gemma3 (Gemma 3 4B and up): a SigLIP ViT over the image's patches (learned position
embeddings, layer norms, GELU FFN, post-LN), then the patch grid average-pooled by n_merge
per side (4: 64 x 64 patches -> 256 tokens), RMS-normed with the soft-embedding norm and
projected to the text model's width by mm.input_projection. The image is resized to
image_size x image_size bilinearly (padded to keep its aspect ratio), and the text model
reads it between <start_of_image> and <end_of_image> with non-causal attention.

idefics3 (SmolVLM): the same ViT per tile, then pixel shuffle (each n_merge x n_merge block
of patches concatenated into one token) and one projection (mm.model.fc). The image is
resized (Lanczos) so its longer side is preproc_image_size, then up to whole tiles of
image_size, cut into tiles, plus an overview of the whole at one tile; slices come row by
row as <fake_token_around_image><row_R_col_C> slice, then "\n\n"
<fake_token_around_image><global-img> overview <fake_token_around_image>.
"""
from __future__ import annotations

import numpy as np

from ggmlx import ops
from ggmlx.tensor import Tensor
from llm.errors import ModelLoadError
from llm.mtmd.clip import (
    ClipGraph,
    ClipHParams,
    ClipKV,
    ClipModel,
    ClipTensor,
    Preprocessed,
    Projector,
    check_shape,
    ctn,
    load_vit_layers,
)
from llm.mtmd.image import PadStyle, ResizeAlgo, resize


def pool_2d_avg(cur: Tensor, k: int) -> Tensor:
    """ggml_pool_2d(cur [nx, ny, C], GGML_OP_POOL_AVG, k, k, stride k, no padding)
    -> [nx / k, ny / k, C]: each k x k block's sum divided by k * k, by reshapes (kx, ky
    gathered innermost) and sum_rows."""
    nx, ny, c = cur.ne[0], cur.ne[1], cur.ne[2]
    ox, oy = nx // k, ny // k
    x = ops.cont(ops.permute(ops.reshape_4d(cur, k, ox, k, oy * c), 0, 2, 1, 3))     # [kx, ky, ox, oy c]
    x = ops.sum_rows(ops.reshape_2d(x, k * k, ox * oy * c))
    return ops.reshape_3d(ops.scale(x, 1.0 / (k * k)), ox, oy, c)


def load_gemma3(model: ClipModel) -> int:
    hp = model.hparams
    kv_merge = model.kv.get(ClipKV.PROJ_SCALE_FACTOR.key())
    hp.n_merge = int(kv_merge) if kv_merge is not None else 4       # every Gemma 3 size: 4
    side = hp.n_patches_side
    if hp.n_merge <= 0 or side % hp.n_merge:
        raise ModelLoadError(f"{model.path}: {side} patches per side do not pool by {hp.n_merge}")
    load_vit_layers(model)
    check_shape(model, model.need(ctn(ClipTensor.PATCH_EMBD)), (hp.patch_size, hp.patch_size, 3, hp.n_embd))
    check_shape(model, model.need(ctn(ClipTensor.POS_EMBD)), (hp.n_embd, side * side))
    check_shape(model, model.get(ctn(ClipTensor.PATCH_BIAS, "bias"), False), (hp.n_embd,))
    check_shape(model, model.need(ctn(ClipTensor.MM_SOFT_EMB_N)), (hp.n_embd,))
    proj = model.need(ctn(ClipTensor.MM_INP_PROJ))
    if proj.ne[1] != hp.n_embd:
        raise ModelLoadError(f"{model.path}: '{proj.name}' reads {proj.ne[1]} values per token, the ViT gives "
                             f"{hp.n_embd}")
    return proj.ne[0]


def n_tokens_gemma3(hp: ClipHParams, nx: int, ny: int) -> int:
    return (nx // hp.patch_size) * (ny // hp.patch_size) // (hp.n_merge * hp.n_merge)


def build_gemma3(g: ClipGraph) -> Tensor:
    m, hp = g.model, g.hparams
    inp = g.build_inp()
    cur = g.build_vit(inp, g.n_patches, m.need(ctn(ClipTensor.POS_EMBD)))
    side = g.n_patches_x
    cur = ops.reshape_4d(ops.cont(ops.transpose(cur)), side, side, hp.n_embd, 1)
    cur = pool_2d_avg(cur, hp.n_merge)
    cur = ops.reshape_3d(cur, cur.ne[0] * cur.ne[1], hp.n_embd, 1)
    cur = ops.cont(ops.transpose(cur))
    cur = ops.mul(ops.rms_norm(cur, hp.eps), m.need(ctn(ClipTensor.MM_SOFT_EMB_N)))
    return ops.mul_mat(ops.cont(ops.transpose(m.need(ctn(ClipTensor.MM_INP_PROJ)))), cur)


GEMMA3 = Projector(name="gemma3", text_archs=frozenset({"gemma3"}), load=load_gemma3, build=build_gemma3,
                   n_output_tokens=n_tokens_gemma3, resize_algo=ResizeAlgo.BILINEAR,
                   img_beg="<start_of_image>", img_end="<end_of_image>", non_causal=True)


def patch_merge_permute(g: ClipGraph, cur: Tensor, scale: int) -> Tensor:
    """clip_graph::build_patch_merge_permute: [n_embd, w h] -> [n_embd scale^2, w h / scale^2],
    each scale x scale block of patches one token (the patch grid must divide by scale)."""
    n_embd = cur.ne[0]
    w, h = g.n_patches_x, g.n_patches_y
    cur = ops.reshape_3d(cur, n_embd, w, h)
    cur = ops.permute(ops.reshape_3d(cur, n_embd * scale, w // scale, h), 0, 2, 1, 3)        # unshuffle h
    cur = ops.reshape_3d(ops.cont(cur), n_embd * scale * scale, h // scale, w // scale)
    cur = ops.permute(cur, 0, 2, 1, 3)                                                      # unshuffle w
    return g.cb(ops.cont_2d(cur, cur.ne[0], cur.ne[1] * cur.ne[2]), "pixel_shuffle")


def load_idefics3(model: ClipModel) -> int:
    hp = model.hparams
    merge, longest = model.kv.get(ClipKV.PROJ_SCALE_FACTOR.key()), model.kv.get(ClipKV.PREPROC_IMAGE_SIZE.key())
    if merge is None or int(merge) <= 1:
        raise ModelLoadError(f"{model.path}: idefics3 needs '{ClipKV.PROJ_SCALE_FACTOR.key()}' > 1")
    if not longest:
        raise ModelLoadError(f"{model.path}: idefics3 without '{ClipKV.PREPROC_IMAGE_SIZE.key()}' (the "
                             f"llava-uhd slicing of old conversions) is not supported yet")
    hp.n_merge, hp.image_longest_edge = int(merge), int(longest)
    side = hp.n_patches_side
    if side % hp.n_merge:
        raise ModelLoadError(f"{model.path}: {side} patches per side do not merge by {hp.n_merge}")
    load_vit_layers(model)
    check_shape(model, model.need(ctn(ClipTensor.PATCH_EMBD)), (hp.patch_size, hp.patch_size, 3, hp.n_embd))
    check_shape(model, model.need(ctn(ClipTensor.POS_EMBD)), (hp.n_embd, side * side))
    fc = model.need(ctn(ClipTensor.MM_PROJECTOR))
    if fc.ne[0] != hp.n_embd * hp.n_merge ** 2:
        raise ModelLoadError(f"{model.path}: '{fc.name}' reads {fc.ne[0]} values per token; pixel shuffle "
                             f"gives {hp.n_embd * hp.n_merge ** 2}")
    return fc.ne[1]


def preprocess_idefics3(model: ClipModel, proj: Projector, img: np.ndarray) -> Preprocessed:
    """mtmd_image_preprocessor_idefics3 (with a preproc_image_size): resize to the longest
    edge (keeping the aspect ratio, the other side made even), up to whole tiles, crop."""
    hp = model.hparams
    tile, longest = hp.image_size, hp.image_longest_edge
    h0, w0 = img.shape[:2]
    aspect = w0 / h0
    if w0 >= h0:
        rw, rh = longest, int(longest / aspect)
        rh += rh % 2
    else:
        rw, rh = int(longest * aspect), longest
        rw += rw % 2
    gx, gy = (rw + tile - 1) // tile, (rh + tile - 1) // tile
    resized = resize(img, rw, rh, proj.resize_algo, PadStyle.NONE)
    refined = resize(resized, gx * tile, gy * tile, proj.resize_algo, PadStyle.NONE)
    overview = resize(refined, tile, tile, proj.resize_algo, PadStyle.NONE)
    slices = [np.ascontiguousarray(refined[y * tile:(y + 1) * tile, x * tile:(x + 1) * tile])
              for y in range(gy) for x in range(gx)]
    return Preprocessed(slices, gx, gy, overview)


def build_idefics3(g: ClipGraph) -> Tensor:
    m, hp = g.model, g.hparams
    cur = g.build_vit(g.build_inp(), g.n_patches, m.need(ctn(ClipTensor.POS_EMBD)))
    cur = patch_merge_permute(g, ops.reshape_2d(cur, hp.n_embd, g.n_patches), hp.n_merge)
    return ops.mul_mat(m.need(ctn(ClipTensor.MM_PROJECTOR)), cur)


IDEFICS3 = Projector(name="idefics3", text_archs=frozenset({"llama"}), load=load_idefics3, build=build_idefics3,
                     n_output_tokens=n_tokens_gemma3, resize_algo=ResizeAlgo.LANCZOS, preprocess=preprocess_idefics3,
                     tok_ov_img_start=("\n\n", "<fake_token_around_image>", "<global-img>"),
                     tok_ov_img_end=("<fake_token_around_image>",), tok_row_end=("\n",),
                     sli_img_start_tmpl="<fake_token_around_image><row_%d_col_%d>")

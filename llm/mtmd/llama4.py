"""Llama 4 encoders: llama.cpp's tools/mtmd/models/llama4.cpp (clip_graph_llama4).

llama4 (Llama 4 Scout / Maverick): one square tile of image_size at a time. The patches are
unfolded (ggml_im2col into F32 columns, not the F16 of ggml_conv_2d) and projected by the 2-D
patch matrix; a class embedding follows them, learned positions are added, and a ViT with layer
norms, GELU FFNs and a 2-D rope (build_rope_2d without interleaving: the first half of each head
at the patch's column, the second at its row, both from 1; the class row at 0) reads them. The
class row is dropped, pixel shuffle joins each scale_factor x scale_factor block (Llama 4's own
order: no second permute), and the adapter (mm.model.mlp.1, GELU, mm.model.mlp.2, GELU) and
mm.model.fc project to the text width. The image is cut as llava-uhd does with resolution
candidates of 1..3 x 1..3 tiles (not 1 x 1): the tiles row by row, then the overview; the text
model reads <|image_start|>, them, <|image_end|>, with no text between tiles in llama.cpp 0.3.36.
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
    Preprocessed,
    Projector,
    check_shape,
    ctn,
    load_vit_layers,
    positive_int,
)
from llm.mtmd.image import ResizeAlgo
from llm.mtmd.internvl import preprocess_pinpoints

ROPE_THETA = 10000.0
MAX_TILES_PER_SIDE = 3          # set_llava_uhd_res_candidates(model, 3)


def load_llama4(model: ClipModel) -> int:
    hp = model.hparams
    hp.n_merge = merge = positive_int(model, ClipKV.PROJ_SCALE_FACTOR, 1)
    side = hp.n_patches_side
    if side % merge:
        raise ModelLoadError(f"{model.path}: {side} patches per side do not shuffle by {merge}")
    if hp.d_head % 4:
        raise ModelLoadError(f"{model.path}: the 2-D rope rotates pairs in each half of a head; head_dim is "
                             f"{hp.d_head}")
    load_vit_layers(model)
    n_embd, p = hp.n_embd, hp.patch_size
    check_shape(model, model.need(ctn(ClipTensor.PATCH_EMBD)), (p * p * 3, n_embd))
    check_shape(model, model.need(ctn(ClipTensor.CLASS_EMBD, "")), (n_embd,))
    check_shape(model, model.need(ctn(ClipTensor.POS_EMBD)), (n_embd, side * side + 1))
    for t in (ClipTensor.LN_PRE, ClipTensor.LN_POST):
        check_shape(model, model.get(ctn(t), False), (n_embd,))
    mlp1 = model.need(ctn(ClipTensor.MVLM_PROJ_MLP, "weight", 1))
    mlp2 = model.need(ctn(ClipTensor.MVLM_PROJ_MLP, "weight", 2))
    fc = model.need(ctn(ClipTensor.MM_PROJECTOR))
    check_shape(model, mlp1, (n_embd * merge * merge, mlp1.ne[1]))
    check_shape(model, mlp2, (mlp1.ne[1], mlp2.ne[1]))
    check_shape(model, fc, (mlp2.ne[1], fc.ne[1]))
    return fc.ne[1]


def n_tokens_llama4(hp: ClipHParams, nx: int, ny: int) -> int:
    return (nx // hp.patch_size) * (ny // hp.patch_size) // (hp.n_merge * hp.n_merge)


def res_candidates(hp: ClipHParams) -> list[tuple[int, int]]:
    """set_llava_uhd_res_candidates: x x y tiles for x, y in 1..3 but 1 x 1, x the outer loop."""
    sz = hp.image_size
    return [(x * sz, y * sz) for x in range(1, MAX_TILES_PER_SIDE + 1) for y in range(1, MAX_TILES_PER_SIDE + 1)
            if (x, y) != (1, 1)]


def preprocess_llama4(model: ClipModel, proj: Projector, img: np.ndarray) -> Preprocessed:
    return preprocess_pinpoints(model.hparams, img, res_candidates(model.hparams))


def unfold_patches(g: ClipGraph) -> Tensor:
    """ggml_im2col of the image by patch_size with stride patch_size, F32 columns ->
    [p p 3, n_patches] (kx fastest, then ky, then the channel; patches in raster order)."""
    p, ox, oy = g.patch_size, g.n_patches_x, g.n_patches_y
    x = ops.cont(ops.permute(ops.reshape_4d(g.inp_raw, p, ox, p, oy * 3), 0, 2, 1, 3))   # [kx, ky, ox, oy c]
    x = ops.cont(ops.permute(ops.reshape_3d(x, p * p, ox * oy, 3), 0, 2, 1, 3))         # [kx ky, c, ox oy]
    return ops.reshape_2d(x, p * p * 3, ox * oy)


def build_llama4(g: ClipGraph) -> Tensor:
    m, hp = g.model, g.hparams
    n_embd, px, py, n_patches, s = g.n_embd, g.n_patches_x, g.n_patches_y, g.n_patches, hp.n_merge
    if px != py or px % s:
        raise ValueError(f"llama4: an image of {g.nx}x{g.ny} is not a square of whole {s}x{s} blocks of patches")
    n_pos = n_patches + 1
    pos_h = new_input(GGMLType.I32, (n_pos,), "pos_h")
    pos_w = new_input(GGMLType.I32, (n_pos,), "pos_w")
    g.inputs[pos_h] = np.append(np.arange(n_patches) // px + 1, 0).astype(np.int32)
    g.inputs[pos_w] = np.append(np.arange(n_patches) % px + 1, 0).astype(np.int32)

    inp = g.cb(ops.mul_mat(m.need(ctn(ClipTensor.PATCH_EMBD)), unfold_patches(g)), "patch_conv")
    inp = ops.concat(inp, ops.reshape_2d(m.need(ctn(ClipTensor.CLASS_EMBD, "")), n_embd, 1), 1)
    cur = g.build_vit(inp, n_pos, m.need(ctn(ClipTensor.POS_EMBD)),
                      add_pos=lambda x, _: g.build_rope_2d(x, pos_w, pos_h, ROPE_THETA, interleave_freq=False))
    cur = ops.cont(ops.view_2d(cur, n_embd, n_patches, cur.nb[1], 0))      # the class row dropped

    # pixel shuffle (Llama4VisionPixelShuffleMLP's order)
    cur = ops.cont(ops.permute(ops.reshape_4d(cur, n_embd * s, px // s, py, 1), 0, 2, 1, 3))
    cur = g.cb(ops.reshape_2d(cur, n_embd * s * s, n_patches // (s * s)), "pixel_shuffle")

    cur = ops.gelu(ops.mul_mat(m.need(ctn(ClipTensor.MVLM_PROJ_MLP, "weight", 1)), cur))
    cur = g.cb(ops.gelu(ops.mul_mat(m.need(ctn(ClipTensor.MVLM_PROJ_MLP, "weight", 2)), cur)), "adapter_mlp")
    return g.cb(ops.mul_mat(m.need(ctn(ClipTensor.MM_PROJECTOR)), cur), "projected")


LLAMA4 = Projector(name="llama4", text_archs=frozenset({"llama4"}), load=load_llama4, build=build_llama4,
                   n_output_tokens=n_tokens_llama4, resize_algo=ResizeAlgo.BILINEAR, preprocess=preprocess_llama4,
                   img_beg="<|image_start|>", img_end="<|image_end|>")

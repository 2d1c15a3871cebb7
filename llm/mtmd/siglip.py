"""SigLIP encoders: llama.cpp's tools/mtmd/models/siglip.cpp (clip_graph_siglip).

gemma3 (Gemma 3 4B and up): a SigLIP ViT over the image's patches (learned position
embeddings, layer norms, GELU FFN, post-LN), then the patch grid average-pooled by n_merge
per side (4: 64 x 64 patches -> 256 tokens), RMS-normed with the soft-embedding norm and
projected to the text model's width by mm.input_projection. The image is resized to
image_size x image_size bilinearly (padded to keep its aspect ratio), and the text model
reads it between <start_of_image> and <end_of_image> with non-causal attention.
"""
from __future__ import annotations

from ggmlx import ops
from ggmlx.tensor import Tensor
from llm.errors import ModelLoadError
from llm.mtmd.clip import (
    ClipGraph,
    ClipHParams,
    ClipKV,
    ClipModel,
    ClipTensor,
    Projector,
    check_shape,
    ctn,
    load_vit_layers,
)
from llm.mtmd.image import ResizeAlgo


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

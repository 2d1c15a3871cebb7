"""LLaVA encoders: llama.cpp's tools/mtmd/models/llava.cpp (clip_graph_llava).

mlp (LLaVA 1.5): a CLIP ViT with a class embedding (appended after the patches, as clip.cpp
concatenates it), learned positions, a pre-LN and quick-GELU layers, read at the layer
before the last; its patch rows (from index 1, clip.cpp's "patches" input) go through a
two-layer GELU MLP (mm.0, mm.2). The image is padded to a square on grey (122, 116, 104)
and resized bicubically to image_size; no text marks it in the prompt.

With clip.vision.image_grid_pinpoints (LLaVA 1.6) either is llava-uhd: the image resized
into the best pinpoint, cut into image_size tiles (row by row), then the overview, each its
own chunk with no text between, as mtmd.cpp 0.3.36 lays it out (v.image_newline is unused).

mlp_norm (Yi-VL's LLaVA): the same ViT and image; the MLP is mm.0, a layer norm (mm.1), GELU,
mm.3 and a second layer norm (mm.4), both at the ViT's epsilon. Its files say "mlp": clip.cpp
reads an "mlp" file holding mm.3 as mlp_norm (clip.load_model does the same).
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
    preprocess_fixed_size,
)
from llm.mtmd.image import ResizeAlgo
from llm.mtmd.internvl import preprocess_pinpoints


def load_vit_mlp(model: ClipModel) -> None:
    """The CLIP ViT both LLaVA projectors read, at the layer before the last."""
    hp = model.hparams
    load_vit_layers(model)
    n_patches = hp.n_patches_side ** 2
    cls = model.get(ctn(ClipTensor.CLASS_EMBD, ""), False)
    check_shape(model, cls, (hp.n_embd,))
    check_shape(model, model.need(ctn(ClipTensor.PATCH_EMBD)), (hp.patch_size, hp.patch_size, 3, hp.n_embd))
    check_shape(model, model.need(ctn(ClipTensor.POS_EMBD)), (hp.n_embd, n_patches + (cls is not None)))
    if hp.n_layer < 2:
        raise ModelLoadError(f"{model.path}: LLaVA reads the layer before the last; the ViT has {hp.n_layer}")
    res_candidates(model)


def preprocess_llava(model: ClipModel, proj: Projector, img: np.ndarray) -> Preprocessed:
    """mtmd's fixed-size preprocessor, or llava-uhd where the file has pinpoints (LLaVA 1.6)."""
    candidates = res_candidates(model)
    if not candidates:
        return preprocess_fixed_size(model, proj, img)
    return preprocess_pinpoints(model.hparams, img, candidates)


def res_candidates(model: ClipModel) -> list[tuple[int, int]]:
    """clip.vision.image_grid_pinpoints as (width, height) pairs; none without the key. Each
    must be whole tiles: clip.cpp's LLaVA graph asserts square tiles."""
    key, sz = ClipKV.IMAGE_GRID_PINPOINTS.key(), model.hparams.image_size
    v = model.kv.get(key, [])
    if not isinstance(v, (list, tuple, np.ndarray)) or len(v) % 2 \
            or not all(isinstance(x, (int, np.integer)) and x > 0 and x % sz == 0 for x in v):
        raise ModelLoadError(f"{model.path}: key '{key}' must be an even number of positive multiples of "
                             f"image_size {sz}, got {v!r}")
    return [(int(v[i]), int(v[i + 1])) for i in range(0, len(v), 2)]


def load_mlp(model: ClipModel) -> int:
    load_vit_mlp(model)
    mm0 = model.need(ctn(ClipTensor.LLAVA_PROJ, "weight", 0))
    mm2 = model.need(ctn(ClipTensor.LLAVA_PROJ, "weight", 2))
    check_shape(model, mm0, (model.hparams.n_embd, mm0.ne[1]))
    check_shape(model, model.need(ctn(ClipTensor.LLAVA_PROJ, "bias", 0)), (mm0.ne[1],))
    check_shape(model, mm2, (mm0.ne[1], mm2.ne[1]))
    check_shape(model, model.need(ctn(ClipTensor.LLAVA_PROJ, "bias", 2)), (mm2.ne[1],))
    return mm2.ne[1]


def load_mlp_norm(model: ClipModel) -> int:
    load_vit_mlp(model)
    mm0 = model.need(ctn(ClipTensor.LLAVA_PROJ, "weight", 0))
    mm3 = model.need(ctn(ClipTensor.LLAVA_PROJ, "weight", 3))
    n_mid, n_out = mm0.ne[1], mm3.ne[1]
    check_shape(model, mm0, (model.hparams.n_embd, n_mid))
    check_shape(model, mm3, (n_mid, n_out))
    for il, s, n in ((0, "bias", n_mid), (1, "weight", n_mid), (1, "bias", n_mid), (3, "bias", n_out),
                     (4, "weight", n_out), (4, "bias", n_out)):
        check_shape(model, model.need(ctn(ClipTensor.LLAVA_PROJ, s, il)), (n,))
    return n_out


def n_tokens_mlp(hp: ClipHParams, nx: int, ny: int) -> int:
    return (nx // hp.patch_size) * (ny // hp.patch_size)


def build_vit_mlp(g: ClipGraph) -> Tensor:
    """The ViT to the layer before the last -> its patch rows [n_embd, n_patches]."""
    m, hp = g.model, g.hparams
    inp = g.build_inp()
    cls = m.get(ctn(ClipTensor.CLASS_EMBD, ""), False)
    if cls is not None:
        inp = ops.concat(inp, ops.reshape_2d(cls, hp.n_embd, 1), 1)
    n_pos = g.n_patches + (cls is not None)
    # clip.cpp adds get_rows(position_embd, positions 0..n_pos-1): every row, in order
    cur = g.build_vit(ops.add(inp, m.need(ctn(ClipTensor.POS_EMBD))), n_pos, None, n_layer=hp.n_layer - 1)
    cur = ops.reshape_2d(cur, hp.n_embd, n_pos)
    # get_rows(cur, patches = offset .. offset + n_patches - 1), offset 1 with a class embedding
    off = int(cls is not None)
    return ops.cont(ops.view_2d(cur, hp.n_embd, g.n_patches, cur.nb[1], off * cur.nb[1]))


def build_mlp(g: ClipGraph) -> Tensor:
    m = g.model
    cur = build_vit_mlp(g)
    cur = ops.add(ops.mul_mat(m.need(ctn(ClipTensor.LLAVA_PROJ, "weight", 0)), cur),
                  m.need(ctn(ClipTensor.LLAVA_PROJ, "bias", 0)))
    cur = ops.gelu(cur)
    return ops.add(ops.mul_mat(m.need(ctn(ClipTensor.LLAVA_PROJ, "weight", 2)), cur),
                   m.need(ctn(ClipTensor.LLAVA_PROJ, "bias", 2)))


def build_mlp_norm(g: ClipGraph) -> Tensor:
    m = g.model

    def mm(il: int, s: str = "weight") -> Tensor:
        return m.need(ctn(ClipTensor.LLAVA_PROJ, s, il))

    cur = build_vit_mlp(g)
    cur = ops.add(ops.mul_mat(mm(0), cur), mm(0, "bias"))
    cur = ops.gelu(ops.add(ops.mul(ops.norm(cur, g.eps), mm(1)), mm(1, "bias")))
    cur = ops.add(ops.mul_mat(mm(3), cur), mm(3, "bias"))
    return ops.add(ops.mul(ops.norm(cur, g.eps), mm(4)), mm(4, "bias"))


MLP = Projector(name="mlp", text_archs=frozenset({"llama"}), load=load_mlp, build=build_mlp,
                n_output_tokens=n_tokens_mlp, resize_algo=ResizeAlgo.BICUBIC, pad_color=(122, 116, 104),
                preprocess=preprocess_llava)
MLP_NORM = Projector(name="mlp_norm", text_archs=frozenset({"llama"}), load=load_mlp_norm, build=build_mlp_norm,
                     n_output_tokens=n_tokens_mlp, resize_algo=ResizeAlgo.BICUBIC, pad_color=(122, 116, 104),
                     preprocess=preprocess_llava)

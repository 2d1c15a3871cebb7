"""InternVL encoders: llama.cpp's tools/mtmd/models/internvl.cpp (clip_graph_internvl).

internvl (InternVL 2.5 / 3): an InternViT over one tile of image_size x image_size - a class
embedding appended after the patches, learned positions, layer norms (RMS norms in the 6B ViT:
width 3200, 45 layers), GELU FFNs and layer scales (ls1, ls2) on the attention and FFN outputs
- then the class row dropped, pixel shuffle (each n_merge x n_merge block of patches one
token of n_embd n_merge^2) and the MLP projector: a layer norm (eps 1e-5), mm.model.mlp.1,
GELU, mm.model.mlp.3. The image, when larger than a tile, is resized (bicubic, keeping its
aspect ratio, padded) to the a x b tile grid that keeps most of it (preproc_min_tiles <= a b
<= preproc_max_tiles) and cut into tiles; an overview of the whole image (resized to one tile,
not padded) follows them. The text model reads <img>, the tiles row by row, the overview, </img>.
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
    FfnOp,
    Preprocessed,
    Projector,
    check_shape,
    ctn,
    load_vit_layers,
    positive_int,
)
from llm.mtmd.image import PadStyle, ResizeAlgo, resize

MIN_TILES, MAX_TILES = 1, 12        # clip.cpp's defaults for files without the keys
PROJ_NORM_EPS = 1e-5                # the projector's layer norm: PyTorch's default


def load_internvl(model: ClipModel) -> int:
    hp = model.hparams
    hp.n_merge = positive_int(model, ClipKV.PROJ_SCALE_FACTOR, 1)
    hp.preproc_min_tiles = positive_int(model, ClipKV.PREPROC_MIN_TILES, MIN_TILES)
    hp.preproc_max_tiles = positive_int(model, ClipKV.PREPROC_MAX_TILES, MAX_TILES)
    if hp.preproc_min_tiles > hp.preproc_max_tiles:
        raise ModelLoadError(f"{model.path}: preproc_min_tiles {hp.preproc_min_tiles} > preproc_max_tiles "
                             f"{hp.preproc_max_tiles}")
    side = hp.n_patches_side
    if side % hp.n_merge:
        raise ModelLoadError(f"{model.path}: {side} patches per side do not shuffle by {hp.n_merge}")
    load_vit_layers(model)
    n_embd = hp.n_embd
    check_shape(model, model.need(ctn(ClipTensor.PATCH_EMBD)), (hp.patch_size, hp.patch_size, 3, n_embd))
    check_shape(model, model.get(ctn(ClipTensor.PATCH_BIAS, "bias"), False), (n_embd,))
    check_shape(model, model.need(ctn(ClipTensor.CLASS_EMBD, "")), (n_embd,))
    check_shape(model, model.need(ctn(ClipTensor.POS_EMBD)), (n_embd, side * side + 1))
    for t in (ClipTensor.LN_PRE, ClipTensor.LN_POST):
        check_shape(model, model.get(ctn(t), False), (n_embd,))
    n_in = n_embd * hp.n_merge * hp.n_merge
    for s in ("weight", "bias"):
        check_shape(model, model.need(ctn(ClipTensor.MVLM_PROJ_MLP, s, 0)), (n_in,))
    mm1 = model.need(ctn(ClipTensor.MVLM_PROJ_MLP, "weight", 1))
    mm3 = model.need(ctn(ClipTensor.MVLM_PROJ_MLP, "weight", 3))
    check_shape(model, mm1, (n_in, mm1.ne[1]))
    check_shape(model, model.need(ctn(ClipTensor.MVLM_PROJ_MLP, "bias", 1)), (mm1.ne[1],))
    check_shape(model, mm3, (mm1.ne[1], mm3.ne[1]))
    check_shape(model, model.need(ctn(ClipTensor.MVLM_PROJ_MLP, "bias", 3)), (mm3.ne[1],))
    return mm3.ne[1]


def n_tokens_internvl(hp: ClipHParams, nx: int, ny: int) -> int:
    return (nx // hp.patch_size) * (ny // hp.patch_size) // (hp.n_merge * hp.n_merge)


def res_candidates(hp: ClipHParams) -> list[tuple[int, int]]:
    """set_internvl_dhr_res_candidates: every a x b tile grid with min_tiles <= a b <= max_tiles
    (a, then b, ascending), in pixels."""
    lo, hi, sz = hp.preproc_min_tiles, hp.preproc_max_tiles, hp.image_size
    out = []
    for a in range(lo, hi + 1):
        for b in range(max(-(-lo // a), lo), min(hi // a, hi) + 1):
            out.append((a * sz, b * sz))
    return out


def select_best_resolution(nx: int, ny: int, candidates: list[tuple[int, int]]) -> tuple[int, int]:
    """llava-uhd's select_best_resolution: the candidate that keeps the most of the image
    (resized into it keeping its aspect ratio, float32 scale, truncated), then wastes least."""
    best, best_eff, best_waste = (0, 0), 0, np.iinfo(np.int32).max
    for cw, ch in candidates:
        scale = min(np.float32(cw) / np.float32(nx), np.float32(ch) / np.float32(ny))
        tw, th = int(np.float32(nx) * scale), int(np.float32(ny) * scale)
        eff = min(tw * th, nx * ny)
        waste = cw * ch - eff
        if eff > best_eff or (eff == best_eff and waste < best_waste):
            best, best_eff, best_waste = (cw, ch), eff, waste
    return best


def preprocess_pinpoints(hp: ClipHParams, img: np.ndarray, candidates: list[tuple[int, int]]) -> Preprocessed:
    """mtmd_image_preprocessor_llava_uhd with resolution candidates: the overview (bicubic, not
    padded, one tile) and the tiles (row by row) of the image resized (bicubic, padded) to the
    best candidate; an image no larger than one tile is the overview alone."""
    sz = hp.image_size
    ny, nx = img.shape[:2]
    overview = resize(img, sz, sz, ResizeAlgo.BICUBIC, PadStyle.NONE)
    if nx <= sz and ny <= sz:
        return Preprocessed([], overview=overview)
    rw, rh = select_best_resolution(nx, ny, candidates)
    refined = resize(img, rw, rh, ResizeAlgo.BICUBIC, PadStyle.CEIL, (0, 0, 0))
    tiles = [np.ascontiguousarray(refined[y:y + sz, x:x + sz]) for y in range(0, rh, sz) for x in range(0, rw, sz)]
    return Preprocessed(tiles, grid_x=rw // sz, grid_y=rh // sz, overview=overview)


def preprocess_internvl(model: ClipModel, proj: Projector, img: np.ndarray) -> Preprocessed:
    """mtmd_image_preprocessor_internvl: the tiles, then the overview."""
    return preprocess_pinpoints(model.hparams, img, res_candidates(model.hparams))


def build_internvl(g: ClipGraph) -> Tensor:
    m, hp = g.model, g.hparams
    n_embd, n_patches, s = g.n_embd, g.n_patches, hp.n_merge
    n_pos = n_patches + 1
    inp = g.build_inp()
    inp = ops.concat(inp, ops.reshape_2d(m.need(ctn(ClipTensor.CLASS_EMBD, "")), n_embd, 1), 1)
    rms = hp.n_embd == 3200 and hp.n_layer == 45        # the 6B InternViT
    cur = g.build_vit(inp, n_pos, m.need(ctn(ClipTensor.POS_EMBD)), rms=rms)
    cur = ops.cont(ops.view_2d(cur, n_embd, n_patches, cur.nb[1], 0))      # the class row dropped

    # pixel shuffle (tiles are square: height and width as clip.cpp reads them)
    height, width = g.n_patches_y, g.n_patches_x
    cur = ops.cont(ops.permute(ops.reshape_4d(cur, n_embd * s, height // s, width, 1), 0, 2, 1, 3))
    cur = ops.reshape_4d(cur, n_embd * s * s, height // s, width // s, 1)
    cur = ops.cont(ops.permute(cur, 0, 2, 1, 3))
    cur = ops.reshape_2d(cur, n_embd * s * s, cur.ne[1] * cur.ne[2])

    def mlp(part: str, il: int) -> Tensor:
        return m.need(ctn(ClipTensor.MVLM_PROJ_MLP, part, il))
    cur = g.cb(ops.mul(ops.norm(cur, PROJ_NORM_EPS), mlp("weight", 0)), "norm_w")
    cur = g.cb(ops.add(cur, mlp("bias", 0)), "norm_b")
    return g.build_ffn(cur, mlp("weight", 1), mlp("bias", 1), None, None, mlp("weight", 3), mlp("bias", 3),
                       FfnOp.GELU, -1)


INTERNVL = Projector(name="internvl", text_archs=frozenset({"qwen2", "qwen3", "llama", "internlm2"}),
                     load=load_internvl, build=build_internvl, n_output_tokens=n_tokens_internvl,
                     resize_algo=ResizeAlgo.BICUBIC, preprocess=preprocess_internvl, img_beg="<img>",
                     img_end="</img>")

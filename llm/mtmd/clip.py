"""The vision encoder's model and shared graph blocks: llama.cpp's tools/mtmd/clip.cpp.

An mmproj GGUF holds a ViT and its projector under the `clip.*` keys and `v.*` / `mm.*`
tensors (clip-impl.h's KEY_* and TN_*, tabled here as ClipKV and ClipTensor). ClipModel is
clip_model (hparams, tensors on one device); ClipGraph is clip_graph: build_inp (the patch
embedding, ggml_conv_2d), build_vit, build_norm, build_attn and build_ffn with clip.cpp's
node names (`cb(cur, "ffn_out", il)`). Each projector family has its own file building on
them (siglip.py for gemma3), as clip.cpp's models/*.cpp. An audio mmproj (`clip.audio.*`
keys, `a.*` tensors) loads the same way with the audio hparams (whisper.py).
"""
from __future__ import annotations

import enum
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import numpy as np

from ggmlx import gguf, ops, weights
from ggmlx.graph import Graph
from ggmlx.tensor import Tensor, new_input, new_weight
from ggmlx.types import GGMLType
from llm.errors import ModelLoadError
from llm.mtmd.image import PadStyle, ResizeAlgo, resize

PREFIX_VISION = "v"
PREFIX_AUDIO = "a"


class ClipKV(enum.Enum):
    """clip-impl.h's KEY_*; `%s` is the modality prefix ("vision")."""
    PROJ_TYPE = "clip.projector_type"
    VISION_PROJ_TYPE = "clip.vision.projector_type"
    AUDIO_PROJ_TYPE = "clip.audio.projector_type"
    HAS_VISION_ENC = "clip.has_vision_encoder"
    HAS_AUDIO_ENC = "clip.has_audio_encoder"
    USE_GELU = "clip.use_gelu"
    USE_SILU = "clip.use_silu"
    N_EMBD = "clip.%s.embedding_length"
    N_FF = "clip.%s.feed_forward_length"
    N_BLOCK = "clip.%s.block_count"
    PROJ_DIM = "clip.%s.projection_dim"
    N_HEAD = "clip.%s.attention.head_count"
    N_HEAD_KV = "clip.%s.attention.head_count_kv"
    N_EMBD_HEAD = "clip.%s.attention.head_dim"
    LAYER_NORM_EPS = "clip.%s.attention.layer_norm_epsilon"
    IMAGE_SIZE = "clip.vision.image_size"
    PATCH_SIZE = "clip.vision.patch_size"
    IMAGE_MEAN = "clip.vision.image_mean"
    IMAGE_STD = "clip.vision.image_std"
    PROJ_SCALE_FACTOR = "clip.vision.projector.scale_factor"
    PREPROC_IMAGE_SIZE = "clip.vision.preproc_image_size"
    A_NUM_MEL_BINS = "clip.audio.num_mel_bins"
    A_PROJ_STACK_FACTOR = "clip.audio.projector.stack_factor"
    SPATIAL_MERGE_SIZE = "clip.vision.spatial_merge_size"
    WIN_ATTN_PATTERN = "clip.vision.n_wa_pattern"
    PREPROC_MIN_TILES = "clip.vision.preproc_min_tiles"
    PREPROC_MAX_TILES = "clip.vision.preproc_max_tiles"
    IMAGE_GRID_PINPOINTS = "clip.vision.image_grid_pinpoints"

    def key(self, prefix: str = "vision") -> str:
        return self.value % prefix if "%s" in self.value else self.value


class ClipTensor(enum.Enum):
    """clip-impl.h's TN_*: `{p}` the tensor prefix ("v"), `{il}` the layer, `{s}` weight/bias."""
    POS_EMBD = "{p}.position_embd.weight"
    CLASS_EMBD = "v.class_embd"
    PATCH_EMBD = "v.patch_embd.weight"
    PATCH_EMBD_1 = "v.patch_embd.weight.1"          # qwen2vl: the second temporal patch kernel
    ATTN_QKV = "{p}.blk.{il}.attn_qkv.{s}"          # qwen3vl: Q, K and V in one matrix
    DEEPSTACK_NORM = "v.deepstack.{il}.norm.{s}"    # qwen3vl: a layer's DeepStack merger
    DEEPSTACK_FC1 = "v.deepstack.{il}.fc1.{s}"
    DEEPSTACK_FC2 = "v.deepstack.{il}.fc2.{s}"
    PATCH_BIAS = "v.patch_embd.bias"
    ATTN_Q = "{p}.blk.{il}.attn_q.{s}"
    ATTN_K = "{p}.blk.{il}.attn_k.{s}"
    ATTN_V = "{p}.blk.{il}.attn_v.{s}"
    ATTN_OUTPUT = "{p}.blk.{il}.attn_out.{s}"
    FFN_UP = "{p}.blk.{il}.ffn_up.{s}"
    FFN_GATE = "{p}.blk.{il}.ffn_gate.{s}"
    FFN_DOWN = "{p}.blk.{il}.ffn_down.{s}"
    LN_1 = "{p}.blk.{il}.ln1.{s}"
    LN_2 = "{p}.blk.{il}.ln2.{s}"
    LN_PRE = "{p}.pre_ln.{s}"
    LS_1 = "{p}.blk.{il}.ls1.{s}"                   # layer scales (internvl)
    LS_2 = "{p}.blk.{il}.ls2.{s}"
    LN_POST = "{p}.post_ln.{s}"
    MM_INP_PROJ = "mm.input_projection.weight"      # gemma3
    MM_PROJECTOR = "mm.model.fc.{s}"                # idefics3
    MVLM_PROJ_MLP = "mm.model.mlp.{il}.{s}"         # internvl: mm.model.mlp.0 (norm), .1, .3
    LLAVA_PROJ = "mm.{il}.{s}"                      # mlp (LLaVA): mm.0, mm.2
    MM_SOFT_EMB_N = "mm.soft_emb_norm.weight"       # gemma3
    MM_INP_NORM = "mm.input_norm.weight"            # pixtral (Mistral Small 3.1): before the patch merger; lfm2
    MM_INP_NORM_B = "mm.input_norm.bias"            # lfm2
    MM_PATCH_MERGER = "mm.patch_merger.{s}"         # pixtral (Mistral Small 3.1)
    TOK_IMG_BREAK = "v.token_embd.img_break"        # pixtral: the [IMG_BREAK] embedding after each row
    CONV1D = "a.conv1d.{il}.{s}"                    # whisper encoder: a.conv1d.1, a.conv1d.2
    MM_AUDIO_MLP = "mm.a.mlp.{il}.{s}"              # ultravox: mm.a.mlp.1, mm.a.mlp.2
    MM_AUDIO_FC = "mm.a.fc.{s}"                     # qwen2a
    MM_NORM_PRE = "mm.a.norm_pre.{s}"               # ultravox
    MM_NORM_MID = "mm.a.norm_mid.{s}"               # ultravox


def ctn(t: ClipTensor, suffix: str = "weight", il: int = -1, prefix: str = PREFIX_VISION) -> str:
    return t.value.format(p=prefix, il=il, s=suffix)


class FfnOp(enum.Enum):
    """ffn_op_type: clip.use_gelu -> GELU, clip.use_silu -> SILU, neither -> GELU_QUICK;
    the Whisper-style audio encoders always GELU_ERF."""
    GELU = "gelu"
    SILU = "silu"
    GELU_QUICK = "gelu_quick"
    GELU_ERF = "gelu_erf"


@dataclass
class ClipHParams:
    """clip_hparams (the vision part)."""
    projector: str
    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    n_head_kv: int
    d_head: int
    projection_dim: int
    eps: float
    image_size: int
    patch_size: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    ffn_op: FfnOp
    n_merge: int = 1             # the projector's spatial merge / pooling factor per side
    image_longest_edge: int = 0  # idefics3: the longer side the image is resized to before tiling
    n_mel_bins: int = 0          # an audio encoder's mel bands (0: a vision encoder)
    proj_stack_factor: int = 0   # ultravox: encoder frames stacked into one token
    image_min_pixels: int = 0    # dynamic-size images (qwen2vl): the pixel range they are resized into
    image_max_pixels: int = 0
    n_wa_pattern: int = 0        # qwen2.5vl: every n-th layer attends over the whole image, the rest in windows
    preproc_min_tiles: int = 0   # internvl: the tile grids (a x b tiles) an image may be cut into
    preproc_max_tiles: int = 0

    @property
    def is_audio(self) -> bool:
        return self.n_mel_bins > 0

    @property
    def n_patches_side(self) -> int:
        return self.image_size // self.patch_size


@dataclass
class ClipLayer:
    q_w: Tensor
    k_w: Tensor
    v_w: Tensor
    o_w: Tensor
    ff_up_w: Tensor
    ff_down_w: Tensor
    q_b: Tensor | None = None
    k_b: Tensor | None = None
    v_b: Tensor | None = None
    o_b: Tensor | None = None
    ln_1_w: Tensor | None = None
    ln_1_b: Tensor | None = None
    ln_2_w: Tensor | None = None
    ln_2_b: Tensor | None = None
    ff_up_b: Tensor | None = None
    ff_gate_w: Tensor | None = None
    ff_gate_b: Tensor | None = None
    ff_down_b: Tensor | None = None
    ls_1_w: Tensor | None = None     # layer scales of the attention and FFN outputs (internvl)
    ls_2_w: Tensor | None = None


@dataclass
class ClipModel:
    """clip_model: an mmproj file's vision (or audio) hparams and tensors, on one device;
    `prefix` is the encoder's tensor prefix ("v", or "a" for audio)."""
    path: str
    hparams: ClipHParams
    kv: dict
    prefix: str = PREFIX_VISION
    tensors: dict[str, Tensor] = field(default_factory=dict)
    layers: list[ClipLayer] = field(default_factory=list)

    def get(self, name: str, required: bool = True) -> Tensor | None:
        t = self.tensors.get(name)
        if t is None and required:
            raise ModelLoadError(f"{self.path}: missing tensor '{name}'")
        return t

    def need(self, name: str) -> Tensor:
        t = self.get(name)
        assert t is not None
        return t


def _key(path: str, kv: dict, k: ClipKV, kind: type, default=None, prefix: str = "vision"):
    name = k.key(prefix)
    if name not in kv:
        if default is None:
            raise ModelLoadError(f"{path}: missing key '{name}'")
        return default
    v = kv[name]
    ok = isinstance(v, bool) if kind is bool else isinstance(v, (int, float) if kind is float else kind) \
        and not isinstance(v, bool)
    if not ok:
        raise ModelLoadError(f"{path}: key '{name}' holds {v!r}, expected {kind.__name__}")
    return kind(v)


def positive_int(model: ClipModel, k: ClipKV, default: int) -> int:
    """The vision key k, an integer >= 1 (default where the file has none)."""
    v = model.kv.get(k.key(), default)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ModelLoadError(f"{model.path}: '{k.key()}' must be an integer >= 1, got {v!r}")
    return v


def _floats(path: str, kv: dict, k: ClipKV) -> tuple[float, float, float]:
    v = kv.get(k.key())
    if not isinstance(v, (list, tuple, np.ndarray)) or len(v) < 3:
        raise ModelLoadError(f"{path}: key '{k.key()}' must be an array of at least 3 floats, got {v!r}")
    return (float(v[0]), float(v[1]), float(v[2]))


def projector_type(path: str, kv: dict, audio: bool = False) -> str:
    modal = ClipKV.AUDIO_PROJ_TYPE if audio else ClipKV.VISION_PROJ_TYPE
    proj = kv.get(ClipKV.PROJ_TYPE.value) or kv.get(modal.value)
    if not isinstance(proj, str) or not proj:
        raise ModelLoadError(f"{path}: no projector type ('{ClipKV.PROJ_TYPE.value}'): not an mmproj file?")
    return proj


def load_hparams(path: str, kv: dict, projector: str) -> ClipHParams:
    """clip_model_loader::load_hparams for the vision modality."""
    if not kv.get(ClipKV.HAS_VISION_ENC.value, False):
        raise ModelLoadError(f"{path}: the mmproj has no vision encoder ('{ClipKV.HAS_VISION_ENC.value}')")
    use_gelu = _key(path, kv, ClipKV.USE_GELU, bool, False)
    use_silu = _key(path, kv, ClipKV.USE_SILU, bool, False)
    if use_gelu and use_silu:
        raise ModelLoadError(f"{path}: both use_gelu and use_silu are set")
    ffn_op = FfnOp.GELU if use_gelu else FfnOp.SILU if use_silu else FfnOp.GELU_QUICK
    n_embd = _key(path, kv, ClipKV.N_EMBD, int)
    n_head = _key(path, kv, ClipKV.N_HEAD, int)
    hp = ClipHParams(
        projector=projector, n_embd=n_embd, n_ff=_key(path, kv, ClipKV.N_FF, int),
        n_layer=_key(path, kv, ClipKV.N_BLOCK, int), n_head=n_head,
        n_head_kv=_key(path, kv, ClipKV.N_HEAD_KV, int, n_head),
        d_head=_key(path, kv, ClipKV.N_EMBD_HEAD, int, n_embd // max(n_head, 1)),
        projection_dim=_key(path, kv, ClipKV.PROJ_DIM, int),
        eps=_key(path, kv, ClipKV.LAYER_NORM_EPS, float),
        image_size=_key(path, kv, ClipKV.IMAGE_SIZE, int), patch_size=_key(path, kv, ClipKV.PATCH_SIZE, int),
        image_mean=_floats(path, kv, ClipKV.IMAGE_MEAN), image_std=_floats(path, kv, ClipKV.IMAGE_STD),
        ffn_op=ffn_op)
    if hp.patch_size <= 0 or hp.image_size % hp.patch_size:
        raise ModelLoadError(f"{path}: image_size {hp.image_size} is not a multiple of patch_size {hp.patch_size}")
    if n_head <= 0 or hp.d_head * n_head != n_embd:
        raise ModelLoadError(f"{path}: {n_head} heads of {hp.d_head} do not make embedding_length {n_embd}")
    return hp


def load_hparams_audio(path: str, kv: dict, projector: str) -> ClipHParams:
    """clip_model_loader::load_hparams for the audio modality of the Whisper-style encoders:
    GELU (erf) FFNs whatever use_gelu says, no image keys; qwen2.5o's audio half is qwen2a."""
    n_embd = _key(path, kv, ClipKV.N_EMBD, int, prefix="audio")
    n_head = _key(path, kv, ClipKV.N_HEAD, int, prefix="audio")
    n_mel = _key(path, kv, ClipKV.A_NUM_MEL_BINS, int)
    if not 0 < n_mel <= 256:
        raise ModelLoadError(f"{path}: '{ClipKV.A_NUM_MEL_BINS.key()}' is {n_mel}; it must be in 1..256")
    hp = ClipHParams(
        projector="qwen2a" if projector == "qwen2.5o" else projector, n_embd=n_embd,
        n_ff=_key(path, kv, ClipKV.N_FF, int, prefix="audio"),
        n_layer=_key(path, kv, ClipKV.N_BLOCK, int, prefix="audio"),
        n_head=n_head, n_head_kv=_key(path, kv, ClipKV.N_HEAD_KV, int, n_head, prefix="audio"),
        d_head=_key(path, kv, ClipKV.N_EMBD_HEAD, int, n_embd // max(n_head, 1), prefix="audio"),
        projection_dim=_key(path, kv, ClipKV.PROJ_DIM, int, prefix="audio"),
        eps=_key(path, kv, ClipKV.LAYER_NORM_EPS, float, prefix="audio"),
        image_size=0, patch_size=1, image_mean=(0.0, 0.0, 0.0), image_std=(1.0, 1.0, 1.0), ffn_op=FfnOp.GELU_ERF,
        n_mel_bins=n_mel, proj_stack_factor=_key(path, kv, ClipKV.A_PROJ_STACK_FACTOR, int, 0))
    if n_head <= 0 or hp.d_head * n_head != n_embd:
        raise ModelLoadError(f"{path}: {n_head} heads of {hp.d_head} do not make embedding_length {n_embd}")
    return hp


def load_model(path: str | os.PathLike, device: jax.Device | None = None) -> tuple[ClipModel, gguf.GGUFReader]:
    """Read an mmproj file: its hparams and every tensor put on `device` (F32/F16 as stored,
    quantized ones as blocks). The projector's own loader then picks its tensors."""
    path = os.fspath(path)
    try:
        reader = gguf.GGUFReader(path)
    except gguf.GGUFError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    kv = dict(reader.kv)
    if not kv.get(ClipKV.HAS_VISION_ENC.value, False) and kv.get(ClipKV.HAS_AUDIO_ENC.value, False):
        model = ClipModel(path, load_hparams_audio(path, kv, projector_type(path, kv, audio=True)), kv,
                          PREFIX_AUDIO)
    else:
        proj = projector_type(path, kv)
        if proj == "mlp" and ctn(ClipTensor.LLAVA_PROJ, "weight", 3) in reader.tensors:
            proj = "mlp_norm"       # clip_model_loader: an "mlp" file with mm.3 is Yi-VL's mlp_norm
        # qwen2.5o (Qwen2.5-Omni) holds both encoders: its vision half is qwen2.5vl's
        model = ClipModel(path, load_hparams(path, kv, "qwen2.5vl_merger" if proj == "qwen2.5o" else proj), kv)
    for name, ti in reader.tensors.items():
        t = new_weight(GGMLType(ti.type), ti.ne, name)
        t.data = weights.to_device(ti.data, GGMLType(ti.type), ti.ne, device, "native")
        model.tensors[name] = t
    return model, reader


def audio_beside(model: ClipModel) -> ClipModel | None:
    """The audio encoder of an mmproj that holds one beside its vision encoder (qwen2.5o: mtmd's
    ctx_a beside ctx_v), on the same tensors; None for a file of one modality."""
    kv = model.kv
    if model.hparams.is_audio or not kv.get(ClipKV.HAS_AUDIO_ENC.value, False):
        return None
    hp = load_hparams_audio(model.path, kv, projector_type(model.path, kv, audio=True))
    return ClipModel(model.path, hp, kv, PREFIX_AUDIO, tensors=model.tensors)


def check_shape(model: ClipModel, t: Tensor | None, ne: tuple[int, ...]) -> None:
    if t is None:
        return
    want = tuple(ne) + (1,) * (4 - len(ne))
    if t.ne != want:
        raise ModelLoadError(f"{model.path}: tensor '{t.name}' has wrong shape; expected {list(want)}, "
                             f"got {list(t.ne)}")


def load_vit_layers(model: ClipModel) -> None:
    """The standard ViT layers (clip_model_loader::load_tensors), each checked against the
    hparams; the up/down swap of old conversions is refused rather than guessed."""
    hp = model.hparams
    n_embd, n_ff = hp.n_embd, hp.n_ff
    n_q, n_kv = hp.d_head * hp.n_head, hp.d_head * hp.n_head_kv
    p = model.prefix
    for il in range(hp.n_layer):
        def get(t: ClipTensor, s: str = "weight", required: bool = False, il: int = il) -> Tensor | None:
            return model.get(ctn(t, s, il, p), required)
        layer = ClipLayer(
            q_w=model.need(ctn(ClipTensor.ATTN_Q, "weight", il, p)),
            k_w=model.need(ctn(ClipTensor.ATTN_K, "weight", il, p)),
            v_w=model.need(ctn(ClipTensor.ATTN_V, "weight", il, p)),
            o_w=model.need(ctn(ClipTensor.ATTN_OUTPUT, "weight", il, p)),
            ff_up_w=model.need(ctn(ClipTensor.FFN_UP, "weight", il, p)),
            ff_down_w=model.need(ctn(ClipTensor.FFN_DOWN, "weight", il, p)),
            q_b=get(ClipTensor.ATTN_Q, "bias"), k_b=get(ClipTensor.ATTN_K, "bias"), v_b=get(ClipTensor.ATTN_V, "bias"),
            o_b=get(ClipTensor.ATTN_OUTPUT, "bias"), ln_1_w=get(ClipTensor.LN_1), ln_1_b=get(ClipTensor.LN_1, "bias"),
            ln_2_w=get(ClipTensor.LN_2), ln_2_b=get(ClipTensor.LN_2, "bias"), ff_up_b=get(ClipTensor.FFN_UP, "bias"),
            ff_gate_w=get(ClipTensor.FFN_GATE), ff_gate_b=get(ClipTensor.FFN_GATE, "bias"),
            ff_down_b=get(ClipTensor.FFN_DOWN, "bias"), ls_1_w=get(ClipTensor.LS_1), ls_2_w=get(ClipTensor.LS_2))
        for t, ne in ((layer.q_w, (n_embd, n_q)), (layer.k_w, (n_embd, n_kv)), (layer.v_w, (n_embd, n_kv)),
                      (layer.o_w, (n_q, n_embd)), (layer.ff_up_w, (n_embd, n_ff)), (layer.ff_down_w, (n_ff, n_embd)),
                      (layer.ff_gate_w, (n_embd, n_ff)), (layer.q_b, (n_q,)), (layer.k_b, (n_kv,)),
                      (layer.v_b, (n_kv,)), (layer.o_b, (n_embd,)), (layer.ln_1_w, (n_embd,)),
                      (layer.ln_1_b, (n_embd,)), (layer.ln_2_w, (n_embd,)), (layer.ln_2_b, (n_embd,)),
                      (layer.ff_up_b, (n_ff,)), (layer.ff_gate_b, (n_ff,)), (layer.ff_down_b, (n_embd,)),
                      (layer.ls_1_w, (n_embd,)), (layer.ls_2_w, (n_embd,))):
            check_shape(model, t, ne)
        model.layers.append(layer)


class ClipGraph:
    """clip_graph: one image's encoder graph, built from the model's tensors; `inp_raw` is the
    F32 [nx, ny, 3] input (planar RGB, normalized; for a sound the [n_frames, n_mel, 1] log-mel
    spectrogram) and `out` the [n_mmproj_embd, n_tokens] result."""

    def __init__(self, model: ClipModel, nx: int, ny: int):
        hp = model.hparams
        self.model, self.hparams = model, hp
        self.nx, self.ny = nx, ny
        self.patch_size = hp.patch_size
        self.n_patches_x, self.n_patches_y = nx // hp.patch_size, ny // hp.patch_size
        self.n_patches = self.n_patches_x * self.n_patches_y
        self.n_embd, self.n_head, self.d_head = hp.n_embd, hp.n_head, hp.d_head
        self.n_head_kv = hp.n_head_kv
        self.eps = hp.eps
        self.kq_scale = 1.0 / math.sqrt(float(hp.d_head))
        self.gf = Graph()
        self.inp_raw = new_input(GGMLType.F32, (nx, ny, 1 if hp.is_audio else 3, 1), "inp_raw")
        # the values of its other inputs (positions, window indices), fixed by the image's size
        self.inputs: dict[Tensor, np.ndarray] = {}
        self.out: Tensor | None = None

    @staticmethod
    def cb(cur: Tensor, name: str, il: int = -1) -> Tensor:
        return cur.set_name(f"{name}-{il}" if il >= 0 else name)

    def finish(self, cur: Tensor) -> None:
        cur.set_output()
        self.gf.build_forward_expand(cur)
        self.out = cur

    def conv_2d_patches(self, kernel: Tensor, img: Tensor) -> Tensor:
        """ggml_conv_2d(kernel [p, p, C, n_embd], img [nx, ny, C]) with stride p and no padding
        -> [n_embd, n_patches] (the result clip's build_inp transposes to): im2col's patch
        rows (kx fastest, then ky, then the channel) by reshapes and permutes, one product.
        ggml_conv_2d's im2col writes F16 (F32 only for a BF16 kernel), and the product, whose
        first operand is those columns, reads the kernel as F16 too: both are rounded."""
        p, ox, oy = self.patch_size, self.n_patches_x, self.n_patches_y
        c = img.ne[2]
        x = ops.cont(ops.permute(ops.reshape_4d(img, p, ox, p, oy * c), 0, 2, 1, 3))   # [kx, ky, ox, oy c]
        x = ops.cont(ops.permute(ops.reshape_3d(x, p * p, ox * oy, c), 0, 2, 1, 3))    # [kx ky, c, ox oy]
        x = ops.reshape_2d(x, p * p * c, ox * oy)
        k = ops.reshape_2d(kernel, p * p * c, kernel.ne[3])
        if kernel.type != GGMLType.BF16:
            x = ops.cast(ops.cast(x, GGMLType.F16), GGMLType.F32)
        if kernel.type == GGMLType.F32:
            k = ops.cast(ops.cast(k, GGMLType.F16), GGMLType.F32)
        return ops.mul_mat(k, x)

    def build_inp(self) -> Tensor:
        """Patches -> [n_embd, n_patches] (+ the patch bias)."""
        m = self.model
        inp = self.conv_2d_patches(m.need(ctn(ClipTensor.PATCH_EMBD)), self.inp_raw)
        bias = m.get(ctn(ClipTensor.PATCH_BIAS, "bias"), False)
        if bias is not None:
            inp = self.cb(ops.add(inp, bias), "patch_bias")
        return inp

    def build_norm(self, cur: Tensor, mw: Tensor | None, mb: Tensor | None, rms: bool, il: int) -> Tensor:
        cur = ops.rms_norm(cur, self.eps) if rms else ops.norm(cur, self.eps)
        if mw is not None:
            cur = self.cb(ops.mul(cur, mw), "norm_w", il)
        if mb is not None:
            cur = self.cb(ops.add(cur, mb), "norm_b", il)
        return cur

    def build_ffn(self, cur: Tensor, up: Tensor | None, up_b: Tensor | None, gate: Tensor | None,
                  gate_b: Tensor | None, down: Tensor | None, down_b: Tensor | None, op: FfnOp, il: int) -> Tensor:
        tmp = self.cb(ops.mul_mat(up, cur), "ffn_up", il) if up is not None else cur
        if up_b is not None:
            tmp = self.cb(ops.add(tmp, up_b), "ffn_up_b", il)
        if gate is not None:
            cur = self.cb(ops.mul_mat(gate, cur), "ffn_gate", il)
            if gate_b is not None:
                cur = self.cb(ops.add(cur, gate_b), "ffn_gate_b", il)
            glu = {FfnOp.SILU: (ops.swiglu_split, "ffn_swiglu"), FfnOp.GELU: (ops.geglu_split, "ffn_geglu")}
            if op not in glu:
                raise ModelLoadError(f"{self.model.path}: a gated {op.value} FFN is not supported yet")
            glu_fn, name = glu[op]
            cur = self.cb(glu_fn(cur, tmp), name, il)
        else:
            act = {FfnOp.SILU: (ops.silu, "ffn_silu"), FfnOp.GELU: (ops.gelu, "ffn_gelu"),
                   FfnOp.GELU_QUICK: (ops.gelu_quick, "ffn_gelu_quick"), FfnOp.GELU_ERF: (ops.gelu_erf, "ffn_gelu_erf")}
            fn, name = act[op]
            cur = self.cb(fn(tmp), name, il)
        if down is not None:
            cur = ops.mul_mat(down, cur)
        if down_b is not None:
            cur = ops.add(self.cb(cur, "ffn_down", il), down_b)
        return cur

    def build_attn(self, wo: Tensor, wo_b: Tensor | None, q_cur: Tensor, k_cur: Tensor, v_cur: Tensor,
                   il: int, kq_mask: Tensor | None = None) -> Tensor:
        """Attention over the patches, unfused (kq -> softmax -> kqv), as clip.cpp computes it
        with flash attention off: full (non-causal), or within kq_mask [n_pos, n_pos] (0 or
        -inf); -> [n_embd, n_pos]. The probabilities are named `kq_soft_max-il`, as the text
        graph names its own, so a trace can capture them (LLM.trace's capture_encoder)."""
        q = ops.permute(q_cur, 0, 2, 1, 3)
        k = ops.permute(k_cur, 0, 2, 1, 3)
        v = ops.cont(ops.permute(v_cur, 1, 2, 0, 3))
        kq = self.cb(ops.soft_max_ext(ops.mul_mat(k, q), kq_mask, self.kq_scale, 0.0), "kq_soft_max", il)
        kqv = ops.mul_mat(v, kq)
        cur = ops.permute(kqv, 0, 2, 1, 3)
        cur = self.cb(ops.cont_2d(cur, cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3]), "kqv_out", il)
        cur = ops.mul_mat(wo, cur)
        if wo_b is not None:
            cur = ops.add(cur, wo_b)
        return cur

    def build_rope_2d(self, cur: Tensor, pos_a: Tensor, pos_b: Tensor, freq_base: float,
                      interleave_freq: bool) -> Tensor:
        """clip_graph::build_rope_2d on [d_head, n_head, n_pos]: the first half of each head
        rotated (adjacent pairs) at pos_a, the second at pos_b; interleave_freq scales the
        second half's frequencies by freq_base^(-2 / d_head), making them the odd ones of the
        whole head. Two ropes of half a head each, joined (ggml_rope_set_offset's effect)."""
        half = cur.ne[0] // 2
        odd = float(np.float32(freq_base) ** np.float32(-2.0 / cur.ne[0])) if interleave_freq else 1.0
        parts = []
        for j, (pos, scale) in enumerate(((pos_a, 1.0), (pos_b, odd))):
            x = ops.cont(ops.view_3d(cur, half, cur.ne[1], cur.ne[2], cur.nb[1], cur.nb[2], j * half * cur.nb[0]))
            parts.append(ops.rope_ext(x, pos, None, n_dims=half, mode=ops.ROPE_TYPE_NORMAL, n_ctx_orig=0,
                                      freq_base=freq_base, freq_scale=scale, ext_factor=0.0, attn_factor=1.0,
                                      beta_fast=0.0, beta_slow=0.0))
        return ops.concat(parts[0], parts[1], 0)

    def build_vit(self, inp: Tensor, n_pos: int, learned_pos_embd: Tensor | None,
                  n_layer: int | None = None, avgpool: bool = False, rms: bool = False,
                  add_pos: Callable[[Tensor, ClipLayer], Tensor] | None = None) -> Tensor:
        """clip_graph::build_vit with layer norms (NORM_TYPE_NORMAL; rms: NORM_TYPE_RMS) and the
        layers' scales where they have them, add_pos applied to each layer's Q and K (a rope)
        -> [n_embd, n_pos, 1];
        n_layer: run only the first n_layer layers (LLaVA reads the one before the last);
        avgpool: each two positions averaged before the post-LN (qwen2a's nn.AvgPool1d(2, 2),
        ggml_pool_1d on the transposed rows) -> [n_embd, n_pos / 2, 1]."""
        m, hp = self.model, self.hparams
        if learned_pos_embd is not None:
            inp = self.cb(ops.add(inp, learned_pos_embd), "pos_embed")
        inpL = ops.reshape_2d(inp, self.n_embd, n_pos)
        p = m.prefix
        pre_w = m.get(ctn(ClipTensor.LN_PRE, prefix=p), False)
        pre_b = m.get(ctn(ClipTensor.LN_PRE, "bias", prefix=p), False)
        if pre_w is not None:
            inpL = self.cb(self.build_norm(inpL, pre_w, pre_b, rms, -1), "pre_ln")
        for il, layer in enumerate(m.layers[:n_layer]):
            cur = self.cb(self.build_norm(inpL, layer.ln_1_w, layer.ln_1_b, rms, il), "layer_inp_normed", il)
            q = ops.mul_mat(layer.q_w, cur)
            if layer.q_b is not None:
                q = ops.add(q, layer.q_b)
            k = ops.mul_mat(layer.k_w, cur)
            if layer.k_b is not None:
                k = ops.add(k, layer.k_b)
            v = ops.mul_mat(layer.v_w, cur)
            if layer.v_b is not None:
                v = ops.add(v, layer.v_b)
            q = self.cb(ops.reshape_4d(q, self.d_head, self.n_head, n_pos, 1), "Qcur", il)
            k = self.cb(ops.reshape_4d(k, self.d_head, self.n_head_kv, n_pos, 1), "Kcur", il)
            v = self.cb(ops.reshape_4d(v, self.d_head, self.n_head_kv, n_pos, 1), "Vcur", il)
            if add_pos is not None:
                q = self.cb(add_pos(q, layer), "Qcur_pos", il)
                k = self.cb(add_pos(k, layer), "Kcur_pos", il)
            cur = self.cb(self.build_attn(layer.o_w, layer.o_b, q, k, v, il), "attn_out", il)
            if layer.ls_1_w is not None:
                cur = self.cb(ops.mul(cur, layer.ls_1_w), "attn_out_scaled", il)
            cur = ops.add(cur, inpL)
            inpL = self.cb(cur, "ffn_inp", il)
            cur = self.cb(self.build_norm(cur, layer.ln_2_w, layer.ln_2_b, rms, il), "ffn_inp_normed", il)
            cur = self.build_ffn(cur, layer.ff_up_w, layer.ff_up_b, layer.ff_gate_w, layer.ff_gate_b,
                                 layer.ff_down_w, layer.ff_down_b, hp.ffn_op, il)
            cur = self.cb(cur, "ffn_out", il)
            if layer.ls_2_w is not None:
                cur = self.cb(ops.mul(cur, layer.ls_2_w), "ffn_out_scaled", il)
            inpL = self.cb(ops.add(inpL, cur), "layer_out", il)
        if avgpool:
            n_pos //= 2
            even = ops.view_2d(inpL, self.n_embd, n_pos, 2 * inpL.nb[1], 0)
            odd = ops.view_2d(inpL, self.n_embd, n_pos, 2 * inpL.nb[1], inpL.nb[1])
            inpL = ops.scale(ops.add(even, odd), 0.5)
        post_w = m.get(ctn(ClipTensor.LN_POST, prefix=p), False)
        post_b = m.get(ctn(ClipTensor.LN_POST, "bias", prefix=p), False)
        if post_w is not None:
            inpL = self.build_norm(inpL, post_w, post_b, rms, -1)
        return ops.reshape_3d(inpL, self.n_embd, n_pos, 1)


@dataclass
class Preprocessed:
    """mtmd_image_preproc_out: the images the encoder reads (uint8 [ny, nx, 3] each, before
    normalization), and for a tiled image its grid of slices and the overview."""
    entries: list[np.ndarray]
    grid_x: int = 0
    grid_y: int = 0
    overview: np.ndarray | None = None


def preprocess_fixed_size(model: ClipModel, proj: Projector, img: np.ndarray) -> Preprocessed:
    """mtmd_image_preprocessor_fixed_size: one image_size x image_size image."""
    sz = model.hparams.image_size
    return Preprocessed([resize(img, sz, sz, proj.resize_algo, proj.resize_pad, proj.pad_color)])


@dataclass(frozen=True)
class Projector:
    """What one projector type needs, from clip.cpp (tensors, graph, output tokens) and
    mtmd.cpp (the text around an image, the preprocessor and the slice layout, whether the
    text model attends over the image non-causally). Token texts in `tok_*` are looked up
    as single tokens (mtmd's lookup_token); `img_beg`, `img_end` and the slice template are
    tokenized."""
    name: str                       # clip.projector_type
    text_archs: frozenset[str]      # the text models it feeds
    load: Callable[[ClipModel], int]            # picks and checks its tensors; -> n_mmproj_embd
    build: Callable[[ClipGraph], Tensor]        # the graph of one image -> [n_mmproj_embd, n_tokens]
    n_output_tokens: Callable[[ClipHParams, int, int], int]   # (hp, nx, ny) of the preprocessed image
    resize_algo: ResizeAlgo = ResizeAlgo.BILINEAR               # images only
    # the tokens' grid (per row, per column) where the text model reads 2-D (M-RoPE) positions
    n_output_grid: Callable[[ClipHParams, int, int], tuple[int, int]] | None = None
    preprocess: Callable[[ClipModel, Projector, np.ndarray], Preprocessed] = preprocess_fixed_size
    resize_pad: PadStyle = PadStyle.CEIL
    pad_color: tuple[int, int, int] = (0, 0, 0)
    img_beg: str = ""
    img_end: str = ""
    non_causal: bool = False        # mtmd_decode_use_non_causal
    # a tiled image (llava-uhd style): the overview's surrounding tokens, the row end, the
    # text before each slice (`% (row, col)`, from 1), the overview before the slices or after
    tok_ov_img_start: tuple[str, ...] = ()
    tok_ov_img_end: tuple[str, ...] = ()
    tok_row_end: tuple[str, ...] = ()
    sli_img_start_tmpl: str = ""
    ov_img_first: bool = False

"""Whisper-style audio encoders: llama.cpp's tools/mtmd/models/whisper-enc.cpp (clip_graph_whisper_enc).

The encoder reads one 30 s chunk of the log-mel spectrogram (audio.py), [3000 frames, n_mel]:
two convolutions (kernel 3, padding 1; the second with stride 2, so 1500 positions), each
followed by the exact (erf) GELU, learned positions, pre-LN transformer layers (biases on Q
and V, none on K; GELU-erf FFN) and a post-LN. ggml_conv_1d reads its input through an F16
im2col and so multiplies F16-rounded inputs by the F16-rounded kernel; conv_1d_ph does the same.

ultravox (Ultravox 0.5 on Llama 3 / Gemma 3): the encoder's positions stacked stack_factor at a
time into one token (StackAudioFrames), RMS-normed, mm.a.mlp.1, a SwiGLU that passes the first
half through and gates with silu of the second (ggml_swiglu_swapped), RMS-normed again and
mm.a.mlp.2 to the text width. No text marks the sound in the prompt.

The stack is clip_graph::build_stack's, quirks included: the values are padded with zeros to
GGML_PAD(n, stack x n_embd), a power-of-two bit trick that is no multiple for other strides,
and the rows that fit are read. Ultravox's 1500 positions of 1280 in 8s give 187 tokens (its
last 4 positions dropped, where StackAudioFrames would pad them into a 188th), as many as
clip_n_output_tokens counts (ceil(3000 / s) / 2). Where the two counts differ (width 32 in 8s:
188 rows, 187 counted) llama.cpp aborts, and such a file is refused here at load.

qwen2a (Qwen2-Audio): each two encoder positions averaged before the post-LN (750 tokens a
chunk), then one projection with bias (mm.a.fc); the sound sits between <|audio_bos|> and
<|audio_eos|>; qwen2.5o (Qwen2.5-Omni) is a qwen2.5vl vision encoder and this one in one file,
for a qwen2vl text model that reads the sound at M-RoPE positions (every section n_past + i).

voxtral (Voxtral Mini): the positions averaged in pairs, stacked stack_factor at a time (4: 187
tokens a chunk, with the same padding quirk), then a GELU (erf) MLP without biases (mm.a.mlp.1,
mm.a.mlp.2); [BEGIN_AUDIO] goes before the sound.
"""
from __future__ import annotations

from ggmlx import ops
from ggmlx.tensor import Tensor
from ggmlx.types import GGMLType
from llm.errors import ModelLoadError
from llm.mtmd import audio
from llm.mtmd.clip import (
    ClipGraph,
    ClipHParams,
    ClipModel,
    ClipTensor,
    FfnOp,
    Preprocessed,
    Projector,
    check_shape,
    ctn,
    load_vit_layers,
)

N_POS = audio.CHUNK_FRAMES // 2          # encoder positions of one chunk (after the stride-2 conv)
RMS_EPS = 1e-6                           # the ultravox projector's norms (not the file's eps)


def conv_1d_ph(kernel: Tensor, x: Tensor, s: int, d: int) -> Tensor:
    """ggml_conv_1d_ph(kernel [K, IC, OC], x [L, IC]): stride s, dilation d, padding K / 2
    -> [OL, OC]. The columns are F16 (ggml_conv_1d's im2col; F32 for a BF16 kernel), and the
    mul_mat converts an F32 kernel to F16 to multiply them, so it is rounded here too; sums
    stay F32."""
    k = kernel.ne[0]
    bf16 = kernel.type == GGMLType.BF16
    cols = ops.im2col(kernel, x, s, 0, k // 2, 0, d, 0, False, GGMLType.F32 if bf16 else GGMLType.F16)  # [IC K, OL]
    w = ops.cast(ops.cast(kernel, GGMLType.F16), GGMLType.F32) if kernel.type == GGMLType.F32 else kernel
    out = ops.mul_mat(ops.reshape_2d(cols, cols.ne[0], cols.ne[1] * cols.ne[2]),
                      ops.reshape_2d(w, k * kernel.ne[1], kernel.ne[2]))
    return ops.reshape_2d(out, cols.ne[1], kernel.ne[2])


def load_whisper_encoder(model: ClipModel) -> None:
    """The encoder's tensors (conv1d, positions, the ViT layers), checked against the hparams."""
    hp = model.hparams
    load_vit_layers(model)
    for il, layer in enumerate(model.layers):
        if layer.q_b is None or layer.v_b is None or layer.k_b is not None or layer.ln_1_b is None \
                or layer.ln_2_b is None:
            raise ModelLoadError(f"{model.path}: Whisper layer {il} needs Q and V biases, no K bias, and biased "
                                 f"layer norms")
    check_shape(model, model.need(ctn(ClipTensor.CONV1D, "weight", 1)), (3, hp.n_mel_bins, hp.n_embd))
    check_shape(model, model.need(ctn(ClipTensor.CONV1D, "bias", 1)), (1, hp.n_embd))
    check_shape(model, model.need(ctn(ClipTensor.CONV1D, "weight", 2)), (3, hp.n_embd, hp.n_embd))
    check_shape(model, model.need(ctn(ClipTensor.CONV1D, "bias", 2)), (1, hp.n_embd))
    pos = model.need(ctn(ClipTensor.POS_EMBD, prefix=model.prefix))
    if pos.ne[0] != hp.n_embd or pos.ne[1] < N_POS:
        raise ModelLoadError(f"{model.path}: '{pos.name}' is {list(pos.ne[:2])}; the encoder needs "
                             f"[{hp.n_embd}, >= {N_POS}]")


def build_whisper_encoder(g: ClipGraph, avgpool: bool = False) -> Tensor:
    """The convolutions and the transformer -> [n_embd, 1500] ("after_transformer"; 750 with
    avgpool)."""
    m, hp = g.model, g.hparams
    x = ops.reshape_2d(g.inp_raw, g.nx, g.ny)                                   # [n_frames, n_mel]
    cur = ops.add(conv_1d_ph(m.need(ctn(ClipTensor.CONV1D, "weight", 1)), x, 1, 1),
                  m.need(ctn(ClipTensor.CONV1D, "bias", 1)))
    cur = ops.gelu_erf(cur)
    cur = ops.add(conv_1d_ph(m.need(ctn(ClipTensor.CONV1D, "weight", 2)), cur, 2, 1),
                  m.need(ctn(ClipTensor.CONV1D, "bias", 2)))
    cur = ops.gelu_erf(cur)
    inp = g.cb(ops.cont(ops.transpose(cur)), "after_conv1d")                   # [n_embd, n_pos]
    n_pos = inp.ne[1]
    pos = m.need(ctn(ClipTensor.POS_EMBD, prefix=m.prefix))
    cur = g.build_vit(inp, n_pos, ops.view_2d(pos, pos.ne[0], n_pos, pos.nb[1], 0), avgpool=avgpool)
    return g.cb(ops.reshape_2d(cur, hp.n_embd, cur.ne[1]), "after_transformer")


def preprocess_whisper(model: ClipModel, proj: Projector, samples) -> Preprocessed:
    """mtmd_audio_preprocessor_whisper: the sound's log-mel chunks, each [n_mel, 3000]."""
    return Preprocessed(audio.whisper_chunks(samples, audio.mel_filters(model.hparams.n_mel_bins)))


def ggml_pad_size(x: int, n: int) -> int:
    """GGML_PAD(x, n): x rounded up to a multiple of n by a mask, exact only for powers of two."""
    return (x + n - 1) & ~(n - 1)


def stack_rows(n_embd: int, n_pos: int, s: int) -> int:
    """The tokens clip_graph::build_stack makes of n_pos positions of n_embd, s at a time."""
    return ggml_pad_size(n_embd * n_pos, n_embd * s) // (n_embd * s)


def check_stack(model: ClipModel, n_pos: int, counted: int) -> None:
    """The stacked rows of a chunk's n_pos positions must be the tokens llama.cpp counts."""
    hp = model.hparams
    s = hp.proj_stack_factor
    if s <= 0:
        raise ModelLoadError(f"{model.path}: {hp.projector} needs 'clip.audio.projector.stack_factor'")
    rows = stack_rows(hp.n_embd, n_pos, s)
    if rows != counted:
        raise ModelLoadError(f"{model.path}: stacking {n_pos} positions of {hp.n_embd} by {s} gives {rows} tokens, "
                             f"llama.cpp counts {counted} and aborts on such a file")


def build_stack(g: ClipGraph, cur: Tensor) -> Tensor:
    """clip_graph::build_stack: [n_embd, n_pos] -> [n_embd s, rows], zero-padded to GGML_PAD."""
    s, total = g.hparams.proj_stack_factor, cur.ne[0] * cur.ne[1]
    stride = g.hparams.n_embd * s
    padded = ggml_pad_size(total, stride)
    if padded > total:
        cur = ops.pad(ops.view_1d(cur, total, 0), padded - total, 0, 0, 0)
    return g.cb(ops.view_2d(cur, stride, padded // stride, stride * 4, 0), "after_stacked")


def load_ultravox(model: ClipModel) -> int:
    hp = model.hparams
    check_stack(model, N_POS, n_tokens_ultravox(hp, audio.CHUNK_FRAMES, hp.n_mel_bins))
    load_whisper_encoder(model)
    n_stack = hp.n_embd * hp.proj_stack_factor
    check_shape(model, model.need(ctn(ClipTensor.MM_NORM_PRE)), (n_stack,))
    mlp1 = model.need(ctn(ClipTensor.MM_AUDIO_MLP, "weight", 1))
    check_shape(model, mlp1, (n_stack, mlp1.ne[1]))
    if mlp1.ne[1] % 2:
        raise ModelLoadError(f"{model.path}: '{mlp1.name}' gives {mlp1.ne[1]} values; the SwiGLU halves an even count")
    check_shape(model, model.need(ctn(ClipTensor.MM_NORM_MID)), (mlp1.ne[1] // 2,))
    mlp2 = model.need(ctn(ClipTensor.MM_AUDIO_MLP, "weight", 2))
    check_shape(model, mlp2, (mlp1.ne[1] // 2, mlp2.ne[1]))
    return mlp2.ne[1]


def n_tokens_ultravox(hp: ClipHParams, nx: int, ny: int) -> int:
    """clip_n_output_tokens: the frames in stacks (the last one partial), halved."""
    return -(-nx // hp.proj_stack_factor) // 2


def build_ultravox(g: ClipGraph) -> Tensor:
    m = g.model
    cur = build_stack(g, build_whisper_encoder(g))
    cur = ops.mul(ops.rms_norm(cur, RMS_EPS), m.need(ctn(ClipTensor.MM_NORM_PRE)))
    cur = ops.mul_mat(m.need(ctn(ClipTensor.MM_AUDIO_MLP, "weight", 1)), cur)
    cur = ops.glu(cur, None, ops.GLU_SWIGLU, swapped=True)
    cur = ops.mul(ops.rms_norm(cur, RMS_EPS), m.need(ctn(ClipTensor.MM_NORM_MID)))
    return g.cb(ops.mul_mat(m.need(ctn(ClipTensor.MM_AUDIO_MLP, "weight", 2)), cur), "projected")


ULTRAVOX = Projector(name="ultravox", text_archs=frozenset({"llama", "gemma3"}), load=load_ultravox,
                     build=build_ultravox, n_output_tokens=n_tokens_ultravox, preprocess=preprocess_whisper)


def load_qwen2a(model: ClipModel) -> int:
    hp = model.hparams
    load_whisper_encoder(model)
    fc = model.need(ctn(ClipTensor.MM_AUDIO_FC))
    check_shape(model, fc, (hp.n_embd, fc.ne[1]))
    check_shape(model, model.need(ctn(ClipTensor.MM_AUDIO_FC, "bias")), (fc.ne[1],))
    return fc.ne[1]


def n_tokens_qwen2a(hp: ClipHParams, nx: int, ny: int) -> int:
    return nx // 2 // 2


def build_qwen2a(g: ClipGraph) -> Tensor:
    m = g.model
    cur = build_whisper_encoder(g, avgpool=True)
    cur = ops.add(ops.mul_mat(m.need(ctn(ClipTensor.MM_AUDIO_FC)), cur), m.need(ctn(ClipTensor.MM_AUDIO_FC, "bias")))
    return g.cb(cur, "projected")


QWEN2A = Projector(name="qwen2a", text_archs=frozenset({"qwen2", "qwen2vl"}), load=load_qwen2a, build=build_qwen2a,
                   n_output_tokens=n_tokens_qwen2a, preprocess=preprocess_whisper, img_beg="<|audio_bos|>",
                   img_end="<|audio_eos|>")


def load_voxtral(model: ClipModel) -> int:
    hp = model.hparams
    check_stack(model, N_POS // 2, n_tokens_voxtral(hp, audio.CHUNK_FRAMES, hp.n_mel_bins))
    load_whisper_encoder(model)
    mlp1 = model.need(ctn(ClipTensor.MM_AUDIO_MLP, "weight", 1))
    check_shape(model, mlp1, (hp.n_embd * hp.proj_stack_factor, mlp1.ne[1]))
    mlp2 = model.need(ctn(ClipTensor.MM_AUDIO_MLP, "weight", 2))
    check_shape(model, mlp2, (mlp1.ne[1], mlp2.ne[1]))
    return mlp2.ne[1]


def n_tokens_voxtral(hp: ClipHParams, nx: int, ny: int) -> int:
    return -(-nx // hp.proj_stack_factor) // 2 // 2


def build_voxtral(g: ClipGraph) -> Tensor:
    m = g.model
    cur = build_stack(g, build_whisper_encoder(g, avgpool=True))
    cur = g.build_ffn(cur, m.need(ctn(ClipTensor.MM_AUDIO_MLP, "weight", 1)), None, None, None,
                      m.need(ctn(ClipTensor.MM_AUDIO_MLP, "weight", 2)), None, FfnOp.GELU_ERF, -1)
    return g.cb(cur, "projected")


VOXTRAL = Projector(name="voxtral", text_archs=frozenset({"llama"}), load=load_voxtral, build=build_voxtral,
                    n_output_tokens=n_tokens_voxtral, preprocess=preprocess_whisper, img_beg="[BEGIN_AUDIO]")

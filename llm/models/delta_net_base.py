"""The Gated DeltaNet pieces shared by qwen3next, qwen35 and qwen35moe: llama.cpp's
src/models/delta-net-base.cpp (llm_build_delta_net_base) and models.h's build_gdn_l2_norm.

A linear-attention layer keeps two states per sequence in the recurrent memory: the short
convolution's last `d_conv - 1` inputs (r) and one [S_v, S_v] matrix per value head (s). The
recurrence itself is one op, `gated_delta_net` (ggml_gated_delta_net, what llama.cpp runs on
the CPU by default: its fused path), compiled as a loop over the ubatch's tokens."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ggmlx import ops
from llm.graph import LLMNormType

if TYPE_CHECKING:
    from ggmlx.tensor import Tensor
    from llm.graph import GraphBuilder, InpRS


def build_gdn_l2_norm(x: Tensor, eps: float) -> Tensor:
    """x / max(||x||, ...) over ne0 as llama.cpp writes it: an RMS norm with eps / n, scaled
    by 1 / sqrt(n)."""
    n = x.ne[0]
    return ops.scale(ops.rms_norm(x, eps / n), 1.0 / math.sqrt(n))


def build_conv_state(g: GraphBuilder, inp: InpRS, conv_all: Tensor, x: Tensor, d_conv: int, channels: int,
                     il: int) -> Tensor:
    """The conv input of the ubatch's sequences: each one's conv state followed by its tokens'
    x [channels, n_seq_tokens, n_seqs] -> [d_conv - 1 + n_seq_tokens, channels, n_seqs]; its
    last d_conv - 1 columns are written back as the new conv state."""
    n_seqs = g.params.n_seqs
    conv = g.cb(g.build_rs(inp, conv_all, g.hparams.n_embd_r()), "conv_states", il)
    conv = g.cb(ops.reshape_3d(conv, d_conv - 1, channels, n_seqs), "conv_states_reshaped", il)
    xt = g.cb(ops.transpose(x), "qkv_mixed_transposed", il)
    conv_input = g.cb(ops.concat(conv, xt, 0), "conv_input", il)
    last = ops.view_3d(conv_input, d_conv - 1, channels, n_seqs, conv_input.nb[1], conv_input.nb[2],
                       x.ne[1] * conv_input.nb[0])
    g.cb(last, "conv_state_last", il)
    g.write_rs(conv_all, ops.reshape_2d(ops.cont(last), g.hparams.n_embd_r(), n_seqs), inp)
    return conv_input


def build_recurrent_attn(g: GraphBuilder, inp: InpRS, s_all: Tensor, q: Tensor, k: Tensor, v: Tensor,
                         gate: Tensor, beta: Tensor, state: Tensor, il: int) -> Tensor:
    """The delta rule over the ubatch from each sequence's state [S_v, S_v, H_v, n_seqs]; the
    last state goes back to the sequence's cell. -> `attn_output` [S_v, H_v, n_seq_tokens,
    n_seqs]."""
    S_v, H_v, n_seq_tokens, n_seqs = v.ne
    out = ops.gated_delta_net(q, k, v, gate, beta, state, 1)
    f32 = 4
    o = ops.view_4d(out, S_v, H_v, n_seq_tokens, n_seqs, S_v * f32, S_v * H_v * f32,
                    S_v * H_v * n_seq_tokens * f32, 0)
    g.cb(o, "attn_output", il)
    n_embd_s = g.hparams.n_embd_s()
    new_state = g.cb(ops.view_2d(out, n_embd_s, n_seqs, n_embd_s * f32, v.nelements() * f32), "new_state", il)
    g.write_rs(s_all, new_state, inp)
    return o


def build_norm_gated(g: GraphBuilder, x: Tensor, w: Tensor, gate: Tensor, il: int) -> Tensor:
    """RMS norm of x (weight w) times silu(gate): the output norm gated by z."""
    return ops.mul(g.build_norm(x, w, None, LLMNormType.RMS, il), ops.silu(gate))

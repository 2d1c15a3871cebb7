"""Graph building for llm (llm_graph_context): graph inputs with set_input / can_reuse, and
the shared blocks every architecture uses (build_inp_embd, build_norm, build_attn, build_ffn,
build_moe_ffn) with their options as enums (LLMNormType, LLMFfnOpType, LLMFfnGateType, as in
llama-graph.h). Architecture files in llm/models/ call these and name every intermediate
through `cb`, so dumps and eval callbacks find `attn_norm-3`, `Qcur-3`, `l_out-3`, ..."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, assert_never

import numpy as np

from ggmlx import ops, types
from ggmlx.graph import Graph
from ggmlx.tensor import Flag, Tensor, new_input
from ggmlx.types import GGMLType
from llm.adapter import TOKEN_EMBD
from llm.arch import LLMArch
from llm.errors import ModelLoadError
from llm.hparams import ExpertGatingFuncType, HParams, RopeScalingType
from llm.kv_cache import hadamard
from llm.layer import Layer

if TYPE_CHECKING:
    from llm.adapter import LoraAdapter, LoraScales
    from llm.kv_cache import KVCache
    from llm.kv_cells import SlotInfo
    from llm.memory_recurrent import MemoryRecurrent
    from llm.model import Model

F32, I32 = GGMLType.F32, GGMLType.I32


# The block options of llama-graph.h. Members are llama.cpp's names without the enum's common
# prefix (LLM_NORM_RMS -> LLMNormType.RMS, LLM_NORM -> NORM, LLM_FFN_SILU -> LLMFfnOpType.SILU,
# LLM_FFN_PAR -> LLMFfnGateType.PAR), only those the builders implement. Plain Enums: their
# values mean nothing outside this module, and unlike IntEnums no int or member of another
# option compares equal to them. Each builder checks its options with _option.

class LLMNormType(enum.Enum):
    """llm_norm_type: the normalization of build_norm (LLM_NORM_GROUP has no op here)."""

    NORM = enum.auto()   # LayerNorm: mean and variance over ne0, hparams.f_norm_eps
    RMS = enum.auto()    # RMSNorm: root mean square over ne0, hparams.f_norm_rms_eps


class LLMFfnOpType(enum.Enum):
    """llm_ffn_op_type: the activation of build_ffn / build_moe_ffn (LLM_FFN_RELU and REGLU have
    no op here)."""

    SILU = enum.auto()             # silu; with a parallel gate SwiGLU, silu(gate x) * up x
    GELU = enum.auto()             # gelu; with a parallel gate GeGLU
    SWIGLU = enum.auto()           # silu(g) * u of a fused ffn_up whose rows are [g; u] (Phi-3)
    GEGLU = enum.auto()            # gelu(g) * u of a fused ffn_up
    SWIGLU_OAI_MOE = enum.auto()   # gpt-oss's clamped SwiGLU (alpha 1.702, limit 7); parallel gate
    RELU_SQR = enum.auto()         # relu(x)^2 without a gate (Nemotron-H)


class LLMFfnGateType(enum.Enum):
    """llm_ffn_gate_type: how ffn_gate meets ffn_up in build_ffn."""

    SEQ = enum.auto()   # no ffn_gate: act(up x) (here llama.cpp's gate(up x) is not supported)
    PAR = enum.auto()   # ffn_gate parallel to ffn_up: act(gate x) * up x


def _option(arg: str, value: object, kind: type[enum.Enum]) -> None:
    """A builder's option must be a member of its enum: a string, an int or another option's
    member is a caller's bug, reported by argument and value rather than taking a branch."""
    if not isinstance(value, kind):
        raise TypeError(f"{arg} must be an {kind.__name__}, not {value!r}")


def _unsupported(builder: str, arg: str, value: enum.Enum, why: str) -> ValueError:
    """A member the builder has no lowering for (or not with the other options given)."""
    return ValueError(f"{builder}: {arg}={type(value).__name__}.{value.name} is not supported: {why}")


class GraphHook(Protocol):
    """What the core calls on a graph it builds while hooks are set (llm.research.trace's
    GraphEdits implements it): edit the graph after it is built, read its outputs after it ran.
    Hooks are compared by identity, so a graph is reused only under the same hooks."""

    def apply(self, g: GraphBuilder) -> None: ...

    def collect(self, g: GraphBuilder, ub, outs: dict) -> None: ...


@dataclass(frozen=True)
class GraphParams:
    """Everything that fixes a graph's shape. Two ubatches with equal params reuse one graph
    (llm_graph_params::allow_reuse); the padded sizes keep the number of shapes small."""
    n_tokens: int          # ubatch tokens, padded to a bucket
    n_outputs: int         # output rows, padded to a bucket
    n_kv: int              # KV cells the attention reads, padded to a bucket
    embd_input: bool       # embeddings instead of token ids
    embeddings: bool = False  # also output the final hidden state (result_norm / result_embd)
    flash_attn: bool = True   # fused attention; False: kq -> kq_soft_max -> kqv nodes
    # interventions and captures (a GraphHook, compared by identity) applied to the built
    # graph, so a graph is reused only under the same edits
    edits: GraphHook | None = None
    n_kv_swa: int = 0      # cells the sliding-window layers read from their own cache (0: none)
    # the LoRA adapters applied (llm.adapter.LoraAdapter, compared by identity); their scales
    # are inputs (InpLora), so only the set selects a graph
    loras: tuple[LoraAdapter, ...] = ()
    # recurrent memory: the ubatch's sequences (a power of two, padded with the scratch cell),
    # each of n_tokens / n_seqs tokens (llama_ubatch's equal split); 0 without recurrent layers
    n_seqs: int = 0


class GraphInput:
    """A graph input: its tensors, how to fill them for a ubatch, and whether a graph built
    for other params can still take them."""

    def __init__(self, params: GraphParams):
        self.params = params

    def can_reuse(self, params: GraphParams) -> bool:
        return self.params == params

    def set_input(self, ub, values: dict) -> None:
        raise NotImplementedError


class InpEmbd(GraphInput):
    """Token ids (padded with id 0) or input embeddings."""

    def __init__(self, params: GraphParams, n_embd: int):
        super().__init__(params)
        self.embd: Tensor | None
        self.tokens: Tensor | None
        if params.embd_input:
            self.embd = new_input(F32, (n_embd, params.n_tokens), "inp_embd")
            self.tokens = None
        else:
            self.tokens = new_input(I32, (params.n_tokens,), "inp_tokens")
            self.embd = None

    def set_input(self, ub, values: dict) -> None:
        n = self.params.n_tokens
        if self.tokens is not None:
            tok = np.zeros(n, np.int32)
            tok[:ub.n_tokens] = ub.token
            values[self.tokens] = tok
        else:
            e = np.zeros((n, ub.embd.shape[1]), np.float32)
            e[:ub.n_tokens] = ub.embd
            values[self.embd] = e


class InpPos(GraphInput):
    """Token positions [n_tokens]; for M-RoPE models (n_pos_per_embd 4) the t, h, w, e streams
    [4 * n_tokens], a text token at (p, p, p, 0) as llama.cpp sets them, an image's token at
    the ubatch's 2-D positions."""

    def __init__(self, params: GraphParams, n_pos_per_embd: int = 1):
        super().__init__(params)
        self.n_pos_per_embd = n_pos_per_embd
        self.pos = new_input(I32, (params.n_tokens * n_pos_per_embd,), "inp_pos")

    def set_input(self, ub, values: dict) -> None:
        n = self.params.n_tokens
        p = np.zeros((self.n_pos_per_embd, n), np.int32)
        if ub.pos_sections is not None:
            p[:, :ub.n_tokens] = ub.pos_sections[:self.n_pos_per_embd]
        else:
            p[:min(3, self.n_pos_per_embd), :ub.n_tokens] = ub.pos
        values[self.pos] = p.reshape(-1)


class InpAttnScale(GraphInput):
    """Per-token query scale of attention temperature tuning (llama4, mistral3):
    log(floor((pos + offset) / floor_scale) + 1) * temp_scale + 1, as [1, 1, n_tokens]."""

    def __init__(self, params: GraphParams, temp_scale: float, floor_scale: int, offset: float):
        super().__init__(params)
        self.temp_scale, self.floor_scale, self.offset = temp_scale, floor_scale, offset
        self.scale = new_input(F32, (1, 1, params.n_tokens), "inp_attn_scale")

    def set_input(self, ub, values: dict) -> None:
        s = np.ones(self.params.n_tokens, np.float32)
        pos = ub.pos.astype(np.float32)
        s[:ub.n_tokens] = (np.log(np.floor((pos + np.float32(self.offset)) / np.float32(self.floor_scale)) + 1.0)
                           * np.float32(self.temp_scale) + 1.0)
        values[self.scale] = s.reshape(self.params.n_tokens, 1, 1)


class InpLora(GraphInput):
    """Each adapter's scale per token, [1, n_tokens] (a sequence's own scales or the context's;
    0 on padding), read by build_lora_mm: changing a scale changes an input, not the graph."""

    def __init__(self, params: GraphParams, scales: LoraScales):
        super().__init__(params)
        self.scales = scales
        self.scale = [new_input(F32, (1, params.n_tokens), f"inp_lora_scale-{k}") for k in range(len(params.loras))]

    def set_input(self, ub, values: dict) -> None:
        n = self.params.n_tokens
        per = self.scales.per_token(ub.seq_id, n)
        for k, t in enumerate(self.scale):
            values[t] = per[k].reshape(n, 1)


class InpOutIds(GraphInput):
    """Rows of the last layer that reach the output projection (padded with row 0)."""

    def __init__(self, params: GraphParams):
        super().__init__(params)
        self.out_ids = new_input(I32, (params.n_outputs,), "inp_out_ids")

    def set_input(self, ub, values: dict) -> None:
        ids = np.zeros(self.params.n_outputs, np.int32)
        rows = np.flatnonzero(ub.output).astype(np.int32)
        ids[:rows.size] = rows
        values[self.out_ids] = ids


class InpAttnKV(GraphInput):
    """The KV-cache attention inputs: the cells this ubatch writes (k_idxs) and the masks
    (one for full-attention layers, one for sliding-window layers when the model has them;
    with a separate window cache, its own write indices and a mask over its n_kv_swa cells);
    with a quantized cache the Hadamard matrices that turn Q and K, and V (k_rot, v_rot)."""

    def __init__(self, params: GraphParams, kv, with_swa: bool):
        super().__init__(params)
        self.kv = kv
        self.k_idxs = new_input(I32, (params.n_tokens,), "inp_k_idxs")
        self.kq_mask = new_input(F32, (params.n_kv, params.n_tokens), "kq_mask")
        own = kv.cells_swa is not None
        self.k_idxs_swa = new_input(I32, (params.n_tokens,), "inp_k_idxs_swa") if own else None
        n_kv_swa = params.n_kv_swa if own else params.n_kv
        self.kq_mask_swa = new_input(F32, (n_kv_swa, params.n_tokens), "kq_mask_swa") if with_swa else None
        self.slot: SlotInfo | None = None          # the ubatch's cells, set before set_input
        self.slot_swa: SlotInfo | None = None      # ... in the window cache, when there is one
        self.k_rot = new_input(F32, (kv.n_rot_k, kv.n_rot_k), "attn_inp_k_rot") if kv.n_rot_k else None
        self.v_rot = new_input(F32, (kv.n_rot_v, kv.n_rot_v), "attn_inp_v_rot") if kv.n_rot_v else None

    def set_input(self, ub, values: dict) -> None:
        n, n_kv = self.params.n_tokens, self.params.n_kv
        assert self.slot is not None    # the context sets it before set_input
        slot, slot_swa = self.slot, self.slot_swa
        for rot in (self.k_rot, self.v_rot):
            if rot is not None:
                values[rot] = hadamard(rot.ne[0])
        values[self.k_idxs] = self.kv.write_indices(slot, n)
        values[self.kq_mask] = self.kv.mask(ub, n, n_kv, swa=False)
        if self.k_idxs_swa is not None:
            assert slot_swa is not None     # a window cache gives every ubatch a slot there too
            values[self.k_idxs_swa] = self.kv.write_indices(slot_swa, n, swa=True)
        if self.kq_mask_swa is not None:
            n_kv_swa = self.params.n_kv_swa if self.k_idxs_swa is not None else n_kv
            values[self.kq_mask_swa] = self.kv.mask(ub, n, n_kv_swa, swa=True)


class InpRS(GraphInput):
    """The recurrent-state input (llm_graph_input_rs): the cell each of the ubatch's n_seqs
    sequences reads its states from and writes them back to (`inp_s_copy`)."""

    def __init__(self, params: GraphParams, rs):
        super().__init__(params)
        self.rs = rs
        self.s_copy = new_input(I32, (params.n_seqs,), "inp_s_copy")
        self.slot: np.ndarray | None = None        # the ubatch's cells, set before set_input

    def set_input(self, ub, values: dict) -> None:
        assert self.slot is not None    # the context sets it before set_input
        values[self.s_copy] = self.rs.copy_indices(self.slot, self.params.n_seqs)


def mul_mat_hadamard(cur: Tensor, rot: Tensor) -> Tensor:
    """cur turned by the Hadamard matrix rot [n, n] in runs of n along ne0 (llama.cpp's
    llama_mul_mat_hadamard): -> cur.ne."""
    n = rot.ne[0]
    res = ops.cont_2d(cur, n, cur.nelements() // n) if not cur.is_contiguous() else \
        ops.reshape_2d(cur, n, cur.nelements() // n)
    return ops.reshape_4d(ops.mul_mat(rot, res), *cur.ne)


def rope_multi_params(hp: HParams, il: int) -> dict:
    """rope_multi arguments for layer il: rope_params' with the model's sections and mode."""
    p = rope_params(hp, il)
    return dict(p, sections=tuple(hp.rope_sections), mode=int(hp.rope_type))


def rope_params(hp: HParams, il: int) -> dict:
    """rope_ext arguments for layer il; sliding-window layers may have their own base. YaRN
    follows cparams' default: ext_factor < 0 means "on exactly when the model uses YaRN"."""
    swa = hp.is_swa(il)
    return dict(n_dims=hp.n_rot_l(il), mode=int(hp.rope_type), n_ctx_orig=hp.n_ctx_orig_yarn,
                freq_base=hp.rope_freq_base_train_swa if swa else hp.rope_freq_base_train,
                freq_scale=hp.rope_freq_scale_train_swa if swa else hp.rope_freq_scale_train,
                ext_factor=yarn_ext_factor(hp), attn_factor=yarn_attn_factor(hp),
                beta_fast=hp.yarn_beta_fast, beta_slow=hp.yarn_beta_slow)


def yarn_ext_factor(hp: HParams) -> float:
    """cparams.yarn_ext_factor: the file's, else 1 exactly when the model was trained with YaRN."""
    if hp.yarn_ext_factor >= 0:
        return hp.yarn_ext_factor
    return 1.0 if hp.rope_scaling_type_train == RopeScalingType.YARN else 0.0


def yarn_attn_factor(hp: HParams) -> float:
    """cparams.yarn_attn_factor as llama_context derives it. With YaRN on, get_mscale of the
    scaling factor (over get_mscale with yarn_log_multiplier when the file has one; deepseek2
    uses that multiplier on both sides), divided by the 1 + 0.1 ln(factor) that ggml's rope
    multiplies back in; always times rope.scaling.attn_factor."""
    f = hp.yarn_attn_factor
    if yarn_ext_factor(hp) != 0.0:
        factor = 1.0 / hp.rope_freq_scale_train
        log_mul = hp.rope_yarn_log_mul
        if log_mul != 0.0:
            mscale = log_mul if hp.arch == LLMArch.DEEPSEEK2 and log_mul != 1.0 else 1.0
            f = _get_mscale(factor, mscale) / _get_mscale(factor, log_mul)
        else:
            f = _get_mscale(factor, 1.0)
        f /= 1.0 + 0.1 * math.log(factor)
    return f * hp.rope_attn_factor


def _get_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


class GraphBuilder:
    """State of one graph build (llm_graph_context): the model, params, inputs and the
    graph being expanded."""

    def __init__(self, model: Model, memory, params: GraphParams, *, lora: LoraScales | None = None):
        """memory: the context's (KVCache, MemoryRecurrent or MemoryHybrid); attention layers
        use its KV cache (`kv`), recurrent layers its states (`rs`)."""
        if params.loras and (lora is None or lora.adapters != params.loras):
            raise ValueError("GraphBuilder: params.loras needs the LoraScales of those adapters (lora=)")
        self.model = model
        self.lora = lora
        self.inp_lora: InpLora | None = None
        self.inp_out_ids: Tensor | None = None
        # input embeddings as given, [n_embd_inp, n_tokens] (None for tokens): DeepStack's slices
        self.t_inp_embd: Tensor | None = None
        self._lora_scale: dict[tuple[int, int], Tensor] = {}
        self.hparams = model.hparams
        self.memory = memory
        # None without attention layers (a recurrent memory) or without a memory (a graph for tests)
        self.kv: KVCache = memory.mem_attn if memory is not None else None  # type: ignore[assignment]
        self.rs: MemoryRecurrent | None = memory.mem_recr if memory is not None else None
        self.inp_rs: InpRS | None = None
        self.params = params
        self.n_tokens = params.n_tokens
        self.n_outputs = params.n_outputs
        self.n_kv = params.n_kv
        self.inputs: list[GraphInput] = []
        self.gf = Graph()
        self.inp_attn: InpAttnKV | None = None
        self.res_logits: Tensor | None = None
        self.res_embd: Tensor | None = None
        # each KV cache buffer as the graph last wrote it: a layer sharing another's cache reads it
        self.kv_written: dict[Tensor, Tensor] = {}

    def rope_params(self, il: int) -> dict:
        return rope_params(self.hparams, il)

    def rope_multi_params(self, il: int) -> dict:
        return rope_multi_params(self.hparams, il)

    def need(self, w: Tensor | None, what: str, il: int = -1) -> Tensor:
        """A weight the graph cannot do without; the loader declares these as required, so a
        None here is a builder bug, reported by name rather than as a failure deep in an op."""
        if w is None:
            where = f" of layer {il}" if il >= 0 else ""
            raise ModelLoadError(f"{self.model.path}: the {self.model.arch} graph needs tensor "
                                 f"{what!r}{where}, which the model does not have")
        return w

    def cb(self, t: Tensor, name: str, il: int = -1) -> Tensor:
        """Name an intermediate like llama.cpp's callback: `name-il` inside layers."""
        return t.set_name(f"{name}-{il}" if il >= 0 else name)

    def splice(self, inserted: dict[int, Tensor]) -> None:
        """Put each inserted[n.id] (a node reading n: an intervention, a gradient delta) after
        n in the built graph: every other consumer of n reads it instead, n's output flag (and
        res_logits) moves to it, and gf is rebuilt in order."""
        old = self.gf
        for n in old.nodes:       # the inserted nodes are not in old.nodes: they keep reading n
            if any(s.id in inserted for s in n.src):
                n.src = tuple(inserted.get(s.id, s) for s in n.src)
        for n in old.nodes:
            if n.id in inserted and n.flags & Flag.OUTPUT:
                n.flags &= ~Flag.OUTPUT
                inserted[n.id].set_output()
                if self.res_logits is n:
                    self.res_logits = inserted[n.id]
        gf = Graph()
        for n in old.nodes:
            gf.build_forward_expand(n)
            if n.id in inserted:
                gf.build_forward_expand(inserted[n.id])
        self.gf = gf

    # ---- inputs ----------------------------------------------------------------------

    def build_inp_embd(self, tok_embd: Tensor | None) -> Tensor:
        tok_embd = self.need(tok_embd, "token_embd")
        inp = InpEmbd(self.params, self.hparams.n_embd_inp())
        self.inputs.append(inp)
        if inp.tokens is not None:
            cur = ops.get_rows(tok_embd, inp.tokens)
            for k, adapter in enumerate(self.params.loras):    # the pair is flipped: rows of A by token
                lw = adapter.get_weight(tok_embd.name)
                if lw is None:
                    continue
                ax = ops.get_rows(lw.a, inp.tokens).set_name(f"{tok_embd.name}.lora_ax-{k}")
                delta = ops.scale(ops.mul_mat(lw.b, ax), lw.alpha_scale(adapter.alpha))
                delta = ops.mul(delta, self.lora_scale(k, self.n_tokens)).set_name(f"{tok_embd.name}.lora-{k}")
                cur = ops.add(cur, delta)
        else:
            assert inp.embd is not None   # InpEmbd holds one of the two
            self.t_inp_embd = cur = inp.embd
            if cur.ne[0] != self.hparams.n_embd:    # the model's own columns first (llama.cpp's view)
                cur = ops.view_2d(cur, self.hparams.n_embd, self.n_tokens, cur.nb[1], 0)
        return self.cb(cur, "inp_embd")

    def build_inp_pos(self) -> Tensor:
        inp = InpPos(self.params, self.hparams.n_pos_per_embd())
        self.inputs.append(inp)
        return inp.pos

    def build_inp_attn_scale(self) -> Tensor:
        hp = self.hparams
        inp = InpAttnScale(self.params, hp.f_attn_temp_scale, hp.n_attn_temp_floor_scale, hp.f_attn_temp_offset)
        self.inputs.append(inp)
        return inp.scale

    def build_inp_out_ids(self) -> Tensor | None:
        """None when every padded token is an output row (nothing to select)."""
        if self.n_outputs == self.n_tokens:
            return None
        inp = InpOutIds(self.params)
        self.inputs.append(inp)
        self.inp_out_ids = inp.out_ids
        return inp.out_ids

    def build_attn_inp_kv(self) -> InpAttnKV:
        with_swa = any(self.hparams.swa_layers)
        self.inp_attn = InpAttnKV(self.params, self.kv, with_swa)
        self.inputs.append(self.inp_attn)
        return self.inp_attn

    def build_rs_inp(self) -> InpRS:
        """The recurrent layers' input (llm_graph_context::build_rs_inp)."""
        if self.rs is None or not self.params.n_seqs:
            raise ValueError(f"{self.model.arch}: a recurrent layer needs a context with a recurrent memory "
                             f"and ubatches split by sequence (GraphParams.n_seqs)")
        self.inp_rs = InpRS(self.params, self.rs)
        self.inputs.append(self.inp_rs)
        return self.inp_rs

    def build_rs(self, inp: InpRS, s: Tensor, state_size: int) -> Tensor:
        """The states of the ubatch's sequences from a layer's buffer s [state_size, cells]:
        -> [state_size, n_seqs] (llama.cpp's build_rs, its copies done by seq_cp instead)."""
        return ops.get_rows(ops.reshape_2d(s, state_size, s.ne[1]), inp.s_copy)

    def set_slot(self, slot) -> None:
        """Hand the ubatch's place in the memory (Context's prepare) to the inputs that need it."""
        attn, recr = self.memory.split_slot(slot)
        if self.inp_attn is not None:
            self.inp_attn.slot, self.inp_attn.slot_swa = attn
        if self.inp_rs is not None:
            self.inp_rs.slot = recr

    # ---- LoRA ------------------------------------------------------------------------

    def lora_scale(self, k: int, n_rows: int) -> Tensor:
        """Adapter k's per-token scales [1, n_rows]: the input, or its output rows once the last
        layer kept only those (n_rows == n_outputs)."""
        key = (k, n_rows)
        if key in self._lora_scale:
            return self._lora_scale[key]
        if self.inp_lora is None:
            assert self.lora is not None        # checked in __init__
            self.inp_lora = InpLora(self.params, self.lora)
            self.inputs.append(self.inp_lora)
        s = self.inp_lora.scale[k]
        if n_rows != self.n_tokens:
            if self.inp_out_ids is None or n_rows != self.n_outputs:
                raise ValueError(f"build_lora_mm: {n_rows} rows are neither the ubatch's {self.n_tokens} tokens "
                                 f"nor its {self.n_outputs} outputs")
            s = ops.get_rows(s, self.inp_out_ids)
        self._lora_scale[key] = s
        return s

    def build_lora_mm(self, w: Tensor, cur: Tensor) -> Tensor:
        """mul_mat(w, cur) plus, for each adapter with a pair for w, scale * alpha / r * B (A cur)
        (llama.cpp's build_lora_mm), named `<weight>.lora_ax-k` and `<weight>.lora-k`. The
        token embedding's pair applies to the lookup only (build_inp_embd), not to a tied output."""
        res = ops.mul_mat(w, cur)
        if w.name == TOKEN_EMBD:
            return res
        for k, adapter in enumerate(self.params.loras):
            lw = adapter.get_weight(w.name)
            if lw is None:
                continue
            ax = ops.mul_mat(lw.a, self.lora_input(w, cur)).set_name(f"{w.name}.lora_ax-{k}")
            delta = ops.scale(ops.mul_mat(lw.b, ax), lw.alpha_scale(adapter.alpha))
            delta = ops.mul(delta, self.lora_scale(k, cur.ne[1])).set_name(f"{w.name}.lora-{k}")
            res = ops.add(res, delta)
        return res

    def lora_input(self, w: Tensor, cur: Tensor) -> Tensor:
        """What an adapter of w reads: cur (llm.finetune's training graph applies dropout here)."""
        return cur

    def build_lora_mm_id(self, w: Tensor, cur: Tensor, ids: Tensor) -> Tensor:
        """mul_mat_id(w, cur, ids) plus each adapter's expert pairs, B_e (A_e cur) for the chosen
        experts e (llama.cpp's build_lora_mm_id); cur [n_in, 1 or n_used, n_tokens]."""
        res = ops.mul_mat_id(w, cur, ids)
        for k, adapter in enumerate(self.params.loras):
            lw = adapter.get_weight(w.name)
            if lw is None:
                continue
            ax = ops.mul_mat_id(lw.a, cur, ids).set_name(f"{w.name}.lora_ax-{k}")
            delta = ops.scale(ops.mul_mat_id(lw.b, ax, ids), lw.alpha_scale(adapter.alpha))
            n_rows = cur.ne[2]
            scale = ops.reshape_3d(self.lora_scale(k, n_rows), 1, 1, n_rows)
            delta = ops.mul(delta, scale).set_name(f"{w.name}.lora-{k}")
            res = ops.add(res, delta)
        return res

    # ---- blocks ----------------------------------------------------------------------

    def build_norm(self, cur: Tensor, w: Tensor | None, b: Tensor | None, type_norm: LLMNormType,
                   il: int) -> Tensor:
        """norm or rms_norm over ne0 (type_norm), then the optional weight and bias."""
        _option("type_norm", type_norm, LLMNormType)
        if type_norm is LLMNormType.NORM:
            cur = ops.norm(cur, self.hparams.f_norm_eps)
        elif type_norm is LLMNormType.RMS:
            cur = ops.rms_norm(cur, self.hparams.f_norm_rms_eps)
        else:
            assert_never(type_norm)
        self.cb(cur, "norm", il)
        if w is not None:
            cur = ops.mul(cur, w)
            if b is not None:
                self.cb(cur, "norm_w", il)
        if b is not None:
            cur = ops.add(cur, b)
        return cur

    def build_qk_norm_all_heads(self, layer: Layer, q: Tensor, k: Tensor, il: int) -> tuple[Tensor, Tensor]:
        """RMS-norm Q and K over all their heads at once (OLMoE, MiniMax-M2: weights [n_head *
        head_dim]), then split the heads again: [d, n_head, n_tokens] in and out."""
        hp, d = self.hparams, self.hparams.n_embd_head_k
        q = ops.reshape_2d(q, d * hp.n_head(il), self.n_tokens)
        k = ops.reshape_2d(k, d * hp.n_head_kv(il), self.n_tokens)
        q = self.cb(self.build_norm(q, layer.attn_q_norm, None, LLMNormType.RMS, il), "Qcur_normed", il)
        k = self.cb(self.build_norm(k, layer.attn_k_norm, None, LLMNormType.RMS, il), "Kcur_normed", il)
        return ops.reshape_3d(q, d, hp.n_head(il), self.n_tokens), ops.reshape_3d(k, d, hp.n_head_kv(il), self.n_tokens)

    def build_qkv(self, layer: Layer, cur: Tensor, il: int) -> tuple[Tensor, Tensor, Tensor]:
        """Qcur [d_k, n_head, n_tokens], Kcur and Vcur [d, n_head_kv, n_tokens] from separate
        wq/wk/wv (plus optional biases) or a fused wqkv whose rows are [Q; K; V]."""
        hp = self.hparams
        d_k, d_v = hp.n_embd_head_k_l(il), hp.n_embd_head_v_l(il)
        n_head, n_head_kv = hp.n_head(il), hp.n_head_kv(il)
        if layer.wqkv is not None:
            qkv = self.cb(self.build_lora_mm(self.need(layer.wqkv, "attn_qkv", il), cur), "wqkv", il)
            if layer.bqkv is not None:
                qkv = self.cb(ops.add(qkv, layer.bqkv), "wqkv_b", il)
            row = qkv.nb[1]
            esz = qkv.nb[0]
            q = ops.view_3d(qkv, d_k, n_head, self.n_tokens, d_k * esz, row, 0)
            k = ops.view_3d(qkv, d_k, n_head_kv, self.n_tokens, d_k * esz, row, d_k * n_head * esz)
            v = ops.view_3d(qkv, d_v, n_head_kv, self.n_tokens, d_v * esz, row,
                            (d_k * n_head + d_k * n_head_kv) * esz)
            return self.cb(q, "Qcur", il), self.cb(k, "Kcur", il), self.cb(v, "Vcur", il)
        out = []
        for name, w, b, d, n in (("Qcur", layer.wq, layer.bq, d_k, n_head),
                                 ("Kcur", layer.wk, layer.bk, d_k, n_head_kv),
                                 ("Vcur", layer.wv, layer.bv, d_v, n_head_kv)):
            t = self.cb(self.build_lora_mm(self.need(w, name, il), cur), name, il)
            if b is not None:
                t = self.cb(ops.add(t, b), name, il)
            out.append(self.cb(ops.reshape_3d(t, d, n, self.n_tokens), name, il))
        return out[0], out[1], out[2]

    def build_ffn(self, cur: Tensor, up: Tensor | None, gate: Tensor | None, down: Tensor | None,
                  type_op: LLMFfnOpType, type_gate: LLMFfnGateType, il: int, *, up_b: Tensor | None = None,
                  gate_b: Tensor | None = None, down_b: Tensor | None = None) -> Tensor:
        """down(act(gate x) * up x) with a parallel gate (type_gate PAR: SILU, GELU or
        SWIGLU_OAI_MOE), down(act(up x)) without one (SEQ: SILU, GELU, or SWIGLU / GEGLU of an
        ffn_up that holds [gate; up] fused along its rows, Phi-3). Each projection may have a
        bias."""
        _option("type_op", type_op, LLMFfnOpType)
        _option("type_gate", type_gate, LLMFfnGateType)
        up, down = self.need(up, "ffn_up", il), self.need(down, "ffn_down", il)
        tmp = self.cb(self.build_lora_mm(up, cur), "ffn_up", il)
        if up_b is not None:
            tmp = self.cb(ops.add(tmp, up_b), "ffn_up_b", il)
        if type_gate is LLMFfnGateType.PAR:
            g = self.cb(self.build_lora_mm(self.need(gate, "ffn_gate", il), cur), "ffn_gate", il)
            if gate_b is not None:
                g = self.cb(ops.add(g, gate_b), "ffn_gate_b", il)
            cur = self._gated(g, tmp, type_op, "ffn", il, "build_ffn", "its gate is fused into ffn_up (type_gate SEQ)")
        elif type_gate is LLMFfnGateType.SEQ:
            if gate is not None:
                raise _unsupported("build_ffn", "type_gate", type_gate, "a sequential FFN has no ffn_gate here")
            if type_op is LLMFfnOpType.SILU:
                cur = self.cb(ops.silu(tmp), "ffn_silu", il)
            elif type_op is LLMFfnOpType.GELU:
                cur = self.cb(ops.gelu(tmp), "ffn_gelu", il)
            elif type_op is LLMFfnOpType.SWIGLU:
                cur = self.cb(ops.swiglu(tmp), "ffn_swiglu", il)
            elif type_op is LLMFfnOpType.GEGLU:
                cur = self.cb(ops.geglu(tmp), "ffn_geglu", il)
            elif type_op is LLMFfnOpType.RELU_SQR:
                cur = self.cb(ops.relu(tmp), "ffn_relu", il)
                cur = self.cb(ops.sqr(cur), "ffn_sqr(relu)", il)
            elif type_op is LLMFfnOpType.SWIGLU_OAI_MOE:
                raise _unsupported("build_ffn", "type_op", type_op, "it needs a parallel gate (type_gate PAR)")
            else:
                assert_never(type_op)
        else:
            assert_never(type_gate)
        cur = self.cb(self.build_lora_mm(down, cur), "ffn_down", il)
        if down_b is not None:       # as llama.cpp: the biased result is the caller's to name
            cur = ops.add(cur, down_b)
        return cur

    def _gated(self, gate: Tensor, up: Tensor, type_op: LLMFfnOpType, prefix: str, il: int, where: str,
               fused: str) -> Tensor:
        """act(gate) * up for a separate gate (llama.cpp's LLM_FFN_PAR), named <prefix>_swiglu etc.;
        the fused ops SWIGLU / GEGLU need their gate inside up, which `fused` says is not so here."""
        if type_op is LLMFfnOpType.SILU:
            return self.cb(ops.swiglu_split(gate, up), f"{prefix}_swiglu", il)
        if type_op is LLMFfnOpType.GELU:
            return self.cb(ops.geglu_split(gate, up), f"{prefix}_geglu", il)
        if type_op is LLMFfnOpType.SWIGLU_OAI_MOE:
            return self.cb(ops.swiglu_oai(gate, up, 1.702, 7.0), f"{prefix}_swiglu_oai", il)
        if type_op is LLMFfnOpType.SWIGLU or type_op is LLMFfnOpType.GEGLU:
            raise _unsupported(where, "type_op", type_op, fused)
        if type_op is LLMFfnOpType.RELU_SQR:
            raise _unsupported(where, "type_op", type_op, "it has no gate here (type_gate SEQ)")
        assert_never(type_op)

    def group_limited(self, selection: Tensor, n_expert: int, n_tokens: int, il: int) -> Tensor:
        """DeepSeek-V3's group-limited routing: experts in n_expert_groups groups, each scored by
        the sum of its two best selection values; only the n_group_used best groups stay
        selectable (the others -inf). [n_expert, n_tokens] -> the same."""
        hp = self.hparams
        n_groups, n_per = hp.n_expert_groups, n_expert // hp.n_expert_groups
        groups = ops.reshape_3d(selection, n_per, n_groups, n_tokens)
        best2 = ops.top_k(groups, 2)                                               # [2, groups, T]
        scores = ops.get_rows(ops.reshape_4d(groups, 1, n_per, n_groups, n_tokens), best2)
        scores = ops.sum_rows(ops.reshape_3d(scores, 2, n_groups, n_tokens))       # [1, groups, T]
        kept = self.cb(ops.top_k(ops.reshape_2d(scores, n_groups, n_tokens), hp.n_group_used),
                       "ffn_moe_group_topk", il)                                   # [n_group_used, T]
        masked = ops.set_rows(ops.scale(groups, 0.0, float("-inf")), ops.get_rows(groups, kept), kept)
        return self.cb(ops.reshape_2d(masked, n_expert, n_tokens), "ffn_moe_probs_masked", il)

    def build_moe_ffn(self, cur: Tensor, gate_inp: Tensor | None, up_exps: Tensor | None,
                      gate_exps: Tensor | None, down_exps: Tensor | None, n_expert: int,
                      n_expert_used: int, type_op: LLMFfnOpType, norm_w: bool,
                      gating_op: ExpertGatingFuncType, il: int, *, gate_inp_b: Tensor | None = None,
                      up_exps_b: Tensor | None = None, gate_exps_b: Tensor | None = None,
                      down_exps_b: Tensor | None = None, exp_probs_b: Tensor | None = None,
                      w_scale: float = 0.0, weight_before_ffn: bool = False, probs_in: Tensor | None = None,
                      gate_up_exps: Tensor | None = None, down_exps_s: Tensor | None = None) -> Tensor:
        """Mixture of experts (build_moe_ffn). gating_op SOFTMAX: weights are the softmax
        probabilities of the chosen experts (renormalized when norm_w); SOFTMAX_WEIGHT
        (gpt-oss): experts chosen by raw logits, their logits softmaxed; SIGMOID (llama4):
        experts chosen by raw logits, weighted by their sigmoid. Every expert is gated in
        parallel: type_op SILU (SwiGLU), GELU (GeGLU) or SWIGLU_OAI_MOE (gpt-oss's clamped
        SwiGLU). Router and expert biases are optional (the expert biases indexed by the chosen
        experts: ggml_add_id). exp_probs_b (DeepSeek-V3's selection bias) is added to the
        probabilities only to choose the experts, their weights stay unbiased; w_scale (other
        than 0 and 1) scales the weights after any renormalization. weight_before_ffn (llama4)
        scales each expert's input instead of its output. probs_in: router logits the caller
        computed (gemma4 routes from another input), in place of gate_inp x; gate_up_exps: the
        experts' gate and up fused along their rows, in place of gate_exps and up_exps;
        down_exps_s [n_expert]: a scale of each expert's output."""
        _option("type_op", type_op, LLMFfnOpType)
        _option("gating_op", gating_op, ExpertGatingFuncType)
        down_exps = self.need(down_exps, "ffn_down_exps", il)
        n_embd, n_tokens = cur.ne[0], cur.ne[1]
        if probs_in is None:
            logits = self.cb(self.build_lora_mm(self.need(gate_inp, "ffn_gate_inp", il), cur), "ffn_moe_logits", il)
        else:
            logits = probs_in
        if gate_inp_b is not None:
            logits = self.cb(ops.add(logits, gate_inp_b), "ffn_moe_logits_biased", il)
        if gating_op is ExpertGatingFuncType.SOFTMAX:
            probs = selection = ops.soft_max(logits)
        elif gating_op is ExpertGatingFuncType.SIGMOID:     # llama4 selects by logits: the same order
            probs = selection = ops.sigmoid(logits)
        elif gating_op is ExpertGatingFuncType.SOFTMAX_WEIGHT:
            probs = selection = logits
        elif gating_op is ExpertGatingFuncType.NONE:
            raise _unsupported("build_moe_ffn", "gating_op", gating_op, "it means unset, not a gating function")
        else:
            assert_never(gating_op)
        self.cb(probs, "ffn_moe_probs", il)
        if exp_probs_b is not None:
            selection = self.cb(ops.add(probs, exp_probs_b), "ffn_moe_probs_biased", il)
        if self.hparams.n_expert_groups > 1:
            selection = self.group_limited(selection, n_expert, n_tokens, il)
        selected = self.cb(ops.top_k(selection, n_expert_used), "ffn_moe_topk", il)
        w = ops.get_rows(ops.reshape_3d(probs, 1, n_expert, n_tokens), selected)
        self.cb(w, "ffn_moe_weights", il)
        if gating_op is ExpertGatingFuncType.SOFTMAX_WEIGHT:
            w = ops.reshape_3d(ops.soft_max(ops.reshape_2d(w, n_expert_used, n_tokens)), 1, n_expert_used, n_tokens)
            self.cb(w, "ffn_moe_weights_softmax", il)
        if norm_w:
            w = ops.reshape_2d(w, n_expert_used, n_tokens)
            w_sum = self.cb(ops.sum_rows(w), "ffn_moe_weights_sum", il)
            w_sum = self.cb(ops.clamp(w_sum, 6.103515625e-5, float("inf")), "ffn_moe_weights_sum_clamped", il)
            w = ops.div(w, w_sum)
            w = ops.reshape_3d(w, 1, n_expert_used, n_tokens)
            self.cb(w, "ffn_moe_weights_norm", il)
        if w_scale not in (0.0, 1.0):
            w = self.cb(ops.scale(w, w_scale), "ffn_moe_weights_scaled", il)
        flat_selected = ops.reshape_1d(selected, n_expert_used * n_tokens)

        def add_id(x: Tensor, b: Tensor | None, name: str) -> Tensor:
            if b is None:
                return x
            rows = ops.reshape_3d(ops.get_rows(b, flat_selected), b.ne[0], n_expert_used, n_tokens)
            return self.cb(ops.add(x, rows), name, il)

        x = ops.reshape_3d(cur, n_embd, 1, n_tokens)
        if weight_before_ffn:
            repeated = x
            for _ in range(n_expert_used - 1):
                repeated = ops.concat(repeated, x, 1)
            x = self.cb(ops.mul(repeated, w), "ffn_moe_weighted", il)
        if gate_up_exps is not None:
            gate_up = self.cb(self.build_lora_mm_id(gate_up_exps, x, selected), "ffn_moe_gate_up", il)
            gate, up = self._split_gate_up(gate_up, il)
        else:
            up = self.cb(self.build_lora_mm_id(self.need(up_exps, "ffn_up_exps", il), x, selected), "ffn_moe_up", il)
            up = add_id(up, up_exps_b, "ffn_moe_up_biased")
            gate = self.cb(self.build_lora_mm_id(self.need(gate_exps, "ffn_gate_exps", il), x, selected),
                           "ffn_moe_gate", il)
            gate = add_id(gate, gate_exps_b, "ffn_moe_gate_biased")
        par = self._gated(gate, up, type_op, "ffn_moe", il, "build_moe_ffn",
                          "experts have separate gate and up matrices")
        experts = self.cb(self.build_lora_mm_id(down_exps, par, selected), "ffn_moe_down", il)
        if down_exps_s is not None:     # each chosen expert's scale, as build_lora_mm_id's w_s
            s = ops.get_rows(ops.reshape_2d(down_exps_s, 1, down_exps_s.ne[0]), flat_selected)
            experts = self.cb(ops.mul(experts, ops.reshape_3d(s, 1, n_expert_used, n_tokens)),
                              "ffn_moe_down_scaled", il)
        experts = add_id(experts, down_exps_b, "ffn_moe_down_biased")
        if not weight_before_ffn:
            experts = self.cb(ops.mul(experts, w), "ffn_moe_weighted", il)
        moe_out = ops.view_2d(experts, n_embd, n_tokens, experts.nb[2], 0)
        for e in range(1, n_expert_used):
            view = ops.view_2d(experts, n_embd, n_tokens, experts.nb[2], e * experts.nb[1])
            moe_out = ops.add(moe_out, view)
        return self.cb(moe_out, "ffn_moe_out", il)

    def _split_gate_up(self, gate_up: Tensor, il: int) -> tuple[Tensor, Tensor]:
        """The gate and up halves (views) of fused experts' output [2 n_ff, n_expert_used, n_tokens]."""
        n_ff, ne1, ne2, nb1, nb2 = gate_up.ne[0] // 2, gate_up.ne[1], gate_up.ne[2], gate_up.nb[1], gate_up.nb[2]
        gate = self.cb(ops.view_3d(gate_up, n_ff, ne1, ne2, nb1, nb2, 0), "ffn_moe_gate", il)
        up = self.cb(ops.view_3d(gate_up, n_ff, ne1, ne2, nb1, nb2, n_ff * gate_up.nb[0]), "ffn_moe_up", il)
        return gate, up

    def build_attn(self, inp: InpAttnKV, wo: Tensor | None, bo: Tensor | None, q_cur: Tensor,
                   k_cur: Tensor | None, v_cur: Tensor | None, kq_scale: float, il: int,
                   softcap: float = 0.0, sinks: Tensor | None = None) -> Tensor:
        """Store this ubatch's K and V in the layer's cache cells, then attend over the first
        n_kv cells. q_cur [D, n_head, n_tokens], k_cur/v_cur [D, n_head_kv, n_tokens];
        sinks [n_head]: per-head attention sinks (gpt-oss). k_cur and v_cur None: a layer
        without a cache of its own (HParams.has_kv) attends to the one it shares, as its
        layer wrote it earlier in this graph. wo None: the heads' output [d_v * n_head, n_tokens]
        before any projection."""
        hp = self.hparams
        d_k, d_v = hp.n_embd_head_k_l(il), hp.n_embd_head_v_l(il)
        n_head_kv = hp.n_head_kv(il)
        gqa_k, gqa_v = hp.n_embd_k_gqa(il), hp.n_embd_v_gqa(il)
        k_cache, v_cache = self.kv.k_l[il], self.kv.v_l[il]
        if inp.k_rot is not None:       # a quantized cache holds K turned by a Hadamard matrix, Q turns alike
            q_cur = mul_mat_hadamard(q_cur, inp.k_rot)
            k_cur = None if k_cur is None else mul_mat_hadamard(k_cur, inp.k_rot)
        if inp.v_rot is not None and v_cur is not None:
            v_cur = mul_mat_hadamard(v_cur, inp.v_rot)
        # as llama.cpp: q, v, k enter the graph together, in this order (also fixes the order
        # of same-named nodes that llm.trace and the llama.cpp diff match by)
        for t in (q_cur, v_cur, k_cur):
            if t is not None:
                self.gf.build_forward_expand(t)
        own_swa = self.kv.is_swa(il)
        k_idxs = inp.k_idxs_swa if own_swa and inp.k_idxs_swa is not None else inp.k_idxs
        n_kv = self.params.n_kv_swa if own_swa else self.n_kv
        if k_cur is None or v_cur is None:
            if hp.has_kv(il) or k_cur is not v_cur or k_cache not in self.kv_written:
                raise ValueError(f"build_attn: layer {il} has K and V of its own, or the layer it shares "
                                 f"({hp.kv_layer(il)}) has not written them yet")
            k_upd, v_upd = self.kv_written[k_cache], self.kv_written[v_cache]
        else:
            if not k_cur.is_contiguous():
                k_cur = ops.cont(k_cur)
            if not v_cur.is_contiguous():
                v_cur = ops.cont(v_cur)
            k_upd = ops.set_rows(k_cache, ops.reshape_2d(k_cur, gqa_k, self.n_tokens), k_idxs)
            v_upd = ops.set_rows(v_cache, ops.reshape_2d(v_cur, gqa_v, self.n_tokens), k_idxs)
            self.cb(k_upd, "k_cache_upd", il)
            self.cb(v_upd, "v_cache_upd", il)
            self.kv_written[k_cache], self.kv_written[v_cache] = k_upd, v_upd
        rs_k, rs_v = types.row_size(k_cache.type, d_k), types.row_size(v_cache.type, d_v)
        k = ops.view_4d(k_upd, d_k, n_head_kv, n_kv, 1, rs_k, rs_k * n_head_kv, rs_k * n_head_kv * n_kv, 0)
        v = ops.view_4d(v_upd, d_v, n_head_kv, n_kv, 1, rs_v, rs_v * n_head_kv, rs_v * n_head_kv * n_kv, 0)
        q = ops.permute(q_cur, 0, 2, 1, 3)
        k = ops.permute(k, 0, 2, 1, 3)
        v = ops.permute(v, 0, 2, 1, 3)
        mask = inp.kq_mask_swa if hp.is_swa(il) else inp.kq_mask
        if self.params.flash_attn or sinks is not None:    # the unfused path has no attention sinks
            cur = self.cb(ops.flash_attn_ext(q, k, v, mask, kq_scale, 0.0, softcap, sinks), "__fattn__", il)
            cur = ops.reshape_2d(cur, d_v * hp.n_head(il), self.n_tokens)
        else:
            cur = self.build_attn_mha(q, k, v, mask, kq_scale, softcap, il)
        self.cb(cur, "kqv_out", il)
        if inp.v_rot is not None:       # back from V's rotation
            cur = mul_mat_hadamard(cur, inp.v_rot)
        if wo is None:          # the caller gates the heads' output before its own projection (qwen35)
            return cur
        cur = self.build_lora_mm(wo, cur)
        if bo is not None:
            cur = ops.add(cur, bo)
        return self.cb(cur, "attn_out", il)

    def build_attn_mla(self, inp: InpAttnKV, wo: Tensor | None, q_cur: Tensor, k_cur: Tensor, n_embd_v: int,
                       v_mla: Tensor | None, kq_scale: float, il: int) -> Tensor:
        """Multi-head latent attention with the absorption (llama.cpp's build_attn over
        build_attn_inp_k): the layer's cache holds each token's latent k_cur [D_k, 1, n_tokens]
        (the compressed KV, then its roped part: one KV head), V is a view of each cached row's
        first n_embd_v values, and the attention output [n_embd_v, n_head, n_tokens] is
        decompressed per head by v_mla (wv_b [n_embd_v, d_v, n_head]) before wo. q_cur
        [D_k, n_head, n_tokens] carries the queries absorbed into the latent space."""
        d_k = self.hparams.n_embd_head_k
        k_cache = self.kv.k_l[il]
        for t in (q_cur, k_cur):
            self.gf.build_forward_expand(t)
        if not k_cur.is_contiguous():
            k_cur = ops.cont(k_cur)
        k_upd = self.cb(ops.set_rows(k_cache, ops.reshape_2d(k_cur, d_k, self.n_tokens), inp.k_idxs), "k_cache_upd", il)
        rs = types.row_size(k_cache.type, d_k)
        k = ops.view_4d(k_upd, d_k, 1, self.n_kv, 1, rs, rs, rs * self.n_kv, 0)
        v = ops.view_4d(k_upd, n_embd_v, 1, self.n_kv, 1, rs, rs, rs * self.n_kv, 0)
        q, k, v = ops.permute(q_cur, 0, 2, 1, 3), ops.permute(k, 0, 2, 1, 3), ops.permute(v, 0, 2, 1, 3)
        n_head = q_cur.ne[1]
        if self.params.flash_attn:
            cur = self.cb(ops.flash_attn_ext(q, k, v, inp.kq_mask, kq_scale, 0.0, 0.0, None), "__fattn__", il)
            if v_mla is not None:       # [n_embd_v, n_head, T] -> per head [d_v, n_head, T]
                cur = self.cb(ops.mul_mat(v_mla, ops.permute(cur, 0, 2, 1, 3)), "fattn_mla", il)
                cur = ops.cont(ops.permute(cur, 0, 2, 1, 3))
            cur = ops.reshape_2d(cur, cur.ne[0] * n_head, self.n_tokens)
        else:
            cur = self.build_attn_mha(q, k, v, inp.kq_mask, kq_scale, 0.0, il, v_mla=v_mla)
        self.cb(cur, "kqv_out", il)
        return self.build_lora_mm(self.need(wo, "attn_output", il), cur)

    def build_mamba_layer(self, inp: InpRS, cur: Tensor, layer: Layer, il: int) -> Tensor:
        """A Mamba block (llama.cpp's llm_build_mamba_base::build_mamba_layer): in-projection
        to x and z, the causal conv over x continuing the sequence's conv state, the
        selective scan from its SSM state (dt, B, C from x), y + D x gated by silu(z), the
        out-projection. cur [n_embd, n_tokens] -> [n_embd, n_tokens]; both states written back."""
        hp, rs = self.hparams, self.rs
        assert rs is not None       # build_rs_inp checked
        r_all, s_all = rs.r_l[il], rs.s_l[il]
        assert r_all is not None and s_all is not None     # the memory holds every recurrent layer
        d_conv, d_inner, d_state, dt_rank = hp.ssm_d_conv, hp.ssm_d_inner, hp.ssm_d_state, hp.ssm_dt_rank
        n_seqs = self.params.n_seqs
        n_seq_tokens = self.n_tokens // n_seqs
        conv = ops.reshape_3d(self.build_rs(inp, r_all, hp.n_embd_r()), d_conv - 1, d_inner, n_seqs)
        cur = ops.reshape_3d(cur, cur.ne[0], n_seq_tokens, n_seqs)
        xz = self.build_lora_mm(self.need(layer.ssm_in, "ssm_in", il), cur)        # [2 d_inner, T, S]
        x = ops.view_3d(xz, d_inner, xz.ne[1], xz.ne[2], xz.nb[1], xz.nb[2], 0)
        z = ops.view_3d(xz, d_inner, xz.ne[1], xz.ne[2], xz.nb[1], xz.nb[2], d_inner * 4)
        conv_x = ops.concat(conv, ops.transpose(x), 0)                          # [d_conv - 1 + T, d_inner, S]
        last_conv = ops.view_3d(conv_x, d_conv - 1, d_inner, n_seqs, conv_x.nb[1], conv_x.nb[2],
                                n_seq_tokens * conv_x.nb[0])
        self.write_rs(r_all, ops.reshape_2d(ops.cont(last_conv), hp.n_embd_r(), n_seqs), inp)
        x = ops.ssm_conv(conv_x, self.need(layer.ssm_conv1d, "ssm_conv1d", il))
        x = ops.silu(ops.add(x, self.need(layer.ssm_conv1d_b, "ssm_conv1d_b", il)))
        x_db = self.build_lora_mm(self.need(layer.ssm_x, "ssm_x", il), x)          # [dt_rank + 2 d_state, T, S]
        dt = ops.view_3d(x_db, dt_rank, n_seq_tokens, n_seqs, x_db.nb[1], x_db.nb[2], 0)
        B = ops.view_4d(x_db, d_state, 1, n_seq_tokens, n_seqs, d_state * 4, x_db.nb[1], x_db.nb[2], dt_rank * 4)
        C = ops.view_4d(x_db, d_state, 1, n_seq_tokens, n_seqs, d_state * 4, x_db.nb[1], x_db.nb[2],
                        (dt_rank + d_state) * 4)
        if hp.ssm_dt_b_c_rms or (layer.ssm_dt_norm is not None and layer.ssm_b_norm is not None
                                 and layer.ssm_c_norm is not None):
            dt = self.build_norm(dt, layer.ssm_dt_norm, None, LLMNormType.RMS, il)
            B = self.build_norm(B, layer.ssm_b_norm, None, LLMNormType.RMS, il)
            C = self.build_norm(C, layer.ssm_c_norm, None, LLMNormType.RMS, il)
        else:
            dt = ops.cont(dt)
        dt = self.build_lora_mm(self.need(layer.ssm_dt, "ssm_dt", il), dt)
        dt = ops.add(dt, self.need(layer.ssm_dt_b, "ssm_dt_b", il))
        x_in = x
        x = ops.reshape_4d(x, 1, d_inner, n_seq_tokens, n_seqs)
        ssm = ops.reshape_4d(s_all, d_state, 1, d_inner, s_all.ne[1])
        y_ssm = ops.ssm_scan(ssm, x, dt, self.need(layer.ssm_a, "ssm_a", il), B, C, inp.s_copy)
        self.write_rs(s_all, ops.view_2d(y_ssm, hp.n_embd_s(), n_seqs, hp.n_embd_s() * 4, x.nelements() * 4), inp)
        y = ops.view_3d(y_ssm, d_inner, n_seq_tokens, n_seqs, x.nb[2], x.nb[3], 0)
        y = ops.add(y, ops.mul(x_in, self.need(layer.ssm_d, "ssm_d", il)))
        y = ops.swiglu_split(ops.cont(z), y)
        cur = self.build_lora_mm(self.need(layer.ssm_out, "ssm_out", il), y)
        return ops.reshape_2d(cur, cur.ne[0], n_seq_tokens * n_seqs)

    def build_mamba2_layer(self, inp: InpRS, cur: Tensor, layer: Layer, il: int) -> Tensor:
        """A Mamba-2 block (build_mamba2_layer): one in-projection to z, xBC and dt per head,
        the causal conv over xBC, the scan with one scalar decay per head and B, C shared by
        head groups, y + D x gated by silu(z), the grouped RMS norm, the out-projection.
        cur [n_embd, n_tokens] -> `mamba_out` [n_embd, n_tokens]."""
        hp, rs = self.hparams, self.rs
        assert rs is not None       # build_rs_inp checked
        r_all, s_all = rs.r_l[il], rs.s_l[il]
        assert r_all is not None and s_all is not None     # the memory holds every recurrent layer
        d_conv, d_inner, d_state = hp.ssm_d_conv, hp.ssm_d_inner, hp.ssm_d_state
        n_head, n_group = hp.ssm_dt_rank, hp.ssm_n_group
        head_dim = d_inner // n_head
        conv_dim = d_inner + 2 * n_group * d_state
        n_seqs = self.params.n_seqs
        n_seq_tokens = self.n_tokens // n_seqs
        conv = ops.reshape_3d(self.build_rs(inp, r_all, hp.n_embd_r()), d_conv - 1, conv_dim, n_seqs)
        zxbcdt = self.build_lora_mm(self.need(layer.ssm_in, "ssm_in", il), cur)
        zxbcdt = ops.reshape_3d(zxbcdt, zxbcdt.ne[0], n_seq_tokens, n_seqs)
        nb1, nb2 = zxbcdt.nb[1], zxbcdt.nb[2]
        z = ops.view_4d(zxbcdt, head_dim, n_head, n_seq_tokens, n_seqs, head_dim * 4, nb1, nb2, 0)
        xbc = ops.view_3d(zxbcdt, conv_dim, n_seq_tokens, n_seqs, nb1, nb2, d_inner * 4)
        dt = ops.view_3d(zxbcdt, n_head, n_seq_tokens, n_seqs, nb1, nb2, (d_inner + conv_dim) * 4)
        conv_x = ops.concat(conv, ops.transpose(xbc), 0)                        # [d_conv - 1 + T, conv_dim, S]
        last_conv = ops.view_3d(conv_x, d_conv - 1, conv_dim, n_seqs, conv_x.nb[1], conv_x.nb[2],
                                n_seq_tokens * conv_x.nb[0])
        self.write_rs(r_all, ops.reshape_2d(ops.cont(last_conv), hp.n_embd_r(), n_seqs), inp)
        xbc = ops.ssm_conv(conv_x, self.need(layer.ssm_conv1d, "ssm_conv1d", il))
        if layer.ssm_conv1d_b is not None:      # optional in granitehybrid
            xbc = ops.add(xbc, layer.ssm_conv1d_b)
        xbc = ops.silu(xbc)
        nb1, nb2 = xbc.nb[1], xbc.nb[2]
        x = ops.view_4d(xbc, head_dim, n_head, n_seq_tokens, n_seqs, head_dim * 4, nb1, nb2, 0)
        B = ops.view_4d(xbc, d_state, n_group, n_seq_tokens, n_seqs, d_state * 4, nb1, nb2, d_inner * 4)
        C = ops.view_4d(xbc, d_state, n_group, n_seq_tokens, n_seqs, d_state * 4, nb1, nb2,
                        (d_inner + n_group * d_state) * 4)
        dt = ops.add(ops.cont(dt), self.need(layer.ssm_dt_b, "ssm_dt_b", il))
        ssm = ops.reshape_4d(s_all, d_state, head_dim, n_head, s_all.ne[1])
        y_ssm = ops.ssm_scan(ssm, x, dt, self.need(layer.ssm_a, "ssm_a", il), B, C, inp.s_copy)
        self.write_rs(s_all, ops.view_2d(y_ssm, hp.n_embd_s(), n_seqs, hp.n_embd_s() * 4, x.nelements() * 4), inp)
        rs_h = head_dim * 4
        y = ops.view_4d(y_ssm, head_dim, n_head, n_seq_tokens, n_seqs, rs_h, n_head * rs_h,
                        n_seq_tokens * n_head * rs_h, 0)
        y = self.cb(ops.add(y, ops.mul(x, self.need(layer.ssm_d, "ssm_d", il))), "mamba2_y_add_d", il)
        y = ops.swiglu_split(ops.cont(z), y)
        if layer.ssm_norm is not None:
            y = ops.reshape_4d(y, d_inner // n_group, n_group, n_seq_tokens, n_seqs)
            y = self.build_norm(y, layer.ssm_norm, None, LLMNormType.RMS, il)
        y = ops.reshape_2d(y, d_inner, n_seq_tokens * n_seqs)
        cur = self.build_lora_mm(self.need(layer.ssm_out, "ssm_out", il), y)
        return self.cb(cur, "mamba_out", il)

    def write_rs(self, s_all: Tensor, new: Tensor, inp: InpRS) -> None:
        """The ubatch's sequences' new states [state_size, n_seqs] into their cells of s_all."""
        self.gf.build_forward_expand(ops.set_rows(s_all, new, inp.s_copy))

    def build_attn_mha(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, kq_scale: float,
                       softcap: float, il: int, *, v_mla: Tensor | None = None) -> Tensor:
        """Attention as separate nodes, so the probabilities can be read (`kq_soft_max-il`,
        [n_kv, n_tokens, n_head]); q [D, n_tokens, n_head], k [D, n_kv, n_head_kv], v
        [Dv, n_kv, n_head_kv] -> [Dv * n_head, n_tokens]; with MLA's v_mla the per-head output
        is decompressed first (kqv_mla)."""
        kq = self.cb(ops.mul_mat(k, q), "kq", il)
        if softcap > 0.0:
            kq = self.cb(ops.scale(kq, kq_scale / softcap), "kq_scaled_1", il)
            kq = self.cb(ops.tanh(kq), "kq_tanh", il)
            kq = self.cb(ops.scale(kq, softcap), "kq_scaled_2", il)
            kq_scale = 1.0
        kq = self.cb(ops.soft_max_ext(kq, mask, kq_scale, 0.0), "kq_soft_max", il)
        vt = ops.cont(ops.permute(v, 1, 0, 2, 3))                 # [n_kv, Dv, n_head_kv]
        kqv = self.cb(ops.mul_mat(vt, kq), "kqv", il)               # [Dv, n_tokens, n_head]
        if v_mla is not None:
            kqv = self.cb(ops.mul_mat(v_mla, kqv), "kqv_mla", il)
        cur = ops.permute(kqv, 0, 2, 1, 3)
        return ops.cont_2d(cur, kqv.ne[0] * kqv.ne[2], self.n_tokens)

    def build_embd_output(self, cur: Tensor, name: str = "result_norm") -> Tensor:
        """The final hidden state [n_embd, n_outputs] (llama.cpp's t_embd), an output of the
        graph when the context wants embeddings (an encoder's only output)."""
        self.cb(cur, name)
        self.res_embd = cur
        if self.params.embeddings:
            cur.set_output()
            self.gf.build_forward_expand(cur)
        return cur

    def build_output(self, cur: Tensor, final_softcap: float = 0.0, *,
                     type_norm: LLMNormType = LLMNormType.RMS, logit_scale: float = 1.0) -> Tensor:
        """result_norm -> result_output (logits [n_vocab, n_outputs]): the output norm
        (type_norm) with the model's optional norm and output biases, logits multiplied by
        `logit_scale`, soft-capped if asked."""
        m = self.model
        cur = self.build_embd_output(self.build_norm(cur, m.output_norm, m.output_norm_b, type_norm, -1))
        cur = self.build_lora_mm(self.need(m.output, "output"), cur)
        if m.output_b is not None:
            cur = ops.add(cur, m.output_b)
        if logit_scale != 1.0:
            cur = ops.scale(cur, logit_scale)
        if final_softcap > 0.0:
            cur = ops.scale(ops.tanh(ops.scale(cur, 1.0 / final_softcap)), final_softcap)
        self.cb(cur, "result_output")
        cur.set_output()
        self.res_logits = cur
        self.gf.build_forward_expand(cur)
        return cur

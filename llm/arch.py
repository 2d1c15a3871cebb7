"""Name tables of llama.cpp's llama-arch.h/.cpp: architectures, GGUF keys, tensor names.

GGUF key and tensor names come from these tables (`LLMKV.X.key(arch)`, `tn(...)`), never
from string literals scattered in model files. Which tensors an architecture has is said
once, by its `load_tensors` in llm/models/<arch>.py: the loader rejects a missing tensor
and any tensor of the file that no declaration claimed. The registry of supported
architectures is `llm.models.ARCHS`.
"""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Protocol

from llm.errors import ModelLoadError

if TYPE_CHECKING:
    from llm.graph import GraphBuilder
    from llm.hparams import HParams
    from llm.loader import GGUFMeta, ModelLoader
    from llm.model import Model


class LLMArch(enum.Enum):
    """Architecture names as written in `general.architecture` (llama.cpp's LLM_ARCH_NAMES).

    A name here is known to llama.cpp; only those with a registered builder can be loaded.
    """

    LLAMA = "llama"
    LLAMA4 = "llama4"
    DECI = "deci"
    FALCON = "falcon"
    GROK = "grok"
    GPT2 = "gpt2"
    GPTJ = "gptj"
    GPTNEOX = "gptneox"
    MPT = "mpt"
    BAICHUAN = "baichuan"
    STARCODER = "starcoder"
    REFACT = "refact"
    BERT = "bert"
    NOMIC_BERT = "nomic-bert"
    BLOOM = "bloom"
    STABLELM = "stablelm"
    QWEN = "qwen"
    QWEN2 = "qwen2"
    QWEN2MOE = "qwen2moe"
    QWEN2VL = "qwen2vl"
    QWEN3VL = "qwen3vl"
    QWEN3VLMOE = "qwen3vlmoe"
    QWEN3 = "qwen3"
    QWEN3MOE = "qwen3moe"
    PHI2 = "phi2"
    PHI3 = "phi3"
    PHIMOE = "phimoe"
    PLAMO = "plamo"
    CODESHELL = "codeshell"
    ORION = "orion"
    INTERNLM2 = "internlm2"
    MINICPM = "minicpm"
    MINICPM3 = "minicpm3"
    GEMMA = "gemma"
    GEMMA2 = "gemma2"
    GEMMA3 = "gemma3"
    GEMMA3N = "gemma3n"
    GEMMA4 = "gemma4"
    STARCODER2 = "starcoder2"
    MAMBA = "mamba"
    MAMBA2 = "mamba2"
    JAMBA = "jamba"
    FALCON_H1 = "falcon-h1"
    XVERSE = "xverse"
    COMMAND_R = "command-r"
    COHERE2 = "cohere2"
    DBRX = "dbrx"
    OLMO = "olmo"
    OLMO2 = "olmo2"
    OLMOE = "olmoe"
    OPENELM = "openelm"
    ARCTIC = "arctic"
    DEEPSEEK = "deepseek"
    DEEPSEEK2 = "deepseek2"
    CHATGLM = "chatglm"
    GLM4 = "glm4"
    BITNET = "bitnet"
    T5 = "t5"
    T5ENCODER = "t5encoder"
    JAIS = "jais"
    NEMOTRON = "nemotron"
    EXAONE = "exaone"
    RWKV6 = "rwkv6"
    GRANITE = "granite"
    GRANITE_MOE = "granitemoe"
    GRANITE_HYBRID = "granitehybrid"
    NEMOTRON_H = "nemotron_h"
    LFM2 = "lfm2"
    LFM2MOE = "lfm2moe"
    QWEN3NEXT = "qwen3next"
    QWEN35 = "qwen35"
    QWEN35MOE = "qwen35moe"
    CHAMELEON = "chameleon"
    SMOLLM3 = "smollm3"
    MISTRAL3 = "mistral3"
    OPENAI_MOE = "gpt-oss"
    ERNIE4_5 = "ernie4_5"
    ERNIE4_5_MOE = "ernie4_5-moe"
    GLM4_MOE = "glm4moe"
    SEED_OSS = "seed_oss"
    EXAONE4 = "exaone4"
    MINIMAX_M2 = "minimax-m2"
    HUNYUAN_MOE = "hunyuan-moe"
    APERTUS = "apertus"


def arch_from_name(name: str) -> LLMArch:
    """The LLMArch for a `general.architecture` value; ModelLoadError naming an unknown one."""
    try:
        return LLMArch(name)
    except ValueError:
        raise ModelLoadError(f"unknown model architecture: '{name}'") from None


def _arch_name(arch: LLMArch | str) -> str:
    return arch.value if isinstance(arch, LLMArch) else arch


class LLMKV(enum.Enum):
    """GGUF metadata keys (llama.cpp's LLM_KV_NAMES); `%s` stands for the architecture name."""

    GENERAL_TYPE = "general.type"
    GENERAL_ARCHITECTURE = "general.architecture"
    GENERAL_QUANTIZATION_VERSION = "general.quantization_version"
    GENERAL_ALIGNMENT = "general.alignment"
    GENERAL_FILE_TYPE = "general.file_type"
    GENERAL_NAME = "general.name"
    GENERAL_AUTHOR = "general.author"
    GENERAL_VERSION = "general.version"
    GENERAL_URL = "general.url"
    GENERAL_DESCRIPTION = "general.description"
    GENERAL_LICENSE = "general.license"
    GENERAL_SOURCE_URL = "general.source.url"
    GENERAL_SOURCE_HF_REPO = "general.source.huggingface.repository"
    # Apertus' xIELU activation, per layer (no architecture prefix, as llama.cpp's LLM_KV_XIELU_*)
    XIELU_ALPHA_N = "xielu.alpha_n"
    XIELU_ALPHA_P = "xielu.alpha_p"
    XIELU_BETA = "xielu.beta"
    XIELU_EPS = "xielu.eps"
    ADAPTER_TYPE = "adapter.type"
    ADAPTER_LORA_ALPHA = "adapter.lora.alpha"
    ADAPTER_ALORA_INVOCATION_TOKENS = "adapter.alora.invocation_tokens"
    # written by llama-quantize when it used an importance matrix (tools/quantize/quantize.cpp)
    QUANTIZE_IMATRIX_FILE = "quantize.imatrix.file"
    QUANTIZE_IMATRIX_DATASET = "quantize.imatrix.dataset"
    QUANTIZE_IMATRIX_N_ENTRIES = "quantize.imatrix.entries_count"
    QUANTIZE_IMATRIX_N_CHUNKS = "quantize.imatrix.chunks_count"
    # an importance-matrix GGUF (llama-imatrix)
    IMATRIX_DATASETS = "imatrix.datasets"
    IMATRIX_CHUNK_COUNT = "imatrix.chunk_count"
    IMATRIX_CHUNK_SIZE = "imatrix.chunk_size"

    VOCAB_SIZE = "%s.vocab_size"
    CONTEXT_LENGTH = "%s.context_length"
    EMBEDDING_LENGTH = "%s.embedding_length"
    BLOCK_COUNT = "%s.block_count"
    LEADING_DENSE_BLOCK_COUNT = "%s.leading_dense_block_count"
    FEED_FORWARD_LENGTH = "%s.feed_forward_length"
    EXPERT_FEED_FORWARD_LENGTH = "%s.expert_feed_forward_length"
    EXPERT_SHARED_FEED_FORWARD_LENGTH = "%s.expert_shared_feed_forward_length"
    USE_PARALLEL_RESIDUAL = "%s.use_parallel_residual"
    TENSOR_DATA_LAYOUT = "%s.tensor_data_layout"
    EXPERT_COUNT = "%s.expert_count"
    EXPERT_USED_COUNT = "%s.expert_used_count"
    EXPERT_SHARED_COUNT = "%s.expert_shared_count"
    EXPERT_WEIGHTS_SCALE = "%s.expert_weights_scale"
    EXPERT_WEIGHTS_NORM = "%s.expert_weights_norm"
    EXPERT_GATING_FUNC = "%s.expert_gating_func"
    INTERLEAVE_MOE_LAYER_STEP = "%s.interleave_moe_layer_step"
    POOLING_TYPE = "%s.pooling_type"
    CLASSIFIER_OUTPUT_LABELS = "%s.classifier.output_labels"
    LOGIT_SCALE = "%s.logit_scale"
    DECODER_START_TOKEN_ID = "%s.decoder_start_token_id"
    ATTN_LOGIT_SOFTCAPPING = "%s.attn_logit_softcapping"
    FINAL_LOGIT_SOFTCAPPING = "%s.final_logit_softcapping"
    RESIDUAL_SCALE = "%s.residual_scale"
    EMBEDDING_SCALE = "%s.embedding_scale"
    EMBEDDING_LENGTH_PER_LAYER = "%s.embedding_length_per_layer_input"

    ATTENTION_HEAD_COUNT = "%s.attention.head_count"
    ATTENTION_HEAD_COUNT_KV = "%s.attention.head_count_kv"
    ATTENTION_MAX_ALIBI_BIAS = "%s.attention.max_alibi_bias"
    ATTENTION_CLAMP_KQV = "%s.attention.clamp_kqv"
    ATTENTION_KEY_LENGTH = "%s.attention.key_length"
    ATTENTION_VALUE_LENGTH = "%s.attention.value_length"
    ATTENTION_KEY_LENGTH_SWA = "%s.attention.key_length_swa"
    ATTENTION_VALUE_LENGTH_SWA = "%s.attention.value_length_swa"
    ATTENTION_SHARED_KV_LAYERS = "%s.attention.shared_kv_layers"
    ATTENTION_Q_LORA_RANK = "%s.attention.q_lora_rank"
    ATTENTION_KV_LORA_RANK = "%s.attention.kv_lora_rank"
    ATTENTION_KEY_LENGTH_MLA = "%s.attention.key_length_mla"
    ATTENTION_VALUE_LENGTH_MLA = "%s.attention.value_length_mla"
    EXPERT_GROUP_COUNT = "%s.expert_group_count"
    EXPERT_GROUP_USED_COUNT = "%s.expert_group_used_count"
    ATTENTION_LAYERNORM_EPS = "%s.attention.layer_norm_epsilon"
    ATTENTION_LAYERNORM_RMS_EPS = "%s.attention.layer_norm_rms_epsilon"
    ATTENTION_CAUSAL = "%s.attention.causal"
    ATTENTION_SLIDING_WINDOW = "%s.attention.sliding_window"
    ATTENTION_SLIDING_WINDOW_PATTERN = "%s.attention.sliding_window_pattern"
    ATTENTION_SCALE = "%s.attention.scale"
    ATTENTION_TEMPERATURE_SCALE = "%s.attention.temperature_scale"

    ROPE_DIMENSION_COUNT = "%s.rope.dimension_count"
    ROPE_DIMENSION_COUNT_SWA = "%s.rope.dimension_count_swa"
    ROPE_DIMENSION_SECTIONS = "%s.rope.dimension_sections"
    NUM_DEEPSTACK_LAYERS = "%s.n_deepstack_layers"
    NEXTN_PREDICT_LAYERS = "%s.nextn_predict_layers"
    ROPE_FREQ_BASE = "%s.rope.freq_base"
    ROPE_FREQ_BASE_SWA = "%s.rope.freq_base_swa"
    ROPE_SCALE_LINEAR = "%s.rope.scale_linear"
    ROPE_SCALING_TYPE = "%s.rope.scaling.type"
    ROPE_SCALING_FACTOR = "%s.rope.scaling.factor"
    ROPE_SCALING_ATTN_FACTOR = "%s.rope.scaling.attn_factor"
    ROPE_SCALING_ORIG_CTX_LEN = "%s.rope.scaling.original_context_length"
    ROPE_SCALING_FINETUNED = "%s.rope.scaling.finetuned"
    ROPE_SCALING_YARN_LOG_MUL = "%s.rope.scaling.yarn_log_multiplier"
    ROPE_SCALING_YARN_EXT_FACTOR = "%s.rope.scaling.yarn_ext_factor"
    ROPE_SCALING_YARN_ATTN_FACTOR = "%s.rope.scaling.yarn_attn_factor"
    ROPE_SCALING_YARN_BETA_FAST = "%s.rope.scaling.yarn_beta_fast"
    ROPE_SCALING_YARN_BETA_SLOW = "%s.rope.scaling.yarn_beta_slow"

    SSM_CONV_KERNEL = "%s.ssm.conv_kernel"
    SSM_INNER_SIZE = "%s.ssm.inner_size"
    SSM_STATE_SIZE = "%s.ssm.state_size"
    SSM_TIME_STEP_RANK = "%s.ssm.time_step_rank"
    SSM_GROUP_COUNT = "%s.ssm.group_count"
    SSM_DT_B_C_RMS = "%s.ssm.dt_b_c_rms"
    FULL_ATTENTION_INTERVAL = "%s.full_attention_interval"
    ATTENTION_RECURRENT_LAYERS = "%s.attention.recurrent_layers"
    SHORTCONV_L_CACHE = "%s.shortconv.l_cache"

    SPLIT_NO = "split.no"
    SPLIT_COUNT = "split.count"
    SPLIT_TENSORS_COUNT = "split.tensors.count"

    TOKENIZER_MODEL = "tokenizer.ggml.model"
    TOKENIZER_PRE = "tokenizer.ggml.pre"
    TOKENIZER_LIST = "tokenizer.ggml.tokens"
    TOKENIZER_TOKEN_TYPE = "tokenizer.ggml.token_type"
    TOKENIZER_TOKEN_TYPE_COUNT = "tokenizer.ggml.token_type_count"
    TOKENIZER_SCORES = "tokenizer.ggml.scores"
    TOKENIZER_MERGES = "tokenizer.ggml.merges"
    TOKENIZER_BOS_ID = "tokenizer.ggml.bos_token_id"
    TOKENIZER_EOS_ID = "tokenizer.ggml.eos_token_id"
    TOKENIZER_EOT_ID = "tokenizer.ggml.eot_token_id"
    TOKENIZER_EOM_ID = "tokenizer.ggml.eom_token_id"
    TOKENIZER_UNK_ID = "tokenizer.ggml.unknown_token_id"
    TOKENIZER_SEP_ID = "tokenizer.ggml.seperator_token_id"
    TOKENIZER_PAD_ID = "tokenizer.ggml.padding_token_id"
    TOKENIZER_CLS_ID = "tokenizer.ggml.cls_token_id"
    TOKENIZER_MASK_ID = "tokenizer.ggml.mask_token_id"
    TOKENIZER_ADD_BOS = "tokenizer.ggml.add_bos_token"
    TOKENIZER_ADD_EOS = "tokenizer.ggml.add_eos_token"
    TOKENIZER_ADD_SEP = "tokenizer.ggml.add_sep_token"
    TOKENIZER_ADD_PREFIX = "tokenizer.ggml.add_space_prefix"
    TOKENIZER_REMOVE_EXTRA_WS = "tokenizer.ggml.remove_extra_whitespaces"
    TOKENIZER_PRECOMPILED_CHARSMAP = "tokenizer.ggml.precompiled_charsmap"
    TOKENIZER_NORMALIZER_LOWERCASE = "tokenizer.ggml.normalizer.lowercase"
    TOKENIZER_NORMALIZER_STRIP_ACCENTS = "tokenizer.ggml.normalizer.strip_accents"
    TOKENIZER_HF_JSON = "tokenizer.huggingface.json"
    TOKENIZER_RWKV = "tokenizer.rwkv.world"
    TOKENIZER_CHAT_TEMPLATE = "tokenizer.chat_template"
    TOKENIZER_FIM_PRE_ID = "tokenizer.ggml.fim_pre_token_id"
    TOKENIZER_FIM_SUF_ID = "tokenizer.ggml.fim_suf_token_id"
    TOKENIZER_FIM_MID_ID = "tokenizer.ggml.fim_mid_token_id"
    TOKENIZER_FIM_PAD_ID = "tokenizer.ggml.fim_pad_token_id"
    TOKENIZER_FIM_REP_ID = "tokenizer.ggml.fim_rep_token_id"
    TOKENIZER_FIM_SEP_ID = "tokenizer.ggml.fim_sep_token_id"
    # deprecated spellings of the FIM ids, still found in older files
    TOKENIZER_PREFIX_ID = "tokenizer.ggml.prefix_token_id"
    TOKENIZER_SUFFIX_ID = "tokenizer.ggml.suffix_token_id"
    TOKENIZER_MIDDLE_ID = "tokenizer.ggml.middle_token_id"

    def key(self, arch: LLMArch | str | None = None) -> str:
        """The key string, with `%s` replaced by the architecture name (like llama.cpp's LLM_KV)."""
        if "%s" not in self.value:
            return self.value
        if arch is None:
            raise ValueError(f"key {self.name} ({self.value!r}) needs an architecture name")
        return self.value % _arch_name(arch)


class LLMTensor(enum.Enum):
    """Tensor name templates (llama.cpp's LLM_TENSOR_NAMES); `%d` = block id, then expert id."""

    TOKEN_EMBD = "token_embd"
    TOKEN_EMBD_NORM = "token_embd_norm"
    TOKEN_TYPES = "token_types"
    POS_EMBD = "position_embd"
    OUTPUT = "output"
    OUTPUT_NORM = "output_norm"
    ROPE_FREQS = "rope_freqs"
    ROPE_FACTORS_LONG = "rope_factors_long"
    ROPE_FACTORS_SHORT = "rope_factors_short"
    ATTN_NORM = "blk.%d.attn_norm"
    ATTN_NORM_2 = "blk.%d.attn_norm_2"
    ATTN_Q = "blk.%d.attn_q"
    ATTN_K = "blk.%d.attn_k"
    ATTN_V = "blk.%d.attn_v"
    ATTN_QKV = "blk.%d.attn_qkv"
    ATTN_OUT = "blk.%d.attn_output"
    ATTN_OUT_NORM = "blk.%d.attn_output_norm"
    ATTN_Q_NORM = "blk.%d.attn_q_norm"
    ATTN_Q_A = "blk.%d.attn_q_a"
    ATTN_Q_B = "blk.%d.attn_q_b"
    ATTN_Q_A_NORM = "blk.%d.attn_q_a_norm"
    ATTN_KV_A_MQA = "blk.%d.attn_kv_a_mqa"
    ATTN_KV_A_NORM = "blk.%d.attn_kv_a_norm"
    ATTN_K_B = "blk.%d.attn_k_b"
    ATTN_V_B = "blk.%d.attn_v_b"
    ATTN_K_NORM = "blk.%d.attn_k_norm"
    ATTN_POST_NORM = "blk.%d.post_attention_norm"
    ATTN_ROT_EMBD = "blk.%d.attn_rot_embd"
    ATTN_SINKS = "blk.%d.attn_sinks"
    ATTN_GATE = "blk.%d.attn_gate"
    SSM_IN = "blk.%d.ssm_in"
    SSM_CONV1D = "blk.%d.ssm_conv1d"
    SSM_X = "blk.%d.ssm_x"
    SSM_DT = "blk.%d.ssm_dt"
    SSM_A = "blk.%d.ssm_a"
    SSM_D = "blk.%d.ssm_d"
    SSM_NORM = "blk.%d.ssm_norm"
    SSM_OUT = "blk.%d.ssm_out"
    SSM_DT_NORM = "blk.%d.ssm_dt_norm"
    SSM_B_NORM = "blk.%d.ssm_b_norm"
    SSM_C_NORM = "blk.%d.ssm_c_norm"
    SSM_BETA_ALPHA = "blk.%d.ssm_ba"
    SSM_ALPHA = "blk.%d.ssm_alpha"
    SSM_BETA = "blk.%d.ssm_beta"
    SHORTCONV_CONV = "blk.%d.shortconv.conv"
    SHORTCONV_INPROJ = "blk.%d.shortconv.in_proj"
    SHORTCONV_OUTPROJ = "blk.%d.shortconv.out_proj"
    FFN_NORM = "blk.%d.ffn_norm"
    FFN_POST_NORM = "blk.%d.post_ffw_norm"
    FFN_GATE = "blk.%d.ffn_gate"
    FFN_UP = "blk.%d.ffn_up"
    FFN_DOWN = "blk.%d.ffn_down"
    FFN_ACT = "blk.%d.ffn.act"
    FFN_GATE_INP = "blk.%d.ffn_gate_inp"
    FFN_GATE_EXP = "blk.%d.ffn_gate.%d"
    FFN_UP_EXP = "blk.%d.ffn_up.%d"
    FFN_DOWN_EXP = "blk.%d.ffn_down.%d"
    FFN_GATE_EXPS = "blk.%d.ffn_gate_exps"
    FFN_UP_EXPS = "blk.%d.ffn_up_exps"
    FFN_DOWN_EXPS = "blk.%d.ffn_down_exps"
    FFN_GATE_UP_EXPS = "blk.%d.ffn_gate_up_exps"
    FFN_GATE_INP_SHEXP = "blk.%d.ffn_gate_inp_shexp"
    FFN_GATE_SHEXP = "blk.%d.ffn_gate_shexp"
    FFN_UP_SHEXP = "blk.%d.ffn_up_shexp"
    FFN_DOWN_SHEXP = "blk.%d.ffn_down_shexp"
    FFN_EXP_PROBS_B = "blk.%d.exp_probs_b"
    LAYER_OUT_NORM = "blk.%d.layer_output_norm"
    # Gemma 4: the MoE block's second pre-norm and the post norms of its two branches, the layer scalar
    FFN_PRE_NORM_2 = "blk.%d.pre_ffw_norm_2"
    FFN_POST_NORM_1 = "blk.%d.post_ffw_norm_1"
    FFN_POST_NORM_2 = "blk.%d.post_ffw_norm_2"
    LAYER_OUT_SCALE = "blk.%d.layer_output_scale"
    # Gemma 3n: per-layer embeddings, AltUp, Laurel
    PER_LAYER_TOKEN_EMBD = "per_layer_token_embd"
    PER_LAYER_MODEL_PROJ = "per_layer_model_proj"
    PER_LAYER_PROJ_NORM = "per_layer_proj_norm"
    ALTUP_UNEMBD_PROJ = "altup_unembd_proj"
    ALTUP_PROJ = "altup_proj"
    PER_LAYER_INP_GATE = "blk.%d.inp_gate"
    PER_LAYER_PROJ = "blk.%d.proj"
    PER_LAYER_POST_NORM = "blk.%d.post_norm"
    ALTUP_CORRECT_COEF = "blk.%d.altup_correct_coef"
    ALTUP_CORRECT_SCALE = "blk.%d.altup_correct_scale"
    ALTUP_PREDICT_COEF = "blk.%d.altup_predict_coef"
    ALTUP_ROUTER = "blk.%d.altup_router"
    ALTUP_ROUTER_NORM = "blk.%d.altup_router_norm"
    LAUREL_L = "blk.%d.laurel_l"
    LAUREL_R = "blk.%d.laurel_r"
    LAUREL_POST_NORM = "blk.%d.laurel_post_norm"
    CLS = "cls"
    CLS_OUT = "cls.output"


def llm_arch_is_recurrent(arch: LLMArch) -> bool:
    """Every layer keeps a fixed-size recurrent state instead of a KV cache (Mamba, RWKV)."""
    return arch in (LLMArch.MAMBA, LLMArch.MAMBA2, LLMArch.RWKV6)


def llm_arch_is_hybrid(arch: LLMArch) -> bool:
    """Attention layers (a KV cache) mixed with recurrent ones (a recurrent memory)."""
    return arch in (LLMArch.JAMBA, LLMArch.FALCON_H1, LLMArch.GRANITE_HYBRID, LLMArch.NEMOTRON_H,
                    LLMArch.LFM2, LLMArch.LFM2MOE, LLMArch.QWEN3NEXT, LLMArch.QWEN35, LLMArch.QWEN35MOE)


def tn(tensor: LLMTensor, suffix: str | None = None, bid: int | None = None,
       xid: int | None = None) -> str:
    """A tensor's GGUF name, like llama.cpp's LLM_TN: tn(ATTN_Q, "weight", 3) -> "blk.3.attn_q.weight".

    bid is the block (layer) id, xid the expert id, each required exactly when the template
    has a slot for it.
    """
    n_slots = tensor.value.count("%d")
    ids = [i for i in (bid, xid) if i is not None]
    if len(ids) != n_slots or (xid is not None and bid is None):
        raise ValueError(f"tensor {tensor.name} ('{tensor.value}') takes {n_slots} ids "
                         f"(block, expert), got bid={bid}, xid={xid}")
    name = tensor.value % tuple(ids) if n_slots else tensor.value
    return f"{name}.{suffix}" if suffix else name


class ArchBuilder(Protocol):
    """What an architecture module defines, in the order the loader calls it."""

    def load_hparams(self, hp: HParams, ml: GGUFMeta) -> None:
        """Set the rope type and read the architecture's own keys into `hp` (after the generic
        keys; llama.cpp's `switch (arch)` in load_hparams)."""

    def load_tensors(self, model: Model, ml: ModelLoader) -> None:
        """Declare every weight with `ml.create_tensor` on its placed device; fill `model`."""

    def build_graph(self, g: GraphBuilder) -> None:
        """Build the forward graph for one ubatch from `g`'s inputs and shared blocks."""

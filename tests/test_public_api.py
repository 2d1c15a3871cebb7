"""Every public name an issue promised, pinned: a cleanup can never remove or rename one silently.

Module paths that issue 27 moved into subpackages (llm.trace -> llm.research.trace, ...) are
pinned under their old names too: users import them."""
from __future__ import annotations

import importlib
import inspect

import pytest

import llm

TOP_LEVEL = ["LLM", "Completion", "GenerationChunk", "Batch", "BatchError", "Context", "DecodeStatus",
             "GrammarError", "LoadCancelled", "ModelLoadError", "StateError", "Model", "RowPlan", "load_model",
             "LogitLens", "Trace", "StepProfile", "profile", "SamplingParams", "ContextParams",
             "LoraAdapter", "adapter_lora_init"]

# llama_sampler_init_* (llama.h) -> the keyword names llama.cpp gives their parameters
SAMPLER_CONSTRUCTORS = {
    "greedy": [], "dist": ["seed"], "top_k": ["k"], "top_p": ["p", "min_keep"], "min_p": ["p", "min_keep"],
    "typical": ["p", "min_keep"], "temp": ["t"], "temp_ext": ["t", "delta", "exponent"],
    "xtc": ["p", "t", "min_keep", "seed"], "top_n_sigma": ["n"], "mirostat": ["n_vocab", "seed", "tau", "eta", "m"],
    "mirostat_v2": ["seed", "tau", "eta"],
    "penalties": ["penalty_last_n", "penalty_repeat", "penalty_freq", "penalty_present"],
    "logit_bias": ["n_vocab", "logit_bias"],
}

# module -> names (issues 2-19 and their READMEs/notebooks)
MODULE_NAMES = {
    "llm.sampling": ["grammar", "json_schema", "json_object", "dry", "SamplerChain", "SamplingParams",
                     "TokenDataArray", "LLAMA_DEFAULT_SEED", "Sampler"],
    "llm.distributed": ["initialize"],
    "llm.hub": ["resolve", "DEFAULT_MODEL"],
    "llm.loader": ["GGUFMeta", "ModelLoader"],
    "llm.errors": ["MetadataError", "ModelLoadError", "GrammarError", "StateError", "LoadCancelled"],
    "llm.context": ["Context", "ContextParams", "bucket", "DecodeStatus",
                    "DEFAULT_KV_TYPE", "kv_types"],     # (the last two: issue 33, the numerics' cache type)
    # issue 27: one declaration per parameter, the generation core, block-option enums, the server's routes
    "llm.params": ["param", "Arg", "ParamError", "add_arguments", "from_namespace", "from_kwargs", "from_json",
                   "with_parameters", "fields_of", "MediaParams", "ServerGeneration"],
    "llm.generation.core": ["GenParams", "SeqState", "build_sampler", "grammar_vocab", "Delta", "TokenLogprob",
                            "logprobs_of", "stop_strings"],
    "llm.generation.batcher": ["Batcher", "Job", "Done", "Failed", "media_prompt", "MEDIA_PLACEHOLDER",
                               "check_context_shift"],
    "llm.generation.speculative": ["PromptLookup", "DraftModel", "Speculative", "DraftPolicy", "sample_and_accept_n",
                                   "Rollback", "DraftPool"],
    "llm.graph": ["GraphHook", "LLMNormType", "LLMFfnOpType", "LLMFfnGateType", "GraphBuilder", "mul_mat_hadamard"],
    "llm.hparams": ["ExpertGatingFuncType"],
    "llm.arch": ["ArchBuilder", "llm_arch_is_recurrent", "llm_arch_is_hybrid"],
    "llm.serving.routes": ["router"],
    "llm.serving.engine": ["Engine", "QueueFull"],
    "llm.research.llamacpp_child": ["LlamaCppCrashed"],
    "llm.kv_cache": ["kv_bytes_per_device", "KV_TYPES", "estimate_bytes", "kv_type", "hadamard", "rotation_sizes"],
    "llm.serving": ["Batcher", "Engine", "GenParams", "Job", "Delta", "Done", "logprobs_of"],
    "llm.chat": ["render", "ChatTemplateError"],
    # old module paths of moved modules
    "llm.trace": ["Trace", "LogitLens", "GraphEdits"],
    "llm.grammar": ["GrammarSpec"],
    "llm.speculative": ["PromptLookup", "DraftModel", "Speculative"],
    "llm.perplexity": [],
    "llm.profiler": ["profile", "StepProfile"],
    "llm.diff_llamacpp": [],
    "llm.plot": ["logit_lens", "attention", "attention_grid", "saliency", "token_labels", "image_attention"],
    "llm.tools": ["parse_reply"],
    # issue 31: LoRA adapters
    "llm.adapter": ["LoraAdapter", "LoraWeight", "LoraScales", "adapter_lora_init", "write_lora", "fuse"],
    # issue 35: embeddings stop when the client leaves
    "llm.api": ["EmbedAborted", "GenerationError"],
    # issue 31: fine-tuning
    "llm.finetune": ["LoraConfig", "train", "TrainResult", "StepInfo", "DatasetError", "TrainingError"],
    # issue 32: native tool-call formats, reasoning, the server's info routes
    "llm.chat.formats": ["ChatFormat", "ReasoningFormat", "detect", "ChatSyntax"],
    "llm.chat.prompt": ["ChatOptions", "ChatPrompt", "apply"],
    "llm.chat.grammars": ["tool_grammar", "ToolSpec"],
    "llm.chat.parsers": ["parse", "ChatStream", "ChatMsg", "ToolCall", "MsgDelta"],
    "llm.sampling.structured": ["GrammarTrigger", "TriggerKind", "spec_lark", "check_schema"],
    "llm.serving.anthropic": ["router", "MessagesRequest", "Reply", "error_response"],
    "llm.serving.native": ["router", "InfillRequest", "RerankRequest", "infill_prompt", "rerank_tokens"],
    # issue 34: llm quantize
    "llm.quantize": ["model_quantize", "QuantizeParams", "QuantizeError", "LlamaFType"],
    "llm.imatrix": ["compute_imatrix", "ImatrixParams", "Imatrix", "ImatrixError", "ImatrixHook", "imatrix_chunks"],
    # issue 29: the shared blocks
    "ggmlx.ops": ["rope_multi", "rope_ext", "set_rows", "ssm_conv", "ssm_scan", "relu", "softplus",
                  "gated_delta_net", "repeat_4d"],
    # issue 33: quantized KV caches (block-typed state buffers, set_rows' row quantizers)
    "ggmlx.quants": ["quantize_row", "quantize_jax", "ROW_KERNELS"],
    "ggmlx.tensor": ["buffer_layout"],
    # issue 30: images in (libmtmd)
    "llm.mtmd": ["init_from_file", "MtmdContext", "Bitmap", "InputChunk", "ImageTokens", "MediaError", "EvalError",
                 "default_marker", "MAX_PIXELS", "PROJECTORS"],
    "llm.mtmd.clip": ["ClipModel", "ClipGraph", "ClipHParams", "ClipKV", "ClipTensor", "Projector", "ctn",
                      "load_model", "Preprocessed", "preprocess_fixed_size"],
    "llm.mtmd.image": ["resize_pillow", "resize", "normalize", "ResizeAlgo", "PadStyle"],
    "llm.mtmd.siglip": ["GEMMA3", "IDEFICS3", "pool_2d_avg", "patch_merge_permute", "preprocess_idefics3"],
    "llm.mtmd.llava": ["MLP", "build_mlp"],
    "llm.research.trace": ["MediaTrace", "Trace", "LogitLens"],
    "llm.serving.media": ["load_images", "media_job", "fetch", "REMOTE_MAX_BYTES", "REMOTE_TIMEOUT_S"],
    "llm.serving.requests": ["MediaPart", "media_parts"],
    # issue 28: recurrent and hybrid memories
    "llm.memory_recurrent": ["MemoryRecurrent"],
    "llm.memory_hybrid": ["MemoryHybrid", "memory_kind"],
    # issue 33: ggml numerics
    "ggmlx.native": ["block_matmul", "BLOCK_TYPES", "BLOCK_ISAS", "LANE_TYPES"],
    "ggmlx.weights": ["NUMERICS", "FORMAT_LANES", "pack_lanes", "unpack_lanes"],
}

METHODS = {
    "llm.api:LLM": ["generate", "stream", "chat", "score", "embed", "tokenize", "reset", "set_adapters_lora",
                    "chat_prompt", "media_prompt"],
    "llm.graph:GraphBuilder": ["build_lora_mm", "build_lora_mm_id", "build_attn_mla", "build_moe_ffn",
                               "group_limited", "rope_multi_params", "build_rs_inp", "build_rs",
                               "build_mamba_layer", "build_mamba2_layer"],
    "llm.memory_recurrent:MemoryRecurrent": ["seq_rm", "seq_cp", "seq_keep", "seq_add", "seq_div", "seq_pos_min",
                                             "seq_pos_max", "clear", "seq_checkpoint", "seq_restore"],
    "llm.memory_hybrid:MemoryHybrid": ["seq_rm", "seq_cp", "seq_keep", "seq_add", "seq_div", "seq_pos_min",
                                       "seq_pos_max", "clear", "seq_checkpoint", "seq_restore"],
    "llm.kv_cache:KVCache": ["seq_rm", "seq_cp", "seq_keep", "seq_add", "seq_div", "seq_pos_min", "seq_pos_max",
                             "clear"],
    "llm.context:Context": ["decode", "get_logits_ith", "get_embeddings_seq", "get_embeddings_ith",
                            "state_save_file", "state_load_file", "set_adapters_lora", "set_adapter_scales_seq",
                            "set_causal_attn"],
    "llm.batch:Batch": ["get_one"],
    # issue 30: images in
    "llm.mtmd:MtmdContext": ["tokenize", "encode_chunk", "eval_chunks", "preprocess", "graph", "lookup_token"],
    "llm.mtmd:Bitmap": ["from_file", "from_bytes", "from_array", "from_url"],
    "llm.research.trace:Trace": ["image_attention", "logit_lens"],
    # issue 29: per-layer head sizes (gemma4)
    "llm.hparams:HParams": ["n_embd_head_k_l", "n_embd_head_v_l", "n_rot_l", "has_kv", "kv_layer"],
}


@pytest.mark.parametrize("name", TOP_LEVEL)
def test_top_level(name):
    assert getattr(llm, name) is not None
    assert name in llm.__all__


@pytest.mark.parametrize("name, params", SAMPLER_CONSTRUCTORS.items())
def test_sampler_constructors_carry_llama_cpp_names(name, params):
    fn = getattr(llm.sampling, name)
    assert list(inspect.signature(fn).parameters) == params


def test_sampler_constructors_by_keyword():
    s = llm.sampling
    chain = s.SamplerChain([
        s.logit_bias(n_vocab=8, logit_bias=[(1, 0.5), (1, 0.25)]),
        s.penalties(penalty_last_n=8, penalty_repeat=1.1, penalty_freq=0.0, penalty_present=0.0),
        s.top_k(k=4), s.typical(p=1.0, min_keep=1), s.top_p(p=0.9, min_keep=1), s.min_p(p=0.05, min_keep=1),
        s.xtc(p=0.0, t=0.1, min_keep=1, seed=1), s.top_n_sigma(n=-1.0), s.temp_ext(t=0.8, delta=0.0, exponent=1.0),
        s.temp(t=1.0), s.dist(seed=3)])
    assert isinstance(chain.samplers[0], s.LogitBias)
    assert chain.samplers[0].biases.tolist() == [0.75]
    assert isinstance(s.greedy(), s.Greedy)
    assert isinstance(s.mirostat(n_vocab=8, seed=1, tau=5.0, eta=0.1, m=100), s.Mirostat)
    assert isinstance(s.mirostat_v2(seed=1, tau=5.0, eta=0.1), s.MirostatV2)


@pytest.mark.parametrize("module, names", MODULE_NAMES.items())
def test_module_names(module, names):
    mod = importlib.import_module(module)
    for name in names:
        assert hasattr(mod, name), f"{module}.{name}"


def test_moved_modules_are_the_same_objects():
    import llm.research.trace
    import llm.trace
    assert llm.trace is llm.research.trace
    assert llm.research.trace.__spec__.name == "llm.research.trace"


def test_media_keywords():
    """Issue 30: LLM(model, mmproj=...), generate/stream(..., images=[...])."""
    assert "mmproj" in inspect.signature(llm.LLM.__init__).parameters
    for method in (llm.LLM.generate, llm.LLM.stream):
        assert "images" in inspect.signature(method).parameters
    assert {"images", "capture_encoder"} <= set(inspect.signature(llm.LLM.trace).parameters)


def test_numerics_keywords():
    """Issue 33: load_model(..., numerics="ggml"), LLM(..., numerics=...), bench_model(numerics=)."""
    from llm.cli.bench import bench_model
    for fn in (llm.load_model, llm.LLM.__init__, bench_model):
        assert "numerics" in inspect.signature(fn).parameters


@pytest.mark.parametrize("owner, names", METHODS.items())
def test_methods(owner, names):
    module, cls = owner.split(":")
    klass = getattr(importlib.import_module(module), cls)
    for name in names:
        assert callable(getattr(klass, name)), f"{cls}.{name}"

"""llm: the llama.cpp layer over ggmlx. GGUF model -> vocab, weights, KV cache, decode, sampling."""
from llm.api import LLM, Completion, GenerationChunk
from llm.batch import Batch, BatchError
from llm.context import Context, DecodeStatus
from llm.errors import LoadCancelled, ModelLoadError
from llm.model import Model, load_model

__all__ = ["LLM", "Batch", "BatchError", "Completion", "Context", "DecodeStatus", "GenerationChunk",
           "LoadCancelled", "Model", "ModelLoadError", "load_model"]

"""llm: the llama.cpp layer over ggmlx. GGUF model -> vocab, weights, KV cache, decode, sampling."""
from llm.api import LLM, Completion
from llm.batch import Batch, BatchError
from llm.context import Context, DecodeStatus
from llm.errors import LoadCancelled, ModelLoadError
from llm.model import Model, load_model

__all__ = ["LLM", "Batch", "BatchError", "Completion", "Context", "DecodeStatus", "LoadCancelled", "Model",
           "ModelLoadError", "load_model"]

"""llm: the llama.cpp layer over ggmlx. GGUF model -> vocab, weights, KV cache, decode, sampling."""
from llm.errors import LoadCancelled, ModelLoadError

__all__ = ["ModelLoadError", "LoadCancelled"]

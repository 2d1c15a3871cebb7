"""llm: the llama.cpp layer over ggmlx. GGUF model -> vocab, weights, KV cache, decode, sampling."""

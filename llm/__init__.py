"""llm: the llama.cpp layer over ggmlx. GGUF model -> vocab, weights, KV cache, decode, sampling.

The names below are imported on first use (PEP 562), so `python -m llm` can install its
Ctrl-C handler before JAX is imported."""
import importlib

_EXPORTS = {
    "LLM": "llm.api", "Completion": "llm.api", "GenerationChunk": "llm.api",
    "Batch": "llm.batch", "BatchError": "llm.batch",
    "Context": "llm.context", "DecodeStatus": "llm.context",
    "GrammarError": "llm.errors", "LoadCancelled": "llm.errors", "ModelLoadError": "llm.errors",
    "StateError": "llm.errors",
    "Model": "llm.model", "load_model": "llm.model",
    "LogitLens": "llm.trace", "Trace": "llm.trace",
    "StepProfile": "llm.profiler", "profile": "llm.profiler",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'llm' has no attribute {name!r}")

"""llm: the llama.cpp layer over ggmlx. GGUF model -> vocab, weights, KV cache, decode, sampling.

The names below are imported on first use (PEP 562), so `python -m llm` can install its
Ctrl-C handler before JAX is imported."""
import importlib
import importlib.util

_EXPORTS = {
    "LLM": "llm.api", "Completion": "llm.api", "GenerationChunk": "llm.api",
    "Batch": "llm.batch", "BatchError": "llm.batch",
    "Context": "llm.context", "DecodeStatus": "llm.context",
    "GrammarError": "llm.errors", "LoadCancelled": "llm.errors", "ModelLoadError": "llm.errors",
    "StateError": "llm.errors",
    "Model": "llm.model", "RowPlan": "llm.model", "load_model": "llm.model",
    "LogitLens": "llm.trace", "Trace": "llm.trace",
    "StepProfile": "llm.profiler", "profile": "llm.profiler",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    # submodules of the contract (llm.sampling.grammar, llm.distributed.initialize, llm.hub, ...)
    # are reachable as attributes after a plain `import llm`, as they were before the lazy exports
    if importlib.util.find_spec(f"llm.{name}") is not None:
        return importlib.import_module(f"llm.{name}")
    raise AttributeError(f"module 'llm' has no attribute {name!r}")

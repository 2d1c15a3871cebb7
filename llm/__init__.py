"""llm: the llama.cpp layer over ggmlx. GGUF model -> vocab, weights, KV cache, decode, sampling.

Layout: the core is flat, as llama.cpp's src/ (arch hparams loader model layer graph context
batch kv_cache kv_cells state vocab ...); above it, subpackages named for what they are:
sampling/, generation/, chat/, serving/, research/, cli/ (docs/llama-cpp-map.md maps each).

The names below are imported on first use (PEP 562), so `python -m llm` can install its
Ctrl-C handler before JAX is imported."""
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

_EXPORTS = {
    "LLM": "llm.api", "Completion": "llm.api", "GenerationChunk": "llm.api",
    "Batch": "llm.batch", "BatchError": "llm.batch",
    "Context": "llm.context", "ContextParams": "llm.context", "DecodeStatus": "llm.context",
    "GrammarError": "llm.errors", "LoadCancelled": "llm.errors", "ModelLoadError": "llm.errors",
    "StateError": "llm.errors",
    "Model": "llm.model", "RowPlan": "llm.model", "load_model": "llm.model",
    "SamplingParams": "llm.sampling",
    "LogitLens": "llm.research.trace", "Trace": "llm.research.trace",
    "StepProfile": "llm.research.profiler", "profile": "llm.research.profiler",
    "LoraAdapter": "llm.adapter", "adapter_lora_init": "llm.adapter",
}

# Modules that issue 27 moved into subpackages: their old paths stay importable (public contract).
_MOVED = {
    "llm.grammar": "llm.sampling.structured", "llm.gbnf": "llm.sampling.gbnf",
    "llm.speculative": "llm.generation.speculative", "llm.server": "llm.serving.app",
    "llm.trace": "llm.research.trace", "llm.plot": "llm.research.plot",
    "llm.diff_llamacpp": "llm.research.diff_llamacpp", "llm.profiler": "llm.research.profiler",
    "llm.perplexity": "llm.research.perplexity", "llm.bench": "llm.cli.bench", "llm.tools": "llm.chat.tool_calls",
}

__all__ = sorted(_EXPORTS)


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves a moved module's old name to the module at its new place (the same object)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(_MOVED[spec.name])
        spec.loader_state = (module.__spec__, module.__loader__)
        return module

    def exec_module(self, module):
        # already executed at its new place; the import system stamped the old name's spec on it
        module.__spec__, module.__loader__ = module.__spec__.loader_state


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    # submodules of the contract (llm.sampling.grammar, llm.distributed.initialize, llm.hub, ...)
    # are reachable as attributes after a plain `import llm`, as they were before the lazy exports
    if f"llm.{name}" in _MOVED or importlib.util.find_spec(f"llm.{name}") is not None:
        return importlib.import_module(f"llm.{name}")
    raise AttributeError(f"module 'llm' has no attribute {name!r}")

"""Research: traces, interventions and gradients (trace), figures (plot), node-by-node diffs
against llama.cpp (diff_llamacpp), the per-op profiler (profiler) and perplexity/KL (perplexity).

Nothing is imported here: each module pulls in what it needs (matplotlib, llama-cpp-python)."""

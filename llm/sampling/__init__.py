"""Sampling: llama.cpp's sampler chain (samplers), its parameters, and constrained decoding
(structured: GBNF and JSON schema through llguidance; gbnf: llama.cpp's grammar dialect).

The constructors carry llama.cpp's names (`top_k` is llama_sampler_init_top_k, ...)."""
from llm.sampling.samplers import (
    LLAMA_DEFAULT_SEED,
    SAMPLER_TYPES,
    Dist,
    Dry,
    Greedy,
    LogitBias,
    LogitsSource,
    MinP,
    Mirostat,
    MirostatV2,
    Penalties,
    Sampler,
    SamplerChain,
    SamplingParams,
    Temp,
    TempExt,
    TokenDataArray,
    TopK,
    TopNSigma,
    TopP,
    Typical,
    Xtc,
    dist,
    dry,
    greedy,
    logit_bias,
    min_p,
    mirostat,
    mirostat_v2,
    penalties,
    temp,
    temp_ext,
    top_k,
    top_n_sigma,
    top_p,
    typical,
    xtc,
)

# The grammar constructors live here, not in samplers: llm.sampling.structured builds on samplers,
# and importing it (llguidance, the vocabulary) waits until a grammar is asked for.


def grammar(gbnf: str, root: str = "root"):
    """A checked GBNF grammar (llama.cpp's dialect), as a llm.sampling.structured.GrammarSpec: bind
    it to a vocabulary with `.sampler(vocab)` and put that first in a chain
    (llama_sampler_init_grammar). llm.GrammarError names what is wrong, before any decoding."""
    from llm.sampling import structured
    return structured.spec_gbnf(gbnf, root)


def json_schema(schema):
    """A checked JSON schema (dict or JSON text) as a GrammarSpec (see `grammar`)."""
    from llm.sampling import structured
    return structured.spec_json_schema(schema)


def json_object():
    """JSON-object mode: any JSON object, as a GrammarSpec (see `grammar`)."""
    from llm.sampling import structured
    return structured.spec_json_object()


__all__ = [
    "LLAMA_DEFAULT_SEED", "SAMPLER_TYPES", "Dist", "Dry", "Greedy", "LogitBias", "LogitsSource", "MinP",
    "Mirostat", "MirostatV2", "Penalties", "Sampler", "SamplerChain", "SamplingParams", "Temp", "TempExt",
    "TokenDataArray", "TopK", "TopNSigma", "TopP", "Typical", "Xtc",
    "dist", "dry", "grammar", "greedy", "json_object", "json_schema", "logit_bias", "min_p", "mirostat",
    "mirostat_v2", "penalties", "temp", "temp_ext", "top_k", "top_n_sigma", "top_p", "typical", "xtc",
]

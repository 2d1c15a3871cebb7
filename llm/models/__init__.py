"""The architectures: one module per architecture, each holding everything about it (like
llama.cpp's src/models/<arch>.cpp): the hyperparameters it reads, the tensors it declares
and the graph it builds. Each module is an `ArchBuilder`; `ARCHS` maps the
`general.architecture` value to it. See docs/adding-an-architecture.md.
"""
from __future__ import annotations

import difflib

from llm.arch import ArchBuilder, LLMArch, arch_from_name  # noqa: F401  (ArchBuilder: llm.models.ArchBuilder)
from llm.errors import ModelLoadError
from llm.models import (
    apertus,
    bert,
    cohere2,
    command_r,
    deepseek2,
    ernie4_5,
    ernie4_5_moe,
    exaone,
    exaone4,
    falcon_h1,
    gemma2,
    gemma3,
    gemma3n,
    gemma4,
    glm4,
    glm4moe,
    gpt2,
    gpt_oss,
    granite,
    granite_hybrid,
    granitemoe,
    hunyuan_moe,
    jamba,
    lfm2,
    lfm2moe,
    llama,
    llama4,
    mamba,
    mamba2,
    minimax_m2,
    mistral3,
    nemotron_h,
    nomic_bert,
    olmo2,
    olmoe,
    phi2,
    phi3,
    qwen2,
    qwen2moe,
    qwen2vl,
    qwen3,
    qwen3moe,
    qwen3next,
    qwen3vl,
    qwen3vlmoe,
    qwen35,
    qwen35moe,
    seed_oss,
    smollm3,
    starcoder2,
)

ARCHS: dict[LLMArch, ArchBuilder] = {
    LLMArch.LLAMA: llama,
    LLMArch.NEMOTRON_H: nemotron_h,
    LLMArch.LFM2: lfm2,
    LLMArch.LFM2MOE: lfm2moe,
    LLMArch.FALCON_H1: falcon_h1,
    LLMArch.JAMBA: jamba,
    LLMArch.MAMBA: mamba,
    LLMArch.MAMBA2: mamba2,
    LLMArch.QWEN2: qwen2,
    LLMArch.QWEN3: qwen3,
    LLMArch.PHI3: phi3,
    LLMArch.GEMMA2: gemma2,
    LLMArch.GEMMA3: gemma3,
    LLMArch.GEMMA3N: gemma3n,
    LLMArch.GEMMA4: gemma4,
    LLMArch.HUNYUAN_MOE: hunyuan_moe,
    LLMArch.BERT: bert,
    LLMArch.NOMIC_BERT: nomic_bert,
    LLMArch.QWEN3MOE: qwen3moe,
    LLMArch.QWEN2MOE: qwen2moe,
    LLMArch.OLMO2: olmo2,
    LLMArch.GRANITE: granite,
    LLMArch.GRANITE_HYBRID: granite_hybrid,
    LLMArch.SMOLLM3: smollm3,
    LLMArch.STARCODER2: starcoder2,
    LLMArch.GPT2: gpt2,
    LLMArch.PHI2: phi2,
    LLMArch.OPENAI_MOE: gpt_oss,
    LLMArch.MISTRAL3: mistral3,
    LLMArch.EXAONE: exaone,
    LLMArch.LLAMA4: llama4,
    LLMArch.GRANITE_MOE: granitemoe,
    LLMArch.COMMAND_R: command_r,
    LLMArch.COHERE2: cohere2,
    LLMArch.GLM4: glm4,
    LLMArch.ERNIE4_5: ernie4_5,
    LLMArch.ERNIE4_5_MOE: ernie4_5_moe,
    LLMArch.SEED_OSS: seed_oss,
    LLMArch.APERTUS: apertus,
    LLMArch.QWEN2VL: qwen2vl,
    LLMArch.QWEN3VL: qwen3vl,
    LLMArch.QWEN3VLMOE: qwen3vlmoe,
    LLMArch.QWEN35: qwen35,
    LLMArch.QWEN35MOE: qwen35moe,
    LLMArch.QWEN3NEXT: qwen3next,
    LLMArch.GLM4_MOE: glm4moe,
    LLMArch.OLMOE: olmoe,
    LLMArch.EXAONE4: exaone4,
    LLMArch.DEEPSEEK2: deepseek2,
    LLMArch.MINIMAX_M2: minimax_m2,
}


def get_arch(name: str) -> ArchBuilder:
    """The builder for a `general.architecture` value; ModelLoadError for an unknown or
    unsupported architecture, listing the supported ones."""
    arch = arch_from_name(name)
    if arch not in ARCHS:
        near = difflib.get_close_matches(name, registered_archs(), n=1, cutoff=0.0)
        raise ModelLoadError(f"model architecture '{name}' is not supported (supported: "
                             f"{', '.join(registered_archs())}); the nearest supported one is '{near[0]}'. "
                             f"To add it, see docs/adding-an-architecture.md and make a llama.cpp parity "
                             f"fixture with benchmarks/reference/make_fixture.py")
    return ARCHS[arch]


def registered_archs() -> list[str]:
    """Names of the supported architectures, sorted."""
    return sorted(a.value for a in ARCHS)

"""Random-weight llama models of real models' shapes, for benchmarks at size (issue 33).

`build("1b" | "3b" | "8b")` writes an F16 GGUF of that shape tensor by tensor (GGUFWriter's
streaming path: the 8B is 16 GB in F16, never held in memory), has llama.cpp quantize it to
Q4_K_M (llama_model_quantize in a child process) and keeps only the Q4_K_M file, under
~/.cache/ggmlx/shapes/ (GGMLX_CACHE_DIR/shapes), so a rerun reuses it.

Weights are seeded normals scaled so activations stay finite: matrices and the embedding
N(0, 1/n_in) (a tied output then gives logits of unit scale), norms exactly 1. The tokenizer
is a synthetic byte-level BPE ("gpt2", llama-bpe pre-tokenizer) of the shape's n_vocab:
neither installed model's vocabulary has Llama 3's 128256 tokens.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from pathlib import Path

import numpy as np

from ggmlx.gguf import GGUFValueType as VT
from ggmlx.gguf import GGUFWriter
from ggmlx.types import GGMLType

log = logging.getLogger(__name__)

LLAMA_FTYPE_MOSTLY_Q4_K_M = 15      # llama.h enum llama_ftype


@dataclasses.dataclass(frozen=True)
class Shape:
    """A llama-architecture model's hyperparameters (the HF config's names in comments)."""
    n_embd: int             # hidden_size
    n_layer: int            # num_hidden_layers
    n_head: int             # num_attention_heads
    n_head_kv: int          # num_key_value_heads
    n_ff: int               # intermediate_size
    n_vocab: int            # vocab_size
    tied: bool              # tie_word_embeddings: no output.weight
    rope_theta: float = 500000.0
    rope_factor: float = 0.0        # llama3 rope_scaling.factor; 0: no rope_freqs tensor
    n_ctx_train: int = 131072       # max_position_embeddings
    n_special: int = 256            # Llama 3's added tokens at the end of the vocabulary
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


# Llama-3.2-1B, Llama-3.2-3B and Llama-3.1-8B (their config.json; llama3 rope: low_freq_factor 1,
# high_freq_factor 4, original_max_position_embeddings 8192)
SHAPES = {
    "1b": Shape(n_embd=2048, n_layer=16, n_head=32, n_head_kv=8, n_ff=8192, n_vocab=128256, tied=True,
                rope_factor=32.0),
    "3b": Shape(n_embd=3072, n_layer=28, n_head=24, n_head_kv=8, n_ff=8192, n_vocab=128256, tied=True,
                rope_factor=32.0),
    "8b": Shape(n_embd=4096, n_layer=32, n_head=32, n_head_kv=8, n_ff=14336, n_vocab=128256, tied=False,
                rope_factor=8.0),
}


def _byte_chars() -> list[str]:
    """GPT-2's byte-to-unicode table: byte b is written as this character in a byte-level vocabulary."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def bpe_vocab(n_vocab: int, n_special: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a byte-level BPE vocabulary: the 256 bytes, then tokens
    each the merge of an earlier token and a byte (every merge's parts and result are tokens),
    then n_special control tokens as Llama 3 names them."""
    n_text = n_vocab - n_special
    if n_text < 256:
        raise ValueError(f"n_vocab {n_vocab} leaves {n_text} text tokens, a byte-level vocabulary needs 256")
    tokens = _byte_chars()
    seen = set(tokens)
    merges: list[str] = []
    left = 0
    while len(tokens) < n_text:
        a = tokens[left]
        for b in tokens[:256]:
            if len(tokens) == n_text:
                break
            if a + b not in seen:
                seen.add(a + b)
                tokens.append(a + b)
                merges.append(f"{a} {b}")
        left += 1
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    specials += [f"<|reserved_special_token_{i}|>" for i in range(n_special - len(specials))]
    types = [1] * n_text + [3] * n_special          # llama_token_type: NORMAL, CONTROL
    return tokens + specials[:n_special], types, merges


def llama3_rope_factors(s: Shape) -> np.ndarray:
    """The rope_freqs.weight a converter writes for llama3 rope scaling: per frequency pair, the
    divisor of its frequency (1 for short wavelengths, the factor for long, smooth between)."""
    low, high, n_orig = 1.0, 4.0, 8192
    freqs = s.rope_theta ** -(np.arange(0, s.head_dim, 2, dtype=np.float64) / s.head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = np.clip((n_orig / wavelen - low) / (high - low), 0.0, 1.0)
    return (1.0 / ((1 - smooth) / s.rope_factor + smooth)).astype(np.float32)


def _tensors(s: Shape) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, ne in ggml order, fan-in; 0 for a norm) of every tensor, in file order."""
    n_kv = s.n_head_kv * s.head_dim
    out: list[tuple[str, tuple[int, ...], int]] = [("token_embd.weight", (s.n_embd, s.n_vocab), s.n_embd)]
    for i in range(s.n_layer):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (s.n_embd,), 0),
                (p + "attn_q.weight", (s.n_embd, s.n_embd), s.n_embd),
                (p + "attn_k.weight", (s.n_embd, n_kv), s.n_embd),
                (p + "attn_v.weight", (s.n_embd, n_kv), s.n_embd),
                (p + "attn_output.weight", (s.n_embd, s.n_embd), s.n_embd),
                (p + "ffn_norm.weight", (s.n_embd,), 0),
                (p + "ffn_gate.weight", (s.n_embd, s.n_ff), s.n_embd),
                (p + "ffn_up.weight", (s.n_embd, s.n_ff), s.n_embd),
                (p + "ffn_down.weight", (s.n_ff, s.n_embd), s.n_ff)]
    out.append(("output_norm.weight", (s.n_embd,), 0))
    if not s.tied:
        out.append(("output.weight", (s.n_embd, s.n_vocab), s.n_embd))
    return out


def _random_f16(seed: int, index: int, ne: tuple[int, ...], fan_in: int) -> np.ndarray:
    """Tensor `index`'s values in F16 (a norm: ones in F32, as converters keep 1-D tensors and
    llama.cpp's CPU multiply needs), from its own generator (any tensor reproducible alone),
    drawn a block of rows at a time so the f32 draw never exceeds 64 MiB."""
    if not fan_in:
        return np.ones(math.prod(ne), np.float32)
    rng = np.random.default_rng([seed, index])
    rows, cols = math.prod(ne[1:]), ne[0]
    out = np.empty((rows, cols), np.float16)
    step = max(1, (16 << 20) // cols)
    scale = np.float32(1 / math.sqrt(fan_in))
    for r in range(0, rows, step):
        block = rng.standard_normal((min(step, rows - r), cols), dtype=np.float32)
        out[r:r + step] = block * scale
    return out


def write_f16(s: Shape, path: str | os.PathLike, seed: int = 0, name: str = "random llama") -> None:
    """Write shape `s` with seeded random F16 weights, one tensor in memory at a time."""
    tokens, types, merges = bpe_vocab(s.n_vocab, s.n_special)
    a = "llama"
    w = GGUFWriter()
    for key, value, vtype, etype in (
        ("general.architecture", a, VT.STRING, None),
        ("general.name", name, VT.STRING, None),
        ("general.file_type", 1, VT.UINT32, None),                 # LLAMA_FTYPE_MOSTLY_F16
        (f"{a}.vocab_size", s.n_vocab, VT.UINT32, None),
        (f"{a}.context_length", s.n_ctx_train, VT.UINT32, None),
        (f"{a}.embedding_length", s.n_embd, VT.UINT32, None),
        (f"{a}.block_count", s.n_layer, VT.UINT32, None),
        (f"{a}.feed_forward_length", s.n_ff, VT.UINT32, None),
        (f"{a}.attention.head_count", s.n_head, VT.UINT32, None),
        (f"{a}.attention.head_count_kv", s.n_head_kv, VT.UINT32, None),
        (f"{a}.attention.layer_norm_rms_epsilon", s.rms_eps, VT.FLOAT32, None),
        (f"{a}.rope.freq_base", s.rope_theta, VT.FLOAT32, None),
        (f"{a}.rope.dimension_count", s.head_dim, VT.UINT32, None),
        ("tokenizer.ggml.model", "gpt2", VT.STRING, None),
        ("tokenizer.ggml.pre", "llama-bpe", VT.STRING, None),
        ("tokenizer.ggml.tokens", tokens, VT.ARRAY, VT.STRING),
        ("tokenizer.ggml.token_type", types, VT.ARRAY, VT.INT32),
        ("tokenizer.ggml.merges", merges, VT.ARRAY, VT.STRING),
        ("tokenizer.ggml.bos_token_id", s.n_vocab - s.n_special, VT.UINT32, None),
        ("tokenizer.ggml.eos_token_id", s.n_vocab - s.n_special + 1, VT.UINT32, None),
    ):
        w.add_kv(key, value, vtype, etype)
    tensors = _tensors(s)
    if s.rope_factor:
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(s))
    for t_name, ne, fan_in in tensors:
        w.add_tensor_info(t_name, GGMLType.F16 if fan_in else GGMLType.F32, ne)
    index = {t_name: (i, ne, fan_in) for i, (t_name, ne, fan_in) in enumerate(tensors)}
    w.write(path, tensor_data=lambda t_name: _random_f16(seed, *index[t_name]))


def cache_path(shape: str) -> Path:
    from llm import hub
    return hub.cache_dir() / "shapes" / f"llama-{shape}-random-Q4_K_M.gguf"


def build(shape: str, nthread: int = 2, seed: int = 0) -> Path:
    """The Q4_K_M file of SHAPES[shape], built (F16, then llama.cpp's quantizer) unless cached."""
    from llm.research import quantize_llamacpp
    out = cache_path(shape)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    f16 = out.with_name(f"llama-{shape}-random-F16.gguf.part")
    part = out.with_name(out.name + ".part")
    log.warning("building %s: F16 %s, then Q4_K_M by llama.cpp", out, f16)
    try:
        write_f16(SHAPES[shape], f16, seed, name=f"random llama {shape}")
        quantize_llamacpp.quantize_file(f16, part, LLAMA_FTYPE_MOSTLY_Q4_K_M, nthread)
        os.replace(part, out)
    finally:
        for p in (f16, part):
            p.unlink(missing_ok=True)
    return out

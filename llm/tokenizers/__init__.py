"""Tokenizer algorithms behind `llm.vocab.Vocab`, each matching llama.cpp token for token.

- `spm`: SentencePiece-style merges by score with byte fallback (`tokenizer.ggml.model` "llama").
- `bpe`: byte-level BPE with merge ranks (`tokenizer.ggml.model` "gpt2").
- `pretokenize`: the regex word splitting that `tokenizer.ggml.pre` selects for BPE.
- `unicode`: llama.cpp's UTF-8 decoding, code point classes and GPT-2 byte map.
"""
from llm.tokenizers.bpe import BPETokenizer
from llm.tokenizers.pretokenize import PRE_TOKENIZERS, PreTokenizer
from llm.tokenizers.spm import SPMTokenizer

__all__ = ["BPETokenizer", "PRE_TOKENIZERS", "PreTokenizer", "SPMTokenizer"]

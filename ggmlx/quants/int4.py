"""Packed 4-bit form of Q4_0, Q4_1 and Q4_K weights, made at load time (weight format "int4").

Each sub-block of 32 elements is 16 bytes: byte j's low nibble is element j, its high nibble
element j + 16 (the order of ggml's own Q4_0/Q4_1 blocks, so unpacking is one AND and one
shift per 16 elements), plus an f32 scale and offset per sub-block: `scale * nibble + offset`
equals `dequantize` exactly (Q4_0: d * u - 8d, which is d * (u - 8) since every term is exact
in f32; Q4_1: d, m; Q4_K: d * sc, -dmin * m). 0.75 bytes per element where the int8 format
holds 1.25: a decode step reads 40% fewer weight bytes.
"""
from __future__ import annotations

import numpy as np

from ..types import GGMLType, block_size, type_size
from .int8 import k_scale_offset
from .kernels import NUMPY, read_f16

SUB_BLOCK = 32


def _int4_q4_0(b):
    d = read_f16(NUMPY, b, 0)
    return b[:, 2:18], d, -8.0 * d


def _int4_q4_1(b):
    return b[:, 4:20], read_f16(NUMPY, b, 0), read_f16(NUMPY, b, 2)


def _int4_q4_k(b):
    """Q4_K's qs are 4 runs of 32 bytes, the low nibbles sub-block 2j, the high ones 2j + 1:
    regrouped into 16-byte sub-blocks of (element i, element i + 16) nibble pairs."""
    qs = b[:, 16:144].reshape(-1, 4, 2, 16)
    lo, hi = qs[:, :, 0], qs[:, :, 1]                  # bytes 0..15 and 16..31 of each run
    even = (lo & 0x0F) | (hi << 4)
    odd = (lo >> 4) | (hi & 0xF0)
    return (np.stack([even, odd], axis=2).reshape(-1, 128), *k_scale_offset(b))


# type -> converter: blocks uint8 [n, type_size] -> (packed uint8 [n, block_size // 2],
# scale f32 [n, block_size // 32], offset f32 [n, block_size // 32])
INT4_CONVERTERS = {
    GGMLType.Q4_0: _int4_q4_0,
    GGMLType.Q4_1: _int4_q4_1,
    GGMLType.Q4_K: _int4_q4_k,
}

# Blocks converted per numpy call: bounds the temporaries of a large tensor.
_CONVERT_CHUNK_BLOCKS = 1 << 14


def to_int4(blocks: np.ndarray, t: GGMLType, n_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Packed blocks uint8 [n_rows, row_bytes] of type t -> (nibbles uint8 [n_rows, ne0 // 2],
    scale f32 [n_rows, ne0 // 32], offset f32 [n_rows, ne0 // 32]) with
    scale * nibble + offset == dequantize exactly."""
    convert = INT4_CONVERTERS[t]
    flat = blocks.reshape(-1, type_size(t))
    n_blocks, bs = flat.shape[0], block_size(t)
    q = np.empty((n_blocks, bs // 2), np.uint8)
    scale = np.empty((n_blocks, bs // SUB_BLOCK), np.float32)
    offset = np.empty_like(scale)
    for start in range(0, n_blocks, _CONVERT_CHUNK_BLOCKS):
        stop = min(start + _CONVERT_CHUNK_BLOCKS, n_blocks)
        q[start:stop], scale[start:stop], offset[start:stop] = convert(flat[start:stop])
    return q.reshape(n_rows, -1), scale.reshape(n_rows, -1), offset.reshape(n_rows, -1)

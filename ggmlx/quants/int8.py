"""Exact int8 form of block-quantized weights, made at load time (weight format "int8").

A block type with a linear dequantization y = d * q (+ m) is re-expressed as int8 quants
plus an f32 scale (and, for types with a minimum, an f32 offset) per sub-block of 16 or 32
elements: `scale * q + offset` equals `dequantize` exactly. XLA:CPU does not fuse 4-bit
unpacking into a dot, while int8 upcasts cheaply, so this is the fastest CPU format. The
IQ codebook types (except IQ4_NL/IQ4_XS), TQ* and MXFP4 have no such form.
"""
from __future__ import annotations

import numpy as np

from ..types import GGMLType, block_size, type_size
from . import iq_tables as tab
from .kernels import BITS, CRUMBS, NIBBLES, NUMPY, k_scale_min, q5_quants, read_f16, unpack_bits


def _int8_q4_0(b):
    return unpack_bits(NUMPY, b[:, 2:18], 16, NIBBLES, 0xF).astype(np.int8) - 8, read_f16(NUMPY, b, 0), None


def _int8_q4_1(b):
    q = unpack_bits(NUMPY, b[:, 4:20], 16, NIBBLES, 0xF).astype(np.int8)
    return q, read_f16(NUMPY, b, 0), read_f16(NUMPY, b, 2)


def _int8_q5_0(b):
    return q5_quants(NUMPY, b[:, 2:6], b[:, 6:22]).astype(np.int8) - 16, read_f16(NUMPY, b, 0), None


def _int8_q5_1(b):
    return q5_quants(NUMPY, b[:, 4:8], b[:, 8:24]).astype(np.int8), read_f16(NUMPY, b, 0), read_f16(NUMPY, b, 2)


def _int8_q8_0(b):
    return b[:, 2:34].view(np.int8), read_f16(NUMPY, b, 0), None


def _int8_iq4_nl(b):
    idx = unpack_bits(NUMPY, b[:, 2:18], 16, NIBBLES, 0xF)
    return tab.KVALUES_IQ4NL.astype(np.int8)[idx], read_f16(NUMPY, b, 0), None


def _int8_q2_k(b):
    sc = b[:, 0:16]
    q = unpack_bits(NUMPY, b[:, 16:80], 32, CRUMBS, 3).astype(np.int8)
    d, dmin = read_f16(NUMPY, b, 80), read_f16(NUMPY, b, 82)
    return q, d * (sc & 0xF).astype(np.float32), -(dmin * (sc >> 4).astype(np.float32))


def _int8_q3_k(b):
    hbit = unpack_bits(NUMPY, b[:, 0:32], 32, BITS, 1)
    low = unpack_bits(NUMPY, b[:, 32:96], 32, CRUMBS, 3)
    s = b[:, 96:108]
    scale = unpack_bits(NUMPY, s[:, 0:8], 8, NIBBLES, 0xF) | (unpack_bits(NUMPY, s[:, 8:12], 4, CRUMBS, 3) << 4)
    q = low.astype(np.int8) - ((hbit ^ 1) << 2).astype(np.int8)
    return q, read_f16(NUMPY, b, 108) * (scale.astype(np.int8) - 32).astype(np.float32), None


def k_scale_offset(b):
    """Q4_K/Q5_K: the scale d * sc and offset -dmin * m of each sub-block of 32 (f32, exact)."""
    scale, mins = k_scale_min(NUMPY, b[:, 4:16])
    d, dmin = read_f16(NUMPY, b, 0), read_f16(NUMPY, b, 2)
    return d * scale.astype(np.float32), -(dmin * mins.astype(np.float32))


def _k_affine(b, q):
    return (q.astype(np.int8), *k_scale_offset(b))


def _int8_q4_k(b):
    return _k_affine(b, unpack_bits(NUMPY, b[:, 16:144], 32, NIBBLES, 0xF))


def _int8_q5_k(b):
    q = unpack_bits(NUMPY, b[:, 48:176], 32, NIBBLES, 0xF) | (unpack_bits(NUMPY, b[:, 16:48], 32, BITS, 1) << 4)
    return _k_affine(b, q)


def _int8_q6_k(b):
    low = unpack_bits(NUMPY, b[:, 0:128], 64, NIBBLES, 0xF)
    high = unpack_bits(NUMPY, b[:, 128:192], 32, CRUMBS, 3)
    q = (low | (high << 4)).astype(np.int8) - 32
    return q, read_f16(NUMPY, b, 208) * b[:, 192:208].view(np.int8).astype(np.float32), None


def _int8_iq4_xs(b):
    d = read_f16(NUMPY, b, 0)
    high = (b[:, 2:4].copy().view(np.uint16) >> np.arange(0, 16, 2, dtype=np.uint16)) & 3
    scale = unpack_bits(NUMPY, b[:, 4:8], 1, NIBBLES, 0xF) | (high.astype(np.uint8) << 4)
    idx = unpack_bits(NUMPY, b[:, 8:136], 16, NIBBLES, 0xF)
    return tab.KVALUES_IQ4NL.astype(np.int8)[idx], d * (scale.astype(np.int8) - 32).astype(np.float32), None


# type -> (sub-block length, converter: blocks uint8 [n, type_size] -> (q int8 [n, block_size],
# scale f32 [n, block_size // sub], offset f32 [n, block_size // sub] or None))
INT8_CONVERTERS = {
    GGMLType.Q4_0: (32, _int8_q4_0),
    GGMLType.Q4_1: (32, _int8_q4_1),
    GGMLType.Q5_0: (32, _int8_q5_0),
    GGMLType.Q5_1: (32, _int8_q5_1),
    GGMLType.Q8_0: (32, _int8_q8_0),
    GGMLType.IQ4_NL: (32, _int8_iq4_nl),
    GGMLType.Q2_K: (16, _int8_q2_k),
    GGMLType.Q3_K: (16, _int8_q3_k),
    GGMLType.Q4_K: (32, _int8_q4_k),
    GGMLType.Q5_K: (32, _int8_q5_k),
    GGMLType.Q6_K: (16, _int8_q6_k),
    GGMLType.IQ4_XS: (32, _int8_iq4_xs),
}

# Blocks converted per numpy call: bounds the temporaries of a large tensor.
_CONVERT_CHUNK_BLOCKS = 1 << 14


def to_int8(blocks: np.ndarray, t: GGMLType, n_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Packed blocks uint8 [n_rows, row_bytes] of type t -> (q int8 [n_rows, ne0], scale f32
    [n_rows, ne0 // sub], offset f32 or None) with scale * q + offset == dequantize exactly."""
    sub, convert = INT8_CONVERTERS[t]
    flat = blocks.reshape(-1, type_size(t))
    n_blocks, bs = flat.shape[0], block_size(t)
    q = np.empty((n_blocks, bs), np.int8)
    scale = np.empty((n_blocks, bs // sub), np.float32)
    offset = None
    for start in range(0, n_blocks, _CONVERT_CHUNK_BLOCKS):
        stop = min(start + _CONVERT_CHUNK_BLOCKS, n_blocks)
        q_c, s_c, o_c = convert(flat[start:stop])
        q[start:stop] = q_c
        scale[start:stop] = np.broadcast_to(s_c, (stop - start, bs // sub))
        if o_c is not None:
            if offset is None:
                offset = np.empty_like(scale)
            offset[start:stop] = np.broadcast_to(o_c, (stop - start, bs // sub))
    return q.reshape(n_rows, -1), scale.reshape(n_rows, -1), None if offset is None else offset.reshape(n_rows, -1)

"""Lookup tables of the IQ and FP4 quant types (the constants of ggml-common.h).

The six codebook grids (`iq2xxs_grid`, `iq2xs_grid`, `iq2s_grid`, `iq3xxs_grid`,
`iq3s_grid`, `iq1s_grid`) are not derivable by a formula: ggml found them by search.
They live in `iq_grids.npz` next to this file, one row per grid entry holding the entry's
element values (ggml packs the same values into the bytes of a uint32/uint64). The tests
rebuild every table from gguf-py and compare.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

_GRIDS = np.load(Path(__file__).with_name("iq_grids.npz"))

# Codebooks as float32 [entries, elements per entry].
IQ2XXS_GRID = _GRIDS["iq2xxs"].astype(np.float32)   # [256, 8], values 8, 25, 43
IQ2XS_GRID = _GRIDS["iq2xs"].astype(np.float32)     # [512, 8]
IQ2S_GRID = _GRIDS["iq2s"].astype(np.float32)       # [1024, 8]
IQ3XXS_GRID = _GRIDS["iq3xxs"].astype(np.float32)   # [256, 4], values 4, 12, ..., 62
IQ3S_GRID = _GRIDS["iq3s"].astype(np.float32)       # [512, 4], values 1, 3, ..., 15
IQ1S_GRID = _GRIDS["iq1s"].astype(np.float32)       # [2048, 8], values -1, 0, 1

# Non-linear 4-bit codebook of IQ4_NL and IQ4_XS (kvalues_iq4nl).
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                         dtype=np.float32)

# FP4 (E2M1) values times two (kvalues_mxfp4); the block scale is halved to compensate.
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)

# IQ1_S / IQ1_M shift every grid value by +-1/8 (IQ1S_DELTA in ggml).
IQ1S_DELTA = np.float32(0.125)


def _sign_table(n: int) -> np.ndarray:
    """[n, 8] float32: +1 where bit j of the row index is clear, -1 where it is set."""
    bits = (np.arange(n, dtype=np.uint32)[:, None] >> np.arange(8, dtype=np.uint32)) & 1
    return (1 - 2 * bits.astype(np.int32)).astype(np.float32)


def _ksigns() -> np.ndarray:
    """ksigns_iq2xs: 7 stored sign bits plus an 8th bit that makes the count of set bits even."""
    i = np.arange(128, dtype=np.uint32)
    parity = np.zeros(128, dtype=np.uint32)
    for bit in range(7):
        parity ^= (i >> bit) & 1
    return (i | (parity << 7)).astype(np.uint8)


KSIGNS_IQ2XS = _ksigns()
# Signs of 8 elements as +-1 floats: indexed by a raw sign byte, or by a 7-bit ksigns index.
SIGNS_FROM_BYTE = _sign_table(256)
SIGNS_FROM_KSIGNS = SIGNS_FROM_BYTE[KSIGNS_IQ2XS]

"""ggml tensor types: numeric ids as in ggml.h, block sizes and bytes per block.

A quantized type packs `block_size` consecutive elements of a row into `type_size`
bytes. Row sizes are computed in checked integer arithmetic so that a hostile file
cannot make us allocate from an overflowed size.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class GGMLType(enum.IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39


@dataclass(frozen=True)
class TypeTraits:
    name: str
    block_size: int
    type_size: int
    is_quantized: bool


QK_K = 256

_TRAITS: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.Q4_0: (32, 18),
    GGMLType.Q4_1: (32, 20),
    GGMLType.Q5_0: (32, 22),
    GGMLType.Q5_1: (32, 24),
    GGMLType.Q8_0: (32, 34),
    GGMLType.Q8_1: (32, 40),
    GGMLType.Q2_K: (QK_K, 84),
    GGMLType.Q3_K: (QK_K, 110),
    GGMLType.Q4_K: (QK_K, 144),
    GGMLType.Q5_K: (QK_K, 176),
    GGMLType.Q6_K: (QK_K, 210),
    GGMLType.Q8_K: (QK_K, 292),
    GGMLType.IQ2_XXS: (QK_K, 66),
    GGMLType.IQ2_XS: (QK_K, 74),
    GGMLType.IQ3_XXS: (QK_K, 98),
    GGMLType.IQ1_S: (QK_K, 50),
    GGMLType.IQ4_NL: (32, 18),
    GGMLType.IQ3_S: (QK_K, 110),
    GGMLType.IQ2_S: (QK_K, 82),
    GGMLType.IQ4_XS: (QK_K, 136),
    GGMLType.I8: (1, 1),
    GGMLType.I16: (1, 2),
    GGMLType.I32: (1, 4),
    GGMLType.I64: (1, 8),
    GGMLType.F64: (1, 8),
    GGMLType.IQ1_M: (QK_K, 56),
    GGMLType.BF16: (1, 2),
    GGMLType.TQ1_0: (QK_K, 54),
    GGMLType.TQ2_0: (QK_K, 66),
    GGMLType.MXFP4: (32, 17),
}

_PLAIN = {GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.F64,
          GGMLType.I8, GGMLType.I16, GGMLType.I32, GGMLType.I64}


def traits(t: GGMLType | int) -> TypeTraits:
    """Block geometry of a type; raises ValueError for an unknown id."""
    try:
        t = GGMLType(t)
    except ValueError:
        raise ValueError(f"unknown ggml type id {t!r}") from None
    bs, ts = _TRAITS[t]
    return TypeTraits(t.name, bs, ts, t not in _PLAIN)


def block_size(t: GGMLType | int) -> int:
    return traits(t).block_size


def type_size(t: GGMLType | int) -> int:
    return traits(t).type_size


# Sizes above this are rejected outright: no real tensor is 2**62 bytes, and Python ints
# never overflow, so this is the bound that stands in for ggml's int64 overflow checks.
MAX_BYTES = 1 << 62


class TypeSizeError(ValueError):
    """A shape that cannot be stored in a type (bad block multiple or overflow)."""


def row_size(t: GGMLType | int, ne0: int) -> int:
    """Bytes of one row of `ne0` elements (ggml_row_size), checked."""
    tr = traits(t)
    if ne0 < 0:
        raise TypeSizeError(f"negative row length {ne0}")
    if ne0 % tr.block_size:
        raise TypeSizeError(f"row length {ne0} is not a multiple of the {tr.name} block size {tr.block_size}")
    n = (ne0 // tr.block_size) * tr.type_size
    if n > MAX_BYTES:
        raise TypeSizeError(f"row of {ne0} {tr.name} elements overflows")
    return n


def n_elements(ne: tuple[int, ...] | list[int]) -> int:
    """Element count of a shape, checked against overflow."""
    n = 1
    for d in ne:
        if d < 0:
            raise TypeSizeError(f"negative dimension in {tuple(ne)}")
        n *= d
        if n > MAX_BYTES:
            raise TypeSizeError(f"element count of {tuple(ne)} overflows")
    return n


def nbytes(t: GGMLType | int, ne: tuple[int, ...] | list[int]) -> int:
    """Total bytes of a tensor of shape `ne` (ggml order) in type `t` (ggml_nbytes), checked."""
    if not ne:
        return type_size(t)
    rows = n_elements(ne[1:])
    n = row_size(t, ne[0]) * rows
    if n > MAX_BYTES:
        raise TypeSizeError(f"byte size of {tuple(ne)} {traits(t).name} overflows")
    return n

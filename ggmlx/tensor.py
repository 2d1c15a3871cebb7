"""Symbolic tensor nodes, as in ggml: building a graph does no math.

A node has `op, src, ne` (ggml order, innermost first, always 4 dims), `type`, `op_params`,
`name`, `flags` and strides `nb` (bytes, ggml convention) so that views over a parent's
memory keep ggml's meaning. Leaves are weights (bound to device data), inputs (filled before
each run) or state (buffers threaded through the compiled function, e.g. the KV cache).
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ggmlx import types
from ggmlx.types import GGMLType

MAX_DIMS = 4


class Flag(enum.IntFlag):
    NONE = 0
    INPUT = 1
    OUTPUT = 2
    WEIGHT = 4
    STATE = 8


class Op(enum.Enum):
    NONE = "NONE"           # leaf
    GET_ROWS = "GET_ROWS"
    MUL_MAT = "MUL_MAT"
    MUL_MAT_ID = "MUL_MAT_ID"
    ADD = "ADD"
    SUB = "SUB"
    MUL = "MUL"
    DIV = "DIV"
    SCALE = "SCALE"
    SQR = "SQR"
    SQRT = "SQRT"
    CLAMP = "CLAMP"
    TANH = "TANH"
    SILU = "SILU"
    RELU = "RELU"
    SIGMOID = "SIGMOID"
    SOFTPLUS = "SOFTPLUS"
    XIELU = "XIELU"
    GELU = "GELU"
    GELU_QUICK = "GELU_QUICK"
    GELU_ERF = "GELU_ERF"
    GLU = "GLU"
    RMS_NORM = "RMS_NORM"
    NORM = "NORM"
    ROPE = "ROPE"
    SOFT_MAX = "SOFT_MAX"
    VIEW = "VIEW"
    RESHAPE = "RESHAPE"
    PERMUTE = "PERMUTE"
    CONT = "CONT"
    CPY = "CPY"
    SET_ROWS = "SET_ROWS"
    CONCAT = "CONCAT"
    REPEAT = "REPEAT"
    IM2COL = "IM2COL"
    PAD = "PAD"
    SUM_ROWS = "SUM_ROWS"
    ARGSORT = "ARGSORT"
    TOP_K = "TOP_K"
    FLASH_ATTN_EXT = "FLASH_ATTN_EXT"
    MAP_CUSTOM1 = "MAP_CUSTOM1"
    SSM_CONV = "SSM_CONV"
    SSM_SCAN = "SSM_SCAN"
    GATED_DELTA_NET = "GATED_DELTA_NET"


# ops whose result is a window onto their source's memory (ggml's view ops)
VIEW_OPS = (Op.VIEW, Op.PERMUTE, Op.RESHAPE)

_ids = itertools.count()


@dataclass(eq=False)
class Tensor:
    """One node of a ggmlx graph (identity semantics: two nodes are never equal by value)."""
    op: Op
    src: tuple[Tensor, ...]
    ne: tuple[int, int, int, int]
    type: GGMLType
    nb: tuple[int, int, int, int]
    op_params: tuple = ()
    name: str = ""
    flags: Flag = Flag.NONE
    view_offs: int = 0          # byte offset into src[0] for VIEW
    data: Any = None            # weights: bound device data (see ggmlx.weights)
    id: int = field(default_factory=lambda: next(_ids))

    def set_name(self, name: str) -> Tensor:
        self.name = name
        return self

    def set_input(self) -> Tensor:
        self.flags |= Flag.INPUT
        return self

    def set_output(self) -> Tensor:
        self.flags |= Flag.OUTPUT
        return self

    @property
    def is_leaf(self) -> bool:
        return self.op is Op.NONE

    @property
    def n_dims(self) -> int:
        """Number of dims up to the last one > 1 (ggml_n_dims), at least 1."""
        for i in range(MAX_DIMS - 1, 0, -1):
            if self.ne[i] > 1:
                return i + 1
        return 1

    def nelements(self) -> int:
        return self.ne[0] * self.ne[1] * self.ne[2] * self.ne[3]

    def nrows(self) -> int:
        return self.ne[1] * self.ne[2] * self.ne[3]

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy order (outermost first) of the 4-d shape; the one place where order flips."""
        return tuple(reversed(self.ne))

    def is_contiguous(self) -> bool:
        return self.nb == contiguous_strides(self.type, self.ne)

    def __repr__(self) -> str:
        return f"Tensor({self.op.value}, name={self.name!r}, ne={self.ne}, type={self.type.name})"


def pad_ne(ne) -> tuple[int, int, int, int]:
    ne = tuple(int(d) for d in ne)
    if not 1 <= len(ne) <= MAX_DIMS:
        raise ValueError(f"a tensor has 1 to {MAX_DIMS} dims, got {ne}")
    if any(d < 0 for d in ne):
        raise ValueError(f"negative dimension in {ne}")
    return ne + (1,) * (MAX_DIMS - len(ne))


def contiguous_strides(t: GGMLType, ne) -> tuple[int, int, int, int]:
    """ggml's nb for a contiguous tensor: nb[0] = type size, nb[1] = row size, ..."""
    nb0 = types.type_size(t)
    nb1 = nb0 * (ne[0] // types.block_size(t))
    return (nb0, nb1, nb1 * ne[1], nb1 * ne[1] * ne[2])


def new_tensor(t: GGMLType, ne, *, op: Op = Op.NONE, src=(), op_params=(), name: str = "",
               flags: Flag = Flag.NONE) -> Tensor:
    ne4 = pad_ne(ne)
    if ne4[0] % types.block_size(t):
        raise ValueError(f"ne[0]={ne4[0]} is not a multiple of the {t.name} block size")
    return Tensor(op=op, src=tuple(src), ne=ne4, type=GGMLType(t),
                  nb=contiguous_strides(t, ne4), op_params=tuple(op_params), name=name, flags=flags)


def new_input(t: GGMLType, ne, name: str) -> Tensor:
    """A leaf filled before each run (token ids, positions, masks)."""
    return new_tensor(t, ne, name=name, flags=Flag.INPUT)


def new_state(t: GGMLType, ne, name: str) -> Tensor:
    """A leaf whose buffer is passed in and returned (donated), e.g. one layer's K cache."""
    return new_tensor(t, ne, name=name, flags=Flag.STATE)


def new_weight(t: GGMLType, ne, name: str, data: Any = None) -> Tensor:
    """A leaf bound to device data; its values never enter a compiled-graph cache key."""
    w = new_tensor(t, ne, name=name, flags=Flag.WEIGHT)
    w.data = data
    return w


NP_DTYPES: dict[GGMLType, np.dtype] = {
    GGMLType.F32: np.dtype(np.float32),
    GGMLType.F16: np.dtype(np.float16),
    GGMLType.I32: np.dtype(np.int32),
    GGMLType.I64: np.dtype(np.int64),
    GGMLType.I16: np.dtype(np.int16),
    GGMLType.I8: np.dtype(np.int8),
    GGMLType.F64: np.dtype(np.float64),
}


def buffer_layout(t: Tensor) -> tuple[tuple[int, ...], np.dtype]:
    """(numpy shape, dtype) of the array that holds t's value: its elements in t.shape, or for a
    block type its rows of block bytes, uint8 [ne3, ne2, ne1, row bytes] (a quantized KV cache
    and the views of it; dequantize_jax reads that as it reads the packed blocks)."""
    if types.traits(t.type).is_quantized:
        return (t.ne[3], t.ne[2], t.ne[1], types.row_size(t.type, t.ne[0])), np.dtype(np.uint8)
    return t.shape, np_dtype(t.type)


def np_dtype(t: GGMLType) -> np.dtype:
    """numpy dtype of an unquantized type (BF16 through ml_dtypes)."""
    if t == GGMLType.BF16:
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    try:
        return NP_DTYPES[t]
    except KeyError:
        raise TypeError(f"{t.name} is a block type with no element dtype") from None

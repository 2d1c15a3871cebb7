"""Host dequantization with numpy: packed GGUF tensor bytes -> float32 array.

The result equals ggml's dequantize_row_* bit for bit. Blocks are processed in chunks so
that the temporaries of a large tensor (a 262144-row embedding) stay cache-sized instead
of several times the size of the output.
"""
from __future__ import annotations

import numpy as np

from ..types import GGMLType, block_size, nbytes, type_size
from .kernels import DEQUANTIZE_KERNELS, FLOAT_TYPES, NUMPY

# Elements per numpy chunk: large enough to amortize per-call overhead, small enough
# that a chunk's temporaries stay in cache.
CHUNK_ELEMENTS = 1 << 17

SUPPORTED_TYPES: tuple[GGMLType, ...] = FLOAT_TYPES + tuple(DEQUANTIZE_KERNELS)


def check_type(t: GGMLType | int, what: str) -> GGMLType:
    """`t` as a GGMLType that we can dequantize; unknown id -> ValueError, unsupported -> NotImplementedError."""
    try:
        t = GGMLType(t)
    except ValueError:
        raise ValueError(f"{what}: unknown ggml type id {t!r}") from None
    if t not in SUPPORTED_TYPES:
        raise NotImplementedError(f"{what}: ggml type {t.name} is not supported")
    return t


def numpy_shape(t: GGMLType, ne: tuple[int, ...] | list[int], what: str) -> tuple[int, ...]:
    """The numpy shape (reversed ne) of a tensor of type `t`; bad ne -> ValueError naming it."""
    ne = tuple(int(d) for d in ne)
    if not ne:
        raise ValueError(f"{what}: {t.name} tensor needs at least one dimension, got ne=()")
    nbytes(t, ne)  # raises TypeSizeError (a ValueError) for a bad block multiple or overflow
    return ne[::-1]


def dequantize(data: np.ndarray, type: GGMLType | int, ne: tuple[int, ...] | list[int]) -> np.ndarray:
    """Packed bytes of a tensor -> float32 array of shape ne[::-1] (numpy order).

    `data` is a uint8 array (e.g. a zero-copy view of the GGUF mmap) of exactly
    nbytes(type, ne) bytes. For F32 the result is a view of `data` (read-only if `data`
    is); every other type returns a new array.
    """
    t = check_type(type, "dequantize")
    shape = numpy_shape(t, ne, "dequantize")
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8:
        got = f"numpy {data.dtype}" if isinstance(data, np.ndarray) else data.__class__.__name__
        raise TypeError(f"dequantize: {t.name} tensor data must be a numpy uint8 array, got {got}")
    want = nbytes(t, shape[::-1])
    if data.size != want:
        raise ValueError(f"dequantize: {t.name} tensor of shape ne={shape[::-1]} needs {want} bytes, "
                         f"got {data.size}")
    flat = np.ascontiguousarray(data).reshape(-1)
    if t == GGMLType.F32:
        return flat.view(np.float32).reshape(shape)
    if t == GGMLType.F16:
        return flat.view(np.float16).astype(np.float32).reshape(shape)
    if t == GGMLType.BF16:
        return (flat.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)

    kernel = DEQUANTIZE_KERNELS[t]
    bs, ts = block_size(t), type_size(t)
    blocks = flat.reshape(-1, ts)
    out = np.empty((blocks.shape[0], bs), dtype=np.float32)
    step = max(1, CHUNK_ELEMENTS // bs)
    with np.errstate(over="ignore"):  # huge MXFP4 exponents give inf, as in ggml
        for start in range(0, blocks.shape[0], step):
            out[start:start + step] = kernel(NUMPY, blocks[start:start + step])
    return out.reshape(shape)

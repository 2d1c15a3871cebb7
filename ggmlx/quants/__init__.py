"""ggml quantization blocks: dequantize (numpy and JAX) and quantize.

- `dequantize(data, type, ne)`: packed GGUF bytes -> numpy float32 in shape ne[::-1].
- `dequantize_jax(blocks, type, ne)`: the same inside jit, from the packed blocks on a
  device (layout: ggmlx.quants.jax_dequant; `weights.to_device` puts them there).
- `int8.to_int8(blocks, type, n_rows)`: the exact int8 form of the linear block types.
- `quantize(x, type)`: every type in QUANTIZE_TYPES (F32, F16, BF16, the legacy types,
  Q2_K..Q6_K, IQ4_NL, IQ4_XS, IQ3_S, IQ3_XXS, IQ2_S, IQ1_M, TQ1_0, TQ2_0, MXFP4), bit-exact with
  ggml_quantize_chunk without an importance matrix, and with one (`imatrix`) for IMATRIX_TYPES
  (IQ2_XXS, IQ2_XS and IQ1_S only with one); `quantize_jax(x, type)`: the legacy types and
  IQ4_NL on device, by ggml's quantize_row_*_ref (what set_rows writes into a quantized KV
  cache; `quantize_row` the same on the host).

Dequantization covers F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, IQ4_NL,
IQ4_XS, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, TQ1_0, TQ2_0 and MXFP4.
"""
from .jax_dequant import dequantize_jax
from .numpy_ref import SUPPORTED_TYPES, dequantize
from .quantizers import (
    IMATRIX_TYPES,
    QUANTIZE_KERNELS,
    QUANTIZE_TYPES,
    ROW_KERNELS,
    quantize,
    quantize_jax,
    quantize_row,
    validate_row_data,
)

__all__ = [
    "SUPPORTED_TYPES", "QUANTIZE_TYPES", "QUANTIZE_KERNELS", "IMATRIX_TYPES",
    "ROW_KERNELS", "dequantize", "dequantize_jax", "quantize", "quantize_jax", "quantize_row", "validate_row_data",
]

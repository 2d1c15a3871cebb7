import pytest

from ggmlx import types
from ggmlx.types import GGMLType


def test_ids_and_sizes_match_gguf_py():
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    for t in GGMLType:
        ref = GGMLQuantizationType[t.name]
        assert int(ref) == int(t)
        assert GGML_QUANT_SIZES[ref] == (types.block_size(t), types.type_size(t))


def test_row_size_and_nbytes():
    assert types.row_size(GGMLType.Q4_0, 64) == 36
    assert types.nbytes(GGMLType.Q4_K, (256, 3)) == 3 * 144
    assert types.nbytes(GGMLType.F32, (0, 5)) == 0
    with pytest.raises(types.TypeSizeError, match="multiple"):
        types.row_size(GGMLType.Q4_K, 100)
    with pytest.raises(types.TypeSizeError, match="overflow"):
        types.nbytes(GGMLType.F32, (1 << 40, 1 << 40))
    with pytest.raises(ValueError, match="unknown ggml type"):
        types.traits(4)

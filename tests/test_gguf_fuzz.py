"""Seeded GGUF fuzzing: thousands of mutants of a tiny model file (bit flips, interesting
bytes and integers in the metadata, truncation, inserted or deleted bytes, NaN/inf floats)
through ggmlx.gguf and llm.load_model. The only acceptable failures are GGUFError and
ModelLoadError; anything else (IndexError, OverflowError, MemoryError, ...) is a bug."""
from __future__ import annotations

import random
import time

import numpy as np
import pytest
from tiny_model import TinySpec, write_model

import llm
from ggmlx import gguf
from ggmlx.gguf import GGUFError
from llm.errors import ModelLoadError

N_MUTANTS = 3000
INTERESTING_BYTES = [0, 1, 0x7F, 0x80, 0xFF]
INTERESTING_INTS = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**63 - 1, 2**64 - 1, 1 << 40]
INTERESTING_FLOATS = [np.nan, np.inf, -np.inf, -1.0, 0.0, 1e38]


def mutate(rng: random.Random, data: bytes, head: int) -> bytes:
    """One mutant; most mutations land in the first `head` bytes (header, metadata, tensor
    infos), where a change is a new structure rather than new weight values."""
    b = bytearray(data)
    kind = rng.randrange(6)
    if kind == 0:
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(head)] ^= 1 << rng.randrange(8)
    elif kind == 1:
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(head)] = rng.choice(INTERESTING_BYTES)
    elif kind == 2:
        i, n = rng.randrange(head - 8), rng.choice([4, 8])
        b[i:i + n] = (rng.choice(INTERESTING_INTS) % (1 << (8 * n))).to_bytes(n, "little")
    elif kind == 3:
        del b[rng.randrange(len(b)):]
    elif kind == 4:
        i = rng.randrange(head)
        if rng.random() < 0.5:
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        else:
            del b[i:i + rng.randint(1, 8)]
    else:
        i = rng.randrange(len(b) - 4)
        b[i:i + 4] = np.float32(rng.choice(INTERESTING_FLOATS)).tobytes()
    return bytes(b)


@pytest.mark.slow
def test_gguf_mutants_fail_only_with_typed_errors(tmp_path):
    src = write_model(tmp_path / "tiny.gguf", TinySpec(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=32))
    data = src.read_bytes()
    with gguf.GGUFReader(src) as f:
        head = f.data_offset
    rng = random.Random(19)
    path = tmp_path / "mutant.gguf"
    t0 = time.monotonic()
    outcomes = {"loaded": 0, "rejected": 0}
    for k in range(N_MUTANTS):
        path.write_bytes(mutate(rng, data, head))
        try:
            # every 4th mutant loads its weights too; the others stop after hparams + vocab
            llm.load_model(path, vocab_only=k % 4 != 0)
            outcomes["loaded"] += 1
        except (GGUFError, ModelLoadError):
            outcomes["rejected"] += 1
        except Exception as e:      # any other type is the failure under test
            pytest.fail(f"mutant {k} (seed 19) raised {type(e).__name__}: {e}")
    assert time.monotonic() - t0 < 60
    assert outcomes["rejected"] > N_MUTANTS // 10 and outcomes["loaded"] > 0, outcomes

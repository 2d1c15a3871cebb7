"""Rebuild this folder from the llama.cpp reference data (../shared/reference).

Copies the small tokenize / detokenize / vocab_info files of both real models, and replaces
the large pieces files by `<model>.pieces_digest.npz`: the attribute of every token and, per
block of 1024 token ids, a 16-byte BLAKE2b digest of the pieces (each as a 4-byte
little-endian length and the bytes) for special=false and special=true. Also writes
`synth-spm.tokenizer.json`, the tokenizer metadata of the synthetic models (one shared
512-token SPM vocabulary).

    python tests/data/tokenizer/regenerate.py [/path/to/shared/reference]
"""
from __future__ import annotations

import base64
import gzip
import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
MODELS = ("smollm2-135m-instruct-q4_1", "gemma-3-270m-q4_k_m")
BLOCK = 1024


def block_digests(pieces: list[bytes]) -> np.ndarray:
    """[n_blocks, 16] uint8; tests/test_vocab.py computes the same from our pieces."""
    out = []
    for start in range(0, len(pieces), BLOCK):
        h = hashlib.blake2b(digest_size=16)
        for p in pieces[start:start + BLOCK]:
            h.update(len(p).to_bytes(4, "little") + p)
        out.append(np.frombuffer(h.digest(), dtype=np.uint8))
    return np.stack(out)


def main(reference: Path) -> None:
    tok = reference / "tokenizer"
    for model in MODELS:
        for suffix in ("tokenize.jsonl.gz", "detokenize.jsonl.gz", "vocab_info.json"):
            shutil.copyfile(tok / f"{model}.{suffix}", HERE / f"{model}.{suffix}")
        rows = sorted((json.loads(line) for line in gzip.open(tok / f"{model}.pieces.jsonl.gz", "rt")),
                      key=lambda r: r["id"])
        assert [r["id"] for r in rows] == list(range(len(rows)))
        np.savez_compressed(
            HERE / f"{model}.pieces_digest.npz",
            attr=np.array([r["attr"] for r in rows], dtype=np.int32),
            digest=block_digests([base64.b64decode(r["piece_b64"]) for r in rows]),
            digest_special=block_digests([base64.b64decode(r["piece_special_b64"]) for r in rows]),
        )

    from gguf import GGUFReader  # test-only dependency
    reader = GGUFReader(reference / "synthetic" / "models" / "synth-llama-F32.gguf")
    kv = {}
    for name, f in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        if len(f.types) > 1:
            kv[name] = [f.contents(i) for i in range(len(f.data))]
        else:
            kv[name] = f.contents()
    (HERE / "synth-spm.tokenizer.json").write_text(json.dumps(kv, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE.parents[3] / "shared" / "reference")

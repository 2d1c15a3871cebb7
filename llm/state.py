"""Saved context state: llama.cpp's llama_state_* (session files) for `llm.Context`.

What is saved: the KV cells in use (cell index, position, sequences) with the K and V rows
of every layer in the cache's own type, the last logits with their output ids, the
Mersenne-Twister states of the seeded samplers of an optional sampler chain, and the
caller's tokens. A seq file holds one sequence's cells, positions and rows (no logits).

Layout (little-endian):

    header   magic b"GGMLXST\\0" | version u32 | kind u32 | body length u64 | body crc32 u32
    body     fingerprint 32 B (sha256 of arch, hparams and the GGUF tensor table)
             type_k u32 | type_v u32 | n_layer u32
             n_tokens u32, tokens i32[n_tokens]
             n_cells u32, cell i32[n], pos i32[n], seq u64[n] (kind FULL; kind SEQ: pos only)
             n_outputs u32, n_vocab u32, n_ids u32, output_ids i32[n_ids], logits f32[n_outputs * n_vocab]
             n_rng u32, per rng: key u32[624], pos u32
             per layer: K rows [n, n_embd_k_gqa], V rows [n, n_embd_v_gqa] in the cache types
             (a memory without attention layers: types 0, no layers, no cells)
    recurrent memory (recurrent and hybrid models only; llm.memory_recurrent), in the bytes of
    llama.cpp's llama_memory_recurrent::state_write (a pure recurrent model's seq state after
    llama_state_seq_get_data's magic and seq_id is exactly this):
             cell_count u32; per cell: pos i32, n_seq_id u32, seq_id i32[n_seq_id] (kind SEQ: 0 ids)
             s_trans u32 (0), n_layer u32
             per recurrent layer: type i32, row size u64, conv (R) rows [cell_count, n_embd_r]
             per recurrent layer: type i32, row size u64, SSM (S) rows [cell_count, n_embd_s]

The crc32 over the body catches a flipped byte anywhere; every count is still checked
against the context before anything is allocated from it (as the GGUF reader does), so a
crafted file with a matching checksum fails with StateError too. Loading validates all of
it first and only then touches the context, so a failed load leaves the context unchanged.
Files are written to a temporary file in the same directory and renamed into place, and read
with O_NOFOLLOW: a state file is a regular file, never a symbolic link (a link planted in the
server's slot directory would otherwise be followed). A bad file's error never shows its bytes.
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import secrets
import stat
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from llm.errors import StateError

MAGIC = b"GGMLXST\0"
VERSION = 2      # 2: the recurrent section in llama.cpp's layout
KIND_FULL, KIND_SEQ = 0, 1
_HEADER = struct.Struct("<8sIIQI")
_MT_WORDS = 624
NAME_MAX = 255                  # bytes in one file name (Linux, macOS)
# write_atomic's temporary file is the name + "." + 8 hex digits + ".tmp"
_TMP_RANDOM_BYTES = 4
_TMP_SUFFIX = ".tmp"
MAX_SLOT_FILENAME_BYTES = NAME_MAX - len(".") - 2 * _TMP_RANDOM_BYTES - len(_TMP_SUFFIX)


def model_fingerprint(model) -> bytes:
    """sha256 over the architecture, the hparams and the GGUF tensor table (name, type, shape):
    two files with the same fingerprint give the same K/V for the same tokens."""
    from ggmlx import gguf

    with gguf.GGUFReader(model.path) as f:
        table = sorted((t.name, int(t.type), list(t.ne)) for t in f.tensors.values())
    hp = json.dumps(dataclasses.asdict(model.hparams), sort_keys=True, default=str)
    h = hashlib.sha256()
    for part in (model.arch, hp, json.dumps(table)):
        h.update(part.encode("utf-8"))
        h.update(b"\0")
    return h.digest()


@dataclass
class _Saved:
    """A validated state, not yet applied."""

    kind: int
    tokens: list[int]
    cells: np.ndarray          # int32 cell indices (kind FULL)
    pos: np.ndarray            # int32
    seq: np.ndarray            # uint64 bit sets (kind FULL)
    output_ids: np.ndarray
    logits: np.ndarray
    rngs: list[tuple[np.ndarray, int]]
    k_rows: list[np.ndarray]
    v_rows: list[np.ndarray]
    rs_cells: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))  # kind FULL
    rs_pos: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))
    rs_rows: list[np.ndarray] = dataclasses.field(default_factory=list)     # per state buffer


# --- writing ---------------------------------------------------------------------------------


def _rng_owners(sampler) -> list:
    """The Mersenne Twisters of `sampler` (a chain or one sampler; it says which it owns)."""
    return [] if sampler is None else sampler.rngs()


def _u32(n: int) -> bytes:
    return struct.pack("<I", n)


def _rows(t, cells: np.ndarray) -> np.ndarray:
    """K or V rows of `cells` as host numpy in the cache type ([n_cells, n_embd]); the buffer is
    [..., n_ctx, n_embd] in numpy order."""
    rows = jax.device_get(t.data[..., np.asarray(cells), :])
    return np.asarray(rows).reshape(len(cells), t.data.shape[-1])


def _kv_parts(ctx) -> tuple[list, list]:
    """The KV cache's K and V buffers (none for a memory without attention layers)."""
    kv = ctx.memory.mem_attn
    return ([], []) if kv is None else (kv.k_l, kv.v_l)


def _kv_cells(ctx):
    """The KV cells, or empty ones for a memory without attention layers."""
    kv = ctx.memory.mem_attn
    if kv is not None:
        return kv.cells
    from llm.kv_cells import KVCells
    return KVCells(1, ctx.n_seq_max)


def _rs_buffers(ctx) -> list:
    rs = ctx.memory.mem_recr
    return [] if rs is None else rs._buffers()


def _check_single_cache(ctx, where: str) -> None:
    """State files hold one set of cells: a context with a separate sliding-window cache
    (Context(swa_full=False)) cannot be saved or restored yet."""
    if ctx.memory.cells_swa is not None:
        raise StateError(f"{where}: the context has a separate sliding-window KV cache (swa_full=False); "
                         "state save/load needs swa_full=True")


def serialize(ctx, fingerprint: bytes, tokens: Sequence[int], *, seq_id: int | None = None, sampler=None) -> bytes:
    """The whole state of ctx (seq_id None) or one sequence's, as bytes (header + body)."""
    _check_single_cache(ctx, "state")
    k_l, v_l = _kv_parts(ctx)
    cells_meta = _kv_cells(ctx)
    ids = np.asarray(list(tokens), dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= ctx.n_vocab):
        raise StateError(f"state: tokens must be in [0, n_vocab = {ctx.n_vocab})")
    if seq_id is None:
        cells = np.flatnonzero(cells_meta.pos >= 0).astype(np.int32)
    else:
        if not 0 <= seq_id < ctx.n_seq_max:
            raise StateError(f"state: seq_id {seq_id} is out of range [0, n_seq_max = {ctx.n_seq_max})")
        has = (cells_meta.seq & (np.uint64(1) << np.uint64(seq_id))) != 0
        cells = np.flatnonzero(has & (cells_meta.pos >= 0)).astype(np.int32)
        cells = cells[np.argsort(cells_meta.pos[cells], kind="stable")]
    parts = [fingerprint, _u32(int(k_l[0].type) if k_l else 0), _u32(int(v_l[0].type) if v_l else 0), _u32(len(k_l)),
             _u32(ids.size), ids.astype("<i4").tobytes(), _u32(cells.size)]
    if seq_id is None:
        parts += [cells.astype("<i4").tobytes(), cells_meta.pos[cells].astype("<i4").tobytes(),
                  cells_meta.seq[cells].astype("<u8").tobytes()]
        logits, ids = ctx.logits, ctx.output_ids
    else:
        parts.append(cells_meta.pos[cells].astype("<i4").tobytes())
        logits, ids = np.zeros((0, ctx.n_vocab), np.float32), np.zeros(0, np.int32)
    parts += [_u32(logits.shape[0]), _u32(ctx.n_vocab), _u32(ids.size), ids.astype("<i4").tobytes(),
              np.ascontiguousarray(logits, "<f4").tobytes()]
    owners = _rng_owners(sampler)
    parts.append(_u32(len(owners)))
    for rng in owners:
        st = rng._bits.state["state"]
        parts += [np.asarray(st["key"], "<u4").tobytes(), _u32(int(st["pos"]))]
    for k, v in zip(k_l, v_l, strict=True):
        parts += [_rows(k, cells).tobytes(), _rows(v, cells).tobytes()]
    rs = ctx.memory.mem_recr
    if rs is not None:
        parts.append(recurrent_state_write(rs, seq_id))
    body = b"".join(parts)
    kind = KIND_FULL if seq_id is None else KIND_SEQ
    return _HEADER.pack(MAGIC, VERSION, kind, len(body), zlib.crc32(body)) + body


def recurrent_state_write(rs, seq_id: int | None) -> bytes:
    """The recurrent memory's cells (all, or seq_id's) as llama_memory_recurrent::state_write
    writes them. A cell here belongs to one sequence, its index (copy-on-seq_cp)."""
    cells = np.flatnonzero(rs.pos >= 0) if seq_id is None else np.array([seq_id] if rs.pos[seq_id] >= 0 else [])
    cells = cells.astype(np.int32)
    parts = [_u32(cells.size)]
    for c in cells:
        parts.append(struct.pack("<iI", int(rs.pos[c]), 0) if seq_id is not None
                     else struct.pack("<iIi", int(rs.pos[c]), 1, int(c)))
    parts += [_u32(0), _u32(rs.hparams.n_layer)]            # s_trans, n_layer
    for t in [t for t in rs.r_l if t is not None] + [t for t in rs.s_l if t is not None]:
        parts += [struct.pack("<iQ", int(t.type), 4 * t.ne[0]), np.ascontiguousarray(_rows(t, cells), "<f4").tobytes()]
    return b"".join(parts)


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write to a new temporary file next to `path` (O_EXCL | O_NOFOLLOW: never through a link),
    fsync, then rename over it (a link at `path` is replaced, not followed)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{secrets.token_hex(_TMP_RANDOM_BYTES)}{_TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_file(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of the regular file `path`, opened with O_NOFOLLOW (and O_NONBLOCK, so a FIFO
    does not block the open); StateError for a link, a file that is not a regular file, one
    larger than `limit` bytes (refused before reading) or one that cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise StateError(f"{path}: is a symbolic link; a state file must be a regular file") from None
        raise StateError(f"{path}: cannot read: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise StateError(f"{path}: not a regular file")
        if st.st_size > limit:
            raise StateError(f"{path}: {st.st_size} bytes is too large for this context (at most {limit})")
        try:
            return f.read(limit + 1)
        except OSError as e:
            raise StateError(f"{path}: cannot read: {e.strerror or e}") from None


def max_state_bytes(ctx, *, seq: bool) -> int:
    """An upper bound on the size of any state of ctx: a longer file cannot be one."""
    k_l, v_l = _kv_parts(ctx)
    row_bytes = sum(t.data.shape[-1] * t.data.dtype.itemsize for t in k_l + v_l)
    per_cell = 4 + 4 + 8 + row_bytes
    logits = 0 if seq else ctx.n_batch * (ctx.n_vocab * 4 + 4)
    rs_bytes = ctx.n_seq_max * (8 + sum(t.ne[0] * 4 for t in _rs_buffers(ctx)))
    return (_HEADER.size + 32 + 4 * 13 + ctx.n_ctx * (4 + per_cell) + logits + 64 * (_MT_WORDS + 1) * 4
            + rs_bytes)


def slot_path(directory: str | os.PathLike, filename: str) -> Path:
    """Where llama-server's `POST /slots/{id}?action=save|restore {"filename"}` reads or writes:
    a plain file name inside `directory` (--slot-save-path) of at most MAX_SLOT_FILENAME_BYTES
    (its temporary file must fit NAME_MAX too), and not a link or other non-regular file there;
    StateError for anything else."""
    if (not isinstance(filename, str) or not filename or filename in (".", "..")
            or any(c in filename for c in '/\\:\0') or filename != filename.strip()
            or any(ord(c) < 32 for c in filename)):
        shown = repr(filename)[:60] if isinstance(filename, str) else type(filename).__name__
        raise StateError(f"slot filename {shown}: expected a plain file name")
    try:
        n_bytes = len(filename.encode("utf-8"))
    except UnicodeEncodeError:
        raise StateError("slot filename: not valid Unicode; expected a plain file name") from None
    if n_bytes > MAX_SLOT_FILENAME_BYTES:
        raise StateError(f"slot filename of {n_bytes} bytes is too long: expected a plain file name of at most "
                         f"{MAX_SLOT_FILENAME_BYTES} bytes")
    path = Path(directory) / filename
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return path
    if not stat.S_ISREG(mode):
        what = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
        raise StateError(f"slot filename {filename!r}: {what} in the slot directory; expected a plain file name")
    return path


# --- reading ---------------------------------------------------------------------------------


class _Reader:
    """Bounds-checked reads from the body; every failure is a StateError naming `where`."""

    def __init__(self, data: memoryview, where: str):
        self.data = data
        self.off = 0
        self.where = where

    def error(self, msg: str) -> StateError:
        return StateError(f"{self.where}: {msg}")

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.off + n > len(self.data):
            raise self.error(f"truncated: {what} needs {n} bytes at offset {self.off}, "
                             f"{len(self.data) - self.off} left")
        out = self.data[self.off:self.off + n]
        self.off += n
        return out

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.take(4, what))[0]

    def count(self, what: str, limit: int, limit_name: str) -> int:
        n = self.u32(what)
        if n > limit:
            raise self.error(f"{what} = {n} is more than {limit_name} = {limit}")
        return n

    def array(self, dtype: str, n: int, what: str) -> np.ndarray:
        dt = np.dtype(dtype)
        return np.frombuffer(self.take(n * dt.itemsize, what), dtype=dt).copy()


def parse(ctx, fingerprint: bytes, data: bytes, where: str, *, kind: int, sampler=None) -> _Saved:
    """Parse and validate a state against ctx without changing anything."""
    _check_single_cache(ctx, where)
    if len(data) < _HEADER.size:
        raise StateError(f"{where}: truncated: {len(data)} bytes, shorter than the {_HEADER.size}-byte header")
    magic, version, got_kind, n_body, crc = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise StateError(f"{where}: not a ggmlx state (it does not start with {MAGIC!r})")
    if version != VERSION:
        raise StateError(f"{where}: format version {version}, this build reads version {VERSION}")
    if got_kind != kind:
        names = {KIND_FULL: "full context state", KIND_SEQ: "sequence state"}
        raise StateError(f"{where}: holds a {names.get(got_kind, f'kind {got_kind}')}, "
                         f"expected a {names[kind]}")
    if len(data) - _HEADER.size != n_body:
        what = "truncated" if len(data) - _HEADER.size < n_body else "trailing bytes"
        raise StateError(f"{where}: {what}: the header says {n_body} body bytes, "
                         f"the data has {len(data) - _HEADER.size}")
    body = memoryview(data)[_HEADER.size:]
    if zlib.crc32(body) != crc:
        raise StateError(f"{where}: checksum mismatch (corrupted data)")
    r = _Reader(body, where)
    if bytes(r.take(32, "fingerprint")) != fingerprint:
        raise StateError(f"{where}: saved by another model (fingerprint differs from {ctx.model.path})")
    k_l, v_l = _kv_parts(ctx)
    for name, ts in (("type_k", k_l), ("type_v", v_l)):
        got = r.u32(name)
        if ts and got != int(ts[0].type):
            raise StateError(f"{where}: {name} is GGML type {got}, this context's cache is {ts[0].type.name}")
    n_layer = r.u32("n_layer")
    if n_layer != len(k_l):
        raise StateError(f"{where}: {n_layer} layers, the context has {len(k_l)}")
    n_tokens = r.count("n_tokens", ctx.n_ctx, "n_ctx")
    tokens = r.array("<i4", n_tokens, "tokens")
    if n_tokens and (tokens.min() < 0 or tokens.max() >= ctx.n_vocab):
        raise r.error(f"a token id is outside [0, n_vocab = {ctx.n_vocab})")
    n_cells = r.count("n_cells", ctx.n_ctx if k_l else 0, "n_ctx" if k_l else "the KV cells (none)")
    if kind == KIND_FULL:
        cells = r.array("<i4", n_cells, "cells")
        pos = r.array("<i4", n_cells, "positions")
        seq = r.array("<u8", n_cells, "sequences")
        if n_cells and (cells.min() < 0 or cells.max() >= ctx.n_ctx or np.unique(cells).size != n_cells):
            raise r.error(f"cell indices must be distinct and in [0, n_ctx = {ctx.n_ctx})")
        allowed = np.uint64((1 << ctx.n_seq_max) - 1) if ctx.n_seq_max < 64 else np.uint64(2**64 - 1)
        if n_cells and ((seq == 0).any() or (seq & ~allowed).any()):
            raise r.error(f"a cell's sequence set is empty or names a seq_id >= n_seq_max = {ctx.n_seq_max}")
    else:
        cells = np.zeros(0, np.int32)
        pos = r.array("<i4", n_cells, "positions")
        seq = np.zeros(0, np.uint64)
    if n_cells and pos.min() < 0:
        raise r.error("a cell has a negative position")
    n_outputs = r.count("n_outputs", ctx.n_batch, "n_batch")
    n_vocab = r.u32("n_vocab")
    if n_vocab != ctx.n_vocab:
        raise r.error(f"n_vocab = {n_vocab}, the model has {ctx.n_vocab}")
    n_ids = r.count("n_output_ids", ctx.n_batch, "n_batch")
    ids = r.array("<i4", n_ids, "output_ids")
    if n_ids and (ids.min() < -1 or ids.max() >= n_outputs):
        raise r.error(f"an output id is outside [-1, n_outputs = {n_outputs})")
    logits = r.array("<f4", n_outputs * n_vocab, "logits").reshape(n_outputs, n_vocab)
    owners = _rng_owners(sampler)
    n_rng = r.count("n_rng", 64, "64")
    if sampler is not None and n_rng != len(owners):
        raise r.error(f"{n_rng} sampler RNG states saved, the sampler has {len(owners)} seeded samplers")
    rngs = []
    for i in range(n_rng):
        key = r.array("<u4", _MT_WORDS, f"rng {i} key")
        mt_pos = r.u32(f"rng {i} position")
        if mt_pos > _MT_WORDS:
            raise r.error(f"rng {i} position {mt_pos} > {_MT_WORDS}")
        rngs.append((key, mt_pos))
    k_rows: list[np.ndarray] = []
    v_rows: list[np.ndarray] = []
    for il, (k, v) in enumerate(zip(k_l, v_l, strict=True)):
        for name, t, out in (("K", k, k_rows), ("V", v, v_rows)):
            width = t.data.shape[-1]
            out.append(r.array(t.data.dtype, n_cells * width,
                               f"layer {il} {name} rows").reshape(n_cells, width))
    saved = _Saved(kind, tokens.tolist(), cells, pos, seq, ids, logits, rngs, k_rows, v_rows)
    rs = ctx.memory.mem_recr
    if rs is not None:
        recurrent_state_read(r, rs, saved, kind == KIND_FULL)
    if r.off != len(body):
        raise r.error(f"{len(body) - r.off} unexpected bytes after the last layer")
    return saved


def recurrent_state_read(r: _Reader, rs, saved: _Saved, full: bool) -> None:
    """recurrent_state_write's bytes (llama.cpp's) into `saved`, every field checked against
    the recurrent memory: a whole state names each cell's one sequence, a sequence state none."""
    n_rs = r.count("recurrent cell_count", rs.size if full else 1, "n_seq_max" if full else "1")
    pos, cells = [], []
    for i in range(n_rs):
        pos.append(struct.unpack("<i", r.take(4, f"recurrent cell {i} pos"))[0])
        n_seq = r.count(f"recurrent cell {i} n_seq_id", 1 if full else 0, "1" if full else "0 (a sequence state)")
        if full:
            if n_seq != 1:
                raise r.error(f"recurrent cell {i} names {n_seq} sequences; a cell holds one sequence's state")
            cells.append(struct.unpack("<i", r.take(4, f"recurrent cell {i} seq_id"))[0])
    saved.rs_pos = np.asarray(pos, np.int32)
    if full:
        saved.rs_cells = np.asarray(cells, np.int32)
        if n_rs and (saved.rs_cells.min() < 0 or saved.rs_cells.max() >= rs.size
                     or np.unique(saved.rs_cells).size != n_rs):
            raise r.error(f"recurrent cells' seq_ids must be distinct and in [0, n_seq_max = {rs.size})")
    if n_rs and saved.rs_pos.min() < 0:
        raise r.error("a recurrent cell has a negative position")
    if r.u32("s_trans") != 0:
        raise r.error("transposed SSM states (s_trans 1) are not read")
    n_layer = r.u32("recurrent n_layer")
    if n_layer != rs.hparams.n_layer:
        raise r.error(f"recurrent n_layer = {n_layer}, the model has {rs.hparams.n_layer}")
    for t in [t for t in rs.r_l if t is not None] + [t for t in rs.s_l if t is not None]:
        ttype, row = struct.unpack("<iQ", r.take(12, f"{t.name} type and row size"))
        if ttype != int(t.type) or row != 4 * t.ne[0]:
            raise r.error(f"{t.name}: type {ttype} with rows of {row} bytes, the context holds "
                          f"{t.type.name} rows of {4 * t.ne[0]}")
        saved.rs_rows.append(r.array("<f4", n_rs * t.ne[0], f"{t.name} rows").reshape(n_rs, t.ne[0]))


# --- applying ----------------------------------------------------------------------------------


def _set_rows(t, cells: np.ndarray, rows: np.ndarray) -> None:
    idx = np.asarray(cells, np.int32)
    if idx.size:
        rows = rows.astype(t.data.dtype).reshape(*t.data.shape[:-2], idx.size, t.data.shape[-1])
        t.data = t.data.at[..., idx, :].set(jax.device_put(rows, t.data.sharding))


def _write_rows(ctx, cells: np.ndarray, saved: _Saved) -> None:
    k_l, v_l = _kv_parts(ctx)
    for il, (k, v) in enumerate(zip(k_l, v_l, strict=True)):
        _set_rows(k, cells, saved.k_rows[il])
        _set_rows(v, cells, saved.v_rows[il])


def _write_rs(ctx, cells: np.ndarray, saved: _Saved) -> None:
    """The saved recurrent cells' positions and states into `cells` of the recurrent memory."""
    rs = ctx.memory.mem_recr
    if rs is None:
        return
    rs.pos[cells] = saved.rs_pos
    for t, rows in zip(rs._buffers(), saved.rs_rows, strict=True):
        _set_rows(t, cells, rows)


def _restore_rngs(saved: _Saved, sampler) -> None:
    for rng, (key, mt_pos) in zip(_rng_owners(sampler), saved.rngs, strict=False):
        rng._bits.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": mt_pos}}


def apply_full(ctx, saved: _Saved, sampler=None) -> None:
    """Replace the whole context state by `saved` (already validated)."""
    ctx.memory.clear()
    if ctx.memory.mem_attn is not None:
        cells = ctx.memory.mem_attn.cells
        cells.pos[saved.cells] = saved.pos
        cells.seq[saved.cells] = saved.seq
        cells.head = int(saved.cells.max()) + 1 if saved.cells.size else 0
        if cells.head >= ctx.n_ctx:
            cells.head = 0
        _write_rows(ctx, saved.cells, saved)
    _write_rs(ctx, saved.rs_cells, saved)
    ctx.logits = saved.logits
    ctx.output_ids = saved.output_ids.astype(np.int32)
    _restore_rngs(saved, sampler)


def free_cells_for(ctx, saved: _Saved, where: str) -> np.ndarray:
    """Cells for a sequence state: the empty cells from the start of the cache."""
    free = np.flatnonzero(_kv_cells(ctx).pos < 0)
    n = saved.pos.size
    if free.size < n:
        raise StateError(f"{where}: {n} cells do not fit: the context has {free.size} free cells")
    return free[:n].astype(np.int32)


def apply_seq(ctx, saved: _Saved, dest_seq_id: int, cells: np.ndarray) -> None:
    """Put a sequence state into dest_seq_id (its old cells removed first), in `cells`."""
    if ctx.memory.mem_attn is not None:
        meta = ctx.memory.mem_attn.cells
        meta.pos[cells] = saved.pos
        meta.seq[cells] = np.uint64(1) << np.uint64(dest_seq_id)
        _write_rows(ctx, cells, saved)
    _write_rs(ctx, np.full(saved.rs_pos.size, dest_seq_id, np.int32), saved)

"""A prompt cache on disk (and in memory): evaluated prompts saved as sequence states.

`LLM(..., prompt_cache=DIR)` saves the KV state of each evaluated prompt; a later request
(in this process or another) whose prompt shares a prefix with a saved one restores that
state and evaluates only the rest. Entries live in DIR/<model fingerprint>/: one state file
(llm.state's sequence format, which carries the tokens and is checked on load) and one
.tokens file (int32 ids) per entry, so a lookup reads only the small token files. The
total size is capped; the least recently used entries (file mtime, touched on every hit)
are removed first. The newest entries are also kept in memory, up to `max_memory_bytes`.
"""
from __future__ import annotations

import hashlib
import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from llm import state
from llm.errors import StateError

log = logging.getLogger(__name__)


class PromptCache:
    """Token prefix + model fingerprint -> saved sequence state."""

    def __init__(self, directory: str | os.PathLike, fingerprint: bytes, *, max_bytes: int = 4 << 30,
                 max_memory_bytes: int = 1 << 30, min_tokens: int = 32):
        if max_bytes < 0 or max_memory_bytes < 0:
            raise ValueError("prompt cache: size caps must be >= 0")
        self.dir = Path(directory) / fingerprint.hex()[:32]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.max_memory_bytes = max_memory_bytes
        self.min_tokens = min_tokens
        self._memory: OrderedDict[tuple[int, ...], bytes] = OrderedDict()
        self.hits = self.misses = 0

    @staticmethod
    def _key(tokens: Sequence[int]) -> str:
        return hashlib.sha256(np.asarray(tokens, "<i4").tobytes()).hexdigest()[:40]

    def _entries(self) -> list[Path]:
        return sorted(self.dir.glob("*.state"))

    def lookup(self, tokens: Sequence[int]) -> tuple[int, bytes | None, str]:
        """The saved entry sharing the longest prefix with `tokens`: (prefix length, state bytes,
        where it came from). (0, None, "") when nothing shares at least min_tokens."""
        want = np.asarray(tokens, np.int64)
        best_n, best_key, best_path = 0, None, None
        for key in self._memory:
            n = _common(want, np.asarray(key, np.int64))
            if n > best_n:
                best_n, best_key = n, key
        for path in self._entries():
            try:
                saved = np.fromfile(path.with_suffix(".tokens"), dtype="<i4")
            except OSError:
                continue
            n = _common(want, saved)
            if n > best_n:
                best_n, best_key, best_path = n, None, path
        if best_n < self.min_tokens or (best_key is None and best_path is None):
            self.misses += 1
            return 0, None, ""
        if best_path is None:
            assert best_key is not None
            self._memory.move_to_end(best_key)
            data, where = self._memory[best_key], "memory"
        else:
            try:
                data = best_path.read_bytes()
                os.utime(best_path)
            except OSError:
                self.misses += 1
                return 0, None, ""
            where = str(best_path)
        self.hits += 1
        return best_n, data, where

    def contains(self, tokens: Sequence[int]) -> bool:
        key = tuple(int(t) for t in tokens)
        return key in self._memory or (self.dir / (self._key(key) + ".state")).exists()

    def store(self, tokens: Sequence[int], data: bytes) -> None:
        """Save a state for exactly `tokens` (atomically), then evict down to the caps."""
        key = tuple(int(t) for t in tokens)
        if len(key) < self.min_tokens:
            return
        self._memory[key] = data
        self._memory.move_to_end(key)
        while self._memory and sum(map(len, self._memory.values())) > self.max_memory_bytes:
            self._memory.popitem(last=False)
        if len(data) > self.max_bytes:
            return
        base = self.dir / self._key(key)
        state.write_atomic(base.with_suffix(".tokens"), np.asarray(key, "<i4").tobytes())
        state.write_atomic(base.with_suffix(".state"), data)
        self.evict()

    def evict(self) -> None:
        """Remove least recently used entries until the directory is within max_bytes."""
        entries = []
        for p in self._entries():
            try:
                st = p.stat()
            except OSError:
                continue
            entries.append((st.st_mtime, st.st_size, p))
        entries.sort()
        total = sum(size for _, size, _ in entries)
        for _, size, p in entries:
            if total <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            p.with_suffix(".tokens").unlink(missing_ok=True)
            total -= size
            log.info("prompt cache: evicted %s (%d bytes)", p.name, size)

    def restore(self, ctx, tokens: Sequence[int], seq_id: int = 0, better_than: int = 0) -> int:
        """Load the best entry for `tokens` into seq_id and cut it to the shared prefix, if that
        prefix is longer than `better_than` tokens (what the sequence already holds); returns
        how many tokens are now cached (0: nothing better, the sequence untouched)."""
        n, data, where = self.lookup(tokens)
        if data is None or n <= better_than:
            return 0
        try:
            ctx.state_seq_set_data(data, seq_id, where=f"prompt cache {where}")
        except StateError as e:
            log.warning("prompt cache: %s; ignoring the entry", e)
            return 0
        if not ctx.memory.seq_rm(seq_id, n, -1):
            # a recurrent state cannot be cut back to the shared prefix: the entry holds more
            ctx.memory.seq_rm(seq_id, -1, -1)
            log.debug("prompt cache: %s holds more than the %d shared tokens and cannot be cut", where, n)
            return 0
        return n


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n

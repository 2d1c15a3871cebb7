"""llama-server's /metrics: its counters, kept by the engine thread, and their Prometheus text.

The engine thread counts each finished job (`on_done`, from its Done event) and each decode
step (`on_decode`); the route reads a copy under the same lock (`read`). The two throughput
gauges cover what was done since the previous scrape, as llama-server's "bucket" does (each
read of /metrics starts a new one).
"""
from __future__ import annotations

import dataclasses
import threading
import time

from llm.generation.batcher import Done


@dataclasses.dataclass
class Counters:
    """Work done by finished requests: prompt tokens decoded (a cached prefix is not), tokens
    generated, and the seconds each took, summed over requests (llama-server's t_*_total)."""

    n_prompt_tokens: int = 0
    t_prompt_s: float = 0.0
    n_predicted: int = 0
    t_predicted_s: float = 0.0

    def add(self, done: Done) -> None:
        self.n_prompt_tokens += done.n_prompt_tokens - done.timings["cache_n"]
        self.t_prompt_s += done.timings["prompt_s"]
        self.n_predicted += done.n_completion_tokens
        self.t_predicted_s += done.timings["gen_s"]


@dataclasses.dataclass
class Reading:
    """One copy of the metrics: the totals, the bucket since the previous scrape, the decode counts."""

    total: Counters
    bucket: Counters
    n_decode: int
    n_busy_slots: int
    n_tokens_max: int
    t_start: float


class Metrics:
    """The counters; written on the engine thread, read from any."""

    def __init__(self):
        self._lock = threading.Lock()
        self.t_start = time.time()
        self.total = Counters()
        self.bucket = Counters()
        self.n_decode = 0           # decode steps (llama_decode calls)
        self.n_busy_slots = 0       # busy slots summed over those steps
        self.n_tokens_max = 0       # the longest sequence seen (prompt and output)

    def on_done(self, done: Done, n_tokens: int) -> None:
        with self._lock:
            self.total.add(done)
            self.bucket.add(done)
            self.n_tokens_max = max(self.n_tokens_max, n_tokens)

    def on_decode(self, n_busy_slots: int) -> None:
        with self._lock:
            self.n_decode += 1
            self.n_busy_slots += n_busy_slots

    def read(self, reset_bucket: bool = False) -> Reading:
        with self._lock:
            r = Reading(dataclasses.replace(self.total), dataclasses.replace(self.bucket), self.n_decode,
                        self.n_busy_slots, self.n_tokens_max, self.t_start)
            if reset_bucket:
                self.bucket = Counters()
        return r


def _rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else 0.0


def prometheus(r: Reading, snapshot: dict) -> str:
    """The Prometheus text exposition with llama-server's names, types and help texts; the
    gauges of the moment (slots, queue, KV cells) come from the engine's `snapshot`.
    n_busy_slots_per_decode is typed a counter because llama-server types it so."""
    rows = [
        ("prompt_tokens_total", "counter", "Number of prompt tokens processed.", r.total.n_prompt_tokens),
        ("prompt_seconds_total", "counter", "Prompt process time", r.total.t_prompt_s),
        ("tokens_predicted_total", "counter", "Number of generation tokens processed.", r.total.n_predicted),
        ("tokens_predicted_seconds_total", "counter", "Predict process time", r.total.t_predicted_s),
        ("n_decode_total", "counter", "Total number of llama_decode() calls", r.n_decode),
        ("n_tokens_max", "counter", "Largest observed n_tokens.", r.n_tokens_max),
        ("n_busy_slots_per_decode", "counter", "Average number of busy slots per llama_decode() call",
         r.n_busy_slots / max(r.n_decode, 1)),
        ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.",
         _rate(r.bucket.n_prompt_tokens, r.bucket.t_prompt_s)),
        ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s.",
         _rate(r.bucket.n_predicted, r.bucket.t_predicted_s)),
        ("kv_cache_usage_ratio", "gauge", "KV-cache usage. 1 means 100 percent usage.",
         snapshot["kv_cells_used"] / snapshot["n_ctx"]),
        ("kv_cache_tokens", "gauge", "KV-cache tokens.", snapshot["kv_cells_used"]),
        ("requests_processing", "gauge", "Number of requests processing.", snapshot["slots_processing"]),
        ("requests_deferred", "gauge", "Number of requests deferred.", snapshot["queue"]),
    ]
    lines = []
    for name, kind, help_text, value in rows:
        lines += [f"# HELP llamacpp:{name} {help_text}", f"# TYPE llamacpp:{name} {kind}", f"llamacpp:{name} {value}"]
    return "\n".join(lines) + "\n"

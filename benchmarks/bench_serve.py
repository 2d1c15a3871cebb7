"""Load test of `python -m llm serve`: N concurrent streaming clients for a fixed time.

Usage:
  python benchmarks/bench_serve.py -m smollm2-135m -np 8 [--clients 1,4,8,16] [--duration 30]
  python benchmarks/bench_serve.py --url http://127.0.0.1:8080 ...     (a server already running)
  python benchmarks/bench_serve.py -m smollm2-135m -np 8 --soak 600 --clients 8

Each client sends /v1/completions requests one after the other (a prompt of exactly
--prompt-tokens tokens, distinct per request, --max-tokens generated, stream=true) and
records the time to the first token and the gaps between tokens. Per N: aggregate generated
tokens per second over the window, TTFT p50/p95, inter-token latency p50/p95, errors. Each N
first runs --warmup seconds unmeasured, so compiles of new batch shapes stay out of the
numbers. The clients of a run start spread over --stagger seconds, and its window opens only
then (after --stagger + 1 s): N clients' numbers are those of N clients running, not of the
ramp up to them (which cost a 15 s window of 8 clients 6-12% of its tokens). Targets (issue
13, -np 8): tok/s at 8 clients >= 3x one client; TTFT p95 at 8 clients < 2 s with 64-token
prompts.

--rounds R measures each N R times, the Ns alternating within each round (1, 8, 1, 8, ...), and
reports each N over all its rounds, so a drift of the host's speed during the run reaches every N
alike (on a shared VM, a slow minute during the one-client run alone moved the 8/1 ratio from 2.6
to 3.1):
  python benchmarks/bench_serve.py -np 8 --clients 1,8 --rounds 3 --duration 15 --numerics ggml

--engine runs the same closed-loop clients on the server's engine in this process, without HTTP
(the server's context settings: -np slots, n_outputs_min = -np, its KV bucket; the Batcher's
warmup), and prints per N the steps by their token count (count, ms each, share of the run), so
HTTP and SSE costs can be told from the engine's:
  python benchmarks/bench_serve.py --engine -np 8 --clients 1,8 --numerics ggml

--soak S runs the clients for S seconds once, with disconnects (issue 35): --disconnect-frac of
the clients (default 0.25) leave each of their requests, half of them streamed and closed after
a random number of tokens, half not streamed and hung up after a random 0.2-3 s. It reports
requests done, left and failed, errors by kind, the server's RSS growth (first quarter of the
run, at most a minute -> end), the KV cells used, the slots processing and the queue once idle
(all must be 0) and a greedy reference answer before and after (must be the same), then PASS
or FAIL (exit status 1):
  python benchmarks/bench_serve.py -m smollm2-135m -np 8 --soak 120 --clients 32
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

WORDS = ("the river ran past old mills and quiet farms where people told stories of winter storms "
         "harvest feasts lost sheep bright lanterns and ships that sailed north").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(a) -> tuple[subprocess.Popen, str]:
    port = free_port()
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "llm", "serve", "-m", a.model, "--port", str(port), "-np", str(a.parallel),
           "-c", str(a.ctx_size), "-b", str(a.batch_size), "--queue-size", str(a.queue_size), "--numerics", a.numerics]
    log = open(a.server_log, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=root,
                            env={**os.environ, "PYTHONPATH": str(root)})
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"server exited; see {a.server_log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not start")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Stats:
    """One run's results: tokens, requests done, TTFT and gaps inside its window; requests left
    on purpose and errors over the whole run (a failure during the ramp still fails a soak)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.tokens = 0
        self.requests = 0
        self.left = collections.Counter()        # requests a client left on purpose, by kind
        self.error_kinds = collections.Counter()
        self.errors: list[str] = []

    def error(self, cid: int, e: Exception) -> None:
        kind = str(e).split(":")[0] if isinstance(e, RuntimeError) else type(e).__name__
        with self.lock:
            self.error_kinds[kind] += 1
            self.errors.append(f"client {cid}: {type(e).__name__}: {e}")


def prompt_of(tokenize_url: str, k: int, n_tokens: int, c: httpx.Client | None = None) -> list[int]:
    """Request k's prompt: exactly n_tokens tokens of text distinct per k (from the pool
    prepare_prompts filled when it has it)."""
    if k in PROMPTS:
        return PROMPTS.pop(k)
    rng = np.random.default_rng(k)
    text = " ".join(rng.choice(WORDS, n_tokens * 2))
    body = {"content": text, "add_special": True}
    r = c.post(tokenize_url, json=body) if c is not None else httpx.post(tokenize_url, json=body, timeout=60)
    return r.json()["tokens"][:n_tokens]


PROMPTS: dict[int, list[int]] = {}


def prepare_prompts(url: str, a, first: int, count: int) -> None:
    """Tokenize requests first .. first + count - 1's prompts before a run, so the measured
    window holds only completions (a /tokenize per request took CPU from the server under test);
    a run that needs more tokenizes the rest as it goes."""
    with httpx.Client(timeout=60) as c:
        for k in range(first, first + count):
            PROMPTS[k] = prompt_of(url + "/tokenize", k, a.prompt_tokens, c)


def stream(c: httpx.Client, url: str, body: dict, t_from: float, t_end: float, leave_after: int | None):
    """One streamed completion: (tokens, TTFT, gaps, left), counting only tokens that arrive in
    the window [t_from, t_end] (TTFT: a request sent in it). With `leave_after`, the client closes
    the connection after that many tokens (left = True)."""
    t0 = last = time.perf_counter()
    ttft: float | None = None
    gaps: list[float] = []
    n = n_in = 0
    with c.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']['message']}")
            now = time.perf_counter()
            if now > t_end:
                break
            n += 1
            if now >= t_from:
                n_in += 1
                if n == 1 and t0 >= t_from:
                    ttft = now - t0
                elif n > 1 and last >= t_from:
                    gaps.append(now - last)
            last = now
            if leave_after is not None and n >= leave_after:
                return n_in, ttft, gaps, True      # leaving the block closes the connection mid-stream
    return n_in, ttft, gaps, False


def hang_up(url: str, body: dict, delay: float) -> bool:
    """A non-streaming completion whose client hangs up after `delay` seconds (True), unless the
    answer came first (False)."""
    try:
        r = httpx.post(url + "/v1/completions", json={**body, "stream": False},
                       timeout=httpx.Timeout(300, read=delay))
    except httpx.ReadTimeout:
        return True
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
    return False


def client(url: str, model: str, a, stats: Stats, t_from: float, t_end: float, cid: int, counter: list[int],
           leaves: bool) -> None:
    """Requests one after the other until t_end. A client that `leaves` disconnects from each of
    its requests: half of them streamed and closed after a random number of tokens, half not
    streamed and hung up after a random delay."""
    # clients start spread over --stagger seconds, as real users do (all at the same instant,
    # every prompt lands in one step and the clients stay in lockstep)
    time.sleep(a.stagger * cid / max(a.n_clients, 1))
    rng = np.random.default_rng(1000 + cid)
    with httpx.Client(timeout=300) as c:
        while time.perf_counter() < t_end:
            with stats.lock:
                counter[0] += 1
                k = counter[0]
            body = {"model": model, "max_tokens": a.max_tokens, "temperature": 0.8, "seed": k, "stream": True}
            try:
                body["prompt"] = prompt_of(url + "/tokenize", k, a.prompt_tokens)
                if leaves and rng.random() < 0.5:
                    if hang_up(url, body, float(rng.uniform(0.2, 3.0))):
                        with stats.lock:
                            stats.left["non-streaming, hung up"] += 1
                        continue
                    n, ttft, gaps, left = 0, None, [], False
                else:
                    leave_after = int(rng.integers(1, a.max_tokens)) if leaves else None
                    n, ttft, gaps, left = stream(c, url, body, t_from, t_end, leave_after)
            except Exception as e:  # an error is a result here: count it and go on
                stats.error(cid, e)
                time.sleep(0.5)
                continue
            with stats.lock:
                stats.tokens += n
                if left:
                    stats.left["streaming, closed mid-stream"] += 1
                elif time.perf_counter() >= t_from:
                    stats.requests += 1
                if ttft is not None:
                    stats.ttft.append(ttft)
                stats.itl += gaps


def run(url: str, model: str, a, n_clients: int, seconds: float, counter: list[int], leavers: int = 0) -> Stats:
    """n_clients clients, measured for `seconds` once they all run (settle_s after they start); the
    first `leavers` of them disconnect from their requests."""
    stats = Stats()
    a.n_clients = n_clients
    PROMPTS.clear()
    # generously more requests than the run can finish (each takes at least ~0.25 s)
    prepare_prompts(url, a, counter[0] + 1, n_clients * (int((seconds + settle_s(a)) * 4) + 2))
    t_from = time.perf_counter() + settle_s(a)
    t_end = t_from + seconds
    threads = [threading.Thread(target=client, args=(url, model, a, stats, t_from, t_end, i, counter, i < leavers))
               for i in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return stats


def settle_s(a) -> float:
    """Seconds from a run's start to its window: the clients' stagger and a second more."""
    return a.stagger + 1.0


def merged(runs: list[Stats]) -> Stats:
    """The runs of one N as one: their tokens, requests, errors and latencies together."""
    out = Stats()
    for s in runs:
        out.tokens += s.tokens
        out.requests += s.requests
        out.left.update(s.left)
        out.error_kinds.update(s.error_kinds)
        out.errors += s.errors
        out.ttft += s.ttft
        out.itl += s.itl
    return out


def pct(x: list[float], q: float) -> float:
    return float(np.percentile(x, q)) if x else float("nan")


def wait_idle(url: str, timeout: float = 60) -> dict:
    deadline = time.time() + timeout
    while True:
        h = httpx.get(url + "/health", timeout=10).json()
        if (h["slots_processing"] == 0 and h["queue"] == 0) or time.time() > deadline:
            return h
        time.sleep(0.2)


def engine_bench(a, ns: list[int]) -> int:
    """--engine: N closed-loop clients on a Batcher in this process (no HTTP). Each client's
    requests follow one another (a new prompt of --prompt-tokens distinct tokens when its last
    request ends); the clients start spread over --stagger seconds."""
    import collections

    from llm import hub
    from llm.api import LLM
    from llm.context import ContextParams
    from llm.generation.batcher import Batcher, Done, Job
    from llm.generation.core import GenParams
    from llm.sampling.samplers import SamplingParams
    from llm.serving.engine import slot_context
    cparams = ContextParams(n_ctx=a.ctx_size, n_batch=a.batch_size, **slot_context(a.parallel, a.ctx_size))
    llm = LLM(hub.model_file(a.model), params=cparams, numerics=a.numerics)
    batcher = Batcher(llm.ctx, llm.vocab, a.parallel)
    batcher.warmup()
    rng = np.random.default_rng(0)
    n_vocab = llm.model.n_vocab
    counter = [0]
    tokens = [0]

    def new_job() -> Job:
        counter[0] += 1
        prompt = rng.integers(n_vocab // 8, n_vocab // 2, a.prompt_tokens).tolist()
        params = GenParams(max_tokens=a.max_tokens, sampling=SamplingParams(temp=0.8, seed=counter[0]))
        return Job(prompt, params, lambda ev: None if isinstance(ev, Done) else tokens.__setitem__(0, tokens[0] + 1))

    def run_for(n: int, seconds: float) -> tuple[int, float, collections.Counter, collections.Counter]:
        """(tokens, seconds, steps by token count, their seconds) of n clients for `seconds`, from
        settle_s after they start."""
        steps: collections.Counter = collections.Counter()
        step_s: collections.Counter = collections.Counter()
        t_start = time.perf_counter()
        starts = [t_start + a.stagger * i / n for i in range(n)]
        active: list[Job] = []
        t0 = t_start + settle_s(a)
        t_count: float | None = None    # when the window opened: the ramp's tokens and steps dropped then
        while time.perf_counter() < t0 + seconds:
            now = time.perf_counter()
            if t_count is None and now >= t0:
                t_count = now
                tokens[0] = 0
                steps.clear()
                step_s.clear()
            while starts and starts[0] <= now:
                starts.pop(0)
                active.append(new_job())
                batcher.submit(active[-1])
            for i, job in enumerate(active):
                if job.finished:
                    active[i] = new_job()
                    batcher.submit(active[i])
            ts = time.perf_counter()
            k = batcher.step()
            steps[k] += 1
            step_s[k] += time.perf_counter() - ts
        assert t_count is not None      # (the loop runs until t0 + seconds, past t0)
        elapsed = time.perf_counter() - t_count
        for job in active:
            batcher.cancel(job)
        while batcher.running or batcher.waiting:
            batcher.step()
        return tokens[0], elapsed, steps, step_s

    print(f"engine only: {hub.model_file(a.model).name}, -np {a.parallel}, prompts of {a.prompt_tokens} tokens, "
          f"{a.max_tokens} generated, {a.duration:g} s per run after {a.warmup:g} s warmup, {a.rounds} round(s)")
    if a.warmup:
        for n in ns:
            run_for(n, a.warmup)
    rounds: dict[int, list] = {n: [] for n in ns}
    for _ in range(a.rounds):
        for n in ns:
            rounds[n].append(run_for(n, a.duration))
    base = None
    for n in ns:
        tps = sum(r[0] for r in rounds[n]) / sum(r[1] for r in rounds[n])
        steps, step_s = collections.Counter(), collections.Counter()
        for _, _, st, sec in rounds[n]:
            steps.update(st)
            step_s.update(sec)
        base = base or tps
        print(f"N {n}: {tps:.1f} tok/s, x1 {tps / base:.2f}")
        total = sum(step_s.values())
        for k in sorted(steps, key=lambda k: -step_s[k])[:6]:
            print(f"   steps of {k:3d} tokens: {steps[k]:5d} x {step_s[k] / steps[k] * 1e3:6.2f} ms = "
                  f"{step_s[k] / total * 100:5.1f}%")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--url", default=None, help="use this running server instead of starting one")
    ap.add_argument("-np", "--parallel", type=int, default=8)
    ap.add_argument("-c", "--ctx-size", type=int, default=4096)
    ap.add_argument("-b", "--batch-size", type=int, default=512)
    ap.add_argument("--queue-size", type=int, default=32)
    ap.add_argument("--numerics", choices=("exact", "ggml"), default="exact",
                    help="the server's numerics (llm.load_model): ggml = llama.cpp's quantized products")
    ap.add_argument("--clients", default="1,4,8,16")
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--warmup", type=float, default=15.0)
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure each N this many times, the Ns alternating within each round")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--stagger", type=float, default=2.0, help="clients start spread over this many seconds")
    ap.add_argument("--soak", type=float, default=0.0, help="seconds of one soak run at --clients")
    ap.add_argument("--disconnect-frac", type=float, default=0.25,
                    help="soak: the fraction of clients that disconnect from each of their requests")
    ap.add_argument("--max-rss-growth", type=float, default=20.0,
                    help="soak: FAIL when the server's RSS grows more than this many percent")
    ap.add_argument("--server-log", default="/tmp/bench_serve_server.log")
    ap.add_argument("--engine", action="store_true",
                    help="the clients on the server's engine in this process, without HTTP (no server)")
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {a.rounds}")
    if a.engine:
        return engine_bench(a, [int(x) for x in a.clients.split(",")])
    proc = None
    if a.url:
        url = a.url.rstrip("/")
    else:
        proc, url = start_server(a)
    try:
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        counter = [0]
        ns = [int(x) for x in a.clients.split(",")]
        if a.soak:
            return soak(url, model, a, ns[0], proc, counter)
        print(f"model {model}, -np {a.parallel}, prompts of {a.prompt_tokens} tokens, {a.max_tokens} generated, "
              f"{a.duration:g} s per run after {a.warmup:g} s warmup, {a.rounds} round(s)")
        print(f"{'N':>3} {'reqs':>5} {'err':>4} {'tok/s':>7} {'x1':>5} {'TTFT p50':>9} {'TTFT p95':>9} "
              f"{'ITL p50':>8} {'ITL p95':>8}")
        if a.warmup:
            for n in ns:
                run(url, model, a, n, a.warmup, counter)
                wait_idle(url)
        runs: dict[int, list[Stats]] = {n: [] for n in ns}
        for _ in range(a.rounds):
            for n in ns:
                runs[n].append(run(url, model, a, n, a.duration, counter))
                wait_idle(url)
        base = None
        for n in ns:
            s = merged(runs[n])
            tps = s.tokens / (a.duration * a.rounds)
            base = base or tps
            print(f"{n:>3} {s.requests:>5} {len(s.errors):>4} {tps:>7.1f} {tps / base:>5.2f} "
                  f"{pct(s.ttft, 50):>8.3f}s {pct(s.ttft, 95):>8.3f}s {pct(s.itl, 50) * 1e3:>6.0f}ms "
                  f"{pct(s.itl, 95) * 1e3:>6.0f}ms", flush=True)
            for e in s.errors[:3]:
                print("   error:", e)
        h = wait_idle(url)
        print(f"idle: kv_cells_used {h['kv_cells_used']}, slots_processing {h['slots_processing']}")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    return 0


def greedy(url: str, model: str) -> str:
    """A reference answer: 16 greedy tokens of a fixed prompt."""
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "The capital of France is",
                                                  "max_tokens": 16, "temperature": 0}, timeout=300)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


class RSSSampler(threading.Thread):
    """The server's RSS every 5 s while it runs: (seconds since start, MiB)."""

    def __init__(self, pid: int | None):
        super().__init__()
        self.pid, self.stop = pid, threading.Event()
        self.samples: list[tuple[float, float]] = []

    def run(self) -> None:
        t0 = time.perf_counter()
        while self.pid is not None and not self.stop.wait(5.0):
            self.samples.append((time.perf_counter() - t0, rss_mib(self.pid)))

    def growth(self, seconds: float) -> tuple[float, float, float] | None:
        """(MiB over the first quarter (at most a minute), MiB at the end, growth in %), or None."""
        if not self.samples:
            return None
        first = [r for t, r in self.samples if t <= min(60.0, seconds / 4)] or [self.samples[0][1]]
        r0, r1 = float(np.mean(first)), self.samples[-1][1]
        return r0, r1, (r1 / r0 - 1) * 100


def soak(url: str, model: str, a, n: int, proc, counter) -> int:
    """n clients for --soak seconds, --disconnect-frac of them leaving their requests; PASS when no
    request failed, the server is idle afterwards (no slot processing, no KV cells, empty queue),
    its RSS grew less than --max-rss-growth and the greedy reference answer is unchanged."""
    leavers = round(a.disconnect_frac * n)
    before = greedy(url, model)
    if a.warmup:
        run(url, model, a, n, a.warmup, counter, leavers)
        wait_idle(url)
    rss = RSSSampler(proc.pid if proc is not None else None)
    rss.start()
    s = run(url, model, a, n, a.soak, counter, leavers)
    t_end = time.perf_counter()
    h = wait_idle(url)
    idle_s = time.perf_counter() - t_end
    rss.stop.set()
    rss.join()
    after = greedy(url, model)
    print(f"soak: {n} clients ({leavers} disconnecting) for {a.soak:g} s, -np {a.parallel}, max_tokens {a.max_tokens}")
    print(f"requests: {s.requests} done, {sum(s.left.values())} left on purpose "
          f"({', '.join(f'{v} {k}' for k, v in s.left.items()) or 'none'}), {len(s.errors)} failed; "
          f"{s.tokens} tokens ({s.tokens / a.soak:.1f} tok/s)")
    print(f"errors by kind: {dict(s.error_kinds) or 'none'}")
    for e in s.errors[:5]:
        print("   error:", e)
    growth = rss.growth(a.soak)
    if growth is not None:
        print(f"server RSS: {growth[0]:.0f} MiB (first quarter) -> {growth[1]:.0f} MiB at the end "
              f"({growth[2]:+.1f}%), max {max(r for _, r in rss.samples):.0f} MiB")
    print(f"TTFT p50 {pct(s.ttft, 50):.3f}s p95 {pct(s.ttft, 95):.3f}s; ITL p50 {pct(s.itl, 50) * 1e3:.0f}ms "
          f"p95 {pct(s.itl, 95) * 1e3:.0f}ms")
    print(f"idle {idle_s:.1f} s after the soak: kv_cells_used {h['kv_cells_used']}, "
          f"slots_processing {h['slots_processing']}, queue {h['queue']}")
    print(f"greedy reference: {before!r} before, {after!r} after ({'same' if after == before else 'CHANGED'})")
    failed = [what for what, bad in [
        (f"{len(s.errors)} requests failed", s.errors),
        ("not idle", h["kv_cells_used"] or h["slots_processing"] or h["queue"]),
        (f"RSS grew over {a.max_rss_growth:g}%", growth is not None and growth[2] > a.max_rss_growth),
        ("the greedy answer changed", after != before)] if bad]
    print("PASS" if not failed else f"FAIL: {'; '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

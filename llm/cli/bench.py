"""`python -m llm bench`: prompt processing (pp) and text generation (tg) throughput, like
llama-bench. Each test is compiled by an untimed warm-up run first, so the timed
repetitions measure steady-state speed; compile time and time to first token are reported
separately, with the peak resident memory and the weight format used."""
from __future__ import annotations

import argparse
import csv
import io
import json
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from ggmlx.weights import NUMERICS, WEIGHT_FORMATS
from llm import hub, params
from llm.batch import Batch
from llm.context import Context, ContextParams
from llm.errors import SizeError, UsageError
from llm.model import load_model


@dataclass
class BenchResult:
    model: str
    weight_format: str
    test: str              # "pp512" or "tg128"
    n_tokens: int
    reps: int
    tok_s_median: float
    tok_s_min: float
    tok_s_max: float
    tok_s_stdev: float
    compile_s: float       # compilations during the warm-up run of this test
    load_s: float
    ttft_s: float          # load excluded: first prompt (compiled) + first generated token
    peak_rss_mib: float


def _peak_rss_mib() -> float:
    """The process's resident-memory high-water mark (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _low(n_vocab: int) -> int:
    """The first id the bench's tokens use: above the low ids where special tokens usually sit."""
    return min(1000, n_vocab // 2)


def _prompt(n: int, n_vocab: int) -> list[int]:
    """Deterministic tokens avoiding the low ids where special tokens usually sit."""
    lo = _low(n_vocab)
    return [int(t) for t in (np.arange(n) * 7919 % (n_vocab - lo) + lo)]


def _decode(ctx: Context, batch: Batch) -> None:
    rc = ctx.decode(batch)
    if rc != 0:
        raise RuntimeError(f"decode failed with {rc}: {ctx.last_error}")


def _keep_depth(ctx: Context, n_depth: int) -> None:
    """Back to the n_depth tokens _fill_depth left (an empty cache without depth)."""
    if n_depth:
        ctx.memory.seq_rm(0, n_depth, -1)
    else:
        ctx.memory_clear()


def _fill_depth(ctx: Context, n_depth: int, n_vocab: int) -> None:
    """n_depth prompt tokens in the cache before a test, untimed (llama-bench's -d)."""
    ctx.memory_clear()
    tokens = _prompt(n_depth, n_vocab)
    for i in range(0, n_depth, ctx.n_batch):
        chunk = tokens[i:i + ctx.n_batch]
        _decode(ctx, Batch(tokens=chunk, pos=list(range(i, i + len(chunk))),
                           logits=[j == len(chunk) - 1 for j in range(len(chunk))]))


def _run_pp(ctx: Context, tokens: list[int], n_depth: int = 0) -> float:
    _keep_depth(ctx, n_depth)
    t0 = time.perf_counter()
    for i in range(0, len(tokens), ctx.n_batch):
        chunk = tokens[i:i + ctx.n_batch]
        _decode(ctx, Batch(tokens=chunk, pos=list(range(n_depth + i, n_depth + i + len(chunk))),
                           logits=[j == len(chunk) - 1 for j in range(len(chunk))]))
    return time.perf_counter() - t0


def _run_tg(ctx: Context, n_gen: int, n_vocab: int, n_depth: int = 0) -> float:
    """n_gen single-token decodes after n_depth cached tokens (none: an empty cache), as
    llama-bench's tg test."""
    _keep_depth(ctx, n_depth)
    lo = _low(n_vocab)
    t0 = time.perf_counter()
    for i in range(n_gen):
        _decode(ctx, Batch(tokens=[lo + (i * 31) % (n_vocab - lo)], pos=[n_depth + i], logits=[True]))
    return time.perf_counter() - t0


def _compile_seconds(ctx: Context) -> float:
    return ctx.perf()["t_compile_ms"] / 1e3


def _summary(model: str, fmt: str, test: str, n: int, times: list[float], compile_s: float,
             load_s: float, ttft_s: float) -> BenchResult:
    rates = [n / t for t in times]
    return BenchResult(model=model, weight_format=fmt, test=test, n_tokens=n, reps=len(rates),
                       tok_s_median=statistics.median(rates), tok_s_min=min(rates), tok_s_max=max(rates),
                       tok_s_stdev=statistics.stdev(rates) if len(rates) > 1 else 0.0,
                       compile_s=compile_s, load_s=load_s, ttft_s=ttft_s, peak_rss_mib=_peak_rss_mib())


def bench_model(model_path: str, n_prompt: int = 512, n_gen: int = 128, reps: int = 5,
                n_ubatch: int = 512, n_ctx: int = 2048, weight_format: str = "auto",
                abort_callback: Callable[[], bool] | None = None, n_depth: int = 0, type_k: str | None = None,
                type_v: str | None = None, numerics: str = "exact") -> list[BenchResult]:
    """pp{n_prompt} and tg{n_gen} results for one model (a test with 0 tokens is skipped), each
    after n_depth cached tokens (llama-bench's -d: "tg128 @ d4096"), with the cache types
    type_k / type_v (None: the numerics' default, context.DEFAULT_KV_TYPE). SizeError when the
    depth, prompt and generation do not fit the model's training context (a pp100000 would run
    for many minutes); abort_callback stops loading and decoding."""
    t0 = time.perf_counter()
    model = load_model(model_path, weight_format=weight_format, numerics=numerics,
                       progress_callback=None if abort_callback is None else lambda f: not abort_callback())
    load_s = time.perf_counter() - t0
    n_train = model.hparams.n_ctx_train
    n_total = n_depth + n_prompt + n_gen
    if n_train and n_total > n_train:
        raise SizeError(f"bench: -d {n_depth} + -p {n_prompt} + -n {n_gen} = {n_total} tokens, more than the "
                        f"model's training context ({n_train})")
    n_batch = max(n_ubatch, min(max(n_prompt, n_depth), n_ctx)) if n_prompt or n_depth else n_ubatch
    # (one cell more than n_total without a tg test: the first token after the prompt, timed as TTFT)
    ctx = Context(model, n_ctx=max(n_ctx, n_depth + n_prompt + max(n_gen, 1)), n_batch=n_batch, n_ubatch=n_ubatch,
                  abort_callback=abort_callback, type_k=type_k, type_v=type_v)
    n_vocab = model.n_vocab
    name = str(model_path)
    fmt = model.weight_format if numerics == "exact" else f"{model.weight_format}, ggml numerics"
    at = f" @ d{n_depth}" if n_depth else ""
    results = []
    t_first = time.perf_counter()
    if n_depth:
        _fill_depth(ctx, n_depth, n_vocab)
    if n_prompt:
        _run_pp(ctx, _prompt(n_prompt, n_vocab), n_depth)               # warm-up: compiles
    _decode(ctx, Batch(tokens=[_low(n_vocab)], pos=[n_depth + n_prompt], logits=[True]))
    ttft_s = time.perf_counter() - t_first
    if n_prompt:
        comp = _compile_seconds(ctx)
        times = [_run_pp(ctx, _prompt(n_prompt, n_vocab), n_depth) for _ in range(reps)]
        results.append(_summary(name, fmt, f"pp{n_prompt}{at}", n_prompt, times, comp, load_s,
                                ttft_s))
    if n_gen:
        c0 = _compile_seconds(ctx)
        # warm-up; at depth the whole run, so that every KV bucket it reaches is compiled
        _run_tg(ctx, n_gen if n_depth else min(n_gen, 8), n_vocab, n_depth)
        comp = _compile_seconds(ctx) - c0
        times = [_run_tg(ctx, n_gen, n_vocab, n_depth) for _ in range(reps)]
        results.append(_summary(name, fmt, f"tg{n_gen}{at}", n_gen, times, comp, load_s, ttft_s))
    return results


def format_results(results: list[BenchResult], output: str) -> str:
    rows = [asdict(r) for r in results]
    if output == "json":
        return json.dumps(rows, indent=2)
    if output == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
        return buf.getvalue().rstrip("\n")
    lines = ["| model | format | test | t/s (median) | min..max | compile s | load s | TTFT s | peak RSS MiB |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r.model.rsplit('/', 1)[-1]} | {r.weight_format} | {r.test} | {r.tok_s_median:.1f} "
                     f"| {r.tok_s_min:.1f}..{r.tok_s_max:.1f} | {r.compile_s:.2f} | {r.load_s:.2f} "
                     f"| {r.ttft_s:.2f} | {r.peak_rss_mib:.0f} |")
    return "\n".join(lines)


def add_parser(sub) -> argparse.ArgumentParser:
    """Register the `bench` subcommand on an argparse subparsers object."""
    p = sub.add_parser("bench", help="measure prompt (pp) and generation (tg) tokens per second",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("-m", "--model", default=hub.DEFAULT_MODEL, help="GGUF path or known model name")
    p.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens (pp test; 0 skips)")
    p.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens (tg test; 0 skips)")
    p.add_argument("-r", "--reps", type=int, default=5, help="timed repetitions per test")
    p.add_argument("-ub", "--ubatch", type=int, default=512, help="physical batch size (n_ubatch)")
    p.add_argument("-c", "--ctx-size", type=int, default=2048, help="context size (n_ctx)")
    p.add_argument("-d", "--n-depth", type=int, default=0,
                   help="tokens in the cache before each test (llama-bench's -d: tg128 @ d4096)")
    params.add_arguments(p, ContextParams, only=("type_k", "type_v"))
    p.add_argument("-o", "--output", choices=("md", "json", "csv"), default="md", help="table format")
    p.add_argument("--weight-format", choices=WEIGHT_FORMATS, default="auto",
                   help="how quantized weights are held on the device")
    p.add_argument("--numerics", choices=NUMERICS, default="exact",
                   help="exact (default) or ggml: llama.cpp's quantized products (activations quantized, integer dots)")
    p.add_argument("--profile", action="store_true",
                   help="instead of throughput: per-op time tables of a prefill ubatch (-p tokens) and "
                        "a decode step, with the host-side split and kernels per step")
    p.add_argument("--top", type=int, default=20, help="rows of each --profile table")
    p.set_defaults(fn=run)
    return p


def run(args: argparse.Namespace) -> int:
    for name in ("n_prompt", "n_gen", "n_depth", "reps", "ubatch", "ctx_size"):
        v = getattr(args, name)
        if v < (0 if name in ("n_prompt", "n_gen", "n_depth") else 1):
            bound = ">= 0" if name in ("n_prompt", "n_gen", "n_depth") else ">= 1"
            raise UsageError(f"bench: --{name.replace('_', '-')} must be {bound}, got {v}")
    if args.profile:
        from llm.research.profiler import profile
        steps = profile(str(hub.model_file(args.model)), n_ctx=args.ctx_size, n_prompt=args.n_prompt,
                        n_decode=max(args.n_gen, 1), n_ubatch=args.ubatch, weight_format=args.weight_format,
                        numerics=args.numerics)
        print("\n\n".join(s.format(args.top) for s in steps))
        return 0
    results = bench_model(str(hub.model_file(args.model)), n_prompt=args.n_prompt, n_gen=args.n_gen,
                          reps=args.reps, n_ubatch=args.ubatch, n_ctx=args.ctx_size,
                          weight_format=args.weight_format, abort_callback=args.interrupt.abort,
                          n_depth=args.n_depth, type_k=args.type_k, type_v=args.type_v, numerics=args.numerics)
    print(format_results(results, args.output))
    return 0

"""Recurrent models against llama.cpp (issue 28's "Done means" performance items): decode time
per token at positions ~100 and ~4000 (a recurrent layer's must not grow with the position), and
compare.py-style pp512 / tg128, on a Mamba2-130M-shaped model with seeded random weights.

    .venv/bin/python benchmarks/bench_recurrent.py [-r 3] [-t 2] [--positions 100,4000]
        [--steps 32] [--types F32,Q8_0] [--models mamba2-130m,granite4-hybrid,qwen35-0.8b] [--pos-reps 1]
        [--cache-dir /tmp/ggmlx-bench-recurrent]

The models are written (once, then reused) under --cache-dir by the fixture generator's own
functions (benchmarks/reference/make_fixture.py: Weights, ssm_kv, mamba2_block, output,
write_gguf): n_embd 768, 24 Mamba-2 layers, d_inner 1536, d_state 128, 24 heads of 64, 1 group,
d_conv 4, F32 and a Q8_0 twin, the fixtures' SPM vocabulary padded with plain tokens to
50288 entries (Mamba2-130M's padded vocabulary, so the output matmul is the real one's).
--models granite4-hybrid is a Granite-4-shaped hybrid of the same width (24 layers, attention at every 6th,
gated FFN 2048, 12 heads / 4 KV heads), whose attention layers should make decode grow a little
with the position. --models qwen35-0.8b is a Qwen3.5-0.8B-shaped hybrid (qwen35): n_embd 1024, 24
layers, gated full attention at every 4th (8 heads / 2 KV heads of 256, q/k norms, the output
gate, IMROPE over 64 dims, sections 11/11/10/0), Gated DeltaNet elsewhere (16 key and 16 value
heads of 128, inner 2048, conv 4), SiLU FFN 3584; its vocabulary is padded to 32768, not the
real 248320: the benchmark is about the mixer, and the output matmul is the same work in both
engines (at 248k it would be a third of the weights a decode step reads, at 32k 6%).

Every measurement runs in its own child process per engine and repetition, engines alternating
within each repetition (the way compare.py runs them), 2 threads; the summary gives medians.
Decode at a position: prefill `pos` tokens (ubatches of 512), 4 untimed decodes, then `--steps`
single-token decodes timed, twice alternating between a context at ~100 and one at ~4000 in the
same process; ours also reports the graph compiles in the timed window (must be 0).
pp512 / tg128 reuse compare.py's children (llm bench's bench_model and llama_cpp.Llama.eval).

Run time: ~13 min on a shared 2-core machine with the defaults, most of it our engine's
4000-token prefill (~170 s; its lax.scan ssm_scan is ~87% of a prefill ubatch's op time) and
its compiles (~20 s per child); `-r 1` or `--skip-pos` for a quicker look. On a shared machine
llama.cpp's tg collapses when other processes take the cores (its threads spin-wait at every
op), so its tg numbers are only meaningful with the load average below the thread count.
`--models qwen35-0.8b -r 1`: ~20 min (1216 s at load average 5-10): our 4000-token prefill
~305 s, every 512-token ubatch at a new position compiling its graph once (5 in a 2560-token
prefill), llama.cpp's ~143 s.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "reference"))

N_VOCAB = 50288
QWEN35_VOCAB = 32768    # the real 248320 would make the output matmul (the same work in both engines) dominate
N_CTX_TRAIN = 1 << 20
SHAPE = dict(n_embd=768, n_layer=24, d_state=128, n_head=24, n_group=1)      # Mamba2-130M
N_BATCH = 512


# ---- models ------------------------------------------------------------------------------


def _vocab(n_vocab: int) -> list:
    """The fixtures' 512-token SPM vocabulary, padded with plain tokens to n_vocab."""
    import make_fixture as mf
    import numpy as np
    out = []
    for k, v, vt, at in mf.spm_vocab_kv():
        n_pad = n_vocab - len(v) if isinstance(v, (list, np.ndarray)) else 0
        if k == "tokenizer.ggml.tokens":
            v = list(v) + [f"\u2581x{i}" for i in range(n_pad)]
        elif k == "tokenizer.ggml.scores":
            v = np.concatenate([np.asarray(v, np.float32), -1000.0 - np.arange(n_pad, dtype=np.float32)])
        elif k == "tokenizer.ggml.token_type":
            v = np.concatenate([np.asarray(v, np.int32), np.ones(n_pad, np.int32)])
        out.append((k, v, vt, at))
    return out


def _spec_mamba2(w, n_vocab: int) -> dict:
    import make_fixture as mf
    s = SHAPE
    d = mf.Dims(n_layer=s["n_layer"], n_embd=s["n_embd"], n_ctx_train=N_CTX_TRAIN)
    kv = mf.ssm_kv("mamba2", d, d_state=s["d_state"], dt_rank=s["n_head"], n_group=s["n_group"])
    w.embd("token_embd.weight", n_vocab, d.n_embd)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        mf.mamba2_block(w, p, d, d_state=s["d_state"], n_head=s["n_head"], n_group=s["n_group"])
    mf.output(w, d)
    return kv


def _spec_hybrid(w, n_vocab: int) -> dict:
    """Granite-4-shaped hybrid: attention at layers 5, 11, 17, 23, Mamba-2 elsewhere, gated FFNs."""
    import make_fixture as mf
    a, s = "granitehybrid", SHAPE
    d = mf.Dims(n_layer=s["n_layer"], n_embd=s["n_embd"], n_head=12, n_head_kv=4, n_ff=2048, n_ctx_train=N_CTX_TRAIN)
    attn = [il % 6 == 5 for il in range(d.n_layer)]
    kv = mf.ssm_kv(a, d, d_state=s["d_state"], dt_rank=s["n_head"], n_group=s["n_group"])
    kv[f"{a}.attention.head_count"] = d.n_head
    kv[f"{a}.attention.head_count_kv"] = [d.n_head_kv if x else 0 for x in attn]
    kv[f"{a}.feed_forward_length"] = d.n_ff
    kv[f"{a}.rope.freq_base"] = 10000.0
    kv[f"{a}.rope.dimension_count"] = d.head_dim
    kv.update({f"{a}.residual_scale": 0.22, f"{a}.attention.scale": 0.0078125, f"{a}.logit_scale": 6.0,
               f"{a}.embedding_scale": 12.0})
    w.embd("token_embd.weight", n_vocab, d.n_embd)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        if attn[il]:
            mf.attn_qkv(w, p, d)
            w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        else:
            mf.mamba2_block(w, p, d, d_state=s["d_state"], n_head=s["n_head"], n_group=s["n_group"])
        w.norm(p + "ffn_norm.weight", d.n_embd)
        w.mat(p + "ffn_gate.weight", d.n_ff, d.n_embd)
        w.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)
        w.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)
    mf.output(w, d)
    return kv


def _spec_qwen35(w, n_vocab: int) -> dict:
    """Qwen3.5-0.8B-shaped: 24 layers, gated full attention at every 4th (8 heads / 2 KV heads of
    256, q/k norms, IMROPE over 64 dims), Gated DeltaNet elsewhere (16 key and 16 value heads of
    128, conv 4), dense SiLU FFN 3584. The attention layers' heads are wider than n_embd / n_head,
    which make_fixture's gated_attn_block assumes, so their tensors are declared here."""
    import make_fixture as mf
    a, hd, n_head, n_head_kv, s = "qwen35", 256, 8, 2, 128
    d = mf.Dims(n_layer=24, n_embd=1024, n_head=n_head, n_head_kv=n_head_kv, n_ff=3584, n_ctx_train=N_CTX_TRAIN)
    kv = mf.delta_net_kv(a, d, d_state=s, n_k_heads=16, n_v_heads=16)
    kv.update({f"{a}.attention.key_length": hd, f"{a}.attention.value_length": hd,
               f"{a}.rope.dimension_count": 64, f"{a}.rope.dimension_sections": [11, 11, 10, 0]})
    w.embd("token_embd.weight", n_vocab, d.n_embd)
    mf.output(w, d)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        w.norm(p + "post_attention_norm.weight", d.n_embd)
        if il % 4 == 3:
            w.mat(p + "attn_q.weight", 2 * n_head * hd, d.n_embd)         # [q; gate] per head
            w.mat(p + "attn_k.weight", n_head_kv * hd, d.n_embd)
            w.mat(p + "attn_v.weight", n_head_kv * hd, d.n_embd)
            w.mat(p + "attn_output.weight", d.n_embd, n_head * hd)
            w.norm(p + "attn_q_norm.weight", hd)
            w.norm(p + "attn_k_norm.weight", hd)
        else:
            mf.delta_net_block(w, p, d, d_state=s, n_k_heads=16, n_v_heads=16)
        w.mat(p + "ffn_gate.weight", d.n_ff, d.n_embd)
        w.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)
        w.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)
    return kv


# name -> (spec, seed, vocabulary size)
SPECS = {"mamba2-130m": (_spec_mamba2, 241, N_VOCAB), "granite4-hybrid": (_spec_hybrid, 242, N_VOCAB),
         "qwen35-0.8b": (_spec_qwen35, 243, QWEN35_VOCAB)}


def build_models(cache: Path, names: list[str], types: list[str]) -> dict[tuple[str, str], Path]:
    """The GGUFs (name, type) -> path, written once under `cache` (seeded: the same bytes each time)."""
    import make_fixture as mf
    cache.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in names:
        build, seed, n_vocab = SPECS[name]
        todo = {t: cache / f"{name}-v{n_vocab}-{t}.gguf" for t in types}
        paths.update({(name, t): p for t, p in todo.items()})
        todo = {t: p for t, p in todo.items() if not p.exists()}
        if not todo:
            continue
        mf.N_VOCAB = n_vocab               # output() sizes the output matrix by the module's N_VOCAB
        w = mf.Weights(seed)
        kv = build(w, n_vocab)
        vocab = _vocab(n_vocab)
        for t, p in todo.items():
            t0 = time.perf_counter()
            tmp = p.with_suffix(".tmp")
            mf.write_gguf(tmp, kv, vocab, w.t, t)
            tmp.rename(p)
            print(f"wrote {p} ({p.stat().st_size / 2**20:.0f} MiB, {time.perf_counter() - t0:.1f} s)", flush=True)
    return paths


# ---- children: decode time per token at given positions ------------------------------------


def _prompt(n: int) -> list[int]:
    """Token ids 1000.. below the smallest model's vocabulary (Qwen3.5-shaped's 32768)."""
    return [int(1000 + (i * 7919) % (QWEN35_VOCAB - 1000)) for i in range(n)]


def _pos_ours(model_path: str, positions: list[int], steps: int, threads: int) -> dict:
    from llm.batch import Batch
    from llm.context import Context
    from llm.model import load_model
    model = load_model(model_path)
    out: dict = {}
    ctxs = {}
    for pos in positions:
        ctx = Context(model, n_ctx=pos + 2 * steps + 64, n_batch=N_BATCH, n_ubatch=N_BATCH)
        toks = _prompt(pos)
        t0 = time.perf_counter()
        for i in range(0, pos, N_BATCH):
            chunk = toks[i:i + N_BATCH]
            rc = ctx.decode(Batch(tokens=chunk, pos=list(range(i, i + len(chunk))),
                                  logits=[j == len(chunk) - 1 for j in range(len(chunk))]))
            assert rc == 0, ctx.last_error
        ctx.get_logits_ith(-1)
        out[f"prefill_s@{pos}"] = time.perf_counter() - t0
        for k in range(4):                                   # warm-up: the decode graph compiles here
            assert ctx.decode(Batch(tokens=[1000 + k], pos=[pos + k], logits=[True])) == 0
            ctx.get_logits_ith(-1)
        ctxs[pos] = [ctx, pos + 4]
    times: dict[int, list[float]] = {p: [] for p in positions}
    comp: dict[int, int] = {p: 0 for p in positions}
    for _ in range(2):                                       # alternate the positions, twice
        for pos in positions:
            ctx, p = ctxs[pos]
            c0 = ctx.perf()["n_compiles"]
            t0 = time.perf_counter()
            for k in range(steps):
                assert ctx.decode(Batch(tokens=[1000 + (k * 31) % 30000], pos=[p + k], logits=[True])) == 0
                ctx.get_logits_ith(-1)
            times[pos].append((time.perf_counter() - t0) / steps)
            comp[pos] += ctx.perf()["n_compiles"] - c0
            ctxs[pos][1] = p + steps
    for pos in positions:
        out[f"ms_tok@{pos}"] = 1e3 * min(times[pos])
        out[f"compiles@{pos}"] = comp[pos]
    return out


def _pos_llama_cpp(model_path: str, positions: list[int], steps: int, threads: int) -> dict:
    import llama_cpp
    out: dict = {}
    lls = {}
    for pos in positions:
        ll = llama_cpp.Llama(model_path=model_path, n_ctx=pos + 2 * steps + 64, n_batch=N_BATCH,
                             n_ubatch=N_BATCH, n_threads=threads, n_threads_batch=threads, verbose=False)
        t0 = time.perf_counter()
        ll.eval(_prompt(pos))
        out[f"prefill_s@{pos}"] = time.perf_counter() - t0
        for k in range(4):
            ll.eval([1000 + k])
        lls[pos] = ll
    times: dict[int, list[float]] = {p: [] for p in positions}
    for _ in range(2):
        for pos in positions:
            ll = lls[pos]
            t0 = time.perf_counter()
            for k in range(steps):
                ll.eval([1000 + (k * 31) % 30000])
            times[pos].append((time.perf_counter() - t0) / steps)
    for pos in positions:
        out[f"ms_tok@{pos}"] = 1e3 * min(times[pos])
    return out


POS_ENGINES = {"ggmlx": _pos_ours, "llama.cpp": _pos_llama_cpp}


def _run(cmd: list[str], threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[2:5])} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_pos(engine: str, model: Path, a) -> dict:
    return _run([sys.executable, __file__, "--pos-child", engine, str(model), a.positions, str(a.steps),
                 str(a.threads)], a.threads)


def run_pptg(engine: str, model: Path, a) -> dict:
    import compare
    ns = argparse.Namespace(n_prompt=a.n_prompt, n_gen=a.n_gen, threads=a.threads, depth=0,
                            type_k=compare.DEFAULT, type_v=compare.DEFAULT)
    return compare._run_child(engine, str(model), ns)


# ---- main --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("--positions", default="100,4000")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--types", default="F32,Q8_0")
    ap.add_argument("--pos-types", default="F32", help="weight types the position test runs on")
    ap.add_argument("--models", default="mamba2-130m", help=f"comma-separated, of {', '.join(SPECS)}")
    ap.add_argument("--pos-reps", type=int, default=1, help="repetitions of the position test (each: 2 windows)")
    ap.add_argument("--skip-pos", action="store_true")
    ap.add_argument("--skip-pptg", action="store_true")
    ap.add_argument("--cache-dir", type=Path, default=Path("/tmp/ggmlx-bench-recurrent"))
    a = ap.parse_args(argv)
    types = a.types.split(",")
    names = a.models.split(",")
    paths = build_models(a.cache_dir, names, sorted(set(types) | set(a.pos_types.split(","))))
    positions = [int(x) for x in a.positions.split(",")]
    engines = ["ggmlx", "llama.cpp"]
    t_start = time.perf_counter()
    pos_res: dict[tuple[str, str, str], list[dict]] = {}
    pptg_res: dict[tuple[str, str, str], list[dict]] = {}
    for rep in range(a.reps):
        for name in names:
            if not a.skip_pos and rep < a.pos_reps:
                for t in a.pos_types.split(","):
                    for e in engines:
                        r = run_pos(e, paths[name, t], a)
                        pos_res.setdefault((name, t, e), []).append(r)
                        print(f"[rep {rep}] pos {name} {t} {e}: {json.dumps({k: round(v, 3) for k, v in r.items()})}",
                              flush=True)
            if not a.skip_pptg:
                for t in types:
                    for e in engines:
                        r = run_pptg(e, paths[name, t], a)
                        pptg_res.setdefault((name, t, e), []).append(r)
                        print(f"[rep {rep}] pp/tg {name} {t} {e}: pp {r['pp']:.1f} tg {r['tg']:.1f}", flush=True)
    med = lambda rs, k: statistics.median(r[k] for r in rs)      # noqa: E731
    vocabs = ", ".join(f"{n} {SPECS[n][2]}" for n in names)
    print(f"\n== summary: threads {a.threads}, reps {a.reps} (pp/tg) / {a.pos_reps} (position test), medians, "
          f"vocab {vocabs}, total {time.perf_counter() - t_start:.0f} s, load average now "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} ==")
    if max(os.getloadavg()) > a.threads + 0.5:
        print("note: more runnable processes than cores: llama.cpp's spin-waiting thread pool slows down far "
              "more than XLA's when the cores are shared (its tg can drop 10x); compare on a quiet machine")
    if pos_res:
        p0, p1 = positions[0], positions[-1]
        print(f"\ndecode ms/token at position ~{p0} and ~{p1} ({a.steps} steps timed, best of 2 windows per run)")
        print(f"| model | type | engine | prefill {p0} s | prefill {p1} s | ms/tok @{p0} | ms/tok @{p1} "
              f"| tg@{p1} / tg@{p0} | compiles in timed window |")
        print("|---|---|---|---:|---:|---:|---:|---:|---:|")
        for (name, t, e), rs in pos_res.items():
            m0, m1 = med(rs, f"ms_tok@{p0}"), med(rs, f"ms_tok@{p1}")
            comp = sum(r.get(f"compiles@{p}", 0) for r in rs for p in positions) if e == "ggmlx" else "-"
            print(f"| {name} | {t} | {e} | {med(rs, f'prefill_s@{p0}'):.2f} | {med(rs, f'prefill_s@{p1}'):.2f} "
                  f"| {m0:.2f} | {m1:.2f} | {m1 / m0:.3f} | {comp} |")
    if pptg_res:
        print(f"\npp{a.n_prompt} / tg{a.n_gen} tok/s (compare.py's children)")
        print("| model | type | engine | pp t/s | tg t/s | ggmlx/llama.cpp pp | ggmlx/llama.cpp tg |")
        print("|---|---|---|---:|---:|---:|---:|")
        for (name, t, e), rs in pptg_res.items():
            ours = pptg_res[name, t, "ggmlx"]
            pp, tg = med(rs, "pp"), med(rs, "tg")
            print(f"| {name} | {t} | {e} | {pp:.1f} | {tg:.1f} | {med(ours, 'pp') / pp:.2f} "
                  f"| {med(ours, 'tg') / tg:.2f} |")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--pos-child":
        eng, model, poss, steps, threads = sys.argv[2:7]
        print(json.dumps(POS_ENGINES[eng](model, [int(x) for x in poss.split(",")], int(steps), int(threads))))
    else:
        sys.exit(main())

"""Our engine side by side with llama-cpp-python (and transformers), same model, prompt
length and thread count, runs alternating in one process tree; prints tok/s and ratios.

    .venv/bin/python benchmarks/compare.py [-m MODEL | --shape 1b|3b|8b] [-p 512] [-n 128] [-d 0]
        [-ctk f32] [-ctv f32] [--numerics exact|ggml] [-r 3] [-t 2] [--hf HF_ID] [--ggmlx-dir DIR]
        [--no-transformers]
    .venv/bin/python benchmarks/compare.py --cli [-m MODEL] [-n 32] [--prompt TEXT] [--numerics exact|ggml] [-r 3]

`-d N` measures each test after N cached tokens (llama-bench's -d; the depth is filled
untimed), `-ctk/-ctv` set both engines' KV cache types (llama.cpp's names), e.g. SmolLM2's
decode at depth 4096 with a Q8_0 cache: `-p 0 -n 128 -d 4096 -ctk q8_0 -ctv q8_0`. llama.cpp
runs with flash attention on, as llama-bench's default (auto) does on the CPU and as a
quantized V cache needs.

`--shape 1b|3b|8b` runs a random-weight Q4_K_M model of Llama-3.2-1B's, Llama-3.2-3B's or
Llama-3.1-8B's shape (benchmarks/shapes.py: written in F16 tensor by tensor, quantized by
llama.cpp, cached under ~/.cache/ggmlx/shapes/; the first run builds it, the 8B's 16 GB F16
file needs that much free disk for a while). Each engine's peak RSS (its child process's
VmHWM: load, run and all) is printed beside its tok/s, with ggmlx's ratio to it.

`--cli` times whole processes instead: our command line, `python -m llm generate -m MODEL -p
PROMPT -n N --temp 0 --numerics X` (run from the checkout), against a fresh interpreter that imports
llama_cpp, loads the model (`Llama(n_ctx=2048, n_threads=T, flash_attn=True)`, the sizes our CLI
uses) and completes the prompt greedily to N tokens: start, imports, load, executable and compile
caches, the first run of each graph, generation and exit. Each engine runs once untimed first
(warm page cache, XLA and executable caches, Python bytecode), then reps alternate; wall seconds
and each child's peak RSS (ru_maxrss from wait4) are printed with ggmlx's ratios, and its CPU
seconds (user + system), which other load on the machine disturbs less than the wall time. Run
it on a quiet machine: with another busy process on 2 cores, llama.cpp's threads (spinning at
their barriers) took 5-65 s instead of 0.6 s for SmolLM2, and a median of 3 does not hide that. The children
write bytecode to cache_root()/pycache (PYTHONPYCACHEPREFIX, PYTHONDONTWRITEBYTECODE dropped), as
an installed package has its .pyc files; the checkout stays clean. `-p` is ignored here (the
prompt is `--prompt`).

Peers are optional: `pip install llama-cpp-python` (builds from source, ~10 min on 2 cores);
`pip install torch transformers accelerate` for the transformers column (it loads the same
GGUF, dequantized to f32, or --hf MODEL_ID). Each engine runs in its own subprocess per
repetition so the engines never share a process (and XLA's thread pool is not restricted by
llama.cpp's).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import shapes  # benchmarks/shapes.py, beside this script

from ggmlx import flags
from llm import hub
from llm.kv_cache import KV_TYPES

DEFAULT = "default"     # -ctk / -ctv not given: each engine's own cache type

PEER_INSTALL = {
    "llama_cpp": "pip install llama-cpp-python  (builds from source, ~10 min)",
    "transformers": "pip install torch transformers accelerate  (CPU wheels)",
}


def _ours(model: str, n_prompt: int, n_gen: int, threads: int, n_depth: int, type_k: str, type_v: str,
          numerics: str) -> dict:
    from llm.cli.bench import bench_model
    types = {k: v for k, v in (("type_k", type_k), ("type_v", type_v)) if v != DEFAULT}
    res = {r.test[:2]: r.tok_s_median for r in bench_model(model, n_prompt=n_prompt, n_gen=n_gen, reps=1,
                                                            n_depth=n_depth, numerics=numerics, **types)}
    return {"pp": res.get("pp", 0.0), "tg": res.get("tg", 0.0)}


def _llama_cpp(model: str, n_prompt: int, n_gen: int, threads: int, n_depth: int, type_k: str, type_v: str,
               numerics: str) -> dict:
    import llama_cpp
    types = {k: getattr(llama_cpp, f"GGML_TYPE_{v.upper()}") for k, v in (("type_k", type_k), ("type_v", type_v))
             if v != DEFAULT}
    llm = llama_cpp.Llama(model_path=model, n_ctx=max(2048, n_depth + n_prompt + n_gen), n_batch=512,
                          n_threads=threads, verbose=False, flash_attn=True, **types)
    depth = [1000 + (i * 7919) % 20000 for i in range(n_depth)]
    toks = [1000 + (i * 7919) % 20000 for i in range(n_prompt)]
    llm.eval(depth + [1000 + i for i in range(8)])          # the depth (untimed), and a warm-up
    llm.n_tokens = n_depth                                  # eval removes the cells from n_tokens on
    pp = 0.0
    if n_prompt:
        t0 = time.perf_counter()
        llm.eval(toks)
        pp = n_prompt / (time.perf_counter() - t0)
        llm.n_tokens = n_depth
    t0 = time.perf_counter()
    for i in range(n_gen):
        llm.eval([1000 + i])
    tg = n_gen / (time.perf_counter() - t0)
    return {"pp": pp, "tg": tg}


def _transformers(hf_id: str, n_prompt: int, n_gen: int, threads: int, n_depth: int, type_k: str,
                  type_v: str, numerics: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(threads)
    if hf_id.endswith(".gguf"):     # transformers dequantizes a GGUF to f32 itself (needs accelerate)
        m = AutoModelForCausalLM.from_pretrained(os.path.dirname(hf_id), gguf_file=os.path.basename(hf_id),
                                                 dtype=torch.float32).eval()
    else:
        m = AutoModelForCausalLM.from_pretrained(hf_id, dtype=torch.float32).eval()
    ids = torch.tensor([[1000 + (i * 7919) % 20000 for i in range(n_prompt)]])
    with torch.no_grad():
        m(ids[:, :8])
        t0 = time.perf_counter()
        m(ids)
        pp = n_prompt / (time.perf_counter() - t0)
        past, tok = None, torch.tensor([[1000]])
        t0 = time.perf_counter()
        for _ in range(n_gen):
            out = m(tok, past_key_values=past, use_cache=True)
            past = out.past_key_values
        tg = n_gen / (time.perf_counter() - t0)
    return {"pp": pp, "tg": tg}


# --cli: llama.cpp's side of the whole-process run, in a fresh interpreter (argv: model prompt n_gen threads)
_LLAMA_CPP_CLI = """import sys
import llama_cpp
model, prompt, n_gen, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
llm = llama_cpp.Llama(model_path=model, n_ctx=2048, n_threads=threads, flash_attn=True, verbose=False)
print(llm(prompt, max_tokens=n_gen, temperature=0.0)["choices"][0]["text"])
"""


def _cli_command(engine: str, a) -> tuple[list[str], str]:
    """The command line of one engine's whole-process run and the folder it runs in."""
    if engine == "llama.cpp":
        return [sys.executable, "-c", _LLAMA_CPP_CLI, a.model, a.prompt, str(a.n_gen), str(a.threads)], os.getcwd()
    root = engine.split("@", 1)[1] if engine.startswith("ggmlx@") else os.path.dirname(os.path.dirname(__file__))
    return ([sys.executable, "-m", "llm", "generate", "-m", a.model, "-p", a.prompt, "-n", str(a.n_gen),
             "--temp", "0", "--numerics", a.numerics], os.path.abspath(root))


def _run_cli(engine: str, a) -> dict:
    """One whole process: wall and CPU seconds from start to exit, peak RSS in bytes, the text printed."""
    cmd, cwd = _cli_command(engine, a)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), PYTHONPYCACHEPREFIX=os.path.join(flags.cache_root(),
                                                                                           "pycache"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=cwd)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)        # reaped by wait4, not by Popen
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise RuntimeError(f"{engine} failed ({proc.returncode}):\n{err.read().decode()[-2000:]}")
        return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "rss": usage.ru_maxrss * 1024,
                "text": out.read().decode().strip()}


def cli_main(a, engines: list[str]) -> int:
    """--cli: whole-process runs, each engine warmed once, then reps alternating."""
    for engine in engines:
        _run_cli(engine, a)
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    for _ in range(a.reps):
        for engine in engines:
            runs[engine].append(_run_cli(engine, a))
    med = {e: {k: statistics.median(r[k] for r in rs) for k in ("wall", "cpu", "rss")} for e, rs in runs.items()}
    print(f"model {a.model}  CLI -n {a.n_gen} prompt {a.prompt!r}  ggmlx numerics {a.numerics}  "
          f"threads {a.threads}  reps {a.reps}  load average {os.getloadavg()[0]:.1f}")
    for e, rs in runs.items():
        print(f"  {e}: wall s {[round(r['wall'], 2) for r in rs]}  CPU s {[round(r['cpu'], 2) for r in rs]}  "
              f"peak RSS MB {[round(r['rss'] / 1e6) for r in rs]}  text {rs[-1]['text'][:60]!r}")
    print("| engine | wall s | CPU s | peak RSS MB | ggmlx wall ratio | ggmlx CPU ratio | ggmlx RSS ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    ours = med["ggmlx"]
    for e, m in med.items():
        print(f"| {e} | {m['wall']:.2f} | {m['cpu']:.2f} | {m['rss'] / 1e6:.0f} | {ours['wall'] / m['wall']:.2f} "
              f"| {ours['cpu'] / m['cpu']:.2f} | {ours['rss'] / m['rss']:.2f} |")
    return 0


ENGINES = {"ggmlx": _ours, "llama.cpp": _llama_cpp, "transformers": _transformers}


def _child(engine: str, target: str, n_prompt: int, n_gen: int, threads: int, n_depth: int, type_k: str,
           type_v: str, numerics: str) -> None:
    res = ENGINES[engine](target, n_prompt, n_gen, threads, n_depth, type_k, type_v, numerics)
    res["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024     # peak, KiB on Linux
    print(json.dumps(res))


def _run_child(engine: str, target: str, a) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    if engine.startswith("ggmlx@"):        # another checkout of ggmlx (before/after side by side)
        env["PYTHONPATH"] = engine.split("@", 1)[1]
        engine = "ggmlx"
    cmd = [sys.executable, __file__, "--child", engine, target, str(a.n_prompt), str(a.n_gen), str(a.threads),
           str(a.depth), a.type_k, a.type_v, a.numerics]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{engine} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2-135m", help="GGUF path or known model name")
    ap.add_argument("--shape", choices=sorted(shapes.SHAPES), default=None,
                    help="instead of -m: a random-weight Q4_K_M llama of this model's shape (built once)")
    ap.add_argument("--hf", default=None, help="Hugging Face id of the same model for transformers "
                                                 "(default: transformers loads the GGUF itself)")
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=None, help="tokens generated (default 128; --cli: 32)")
    ap.add_argument("-d", "--depth", type=int, default=0, help="cached tokens before each test (llama-bench's -d)")
    ap.add_argument("-ctk", "--cache-type-k", dest="type_k", default=DEFAULT, choices=(DEFAULT, *KV_TYPES),
                    help="KV cache type of K, both engines (default: each engine's own: ours that of its "
                         "numerics, f16 under ggml and f32 under exact; llama.cpp f16)")
    ap.add_argument("-ctv", "--cache-type-v", dest="type_v", default=DEFAULT, choices=(DEFAULT, *KV_TYPES),
                    help="KV cache type of V, both engines (default: each engine's own)")
    ap.add_argument("--numerics", choices=("exact", "ggml"), default="exact",
                    help="ggmlx's numerics (llm.load_model): ggml = llama.cpp's quantized products")
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--ggmlx-dir", action="append", default=[],
                    help="also run the ggmlx of this checkout (e.g. an export of main), as engine ggmlx@DIR")
    ap.add_argument("--no-transformers", action="store_true", help="leave transformers out even if installed")
    ap.add_argument("--cli", action="store_true",
                    help="time whole processes: our CLI generate against a llama-cpp-python script (wall, peak RSS)")
    ap.add_argument("--prompt", default="The capital of France is", help="--cli: the prompt text")
    a = ap.parse_args(argv)
    if a.n_gen is None:
        a.n_gen = 32 if a.cli else 128
    a.model = str(shapes.build(a.shape, a.threads) if a.shape else hub.resolve(a.model))
    engines = {"ggmlx": a.model}
    engines.update({f"ggmlx@{os.path.abspath(d)}": a.model for d in a.ggmlx_dir})
    if a.cli:
        if importlib.util.find_spec("llama_cpp") is None:
            print(f"llama.cpp: not installed ({PEER_INSTALL['llama_cpp']})")
        else:
            engines["llama.cpp"] = a.model
        return cli_main(a, list(engines))
    for mod, engine, target in (("llama_cpp", "llama.cpp", a.model), ("transformers", "transformers", a.hf or a.model)):
        if engine == "transformers" and (a.no_transformers or a.depth or (a.type_k, a.type_v) != (DEFAULT, DEFAULT)):
            continue        # its column has no depth and no cache types
        if importlib.util.find_spec(mod) is None:
            print(f"{engine}: not installed ({PEER_INSTALL[mod]})")
        else:
            engines[engine] = target
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    for _ in range(a.reps):                      # alternate engines within each repetition
        for engine, target in engines.items():
            runs[engine].append(_run_child(engine, target, a))
    med = {e: {k: statistics.median(r[k] for r in rs) for k in ("pp", "tg", "rss")} for e, rs in runs.items()}
    at = f" @ d{a.depth}" if a.depth else ""
    print(f"model {a.model}  pp{a.n_prompt} / tg{a.n_gen}{at}  cache K {a.type_k} V {a.type_v}  "
          f"ggmlx numerics {a.numerics}  "
          f"threads {a.threads}  reps {a.reps}  load average {os.getloadavg()[0]:.1f}")
    for e, rs in runs.items():
        print(f"  {e}: pp {[round(r['pp'], 1) for r in rs]}  tg {[round(r['tg'], 1) for r in rs]}  "
              f"peak RSS MB {[round(r['rss'] / 1e6) for r in rs]}")
    print("| engine | pp t/s | tg t/s | peak RSS MB | ggmlx pp ratio | ggmlx tg ratio | ggmlx RSS ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    def ratio(k: str, m: dict) -> str:
        return f"{med['ggmlx'][k] / m[k]:.2f}" if m[k] else "-"
    for e, m in med.items():
        print(f"| {e} | {m['pp']:.1f} | {m['tg']:.1f} | {m['rss'] / 1e6:.0f} | {ratio('pp', m)} | {ratio('tg', m)} "
              f"| {ratio('rss', m)} |")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7]),
               sys.argv[8], sys.argv[9], sys.argv[10])
    else:
        sys.exit(main())

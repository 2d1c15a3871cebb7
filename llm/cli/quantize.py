"""`python -m llm quantize IN.gguf OUT.gguf TYPE`: llama-quantize, with its type names and flags.

The output is the bytes llama-quantize writes for the same input (llm.quantize). Bad input (an
unknown type, an already quantized model without --allow-requantize, a type that needs an
importance matrix, an output that exists or cannot be written) is a one-line error and exit 2,
with no output file left behind.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

from llm import quantize as q
from llm.errors import UsageError


def add_parser(sub) -> argparse.ArgumentParser:
    """Register the `quantize` subcommand on an argparse subparsers object."""
    types = ", ".join(q.FTYPE_NAMES)
    p = sub.add_parser("quantize", help="quantize a GGUF model as llama-quantize does (same bytes)",
                       description=f"quantize a GGUF model as llama-quantize does. TYPE: {types} "
                                   f"(any case), or the file type number",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("input", help="the model to quantize (F32/F16/BF16, or quantized with --allow-requantize)")
    p.add_argument("output", help="the quantized model (with --keep-split: the prefix of its shards)")
    p.add_argument("type", help="the file type, e.g. Q4_K_M")
    p.add_argument("nthreads", nargs="?", type=int, default=None, help="threads (llama-quantize's positional form)")
    p.add_argument("--nthread", type=int, default=0, help="threads; 0: one per CPU")
    p.add_argument("--imatrix", default=None, help="importance matrix file (llama-imatrix's GGUF or legacy .dat)")
    p.add_argument("--include-weights", action="append", default=[], metavar="PAT",
                   help="use the importance matrix only for tensors whose name contains PAT (repeatable)")
    p.add_argument("--exclude-weights", action="append", default=[], metavar="PAT",
                   help="do not use the importance matrix for tensors whose name contains PAT (repeatable)")
    p.add_argument("--output-tensor-type", default=None, metavar="T", help="ggml type of output.weight")
    p.add_argument("--token-embedding-type", default=None, metavar="T", help="ggml type of the token embeddings")
    p.add_argument("--tensor-type", action="append", default=[], metavar="PAT=T",
                   help="tensors whose name matches the regex PAT get ggml type T (repeatable, first match wins)")
    p.add_argument("--leave-output-tensor", action="store_true", help="leave output.weight unquantized")
    p.add_argument("--pure", action="store_true", help="no k-quant mixture: every tensor in the default type")
    p.add_argument("--allow-requantize", action="store_true", help="allow quantizing quantized tensors")
    p.add_argument("--keep-split", action="store_true", help="write as many shards as the input has")
    p.set_defaults(fn=run)
    return p


def _tensor_type(spec: str) -> tuple[str, q.GGMLType]:
    """--tensor-type PAT=T (llama-quantize lowercases PAT)."""
    pattern, sep, name = spec.partition("=")
    if not sep or not pattern or not name:
        raise UsageError(f"--tensor-type {spec!r}: expected PATTERN=TYPE, e.g. attn_q=q8_0")
    try:
        re.compile(pattern.lower())
    except re.error as e:
        raise UsageError(f"--tensor-type {spec!r}: bad regular expression: {e}") from None
    return pattern.lower(), q.parse_ggml_type(name)


def params_from_args(a: argparse.Namespace) -> tuple[q.QuantizeParams, str]:
    """The QuantizeParams of the command line and the output path (llama-quantize's handling)."""
    if a.include_weights and a.exclude_weights:
        raise UsageError("--include-weights and --exclude-weights cannot be used together")
    ftype, only_copy = q.parse_ftype(a.type)
    out = a.output
    if a.keep_split and out.endswith(".gguf"):
        out = out[:-len(".gguf")]
    params = q.QuantizeParams(
        ftype=ftype, only_copy=only_copy, nthread=a.nthreads if a.nthreads is not None else a.nthread,
        output_tensor_type=q.parse_ggml_type(a.output_tensor_type) if a.output_tensor_type else None,
        token_embedding_type=q.parse_ggml_type(a.token_embedding_type) if a.token_embedding_type else None,
        allow_requantize=a.allow_requantize, quantize_output_tensor=not a.leave_output_tensor, pure=a.pure,
        keep_split=a.keep_split, include_weights=a.include_weights, exclude_weights=a.exclude_weights,
        tensor_types=[_tensor_type(s) for s in a.tensor_type])
    if a.imatrix:
        try:
            imatrix = q.load_imatrix(a.imatrix)
        except OSError as e:
            raise UsageError(f"cannot read the imatrix {a.imatrix}: {e.strerror}") from None
        params.imatrix = imatrix.values
        kept = params.importance()
        if kept:        # llama-quantize records where the importance came from
            params.kv_overrides = q.imatrix_overrides(a.imatrix, imatrix, len(kept))
    return params, out


def run(a: argparse.Namespace) -> int:
    try:
        params, out = params_from_args(a)
        if not os.path.isfile(a.input):
            raise UsageError(f"{a.input}: no such file")
        outputs = q.output_files(a.input, out, params.keep_split)
        for path in outputs:
            if os.path.exists(path):
                if os.path.samefile(path, a.input):
                    raise UsageError(f"input and output files are the same: '{a.input}'")
                raise UsageError(f"{path} exists: remove it or choose another output")
        t0 = time.perf_counter()
        paths = q.model_quantize(a.input, out, params)
    except q.QuantizeError as e:
        raise UsageError(str(e)) from None
    size_in = sum(os.path.getsize(p) for p in q.input_files(a.input))
    size_out = sum(os.path.getsize(p) for p in paths)
    print(f"quantize: {a.input} -> {', '.join(paths)} as {a.type.upper()}: {size_in / 2**20:.2f} MiB -> "
          f"{size_out / 2**20:.2f} MiB in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    return 0

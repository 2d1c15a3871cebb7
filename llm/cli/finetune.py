"""`python -m llm finetune`: train a LoRA adapter on a GGUF model (llm.finetune) from a data
directory in mlx-lm's formats, with mlx-lm's flag names (declared once, on LoraConfig), and
write it as a llama.cpp LoRA GGUF; a progress line per step and a validation line every
--steps-per-eval on stderr, the summary on stdout, the numbers as JSON with --report."""
from __future__ import annotations

import argparse
import datetime
import json
import sys

from ggmlx.types import GGMLType
from ggmlx.weights import WEIGHT_FORMATS
from llm import hub, params
from llm.errors import UsageError
from llm.finetune import LoraConfig, StepInfo, TrainingError, TrainResult, load_data, train


def add_parser(sub) -> argparse.ArgumentParser:
    """Register the `finetune` subcommand on an argparse subparsers object."""
    p = sub.add_parser("finetune", help="train a LoRA adapter on the GGUF model itself (llama.cpp LoRA GGUF out)",
                       description="Train a LoRA adapter of a GGUF model, its weights frozen in their own "
                                   "(quantized) format, on DIR/train.jsonl, validated on DIR/valid.jsonl.")
    p.add_argument("-m", "--model", default=hub.DEFAULT_MODEL, help="GGUF path or known model name")
    p.add_argument("--data", required=True, metavar="DIR",
                   help="directory with train.jsonl and valid.jsonl: rows {\"text\"}, {\"messages\"} or "
                        "{\"prompt\", \"completion\"}")
    p.add_argument("--adapter-path", default="adapters.gguf", metavar="OUT.gguf",
                   help="where the adapter is written (llama.cpp's --lora loads it) (default: %(default)s)")
    p.add_argument("--resume-adapter-file", default=None, metavar="FILE.gguf",
                   help="continue training this adapter (its weights, rank and alpha)")
    p.add_argument("--report", default=None, metavar="FILE.json",
                   help="write val_loss_start, val_loss_end, train_loss, tokens_per_s, peak_rss_mb, ... as JSON")
    p.add_argument("--test", action="store_true", help="after training, report the loss on DIR/test.jsonl")
    p.add_argument("--fuse", default=None, metavar="OUT.gguf",
                   help="also write the model with the adapter merged into its weights")
    p.add_argument("--fuse-type", choices=("f16", "f32"), default="f16",
                   help="type of the merged weights of --fuse (default: %(default)s)")
    p.add_argument("--weight-format", choices=WEIGHT_FORMATS, default="auto",
                   help="how the frozen weights are held on the device (default: %(default)s)")
    params.add_arguments(p.add_argument_group("training"), LoraConfig)
    p.set_defaults(fn=run)
    return p


def _clock(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))


def _progress(a):
    """The per-step callback: a progress line, a validation line, and stop on Ctrl-C."""
    def cb(info: StepInfo) -> bool:
        sys.stderr.write(f"step {info.step}/{info.iters} | loss {info.loss:.4f} | lr {info.learning_rate:.2e} | "
                         f"{info.tokens_per_s:.0f} tok/s | eta {_clock(info.eta_s)}\n")
        if info.val_loss is not None:
            sys.stderr.write(f"step {info.step}/{info.iters} | val loss {info.val_loss:.4f}\n")
        sys.stderr.flush()
        return not a.interrupt.flag
    return cb


def _write_report(path: str | None, result: TrainResult) -> None:
    if path is not None:
        with open(path, "w") as f:
            json.dump(result.report(), f, indent=1)


def run(a: argparse.Namespace) -> int:
    from llm.adapter import fuse
    from llm.model import load_model
    try:
        config = params.from_namespace(LoraConfig, a)
    except ValueError as e:
        raise UsageError(str(e)) from None
    path = hub.model_file(a.model)
    data = load_data(a.data)
    if a.test and "test" not in data:
        raise UsageError(f"--test: {a.data} has no test.jsonl")
    model = load_model(path, weight_format=a.weight_format, progress_callback=lambda f: not a.interrupt.flag)
    try:
        result = train(model, data["train"], data["valid"], config, callback=_progress(a),
                       resume_adapter_file=a.resume_adapter_file, adapter_path=a.adapter_path,
                       test_data=data["test"] if a.test else None)
    except TrainingError as e:
        _write_report(a.report, e.result)
        raise
    _write_report(a.report, result)
    ratio = result.val_loss_end / result.val_loss_start if result.val_loss_start else float("nan")
    print(f"val loss {result.val_loss_start:.4f} -> {result.val_loss_end:.4f} ({ratio:.2f} of the start) in "
          f"{result.steps} steps of {config.batch_size} x {result.seq_len} tokens; {result.tokens_per_s:.0f} tok/s; "
          f"peak RSS {result.peak_rss_mb:.0f} MB; adapter {a.adapter_path}")
    if result.test_loss is not None:
        print(f"test loss {result.test_loss:.4f}")
    if a.interrupt.flag:
        raise KeyboardInterrupt     # the adapter of the steps done is written
    if a.fuse is not None:
        n = fuse(path, a.fuse, [(a.adapter_path, 1.0)], type=GGMLType[a.fuse_type.upper()])
        print(f"fused: {n} weights merged into {a.fuse}")
    return 0

"""Row split (tensor parallelism) checks on simulated CPU devices, run as a subprocess.

`python tests/row_split_check.py OUT_DIR [MODEL ...]` makes JAX see 4 CPU devices (before
any other JAX use), loads each model on one device and with split_mode="row" over 2 and 4
devices, decodes the same tokens with each, and writes to OUT_DIR/result.json and
result.npz what tests/test_row_split.py asserts on: the logits, each split matrix's bytes
per device, whether the KV cache is divided, the compiles of steady-state steps, the
scheduler dump (GGMLX_SCHED_DEBUG) and the errors of shapes that cannot be split. MODEL
is a tiny spec name of SPECS or a path to a GGUF file; the default is every tiny spec.
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import numpy as np
from tiny_model import TinySpec, prompt_tokens, write_model

N_DEVICES = 4
N_PROMPT = 12
N_GEN = 3
SPECS = {
    # 4 heads / 2 KV heads: by heads on 2 devices, projections gathered on 4 (Q8_0 blocks)
    "llama": TinySpec(arch="llama", n_layer=3, seed=11, wtype="Q8_0"),
    # 4 / 1 heads like Gemma3-270M: gathered on 2 and 4
    "gemma3": TinySpec(arch="gemma3", n_layer=6, n_head_kv=1, seed=12),
    # 8 / 4 heads: by heads on 2 and 4 (F16)
    "llama_mha": TinySpec(arch="llama", n_layer=2, n_head=8, n_head_kv=4, seed=13, wtype="F16"),
}
# the RowPlan alternatives (tests/test_row_split.py checks them like the default plan):
# (spec, devices, uneven_heads, vocab); 6 / 3 heads like SmolLM2's 9 / 3 pad with zero
# heads, gemma3's 4 / 1 copy the KV head (the default, "auto"), or gather
PLAN_SPECS = {"llama_6_3": TinySpec(arch="llama", n_layer=2, n_embd=96, n_head=6, n_head_kv=3, seed=15)}
PLAN_CASES = [("llama_6_3", 2, "pad", "rows"), ("llama_6_3", 4, "pad", "rows"),
              ("gemma3", 2, "pad", "rows"), ("gemma3", 4, "pad", "rows"), ("gemma3", 4, "gather", "rows"),
              ("llama", 2, "gather", "cols"), ("gemma3", 4, "gather", "cols")]
# a shape that no rule serves: 4 KV heads divide by 4, so attn_output is split by its 64
# columns, 16 per device: not whole Q8_0 blocks of 32
BAD_SPEC = TinySpec(arch="llama", n_layer=1, n_head=4, n_head_kv=4, seed=14, wtype="Q8_0")


def _decode(model, n_prompt: int, n_gen: int) -> tuple[np.ndarray, dict]:
    """Logits of every prompt token and of n_gen single-token steps; the compiles of the
    steps after the first two (the graphs must be reused)."""
    import llm
    ctx = llm.Context(model, n_ctx=64, n_ubatch=16, kv_bucket=64)
    toks = prompt_tokens(n_prompt) if model.n_vocab == 512 else [1] + [100 + 37 * i for i in range(n_prompt - 1)]
    assert ctx.decode(llm.Batch(toks, logits=np.ones(n_prompt, bool))) == 0, ctx.last_error
    rows = [ctx.get_logits().copy()]
    compiles = []
    for k in range(n_gen):
        before = ctx.perf()["n_compiles"]
        assert ctx.decode(llm.Batch.get_one([5 + k])) == 0, ctx.last_error
        compiles.append(ctx.perf()["n_compiles"] - before)
        rows.append(ctx.get_logits_ith(-1)[None].copy())
    # a second prompt of the same padded size reuses the prefill executable
    ctx.memory_clear()
    before = ctx.perf()["n_compiles"]
    assert ctx.decode(llm.Batch(toks, logits=np.ones(n_prompt, bool))) == 0, ctx.last_error
    facts = {"step_compiles": compiles, "prefill_again_compiles": ctx.perf()["n_compiles"] - before,
             "kv_bytes_per_device": _bytes_per_device(_kv_arrays(ctx.memory))}
    return np.concatenate(rows), facts


def _kv_arrays(memory) -> list:
    """The attention KV cache's buffers (a hybrid's attention part; none for a recurrent model)."""
    from llm.kv_cache import KVCache
    from llm.memory_hybrid import MemoryHybrid
    kv = memory.mem_attn if isinstance(memory, MemoryHybrid) else memory
    return [t.data for t in kv.k_l + kv.v_l] if isinstance(kv, KVCache) else []


def _case_facts(model, facts: dict, dumps: list[str]) -> dict:
    from ggmlx.types import GGMLType
    from llm.kv_cache import kv_bytes_per_device
    est = kv_bytes_per_device(model, 64, GGMLType.F32, GGMLType.F32)
    facts.update(kv_split=model.placement.kv_split, splits=_split_bytes(model),
                 kv_estimate_per_device={str(d.id): v for d, v in est.items()},
                 n_head=model.hparams.n_head(), n_head_kv=model.hparams.n_head_kv(),
                 uneven_heads=model.placement.row_plan.uneven_heads,
                 dump="\n".join(d for d in dumps if "SPLIT" in d)[:200000])
    return facts


def _bytes_per_device(arrays) -> dict[str, int]:
    out: dict[str, int] = {}
    for a in arrays:
        for s in a.addressable_shards:
            out[str(s.device.id)] = out.get(str(s.device.id), 0) + s.data.nbytes
    return out


def _split_bytes(model) -> dict[str, dict]:
    """Every split weight: its split, total bytes, bytes on each device."""
    out = {}
    for t in model.weight_tensors():
        split = t.data.spec.split
        if split is None:
            continue
        out[t.name] = {"split": str(split), "total": sum(a.nbytes for a in t.data.arrays()),
                       "per_device": _bytes_per_device(t.data.arrays())}
    return out


def run(out_dir: Path, names: list[str]) -> None:
    import jax

    import ggmlx
    ggmlx.init()
    jax.config.update("jax_num_cpu_devices", N_DEVICES)
    import llm
    from llm.errors import ModelLoadError

    dumps: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            dumps.append(record.getMessage())

    logging.getLogger("ggmlx.sched").addHandler(Keep())
    devices = jax.devices("cpu")
    arrays: dict[str, np.ndarray] = {}
    info: dict[str, object] = {"n_devices": len(devices), "cases": {}}
    for name in names:
        if name in SPECS:
            path = write_model(out_dir / f"tiny-{name}.gguf", SPECS[name])
            n_prompt, n_gen = N_PROMPT, N_GEN
        else:
            path, n_prompt, n_gen = Path(name), 8, 2
            name = path.stem
        arrays[f"{name}/1"], _ = _decode(llm.load_model(path, devices=[]), n_prompt, n_gen)
        for n in (2, 4):
            dumps.clear()
            model = llm.load_model(path, devices=devices[:n], split_mode="row")
            arrays[f"{name}/{n}"], facts = _decode(model, n_prompt, n_gen)
            info["cases"][f"{name}/{n}"] = _case_facts(model, facts, dumps)
    if names == list(SPECS):
        for name, spec in PLAN_SPECS.items():
            path = write_model(out_dir / f"tiny-{name}.gguf", spec)
            arrays[f"{name}/1"], _ = _decode(llm.load_model(path, devices=[]), N_PROMPT, N_GEN)
        for name, n, heads, vocab in PLAN_CASES:
            dumps.clear()
            model = llm.load_model(out_dir / f"tiny-{name}.gguf", devices=devices[:n], split_mode="row",
                                   row_plan=llm.RowPlan(uneven_heads=heads, vocab=vocab))
            key = f"{name}/{n}/{heads}/{vocab}"
            arrays[key], facts = _decode(model, N_PROMPT, N_GEN)
            info["cases"][key] = _case_facts(model, facts, dumps)
        try:      # Q8_0 blocks of 32 hold two of the tiny llama's 16-feature heads
            llm.load_model(out_dir / "tiny-llama.gguf", devices=devices[:4], split_mode="row",
                           row_plan=llm.RowPlan(uneven_heads="pad"))
            info["pad_error"] = None
        except ModelLoadError as e:
            info["pad_error"] = str(e)
    path = write_model(out_dir / "tiny-bad.gguf", BAD_SPEC)
    try:
        llm.load_model(path, devices=devices[:4], split_mode="row")
        info["bad_shape_error"] = None
    except ModelLoadError as e:
        info["bad_shape_error"] = str(e)
    np.savez(out_dir / "result.npz", **arrays)
    (out_dir / "result.json").write_text(json.dumps(info))


if __name__ == "__main__":
    run(Path(sys.argv[1]), sys.argv[2:] or list(SPECS))

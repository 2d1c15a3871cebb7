"""LoRA adapters (issue 31): llama.cpp's LoRA GGUF read and checked against the model, applied
in the graph where llama.cpp's build_lora_mm / build_inp_embd apply it, with scales as inputs
(new scales reuse the compiled graph) and per-sequence scales in one batch. The reference is the
same model with the adapter merged into its weights (llm.adapter.fuse): exact F32 math both ways."""
from __future__ import annotations

import numpy as np
import pytest
from tiny_model import TinySpec, model_tensors, prompt_tokens, write_model

import llm
from ggmlx import gguf
from llm.adapter import adapter_lora_init, fuse, write_lora
from llm.batch import Batch
from llm.errors import ModelLoadError

SPEC = TinySpec(n_layer=2, seed=5)
RANK = 4
ADAPTED = ("token_embd.weight", "blk.0.attn_q.weight", "blk.1.attn_v.weight", "blk.0.attn_output.weight",
           "blk.1.ffn_down.weight", "blk.0.ffn_gate.weight", "output.weight")


def random_pairs(seed: int, names=ADAPTED, rank: int = RANK) -> dict:
    rng = np.random.default_rng(seed)
    weights = model_tensors(SPEC)
    pairs = {}
    for name in names:
        n_out, n_in = weights[name].shape
        if name == "token_embd.weight":        # flipped: A [n_vocab, r], B [n_embd, r]
            pairs[name] = (rng.standard_normal((n_out, rank)) * 0.3, rng.standard_normal((n_in, rank)) * 0.3)
        else:
            pairs[name] = (rng.standard_normal((rank, n_in)) * 0.3, rng.standard_normal((n_out, rank)) * 0.3)
    return pairs


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    base = write_model(d / "base.gguf", SPEC)
    one, two = d / "one.gguf", d / "two.gguf"
    write_lora(one, "llama", random_pairs(1), alpha=8.0)
    write_lora(two, "llama", random_pairs(2, names=ADAPTED[1:4]))      # no alpha: scale alone
    return {"dir": d, "base": base, "one": one, "two": two}


@pytest.fixture(scope="module")
def model(files):
    return llm.load_model(files["base"])


def logits_of(model, tokens, *, adapters=(), scales=(), ctx=None):
    ctx = ctx or llm.Context(model, n_ctx=64, n_batch=32, n_ubatch=32, n_seq_max=2)
    ctx.memory_clear()
    ctx.set_adapters_lora(adapters, scales)
    assert ctx.decode(Batch(np.asarray(tokens, np.int32), logits=np.ones(len(tokens), bool))) == 0
    return ctx.get_logits().copy()


def fused_logits(files, tokens, which, tag):
    out = files["dir"] / f"fused-{tag}.gguf"
    fuse(files["base"], out, which)
    return logits_of(llm.load_model(out), tokens)


@pytest.mark.parametrize("scale", [1.0, 0.5, -0.7])
def test_adapter_matches_the_merged_weights(files, model, scale):
    tokens = prompt_tokens(9)
    got = logits_of(model, tokens, adapters=[adapter_lora_init(model, files["one"])], scales=[scale])
    want = fused_logits(files, tokens, [(files["one"], scale)], f"s{scale}")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert np.abs(got - logits_of(model, tokens)).max() > 0.1      # the adapter changes the answer


@pytest.mark.slow
def test_two_adapters_add(files, model):
    tokens = prompt_tokens(7, seed=3)
    a1, a2 = adapter_lora_init(model, files["one"]), adapter_lora_init(model, files["two"])
    got = logits_of(model, tokens, adapters=[a1, a2], scales=[0.8, 1.5])
    want = fused_logits(files, tokens, [(files["one"], 0.8), (files["two"], 1.5)], "both")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_new_scales_reuse_the_compiled_graph(files, model):
    ctx = llm.Context(model, n_ctx=64, n_batch=32, n_ubatch=32, n_seq_max=2)
    adapter = adapter_lora_init(model, files["one"])
    tokens = prompt_tokens(5)
    logits_of(model, tokens, adapters=[adapter], scales=[1.0], ctx=ctx)
    n = ctx.perf()["n_compiles"]
    for s in (0.25, 2.0, 0.0):
        got = logits_of(model, tokens, adapters=[adapter], scales=[s], ctx=ctx)
    assert ctx.perf()["n_compiles"] == n
    np.testing.assert_allclose(got, logits_of(model, tokens), rtol=1e-5, atol=1e-5)   # scale 0 = off
    g, _ = ctx.last_graph
    names = {t.name for t in g.gf.nodes}
    assert {"blk.0.attn_q.weight.lora-0", "blk.0.attn_q.weight.lora_ax-0", "token_embd.weight.lora-0"} <= names


def test_sequences_with_their_own_scales_in_one_batch(files, model):
    adapter = adapter_lora_init(model, files["one"])
    a, b = prompt_tokens(6, seed=1), prompt_tokens(6, seed=2)
    alone_a = logits_of(model, a, adapters=[adapter], scales=[1.0])
    alone_b = logits_of(model, b)
    ctx = llm.Context(model, n_ctx=64, n_batch=32, n_ubatch=32, n_seq_max=2)
    ctx.set_adapters_lora([adapter], [0.0])
    ctx.set_adapter_scales_seq(0, [1.0])
    tokens = np.asarray(a + b, np.int32)
    pos = np.asarray(list(range(6)) * 2, np.int32)
    assert ctx.decode(Batch(tokens, pos=pos, seq_id=[(0,)] * 6 + [(1,)] * 6, logits=np.ones(12, bool))) == 0
    got = ctx.get_logits()
    np.testing.assert_allclose(got[:6], alone_a, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[6:], alone_b, rtol=1e-4, atol=1e-4)


def rewrite_lora(src, dst, *, kv=None, drop=None, tensors=None):
    with gguf.GGUFReader(src) as f:
        w = gguf.GGUFWriter()
        for k, v in f.kv.items():
            if kv and k in kv:
                w.add_kv(k, kv[k])
            else:
                w.add_kv(k, v, f.kv_types[k], f.kv_array_types.get(k))
        for name, ti in f.tensors.items():
            if name == drop:
                continue
            if tensors and name in tensors:
                w.add_tensor(name, tensors[name])
            else:
                w.add_tensor(name, np.array(ti.data), ti.type, ti.ne)
    w.write(dst)
    return dst


@pytest.mark.parametrize("change, match", [
    ({"kv": {"general.architecture": "gemma3"}}, "architecture 'gemma3'"),
    ({"kv": {"general.type": "model"}}, "general.type"),
    ({"kv": {"adapter.type": "cvec"}}, "adapter.type"),
    ({"drop": "blk.0.attn_q.weight.lora_b"}, "missing 'blk.0.attn_q.weight.lora_b'"),
    ({"tensors": {"blk.0.attn_q.weight.lora_b": np.zeros((64, 3), np.float32)}}, "rank of lora_a"),
    ({"tensors": {"blk.0.attn_q.weight.lora_a": np.zeros((4, 32), np.float32)}}, "wrong shape"),
    ({"tensors": {"blk.7.attn_q.weight.lora_a": np.zeros((4, 64), np.float32)}}, "unexpected suffix|does not exist"),
])
def test_bad_adapters_name_the_file_and_tensor(files, model, tmp_path, change, match):
    if "tensors" in change and "blk.7.attn_q.weight.lora_a" in change["tensors"]:
        bad = tmp_path / "bad.gguf"
        write_lora(bad, "llama", {"blk.7.attn_q.weight": (np.zeros((4, 64)), np.zeros((64, 4)))})
    else:
        bad = rewrite_lora(files["one"], tmp_path / "bad.gguf", **change)
    with pytest.raises(ModelLoadError, match=match) as e:
        adapter_lora_init(model, bad)
    assert "bad.gguf" in str(e.value)


def test_truncated_adapter_is_a_load_error(files, model, tmp_path):
    data = files["one"].read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        adapter_lora_init(model, bad)


def test_set_adapters_checks_its_arguments(files, model):
    ctx = llm.Context(model, n_ctx=64, n_seq_max=2)
    adapter = adapter_lora_init(model, files["one"])
    with pytest.raises(ValueError, match="1 adapters but 2 scales"):
        ctx.set_adapters_lora([adapter], [1.0, 2.0])
    with pytest.raises(ValueError, match="finite"):
        ctx.set_adapters_lora([adapter], [float("nan")])
    with pytest.raises(TypeError, match="LoraAdapter"):
        ctx.set_adapters_lora([str(files["one"])], [1.0])
    other = llm.load_model(files["base"])
    with pytest.raises(ValueError, match="another model"):
        ctx.set_adapters_lora([adapter_lora_init(other, files["one"])], [1.0])
    ctx.set_adapters_lora([adapter], [1.0])
    with pytest.raises(ValueError, match="seq_id 5"):
        ctx.set_adapter_scales_seq(5, [1.0])
    with pytest.raises(ValueError, match="2 scales for 1 adapters"):
        ctx.set_adapter_scales_seq(0, [1.0, 1.0])


@pytest.mark.slow
def test_llm_with_an_adapter_generates_as_the_merged_model(files):
    merged = files["dir"] / "merged-llm.gguf"
    fuse(files["base"], merged, [(files["one"], 0.6)])
    kw = dict(temperature=0.0)
    want = llm.LLM(merged, n_ctx=128, n_seq_max=2).generate(prompt_tokens(6), 12, temperature=0.0).tokens
    bare = llm.LLM(files["base"], n_ctx=128, n_seq_max=2)
    base_tokens = bare.generate(prompt_tokens(6), 12, temperature=0.0).tokens
    m = llm.LLM(files["base"], lora=[(files["one"], 0.6)], n_ctx=128, n_seq_max=2)
    assert [a.path for a in m.adapters] == [str(files["one"])]
    assert m.generate(prompt_tokens(6), 12, **kw).tokens == want
    assert m.generate(prompt_tokens(6), 12, lora=[0.0], **kw).tokens == base_tokens    # per call: off
    both = m.generate([prompt_tokens(6), prompt_tokens(6)], 12, **kw)                   # batched
    assert [c.tokens for c in both] == [want, want]
    m.set_adapters_lora([], [])
    assert m.generate(prompt_tokens(6), 12, **kw).tokens == base_tokens
    with pytest.raises(ValueError, match="lora"):
        bare.generate(prompt_tokens(6), 4, lora=[1.0])          # no adapters to scale


@pytest.mark.slow
def test_jobs_with_different_adapter_scales_batch_together(files):
    from llm.generation.batcher import Batcher, Job
    from llm.generation.core import Delta, GenParams
    from llm.sampling.samplers import SamplingParams
    m = llm.LLM(files["base"], lora=[(files["one"], 1.0)], n_ctx=128, n_seq_max=2)
    greedy = SamplingParams(temp=0.0)

    def run(*scales):
        b = Batcher(m.ctx, m.vocab)
        sinks = [[] for _ in scales]
        for s, sink in zip(scales, sinks, strict=True):
            b.submit(Job(prompt_tokens(7, seed=4), GenParams(max_tokens=10, sampling=greedy, lora=s), sink.append))
        while not b.idle:
            b.step()
        return [[t for e in sink if isinstance(e, Delta) for t in e.tokens] for sink in sinks]

    (on,), (off,) = run((1.0,)), run((0.0,))
    assert on != off
    assert run((1.0,), (0.0,)) == [on, off]


@pytest.mark.slow
def test_expert_adapters_match_the_merged_weights(tmp_path):
    """build_lora_mm_id: a pair per expert ([n_in, r, n_expert] and [r, n_out, n_expert]) on the
    experts of a MoE model, and the router through build_lora_mm."""
    from pathlib import Path
    base = Path(__file__).parent / "data" / "fixtures" / "qwen3moe-F32.gguf"
    rng = np.random.default_rng(7)
    pairs = {}
    for name, (n_in, n_out) in (("blk.0.ffn_up_exps.weight", (64, 32)), ("blk.1.ffn_down_exps.weight", (32, 64)),
                                ("blk.0.ffn_gate_exps.weight", (64, 32))):
        pairs[name] = (rng.standard_normal((4, RANK, n_in)) * 0.3, rng.standard_normal((4, n_out, RANK)) * 0.3)
    pairs["blk.1.ffn_gate_inp.weight"] = (rng.standard_normal((RANK, 64)) * 0.3, rng.standard_normal((4, RANK)) * 0.3)
    adapter = tmp_path / "moe.gguf"
    write_lora(adapter, "qwen3moe", pairs, alpha=2.0)
    merged = tmp_path / "merged.gguf"
    assert fuse(base, merged, [(adapter, 0.7)]) == 4
    model = llm.load_model(base)
    tokens = prompt_tokens(8, seed=5)
    got = logits_of(model, tokens, adapters=[adapter_lora_init(model, adapter)], scales=[0.7])
    want = logits_of(llm.load_model(merged), tokens)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert np.abs(got - logits_of(model, tokens)).max() > 0.05


@pytest.mark.slow
def test_control_vectors_compose_with_adapters(files):
    from llm import cvec
    directions = {il: np.random.default_rng(il).standard_normal(SPEC.n_embd).astype(np.float32) for il in (1,)}
    cv = files["dir"] / "cvec.gguf"
    cvec.write(cv, directions, arch="llama")
    merged = files["dir"] / "merged-cvec.gguf"
    fuse(files["base"], merged, [(files["one"], 1.0)])
    kw = dict(temperature=0.0)
    want_m = llm.LLM(merged, n_ctx=128)
    want = want_m.generate(prompt_tokens(6), 10, interventions=want_m.control_vector([(cv, 2.0)]), **kw).tokens
    m = llm.LLM(files["base"], lora=[(files["one"], 1.0)], n_ctx=128)
    got = m.generate(prompt_tokens(6), 10, interventions=m.control_vector([(cv, 2.0)]), **kw).tokens
    plain = m.generate(prompt_tokens(6), 10, **kw).tokens
    assert got == want and got != plain

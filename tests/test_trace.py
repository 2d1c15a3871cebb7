"""LLM.trace / interventions / gradient / logit lens on tiny generated models (tests/tiny_model.py)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from tiny_model import TinySpec, prompt_tokens, write_model

import llm
from ggmlx.compile import get_default_cache
from llm.research.trace import patch

N = 7


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny(request, tmp_path_factory):
    spec = TinySpec(arch=request.param, n_layer=2, n_head_kv=2 if request.param == "llama" else 1, seed=5)
    path = write_model(tmp_path_factory.mktemp("trace") / f"tiny-{request.param}.gguf", spec)
    return llm.LLM(str(path), n_ctx=64)


@pytest.fixture(scope="module")
def toks():
    return prompt_tokens(N)


def plain_logits(m: llm.LLM, tokens, flash_attn=True) -> np.ndarray:
    m.ctx.memory_clear()
    m.ctx.flash_attn = flash_attn
    try:
        assert m.ctx.decode(llm.Batch(tokens, logits=np.ones(len(tokens), bool))) == 0
        return m.ctx.get_logits().copy()
    finally:
        m.ctx.flash_attn = True
        m.ctx.memory_clear()


@pytest.mark.slow
def test_trace_shapes_names_and_logits(tiny, toks):
    tr = tiny.trace(toks, capture=["l_out-*", "attn_norm-1", "Vcur-0", "result_output"])
    hp = tiny.model.hparams
    assert tr.tokens == toks
    assert tr.names == ["Vcur-0", "l_out-0", "attn_norm-1", "l_out-1", "result_output"]
    assert tr["l_out-0"].shape == (N, hp.n_embd)
    assert tr["Vcur-0"].shape == (N, hp.n_embd_v_gqa(0))
    assert tr.logits.shape == (N, hp.n_vocab)
    assert np.array_equal(tr["result_output"], tr.logits)
    diff = np.abs(tr.logits - plain_logits(tiny, toks)).max()
    print(f"\n{tiny.model.arch}: traced vs untraced logits max |d| = {diff:.3g}")
    assert diff <= 1e-5
    assert tr.flash_attn is True and "Trace: 7 tokens" in repr(tr)


def test_result_output_equals_get_logits_ith(tiny, toks):
    tr = tiny.trace(toks, capture=["result_output"], flash_attn=True)
    m = tiny
    m.ctx.memory_clear()
    assert m.ctx.decode(llm.Batch(toks, logits=np.ones(N, bool))) == 0
    for i in range(N):
        assert np.abs(tr["result_output"][i] - m.ctx.get_logits_ith(i)).max() <= 1e-5
    m.ctx.memory_clear()


@pytest.mark.slow
def test_trace_over_several_ubatches_concatenates_rows(tmp_path, toks):
    path = write_model(tmp_path / "tiny.gguf", TinySpec(arch="llama", n_layer=2, seed=5))
    one = llm.LLM(str(path), n_ctx=64).trace(toks, capture=["l_out-1", "kq_soft_max-1"])
    split = llm.LLM(str(path), n_ctx=64, n_batch=3, n_ubatch=3).trace(toks, capture=["l_out-1", "kq_soft_max-1"])
    assert split["l_out-1"].shape == one["l_out-1"].shape == (N, 64)
    assert np.abs(split["l_out-1"] - one["l_out-1"]).max() < 1e-4
    assert split["kq_soft_max-1"].shape == one["kq_soft_max-1"].shape
    assert np.abs(split["kq_soft_max-1"] - one["kq_soft_max-1"]).max() < 1e-5


@pytest.mark.slow
def test_attention_probabilities_are_causal_rows(tiny, toks):
    tr = tiny.trace(toks, capture=["kq_soft_max-*"])
    assert tr.flash_attn is False
    p = tr["kq_soft_max-0"]
    assert p.shape == (tiny.model.hparams.n_head(0), N, N)
    assert np.allclose(p.sum(-1), 1.0, atol=1e-5)
    assert np.all(np.triu(p, 1) == 0)
    diff = np.abs(tr.logits - plain_logits(tiny, toks)).max()
    assert diff < 1e-4      # the unfused path computes the same attention


def test_unknown_node_lists_close_names(tiny, toks):
    with pytest.raises(ValueError, match=r"no node matches 'l_outt-1'.*l_out-1"):
        tiny.trace(toks, capture=["l_outt-1"])
    with pytest.raises(ValueError, match="no node matches 'attn_out-99'"):
        tiny.trace(toks, interventions={"attn_out-99": lambda x: x})


@pytest.mark.slow
def test_identity_and_steering_interventions(tiny, toks):
    base = tiny.trace(toks, capture=["l_out-*"], flash_attn=True)
    same = tiny.trace(toks, capture=["l_out-*"], interventions={"l_out-0": lambda x: x}, flash_attn=True)
    diff = np.abs(same.logits - base.logits).max()
    print(f"\n{tiny.model.arch}: identity intervention logits max |d| = {diff:.3g}")
    assert diff <= 1e-5
    v = np.linspace(-1, 1, tiny.model.hparams.n_embd).astype(np.float32)
    steered = tiny.trace(toks, capture=["l_out-*"], interventions={"l_out-0": lambda x: x + 4.0 * v})
    assert np.abs(steered["l_out-0"] - (base["l_out-0"] + 4.0 * v)).max() < 1e-4   # captured after the edit
    assert np.abs(steered["l_out-1"] - base["l_out-1"]).max() > 1e-2               # consumers see x'


@pytest.mark.slow
def test_layer_pattern_fn_gets_layer_index(tiny, toks):
    seen = []

    def fn(x, il):
        seen.append(il)
        return x * (1.0 + il)
    base = tiny.trace(toks, capture=["l_out-*"])
    tr = tiny.trace(toks, capture=["l_out-*"], interventions={"l_out-*": fn})
    assert sorted(set(seen)) == [0, 1]
    assert np.allclose(tr["l_out-0"], base["l_out-0"], atol=1e-5)


@pytest.mark.slow
def test_head_ablation_zeroes_its_slice(tiny, toks):
    hp = tiny.model.hparams
    d = hp.n_embd_head_v
    ablate = lambda x: x.at[:, d:2 * d].set(0.0)  # noqa: E731
    tr = tiny.trace(toks, capture=["kqv_out-1", "result_output"], interventions={"kqv_out-1": ablate})
    base = tiny.trace(toks, capture=["kqv_out-1"])
    assert np.all(tr["kqv_out-1"][:, d:2 * d] == 0)
    assert np.array_equal(tr["kqv_out-1"][:, :d], base["kqv_out-1"][:, :d])
    assert np.abs(tr.logits - base.logits).max() > 1e-4


@pytest.mark.slow
def test_activation_patching_all_positions_gives_the_source_run(tiny, toks):
    other = prompt_tokens(N, seed=9)
    src = tiny.trace(other, capture=["l_out-0"])
    out = tiny.trace(toks, capture=["l_out-1"], interventions={"l_out-0": patch(src["l_out-0"])})
    assert np.abs(out.logits - src.logits).max() < 1e-4
    one = tiny.trace(toks, capture=["l_out-0"], interventions={"l_out-0": patch(src["l_out-0"], [3])})
    base = tiny.trace(toks, capture=["l_out-0"])
    assert np.array_equal(one["l_out-0"][3], src["l_out-0"][3])
    assert np.array_equal(one["l_out-0"][:3], base["l_out-0"][:3])


@pytest.mark.slow
def test_bad_interventions_raise_and_change_nothing(tiny, toks):
    m = tiny
    m.generate(toks, max_tokens=2, temperature=0.0)
    cached, used = list(m._cached), m.ctx.memory.cells.get_used()
    n_entries = len(get_default_cache())
    with pytest.raises(ValueError, match=r"l_out-0.*float32\[8, 3\].*float32\[8, 64\]"):
        m.trace(toks, interventions={"l_out-0": lambda x: x[:, :3]})
    with pytest.raises(ValueError, match=r"l_out-1.*int32"):
        m.trace(toks, interventions={"l_out-1": lambda x: x.astype(jnp.int32)})
    with pytest.raises(ValueError, match="l_out-0"):
        m.generate(toks, max_tokens=2, interventions={"l_out-0": lambda x: x[:1]})
    with pytest.raises(ValueError, match="must be callable"):
        m.trace(toks, interventions={"l_out-0": 3.0})
    assert len(get_default_cache()) == n_entries
    assert m._cached == cached and m.ctx.memory.cells.get_used() == used


@pytest.mark.slow
def test_steady_state_compiles_nothing(tiny, toks):
    cache = get_default_cache()
    fn = lambda x: x + 0.5  # noqa: E731
    for _ in range(2):
        misses = cache.stats.misses
        tiny.trace(toks, capture=["l_out-*", "attn_norm-0"], interventions={"l_out-0": fn})
    assert cache.stats.misses == misses
    for _ in range(2):
        misses = cache.stats.misses
        tiny.generate(toks, max_tokens=3, temperature=0.0, interventions={"l_out-1": fn})
    assert cache.stats.misses == misses
    other = lambda x: x + 0.5  # noqa: E731   (another object: compiled anew)
    tiny.trace(toks, capture=["l_out-*", "attn_norm-0"], interventions={"l_out-0": other})
    assert cache.stats.misses > misses


@pytest.mark.slow
def test_generation_with_interventions_differs_and_resets_cache(tiny, toks):
    plain = tiny.generate(toks, max_tokens=4, temperature=0.0)
    v = np.full(tiny.model.hparams.n_embd, 3.0, np.float32)
    steer = tiny.generate(toks, max_tokens=4, temperature=0.0, interventions={"l_out-0": lambda x: x + v})
    again = tiny.generate(toks, max_tokens=4, temperature=0.0)
    assert again.tokens == plain.tokens
    tr = tiny.trace(toks, capture=["l_out-0"], interventions={"l_out-0": lambda x: x + v})
    assert steer.tokens[0] == int(np.argmax(tr.logits[-1]))


@pytest.mark.slow
def test_dump_shows_inserted_nodes(tiny, toks):
    m = tiny
    edits_fn = lambda x: x * 2.0  # noqa: E731
    m.trace(toks, capture=["l_out-1"], interventions={"attn_norm-1": edits_fn})
    g, plan = m.trace_context(N).last_graph
    text = g.gf.dump_text(plan.backend_name)
    assert "MAP_CUSTOM1" in text and "attn_norm-1 (intervention)" in text


@pytest.mark.slow
def test_gradient_matches_central_differences(tiny, toks):
    m = tiny
    target = (N - 1, 17)
    grads = m.gradient(toks, target, wrt=["l_out-0", "inp_embd"])
    assert grads["l_out-0"].shape == (N, m.model.hparams.n_embd)
    assert grads["inp_embd"].shape == (N, m.model.hparams.n_embd)
    rng = np.random.default_rng(0)
    eps = 1e-3          # a step of 1e-3 relative to each row's RMS
    x = m.trace(toks, capture=["l_out-0", "inp_embd"])
    for name in ("l_out-0", "inp_embd"):
        rms = np.sqrt(np.mean(x[name] ** 2, axis=1, keepdims=True))
        d = (rng.standard_normal(grads[name].shape) * rms).astype(np.float32)

        def f(s, d=d, name=name):
            fn = lambda x: x.at[:N].add(s * eps * d)  # noqa: E731
            return float(m.trace(toks, capture=[], interventions={name: fn}, flash_attn=True).logits[target])
        fd = (f(1.0) - f(-1.0)) / (2 * eps)
        an = float((grads[name] * d).sum())
        rel = abs(fd - an) / max(abs(an), 1e-6)
        print(f"\n{m.model.arch} {name}: analytic {an:.6g} central FD {fd:.6g} rel {rel:.2e}")
        assert rel < 1e-2


@pytest.mark.slow
def test_gradient_of_a_function_target_and_saliency(tiny, toks):
    m = tiny
    lp = lambda logits: jax_log_softmax(logits)[N - 1, 17]  # noqa: E731
    g = m.gradient(toks, lp, wrt="inp_embd")
    assert g["inp_embd"].shape == (N, m.model.hparams.n_embd) and np.abs(g["inp_embd"]).max() > 0
    s = m.saliency(toks, (N - 1, 17))
    assert s.shape == (N,) and np.isfinite(s).all()


def jax_log_softmax(x):
    import jax
    return jax.nn.log_softmax(x, axis=-1)


def test_bad_gradient_targets(tiny, toks):
    n_vocab = tiny.model.n_vocab
    with pytest.raises(ValueError, match=f"token {n_vocab} is outside"):
        tiny.gradient(toks, (0, n_vocab))
    with pytest.raises(ValueError, match="position 7 is outside"):
        tiny.gradient(toks, (7, 1))
    with pytest.raises(ValueError, match=r"scalar.*\[7, 512\]"):
        tiny.gradient(toks, lambda logits: logits[0])
    with pytest.raises(ValueError, match="no node matches"):
        tiny.gradient(toks, (0, 1), wrt=["nope-1"])


@pytest.mark.slow
def test_logit_lens(tiny, toks):
    tr = tiny.trace(toks, capture=["l_out-*"])
    lens = tr.logit_lens(top_k=3, token=17)
    assert lens.layers == [0, 1]
    assert lens.top_ids.shape == (2, N, 3) and lens.token_rank.shape == (2, N)
    # the last layer read through the head is the model's own output
    assert np.array_equal(lens.top_ids[-1, :, 0], tr.logits.argmax(-1))
    assert np.all(lens.top_probs[:, :, 0] >= lens.top_probs[:, :, 1])
    assert "LogitLens" in repr(lens)
    with pytest.raises(ValueError, match="l_out"):
        tiny.trace(toks, capture=["attn_norm-0"]).logit_lens()

"""The recurrent memory on the Mamba-2 fixture (llama.cpp-proven in test_arch_fixtures):
several sequences in one batch, ubatch splitting, the sequence operations llama.cpp allows
and refuses, and graph reuse in steady state."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

import llm
from llm.kv_cache import KVCache
from llm.memory_hybrid import MemoryHybrid
from llm.memory_recurrent import MemoryRecurrent

FIXTURES = Path(__file__).parent / "data" / "fixtures"
TOL = 1e-4


@pytest.fixture(scope="module")
def model():
    return llm.load_model(FIXTURES / "mamba2-F32.gguf")


@pytest.fixture(scope="module")
def hybrid():
    return llm.load_model(FIXTURES / "granitehybrid-F32.gguf")


@pytest.fixture(scope="module")
def shortconv():
    """LFM2: short-convolution states only (no SSM state) beside attention layers."""
    return llm.load_model(FIXTURES / "lfm2-F32.gguf")


@pytest.fixture(scope="module")
def parallel():
    """Falcon-H1: attention and a Mamba-2 block in every layer (each layer in both memories)."""
    return llm.load_model(FIXTURES / "falcon-h1-F32.gguf")


# the further families run in the slow tier (~10 s each on a loaded 2-core machine)
SHORTCONV = pytest.param("shortconv", marks=pytest.mark.slow)
PARALLEL = pytest.param("parallel", marks=pytest.mark.slow)


@pytest.fixture(scope="module")
def delta():
    """Qwen3.5: Gated DeltaNet layers with a gated attention layer."""
    return llm.load_model(FIXTURES / "qwen35-F32.gguf")


def tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 500, n).astype(np.int32)


def alone(model, toks: np.ndarray, **kw) -> np.ndarray:
    ctx = llm.Context(model, n_ctx=512, **kw)
    assert ctx.decode(llm.Batch(toks, logits=np.ones(len(toks), bool))) == 0, ctx.last_error
    return ctx.get_logits().copy()


def test_context_holds_a_recurrent_memory(model):
    ctx = llm.Context(model, n_ctx=64, n_seq_max=3)
    mem = ctx.memory
    assert isinstance(mem, MemoryRecurrent) and mem.mem_attn is None
    hp = model.hparams
    # one conv and one SSM state per sequence (plus the scratch cell) in each layer, nothing per token
    assert mem.nbytes == hp.n_layer * (hp.n_embd_r() + hp.n_embd_s()) * 4 * (3 + 1)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["model", "hybrid", "delta", SHORTCONV, PARALLEL])
def test_sequences_of_different_lengths_in_one_batch_match_each_alone(name, request):
    model = request.getfixturevalue(name)
    seqs = [tokens(n, s) for n, s in ((13, 1), (7, 2), (3, 3))]
    ctx = llm.Context(model, n_ctx=64, n_seq_max=3)
    toks = np.concatenate(seqs)
    seq_id = [s for s, t in enumerate(seqs) for _ in t]
    assert ctx.decode(llm.Batch(toks, seq_id=seq_id, logits=np.ones(len(toks), bool))) == 0, ctx.last_error
    together = ctx.get_logits()
    start = 0
    for t in seqs:
        ref = alone(model, t)
        assert np.abs(together[start:start + len(t)] - ref).max() <= TOL
        start += len(t)
    # then one decode step of all three at once continues each as alone
    nxt = np.array([5, 6, 7], np.int32)
    assert ctx.decode(llm.Batch(nxt, seq_id=[0, 1, 2], logits=np.ones(3, bool))) == 0
    for s, t in enumerate(seqs):
        assert np.abs(ctx.get_logits_ith(s) - alone(model, np.append(t, nxt[s]))[-1]).max() <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("name", ["model", "hybrid", "delta", SHORTCONV, PARALLEL])
def test_a_long_prompt_in_small_ubatches_equals_one_ubatch(name, request):
    model = request.getfixturevalue(name)
    toks = tokens(300, 4)
    one = alone(model, toks, n_ubatch=512, n_batch=512)
    small = alone(model, toks, n_ubatch=64, n_batch=512)
    assert np.abs(one - small).max() <= TOL


@pytest.mark.slow
def test_decode_compiles_nothing_in_steady_state(model):
    ctx = llm.Context(model, n_ctx=256)
    assert ctx.decode(llm.Batch(tokens(20, 5))) == 0
    for t in range(3):
        assert ctx.decode(llm.Batch([7 + t])) == 0
    n = ctx.perf()["n_compiles"]
    for t in range(20):
        assert ctx.decode(llm.Batch([9 + t])) == 0
    assert ctx.perf()["n_compiles"] == n


@pytest.mark.slow
def test_seq_rm_of_a_tail_is_refused_and_changes_nothing(model):
    toks = tokens(10, 6)
    ctx = llm.Context(model, n_ctx=64, n_seq_max=2)
    assert ctx.decode(llm.Batch(toks)) == 0
    mem = ctx.memory
    assert mem.seq_pos_max(0) == 9 and mem.seq_pos_min(0) == 9
    before = {t: np.asarray(v) for t, v in mem.state().items()}
    assert mem.seq_rm(0, 5, -1) is False                 # a state cannot forget its last tokens
    assert mem.seq_pos_max(0) == 9
    assert all(np.array_equal(np.asarray(v), before[t]) for t, v in mem.state().items())
    assert mem.seq_rm(0, 10, -1) is True                 # nothing past the end: nothing to do
    assert mem.seq_rm(-1, 3, 7) is False                 # every sequence, a part: refused
    assert mem.seq_rm(0, -1, -1) is True and mem.seq_pos_max(0) == -1
    # a sequence removed whole starts again from zero states
    assert ctx.decode(llm.Batch(toks, logits=np.ones(10, bool))) == 0
    assert np.abs(ctx.get_logits() - alone(model, toks)).max() <= TOL


@pytest.mark.slow
def test_seq_cp_copies_the_state(model):
    toks = tokens(8, 7)
    ctx = llm.Context(model, n_ctx=64, n_seq_max=2)
    assert ctx.decode(llm.Batch(toks, seq_id=[0] * 8)) == 0
    ctx.memory.seq_cp(0, 1)
    assert ctx.memory.seq_pos_max(1) == 7
    assert ctx.decode(llm.Batch([11, 11], seq_id=[0, 1], logits=[1, 1])) == 0
    assert np.abs(ctx.get_logits_ith(0) - ctx.get_logits_ith(1)).max() == 0
    ref = alone(model, np.append(toks, 11))[-1]
    assert np.abs(ctx.get_logits_ith(1) - ref).max() <= TOL
    ctx.memory.seq_keep(1)                               # seq 0's state is zeroed, seq 1's kept
    assert ctx.memory.seq_pos_max(0) == -1 and ctx.memory.seq_pos_max(1) == 8
    assert ctx.decode(llm.Batch([12], seq_id=[1])) == 0
    ref = alone(model, np.append(toks, [11, 12]))[-1]
    assert np.abs(ctx.get_logits_ith(0) - ref).max() <= TOL


def test_shared_tokens_and_bad_sequences_are_refused(model):
    ctx = llm.Context(model, n_ctx=64, n_seq_max=2)
    assert ctx.decode(llm.Batch([1, 2], seq_id=[[0, 1], [0, 1]])) == llm.DecodeStatus.INVALID_BATCH
    assert "one sequence" in ctx.last_error
    with pytest.raises(ValueError, match="seq_id = 5"):
        ctx.memory.seq_pos_max(5)
    assert ctx.memory.seq_rm(5) is False


@pytest.mark.slow
def test_positions_shift_without_touching_the_state(model):
    ctx = llm.Context(model, n_ctx=64)
    assert ctx.decode(llm.Batch(tokens(6, 8))) == 0
    ctx.memory.seq_add(0, 0, -1, 10)
    assert ctx.memory.seq_pos_max(0) == 15
    ctx.memory.seq_div(0, 0, -1, 2)
    assert ctx.memory.seq_pos_max(0) == 7
    assert ctx.decode(llm.Batch([4])) == 0 and ctx.memory.seq_pos_max(0) == 8


@pytest.mark.slow
def test_hybrid_memory_pairs_a_kv_cache_with_states(hybrid):
    ctx = llm.Context(hybrid, n_ctx=64, n_seq_max=2)
    mem = ctx.memory
    assert isinstance(mem, MemoryHybrid)
    assert isinstance(mem.mem_attn, KVCache) and isinstance(mem.mem_recr, MemoryRecurrent)
    hp = hybrid.hparams
    assert [mem.mem_recr.r_l[il] is not None for il in range(hp.n_layer)] == [True, False, True, False]
    assert all(mem.mem_attn.k_l[il].ne[0] == 0 for il in (0, 2))     # no K/V for the Mamba layers
    toks = tokens(10, 9)
    assert ctx.decode(llm.Batch(toks)) == 0
    assert mem.seq_pos_max(0) == 9 and mem.seq_pos_min(0) == 9        # the states' position
    assert mem.mem_attn.seq_pos_min(0) == 0
    used = mem.mem_attn.cells.get_used()
    assert mem.seq_rm(0, 4, -1) is False                 # refused by the recurrent part ...
    assert mem.mem_attn.cells.get_used() == used         # ... and the KV cells are unchanged
    assert mem.seq_rm(0, -1, -1) is True and mem.mem_attn.cells.get_used() == 0


@pytest.mark.slow
def test_server_batcher_on_a_recurrent_model(model):
    """The server's continuous batching: three prompts together give the tokens each gives
    alone; n=3 samples copy the prompt's state (seq_cp); slots are reused after their state
    is removed whole (a recurrent slot cannot keep a shorter prefix)."""
    from llm.generation.batcher import Batcher, Delta, GenParams, Job
    from llm.sampling import SamplingParams

    ctx = llm.Context(model, n_ctx=128, n_batch=64, n_ubatch=64, n_seq_max=4)
    b = Batcher(ctx, model.vocab)

    def run(jobs):
        sinks = []
        for toks, params in jobs:
            events: list = []
            sinks.append(events)
            b.submit(Job(toks, params, events.append))
        while not b.idle:
            b.step()
        return [[[t for e in ev if isinstance(e, Delta) and e.index == i for t in e.tokens]
                 for i in range(params.n)] for ev, (_, params) in zip(sinks, jobs, strict=True)]

    greedy = GenParams(max_tokens=6, sampling=SamplingParams(temp=0.0))
    prompts = [tokens(n, s) for n, s in ((8, 11), (16, 12), (12, 14))]
    alone = [run([(p, greedy)])[0][0] for p in prompts]
    together = run([(p, greedy) for p in prompts])
    assert [t[0] for t in together] == alone and all(len(a) == 6 for a in alone)
    # with drafts (prompts that repeat themselves: lookup drafts, mostly rejected) in one batch
    spec = dataclasses.replace(greedy, speculative="prompt-lookup")
    loops = [np.tile(p[:5], 3) for p in prompts]
    assert [t[0] for t in run([(p, spec) for p in loops])] == [run([(p, greedy)])[0][0] for p in loops]
    # a prompt that extends an earlier one starts its slot again from zero states
    longer = np.concatenate([prompts[1], tokens(4, 15)])
    ref = llm.Context(model, n_ctx=128)
    assert ref.decode(llm.Batch(longer)) == 0
    first, got = int(np.argmax(ref.get_logits_ith(-1))), run([(longer, greedy)])[0][0]
    assert got[:1] == [first] or (got == [] and model.vocab.is_eog(first))
    sampled = GenParams(max_tokens=5, n=3, sampling=SamplingParams(temp=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=3))
    samples = run([(prompts[0], sampled)])[0]
    assert all(len(s) == 5 for s in samples) and len({tuple(s) for s in samples}) > 1
    assert run([(prompts[0], sampled)])[0] == samples


class PartlyRightDrafter:
    """Drafts, after each output token, the next `n_right` tokens plain decoding gives, then
    wrong ones: each step keeps n_right drafts and rejects the rest, so the state goes back to
    its checkpoint and decodes the kept ones again."""
    def __init__(self, plain: list[int], n_prompt: int, n_vocab: int, n_right: int):
        self.plain, self.n_prompt, self.n_vocab, self.n_right = plain, n_prompt, n_vocab, n_right

    def draft(self, tokens: list[int], n_max: int) -> list[int]:
        i = len(tokens) - self.n_prompt
        right = self.plain[i:i + self.n_right]
        wrong = [(t + 1) % self.n_vocab for t in self.plain[i + len(right):]] or [0]
        return (right + wrong * n_max)[:n_max]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["model", "hybrid", "delta"])
def test_speculative_greedy_is_identical_on_a_recurrent_state(name, request):
    """Prompt lookup on a repetitive prompt, and drafters right for none or the first two of
    their tokens, give the tokens of plain greedy decoding, and the memory ends where the
    output does."""
    import itertools

    from llm.generation.speculative import Speculative
    from llm.sampling.samplers import SamplerChain, SamplingParams

    path = {"model": "mamba2", "hybrid": "granitehybrid", "delta": "qwen35"}[name]
    m = llm.LLM(str(FIXTURES / f"{path}-F32.gguf"), n_ctx=256)
    block = [int(t) for t in tokens(16, 31)]
    prompt = block * 3 + block[:5]
    plain = m.generate(prompt, max_tokens=24, temperature=0.0)
    spec = m.generate(prompt, max_tokens=24, temperature=0.0, speculative="prompt-lookup")
    assert spec.tokens == plain.tokens and spec.timings["spec_drafted"] > 0
    assert m.ctx.memory.seq_pos_max(0) + 1 == len(m._cached)
    for n_right in (0, 2):
        ctx = llm.Context(m.model, n_ctx=256)
        assert ctx.decode(llm.Batch(prompt, logits=[i == len(prompt) - 1 for i in range(len(prompt))])) == 0
        greedy = SamplerChain.from_params(SamplingParams(temp=0.0), n_vocab=m.model.n_vocab)
        sp = Speculative(ctx, greedy, PartlyRightDrafter(plain.tokens, len(prompt), m.model.n_vocab, n_right))
        assert list(itertools.islice(sp.tokens(prompt), 16)) == plain.tokens[:16], n_right
        assert sp.stats.n_drafted > sp.stats.n_accepted == n_right * (sp.stats.n_steps - 1 if n_right else 0) or \
            (n_right and sp.stats.n_accepted > 0)


def test_a_recurrent_draft_model_is_refused_by_name(model):
    m = llm.LLM(FIXTURES / "granitehybrid-F32.gguf")
    draft = llm.LLM(FIXTURES / "mamba2-F32.gguf")
    with pytest.raises(llm.params.ParamError, match="speculative.*draft model.*recurrent state"):
        m.generate("hello", max_tokens=4, speculative=draft)


def test_info_reports_the_memory_kind(capsys):
    from llm.cli import main
    for name, kind in (("mamba2", "recurrent"), ("granitehybrid", "hybrid")):
        assert main(["info", str(FIXTURES / f"{name}-F32.gguf")]) == 0
        out = capsys.readouterr().out
        assert f"memory: {kind}" in out and "MiB per sequence over 2 layers" in out
        assert ("KV cache" in out) == (kind == "hybrid")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["model", "hybrid", "delta", SHORTCONV, PARALLEL])
def test_state_save_and_restore_continue_identically(name, request, tmp_path):
    """A whole state and one sequence's state (its conv and SSM states, and for the hybrid its
    KV cells) restored into a fresh context continue exactly as the original."""
    model = request.getfixturevalue(name)
    toks = tokens(12, 21)
    ctx = llm.Context(model, n_ctx=64, n_seq_max=2)
    assert ctx.decode(llm.Batch(toks, seq_id=[1] * 12)) == 0
    ctx.state_seq_save_file(tmp_path / "seq.bin", 1, toks)
    ctx.state_save_file(tmp_path / "all.bin", toks)
    assert ctx.decode(llm.Batch([9], seq_id=[1])) == 0
    want = ctx.get_logits_ith(-1).copy()
    for kind in ("all", "seq"):
        fresh = llm.Context(model, n_ctx=64, n_seq_max=2)
        if kind == "all":
            assert fresh.state_load_file(tmp_path / "all.bin") == toks.tolist()
            dest = 1
        else:
            dest = 0                      # into another sequence
            assert fresh.state_seq_load_file(tmp_path / "seq.bin", dest) == toks.tolist()
        assert fresh.memory.seq_pos_max(dest) == 11
        assert fresh.decode(llm.Batch([9], seq_id=[dest])) == 0
        assert np.array_equal(fresh.get_logits_ith(-1), want), kind
    # a state of the other model is refused by its fingerprint, nothing changed
    other = llm.Context(request.getfixturevalue("hybrid" if name == "model" else "model"), n_ctx=64, n_seq_max=2)
    with pytest.raises(llm.StateError, match="another model"):
        other.state_load_file(tmp_path / "all.bin")


@pytest.mark.slow
def test_prompt_cache_reuses_a_whole_prefix_only(model, tmp_path):
    """A cached state serves a prompt that extends it; one that is longer than the shared
    prefix cannot be cut back (a state has no history) and is not used."""
    from llm.prompt_cache import PromptCache
    toks = tokens(10, 31)
    ctx = llm.Context(model, n_ctx=64)
    cache = PromptCache(tmp_path, ctx.fingerprint, min_tokens=2)
    assert ctx.decode(llm.Batch(toks)) == 0
    cache.store(toks, ctx.state_seq_get_data(0, toks))
    fresh = llm.Context(model, n_ctx=64)
    longer = np.concatenate([toks, tokens(3, 32)])
    assert cache.restore(fresh, longer) == 10 and fresh.memory.seq_pos_max(0) == 9
    assert fresh.decode(llm.Batch(longer[10:])) == 0
    assert np.abs(fresh.get_logits_ith(-1) - alone(model, longer)[-1]).max() <= TOL
    other = llm.Context(model, n_ctx=64)
    assert cache.restore(other, np.concatenate([toks[:6], tokens(4, 33)])) == 0
    assert other.memory.seq_pos_max(0) == -1


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mamba2", "mamba"])
def test_recurrent_cells_are_written_in_llamacpps_layout(arch):
    """A state's recurrent section is llama_memory_recurrent::state_write's layout. After the same
    6 tokens, our sequence bytes have llama.cpp's cell, type and row-size fields exactly and its
    conv / SSM values within 1e-5 (tests/data/state, benchmarks/reference/recurrent_state_llamacpp.py);
    and llama.cpp's own bytes, put into our sequence state, decode the fixture's other tokens to
    llama.cpp's logits."""
    import struct
    import zlib

    from llm import state
    ref = (Path(__file__).parent / "data" / "state" / f"{arch}-seq.bin").read_bytes()
    assert struct.unpack_from("<Ii", ref) == (0xAF143CD8, 0)          # io_magic, seq_id
    theirs = ref[8:]
    fx = np.load(FIXTURES / f"{arch}.npz")
    toks = [int(t) for t in fx["tokens_0"]]
    model = llm.load_model(FIXTURES / f"{arch}-F32.gguf")
    ctx = llm.Context(model, n_ctx=64)
    assert ctx.decode(llm.Batch(toks[:6])) == 0
    rs = ctx.memory.mem_recr
    ours = state.recurrent_state_write(rs, 0)
    assert len(ours) == len(theirs)
    at = 20            # cell_count 1, pos 5, n_seq_id 0, s_trans 0, n_layer
    assert ours[:at] == theirs[:at] and struct.unpack_from("<IiIII", ours) == (1, 5, 0, 0, model.hparams.n_layer)
    for t in rs._buffers():
        assert ours[at:at + 12] == theirs[at:at + 12], t.name      # type, row size
        n = 4 * t.ne[0]
        a, b = (np.frombuffer(x[at + 12:at + 12 + n], "<f4") for x in (ours, theirs))
        assert np.abs(a - b).max() <= 1e-5, t.name
        at += 12 + n
    ours_file = ctx.state_seq_get_data(0)
    body = ours_file[state._HEADER.size:-len(ours)] + theirs
    header = state._HEADER.pack(state.MAGIC, state.VERSION, state.KIND_SEQ, len(body), zlib.crc32(body))
    fresh = llm.Context(model, n_ctx=64)
    fresh.state_seq_set_data(header + body, 0)
    assert fresh.decode(llm.Batch(toks[6:], pos=list(range(6, len(toks))), logits=[True] * (len(toks) - 6))) == 0
    assert np.abs(fresh.get_logits() - fx["logits_0"][6:]).max() <= 1e-4

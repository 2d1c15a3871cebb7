"""Saved context state (llm.state through Context.state_*) on tiny generated models: exact round
trips (whole context, one and several sequences, F32 and F16 caches, sampler RNG), and bad
files (truncated, flipped bytes, wrong magic / version / model, too large, bad seq_id), each a
StateError naming the file that leaves the context unchanged; plus a 1,000-file fuzz."""
from __future__ import annotations

import struct

import numpy as np
import pytest
from tiny_model import TinySpec, prompt_tokens, write_model

import llm
from llm import state
from llm.sampling.samplers import SamplerChain, SamplingParams

N_CTX = 64
TOKENS = prompt_tokens(24)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return llm.load_model(write_model(tmp_path_factory.mktemp("m") / "tiny.gguf", TinySpec(seed=3)))


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    return llm.load_model(write_model(tmp_path_factory.mktemp("o") / "other.gguf", TinySpec(seed=3, n_ff=96)))


def new_ctx(model, **kw) -> llm.Context:
    return llm.Context(model, **{"n_ctx": N_CTX, "kv_bucket": N_CTX, **kw})


def prefill(ctx, tokens, seq_id=0, pos0=0) -> None:
    flags = np.zeros(len(tokens), bool)
    flags[-1] = True
    batch = llm.Batch(tokens, pos=np.arange(pos0, pos0 + len(tokens)), seq_id=[[seq_id]] * len(tokens), logits=flags)
    assert ctx.decode(batch) == 0, ctx.last_error


def step(ctx, token, pos, seq_id=0) -> np.ndarray:
    assert ctx.decode(llm.Batch([token], pos=[pos], seq_id=[[seq_id]], logits=[True])) == 0, ctx.last_error
    return ctx.get_logits_ith(-1).copy()


def greedy_run(ctx, pos, n=4, seq_id=0) -> list[np.ndarray]:
    """n greedy steps from the current logits; the logits of each step."""
    out = []
    logits = ctx.get_logits_ith(-1).copy()
    for i in range(n):
        logits = step(ctx, int(np.argmax(logits)), pos + i, seq_id)
        out.append(logits)
    return out


def snapshot(ctx):
    cells = ctx.memory.cells
    return (ctx.logits.copy(), cells.get_used(), cells.pos.copy(), cells.seq.copy(),
            [np.asarray(t.data).copy() for t in ctx.memory.k_l + ctx.memory.v_l])


def assert_same(a, b) -> None:
    np.testing.assert_array_equal(a[0], b[0])
    assert a[1] == b[1]
    np.testing.assert_array_equal(a[2], b[2])
    np.testing.assert_array_equal(a[3], b[3])
    for x, y in zip(a[4], b[4], strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("cache", ["f32", "f16"])
@pytest.mark.slow
def test_file_round_trip_is_exact(model, tmp_path, cache):
    ctx = new_ctx(model, type_k=cache, type_v=cache)
    prefill(ctx, TOKENS)
    before = ctx.get_logits_ith(-1).copy()
    path = tmp_path / "s.bin"
    ctx.state_save_file(path, TOKENS)
    expected = greedy_run(ctx, len(TOKENS))

    fresh = new_ctx(model, type_k=cache, type_v=cache)
    prefill(fresh, prompt_tokens(5, seed=9))          # something to be replaced
    assert fresh.state_load_file(path) == TOKENS
    assert np.abs(fresh.get_logits_ith(-1) - before).max() == 0
    assert fresh.memory.cells.get_used() == len(TOKENS)
    for got, want in zip(greedy_run(fresh, len(TOKENS)), expected, strict=True):
        assert np.abs(got - want).max() == 0


@pytest.mark.slow
def test_get_set_data_and_sampler_rng(model):
    ctx = new_ctx(model)
    prefill(ctx, TOKENS)
    chain = SamplerChain.from_params(SamplingParams(seed=42), n_vocab=model.n_vocab)
    chain.sample(ctx)                                   # advance the RNG
    data = ctx.state_get_data(TOKENS, sampler=chain)
    want = [chain.sample(ctx) for _ in range(5)]
    twin = SamplerChain.from_params(SamplingParams(seed=7), n_vocab=model.n_vocab)
    fresh = new_ctx(model)
    assert fresh.state_set_data(data, sampler=twin) == TOKENS
    assert [twin.sample(fresh) for _ in range(5)] == want


@pytest.mark.parametrize("cache", ["f32", "f16"])
@pytest.mark.slow
def test_seq_round_trip_several_sequences(model, tmp_path, cache):
    ctx = new_ctx(model, n_seq_max=3, type_k=cache, type_v=cache)
    a, b = TOKENS[:12], prompt_tokens(10, seed=5)
    prefill(ctx, a, seq_id=0)
    prefill(ctx, b, seq_id=1)
    ctx.state_seq_save_file(tmp_path / "a.bin", 0, a)
    ctx.state_seq_save_file(tmp_path / "b.bin", 1, b)
    want_a = step(ctx, 7, len(a), 0)
    want_b = step(ctx, 9, len(b), 1)

    fresh = new_ctx(model, n_seq_max=3, type_k=cache, type_v=cache)
    assert fresh.state_seq_load_file(tmp_path / "a.bin", 0) == a
    assert fresh.state_seq_load_file(tmp_path / "b.bin", 2) == b       # into another seq id
    assert fresh.memory.seq_pos_max(0) == len(a) - 1 and fresh.memory.seq_pos_max(2) == len(b) - 1
    assert np.abs(step(fresh, 7, len(a), 0) - want_a).max() == 0
    assert np.abs(step(fresh, 9, len(b), 2) - want_b).max() == 0
    # loading again over a sequence replaces it
    assert fresh.state_seq_load_file(tmp_path / "a.bin", 0) == a
    assert fresh.memory.seq_pos_max(0) == len(a) - 1


@pytest.mark.slow
def test_atomic_write_leaves_no_temp_file(model, tmp_path):
    ctx = new_ctx(model)
    prefill(ctx, TOKENS)
    path = tmp_path / "s.bin"
    path.write_bytes(b"old")
    ctx.state_save_file(path, TOKENS)
    assert [p.name for p in tmp_path.iterdir()] == ["s.bin"]
    assert path.read_bytes()[:8] == state.MAGIC


# ---- bad input -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    ctx = new_ctx(model, n_seq_max=2)
    prefill(ctx, TOKENS)
    d = tmp_path_factory.mktemp("saved")
    ctx.state_save_file(d / "full.bin", TOKENS)
    ctx.state_seq_save_file(d / "seq.bin", 0, TOKENS)
    return d


@pytest.fixture()
def victim(model):
    """A context with its own state, which every failed load must leave as it was."""
    ctx = new_ctx(model, n_seq_max=2)
    prefill(ctx, prompt_tokens(9, seed=11), seq_id=1)
    return ctx


def with_header(data: bytes, **fields) -> bytes:
    magic, version, kind, n_body, crc = state._HEADER.unpack_from(data)
    vals = {**dict(magic=magic, version=version, kind=kind, n_body=n_body, crc=crc), **fields}
    return state._HEADER.pack(*vals.values()) + data[state._HEADER.size:]


def expect_state_error(ctx, path, match, seq=False):
    before = snapshot(ctx)
    with pytest.raises(llm.StateError, match=match) as e:
        if seq:
            ctx.state_seq_load_file(path, 0)
        else:
            ctx.state_load_file(path)
    assert str(path) in str(e.value)
    assert_same(before, snapshot(ctx))


@pytest.mark.parametrize("name,mutate,match", [
    ("truncated", lambda d: d[:len(d) // 2], "truncated"),
    ("header-only", lambda d: d[:10], "truncated"),
    ("empty", lambda d: b"", "truncated"),
    ("trailing", lambda d: d + b"\0\0", "trailing"),
    ("flipped", lambda d: d[:200] + bytes([d[200] ^ 0x10]) + d[201:], "checksum"),
    ("flipped-last", lambda d: d[:-1] + bytes([d[-1] ^ 1]), "checksum"),
    ("magic", lambda d: b"GGUF" + d[4:], "not a ggmlx state"),
    ("version", lambda d: with_header(d, version=99), "version 99"),
    ("kind", lambda d: with_header(d, kind=state.KIND_SEQ), "sequence state"),
])
def test_bad_file_raises_and_changes_nothing(saved, victim, tmp_path, name, mutate, match):
    path = tmp_path / f"{name}.bin"
    path.write_bytes(mutate((saved / "full.bin").read_bytes()))
    expect_state_error(victim, path, match)


def test_other_model_fingerprint(saved, other_model, tmp_path):
    ctx = new_ctx(other_model)
    expect_state_error(ctx, saved / "full.bin", "another model")


def test_wrong_cache_type(saved, model):
    expect_state_error(new_ctx(model, n_seq_max=2, type_k="f16"), saved / "full.bin", "type_k")


def test_too_large_for_context(saved, model):
    small = new_ctx(model, n_ctx=16, kv_bucket=16, n_seq_max=2)
    expect_state_error(small, saved / "full.bin", "too large|n_ctx")
    expect_state_error(small, saved / "seq.bin", "too large|n_ctx|do not fit", seq=True)


def test_crafted_counts_are_checked_before_allocating(saved, victim, tmp_path):
    """A body with a valid checksum but a huge token count must fail on the count."""
    data = (saved / "full.bin").read_bytes()
    body = bytearray(data[state._HEADER.size:])
    off = 32 + 3 * 4
    body[off:off + 4] = struct.pack("<I", 0xFFFFFFF0)
    path = tmp_path / "crafted.bin"
    path.write_bytes(with_header(data[:state._HEADER.size] + bytes(body), crc=state.zlib.crc32(bytes(body))))
    expect_state_error(victim, path, "n_tokens")


def test_bad_seq_ids(saved, victim, model):
    before = snapshot(victim)
    with pytest.raises(llm.StateError, match="dest_seq_id"):
        victim.state_seq_load_file(saved / "seq.bin", 5)
    with pytest.raises(llm.StateError, match="seq_id"):
        victim.state_seq_get_data(7)
    assert_same(before, snapshot(victim))
    with pytest.raises(llm.StateError, match="sequence state|full context"):
        victim.state_seq_load_file(saved / "full.bin", 0)
    assert_same(before, snapshot(victim))


def test_missing_file(victim, tmp_path):
    with pytest.raises(llm.StateError, match="cannot read"):
        victim.state_load_file(tmp_path / "nope.bin")


def test_fuzz_1000_mutated_files_only_state_error(saved, victim, tmp_path):
    rng = np.random.default_rng(0)
    good = (saved / "full.bin").read_bytes()
    before = snapshot(victim)
    path = tmp_path / "fuzz.bin"
    for i in range(1000):
        data = bytearray(good)
        kind = i % 4
        if kind == 0:                                  # flip 1-8 random bytes
            for at in rng.integers(0, len(data), rng.integers(1, 9)):
                data[at] ^= int(rng.integers(1, 256))
        elif kind == 1:                                # truncate
            data = data[:int(rng.integers(0, len(data)))]
        elif kind == 2:                                # random bytes spliced in
            at = int(rng.integers(0, len(data)))
            data[at:at] = rng.bytes(int(rng.integers(1, 64)))
        else:                                          # header field rewritten, checksum kept
            at = int(rng.integers(0, state._HEADER.size))
            data[at] ^= int(rng.integers(1, 256))
        path.write_bytes(bytes(data))
        with pytest.raises(llm.StateError):
            victim.state_load_file(path)
    assert_same(before, snapshot(victim))


def test_slot_path_accepts_only_plain_names(tmp_path):
    assert state.slot_path(tmp_path, "slot0.bin") == tmp_path / "slot0.bin"
    for bad in ["", "..", "../x", "a/b", "a\\b", "c:x", "x\0", " x", 5, "x" * 300]:
        with pytest.raises(llm.StateError, match="plain file name"):
            state.slot_path(tmp_path, bad)

"""llm.sampling against llama.cpp's tests/test-sampling.cpp and each sampler's definition.

As in test-sampling.cpp, input probabilities p become logits log(p) (p also kept in the
array), a sampler runs (usually followed by dist(0), which renormalises), and the
probabilities left are compared to within 1e-5. The libstdc++ draw sequences below come
from std::mt19937 + uniform_real_distribution / discrete_distribution built with GCC 12,
running llama.cpp's dist loop (recorded once; the C++ is not needed to run the tests).
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import llm.sampling as sampling
from llm.sampling.samplers import TokenDataArray


def candidates(probs) -> TokenDataArray:
    probs = np.asarray(probs, dtype=np.float32)
    with np.errstate(divide="ignore"):
        logits = np.log(probs)
    return TokenDataArray(ids=np.arange(probs.size, dtype=np.int32), logits=logits, p=probs.copy())


def check(cur: TokenDataArray, expected) -> None:
    assert cur.size == len(expected), (cur.ids, cur.p)
    np.testing.assert_allclose(cur.p, np.asarray(expected, dtype=np.float32), rtol=0, atol=1e-5)


def run(probs, *samplers, then_dist: bool = True) -> TokenDataArray:
    cur = candidates(probs)
    for smpl in samplers:
        smpl.apply(cur)
    if then_dist:
        sampling.dist(0).apply(cur)
    return cur


P4 = [0.1, 0.2, 0.3, 0.4]


# --- the expectations of test-sampling.cpp ---------------------------------------------------

@pytest.mark.parametrize("t, expected", [(1.0, P4), (0.0, [0, 0, 0, 1])])
def test_temp(t, expected):
    check(run(P4, sampling.temp(t)), expected)


@pytest.mark.parametrize("t, delta, exponent, expected", [(1.0, 0.0, 1.0, P4), (0.0, 0.0, 1.0, [0, 0, 0, 1])])
def test_temp_ext_without_delta(t, delta, exponent, expected):
    check(run(P4, sampling.temp_ext(t, delta, exponent)), expected)


@pytest.mark.parametrize("k, expected", [
    (1, [1.0]),
    (3, [0.44444, 0.33333, 0.22222]),
    (4, [0.4, 0.3, 0.2, 0.1]),
    (0, P4),
])
def test_top_k(k, expected):
    check(run(P4, sampling.top_k(k)), expected)


@pytest.mark.parametrize("p, expected", [
    (0.0, [1.0]),
    (0.7, [0.571429, 0.428571]),
    (0.8, [0.44444, 0.33333, 0.22222]),
    (1.0, P4),
])
def test_top_p(p, expected):
    check(run(P4, sampling.top_p(p, 0)), expected)


@pytest.mark.parametrize("p, expected", [
    (0.00, P4),
    (0.24, P4),
    (0.26, [0.2 / 0.9, 0.3 / 0.9, 0.4 / 0.9]),
    (0.49, [0.2 / 0.9, 0.3 / 0.9, 0.4 / 0.9]),
    (0.51, [0.3 / 0.7, 0.4 / 0.7]),
    (0.74, [0.3 / 0.7, 0.4 / 0.7]),
    (0.76, [1.0]),
    (1.00, [1.0]),
    (1.05, [1.0]),      # test-sampling.cpp: above 1 keeps only the max
])
def test_min_p(p, expected):
    cur = run(P4, sampling.min_p(p, 0))
    check(cur, expected)
    assert list(cur.ids) == sorted(cur.ids)   # the unsorted path keeps the original order


# --- every value llama.cpp accepts, with llama.cpp's meaning (llama-sampling.cpp) -------------

@pytest.mark.parametrize("make, expected", [
    (lambda: sampling.top_k(-1), P4),                    # k <= 0: no-op
    (lambda: sampling.top_p(1.5, 0), P4),                # p >= 1: no-op
    (lambda: sampling.top_p(-0.1, 0), [1.0]),            # p <= 0: the first token reaches it
    (lambda: sampling.min_p(-0.5, 0), P4),               # p <= 0: no-op
    (lambda: sampling.min_p(1e40, 0), [1.0]),            # inf as a float: only the max
    (lambda: sampling.temp(-1.0), [0, 0, 0, 1]),        # t <= 0: only the max keeps its logit
    (lambda: sampling.temp(float("inf")), [0.25] * 4),  # every finite logit becomes 0
    (lambda: sampling.temp_ext(0.0, -1.0, 1.0), [0, 0, 0, 1]),   # delta <= 0: plain temp
    (lambda: sampling.top_n_sigma(-1.0), P4),             # n <= 0: no-op
    (lambda: sampling.top_n_sigma(float("inf")), P4),     # cut at -inf: nothing removed
])
def test_edge_values_behave_as_in_llama_cpp(make, expected):
    check(run(P4, make()), expected)


def test_temp_ext_negative_delta_is_plain_temp():
    plain = run(P4, sampling.temp(0.8))
    check(run(P4, sampling.temp_ext(0.8, -0.5, 2.0)), plain.p)


@pytest.mark.parametrize("probs, p, expected", [
    ([0.4, 0.3, 0.2, 0.1], 2.0, [0.4, 0.3, 0.2, 0.1]),    # p >= 1: no-op
    ([0.97, 0.01, 0.01, 0.01], 0.0, [0.97]),              # p <= 0: the most typical token only
    ([0.4, 0.2, 0.2, 0.2], -1.0, [0.2]),
])
def test_typical_edge_values(probs, p, expected):
    check(run(probs, sampling.typical(p, 0), then_dist=False), expected)


@pytest.mark.parametrize("p, t, expected", [
    (1.5, 0.09, [0.1]),                 # p >= 1: always applies
    (0.99, 0.0, [0.1]),                 # t <= 0: every token is above it, the least likely stays
    (0.99, -1.0, [0.1]),
    (-0.5, 0.09, [0.4, 0.3, 0.2, 0.1]),     # p <= 0: off
    (0.99, 0.6, [0.4, 0.3, 0.2, 0.1]),      # t > 0.5: off
])
def test_xtc_edge_values(p, t, expected):
    check(run([0.4, 0.3, 0.2, 0.1], sampling.xtc(p, t, 0, 0), then_dist=False), expected)


def test_penalties_negative_last_n_is_off():
    smpl = sampling.penalties(-1, 50.0, 5.0, 5.0)       # llama.cpp clamps last_n to 0
    assert smpl.last_n == 0
    for token in [0, 1, 2]:
        smpl.accept(token)
    check(run([0.2] * 5, smpl), [0.2] * 5)


def test_dry_negative_multiplier_rewards_the_repeat():
    # test-sampling.cpp's second DRY case takes 1.0 from token 2's logit; -1.0 adds it
    smpl = sampling.Dry(-1.0, 1.1, 2, 5, n_ctx_train=4096)
    for token in [0, 1, 2, 0, 1]:
        smpl.accept(token)
    z = 3 + math.e
    check(run([0.25] * 4, smpl), [1 / z, 1 / z, math.e / z, 1 / z])


def test_dry_base_below_one_is_off_and_empty_breakers_are_skipped(caplog):
    off = sampling.Dry(1.0, 0.5, 2, 5, n_ctx_train=4096)
    assert not off.enabled
    with caplog.at_level("WARNING", logger="llm.sampling"):
        smpl = sampling.Dry(1.0, 1.1, 2, 5, [[], [3]], n_ctx_train=4096)
        pieces = [b"a", b"b", b"c", b"\n"]
        from_text = sampling.dry(1.0, 1.1, 2, 5, ["", "\n"], n_ctx_train=4096, token_pieces=pieces)
    assert smpl.breakers == from_text.breakers == {3: [()]}
    assert sum("empty sequence breaker" in r.message for r in caplog.records) == 2


def test_mirostat_m_below_two():
    ref = sampling.mirostat(4, 7, 5.0, 0.1, m=100)
    whole = sampling.mirostat(4, 7, 5.0, 0.1, m=0)      # m <= 0: estimate from all candidates
    a, b = candidates(P4), candidates(P4)
    ref.apply(a)
    whole.apply(b)
    assert (a.selected, list(a.ids), ref.mu) == (b.selected, list(b.ids), whole.mu)
    one = sampling.mirostat(4, 7, 5.0, 0.1, m=1)        # nothing to estimate from: top token only
    cur = candidates(P4)
    one.apply(cur)
    assert list(cur.ids) == [3] and cur.selected == 0


def test_mirostat_v2_negative_tau_keeps_the_top_token():
    smpl = sampling.mirostat_v2(1, -1.0, 0.1)
    cur = candidates(P4)
    smpl.apply(cur)
    assert list(cur.ids) == [3] and cur.selected == 0
    assert smpl.mu == pytest.approx(-2.0 - 0.1 * (0.0 + 1.0))   # surprise of p = 1 is 0


def test_seed_converts_like_uint32():
    assert sampling.dist(2 ** 32 + 5).seed == 5
    assert sampling.dist(-1).seed == sampling.LLAMA_DEFAULT_SEED     # llama.cpp's --seed -1: random


def test_from_params_last_n_minus_one_is_the_context_size():
    params = sampling.SamplingParams(penalty_last_n=-1, penalty_repeat=1.1, dry_multiplier=0.8,
                                     dry_penalty_last_n=-1, dry_sequence_breakers=())
    chain = sampling.SamplerChain.from_params(params, n_vocab=8, n_ctx=256, n_ctx_train=4096)
    pen, dry = chain.samplers[0], chain.samplers[1]
    assert (pen.name, pen.last_n, dry.name, dry.penalty_last_n) == ("penalties", 256, "dry", 256)
    with pytest.raises(ValueError, match="n_ctx"):
        sampling.SamplerChain.from_params(params, n_vocab=8)
    with pytest.raises(ValueError, match="penalty_last_n must be >= -1"):
        sampling.SamplerChain.from_params(sampling.SamplingParams(penalty_last_n=-2), n_vocab=8, n_ctx=256)


@pytest.mark.parametrize("t, expected", [
    (0.09, [0.1]),
    (0.19, [0.2, 0.1]),
    (0.29, [0.3, 0.2, 0.1]),
    (0.39, [0.4, 0.3, 0.2, 0.1]),     # only one token above the threshold: nothing removed
])
def test_xtc(t, expected):
    check(run([0.4, 0.3, 0.2, 0.1], sampling.xtc(0.99, t, 0, 0), then_dist=False), expected)


@pytest.mark.parametrize("probs, expected", [
    ([0.97, 0.01, 0.01, 0.01], [0.97]),
    ([0.4, 0.2, 0.2, 0.2], [0.2, 0.2, 0.2]),
])
def test_typical(probs, expected):
    check(run(probs, sampling.typical(0.5, 0), then_dist=False), expected)


@pytest.mark.parametrize("last, expected, repeat, freq, presence", [
    ([0], [0, 0.25, 0.25, 0.25, 0.25], 50.0, 0.0, 0.0),
    ([0, 1, 2], [0, 0, 0, 0.5, 0.5], 50.0, 0.0, 0.0),
    ([0, 1, 2, 0, 0], [0, 0, 0, 0.5, 0.5], 50.0, 0.0, 0.0),
    ([0], [0.000011, 0.249997, 0.249997, 0.249997, 0.249997], 1.0, 5.0, 5.0),
    ([0, 1, 2], [0.000023, 0.000023, 0.000023, 0.499966, 0.499966], 1.0, 5.0, 5.0),
    ([0, 1, 2, 0, 0], [0.000000, 0.000023, 0.000023, 0.499977, 0.499977], 1.0, 5.0, 5.0),
])
def test_penalties(last, expected, repeat, freq, presence):
    smpl = sampling.penalties(len(last), repeat, freq, presence)
    for token in last:
        smpl.accept(token)
    check(run([0.2] * 5, smpl), expected)


@pytest.mark.parametrize("probs, last, expected, multiplier, base, allowed, last_n, breakers", [
    ([0.25] * 4, [0, 1], [0.25] * 4, 1.0, 1.1, 2, 4, []),
    ([0.25] * 4, [0, 1, 2, 0, 1], [0.296923, 0.296923, 0.109232, 0.296923], 1.0, 1.1, 2, 5, []),
    ([0.2] * 5, [0, 1, 3, 4, 0, 1], [0.2] * 5, 1.0, 1.1, 2, 6, [[3]]),
    ([0.2] * 5, [0, 1, 2, 0, 1], [0.241818, 0.241818, 0.032727, 0.241818, 0.241818], 2.0, 1.1, 2, 5, []),
    ([0.2] * 5, [0, 1, 2, 3, 4, 0, 1], [0.2] * 5, 1.0, 1.1, 4, 7, []),
])
def test_dry(probs, last, expected, multiplier, base, allowed, last_n, breakers):
    smpl = sampling.Dry(multiplier, base, allowed, last_n, breakers, n_ctx_train=4096)
    for token in last:
        smpl.accept(token)
    check(run(probs, smpl), expected)


@pytest.mark.parametrize("n, expected", [
    (1.0, [0.0, 0.0, 0.428571, 0.571429]),
    (0.0, P4),          # n <= 0 is a no-op (llama.cpp PR #13345)
    (3.0, P4),
])
def test_top_n_sigma(n, expected):
    check(run(P4, sampling.top_n_sigma(n)), expected)


MIN_P_9997 = float(np.float32(9997.9) / np.float32(9999.0))   # 9997.9f/9999.0f
QUEUES = [
    ("k", 10000, 1.0, 1.0), ("k", 1, 1.0, 1.0), ("p", 10000, 1.0, 1.0), ("p", 10000, 0.0, 1.0),
    ("m", 10000, 1.0, 1.0), ("m", 10000, 1.0, 1e-12),
    ("k", 100, 1.0, 1.0), ("p", 10000, 0.0003, 1.0), ("p", 10000, 0.8, 1.0),
    ("m", 10000, 1.0, MIN_P_9997), ("m", 10000, 1.0, 0.1),
    ("kp", 100, 0.8, 0.1), ("km", 100, 0.8, 0.1), ("pk", 100, 0.8, 0.1), ("pm", 100, 0.8, 0.1),
    ("mk", 100, 0.8, 0.1), ("mp", 100, 0.8, MIN_P_9997), ("mp", 100, 0.8, 0.1),
    ("kpm", 100, 0.8, 0.1), ("kmp", 100, 0.8, 0.1), ("pkm", 100, 0.8, 0.1), ("pmk", 100, 0.8, 0.1),
    ("mkp", 100, 0.8, 0.1), ("mpk", 100, 0.8, 0.1),
]


@pytest.mark.parametrize("sequence, k, p, min_p", QUEUES)
def test_sampler_queue(sequence, k, p, min_p):
    """test_sampler_queue: logits log(id) over 10000 tokens, samplers in the given order."""
    n_vocab = 10000
    with np.errstate(divide="ignore"):
        cur = TokenDataArray.from_logits(np.log(np.arange(n_vocab, dtype=np.float32)))
    min_token_id, max_token_id = 0, n_vocab - 1
    for s in sequence:
        smpl = {"k": lambda: sampling.top_k(k), "p": lambda: sampling.top_p(p, 1),
                "m": lambda: sampling.min_p(min_p, 1)}[s]()
        smpl.apply(cur)
        sampling.dist(0).apply(cur)
        size = cur.size
        if s == "k":
            expected_size = min(size, k)
            min_token_id = max(min_token_id, n_vocab - k)
            assert size == expected_size
            assert cur.ids[0] == max_token_id and cur.ids[expected_size - 1] == min_token_id
        elif s == "p":
            divisor = n_vocab * (n_vocab - 1) // 2 - min_token_id * (min_token_id - 1) // 2
            target = math.ceil(np.float32(p) * np.float32(divisor))
            min_token_id, expected_size, cumsum = n_vocab, 0, 0
            while True:
                min_token_id -= 1
                expected_size += 1
                cumsum += min_token_id
                if cumsum >= target:
                    break
            if min_token_id == 1:
                min_token_id -= 1
                expected_size += 1
            assert size == expected_size
            assert not cur.sorted or (cur.ids[0] == max_token_id and cur.ids[expected_size - 1] == min_token_id)
        else:
            expected_size = math.ceil(np.float32(1.0 - np.float32(min_p)) * n_vocab)
            expected_size = min(max(expected_size, 1), size)
            min_token_id = math.floor(np.float32(min_p) * n_vocab)
            min_token_id = min(max(min_token_id, 1, n_vocab - size), n_vocab - 1)
            assert size == expected_size
            assert not cur.sorted or (cur.ids[0] == max_token_id and cur.ids[expected_size - 1] == min_token_id)


def test_dist_singleton_draws_like_any_other():
    """A one-candidate dist still draws once, so the random stream does not depend on size."""
    singleton, control = sampling.dist(4242), sampling.dist(4242)
    singleton.apply(TokenDataArray.from_logits([0.0]))
    control.apply(TokenDataArray.from_logits([0.0, 0.0]))
    for _ in range(4):
        a, b = TokenDataArray.from_logits(np.zeros(256)), TokenDataArray.from_logits(np.zeros(256))
        control.apply(a)
        singleton.apply(b)
        assert a.selected == b.selected


# --- random draws equal llama.cpp's (std::mt19937 + libstdc++) ------------------------------

SMALL = [0.5, -1.0, 2.0, 0.0, 1.5, -3.0, 1.0, 0.25]
LIBSTDCXX_DIST_SMALL = {
    0: [4, 6, 6, 6, 4, 2, 2, 0, 2, 2, 6, 2, 2, 6, 2, 4],
    42: [6, 2, 4, 4, 2, 1, 2, 2, 2, 4, 0, 4, 7, 0, 7, 4],
    1234: [3, 6, 4, 4, 6, 2, 2, 6, 2, 2, 0, 2, 2, 6, 1, 0],
}
LIBSTDCXX_DIST_BIG = {
    0: [2963, 4226, 4286, 4247, 3125, 1926, 1494, 284],
    42: [3977, 917, 3902, 2977, 2235, 507, 2297, 1667],
    1234: [2494, 4099, 3063, 3858, 4309, 755, 988, 4087],
}
LIBSTDCXX_DISCRETE_4321 = {      # discrete_distribution({0.4, 0.3, 0.2, 0.1})
    0: [1, 2, 2, 2, 1, 0, 0, 0, 0, 1, 2, 1],
    42: [2, 0, 2, 1, 1, 0, 1, 0, 0, 1, 0, 2],
    1234: [1, 2, 1, 2, 2, 0, 0, 2, 0, 0, 0, 1],
}
LIBSTDCXX_UNIFORM_FLOAT = {
    0: [0.548813522, 0.592844605, 0.715189338, 0.844265759, 0.602763355, 0.857945621],
    42: [0.37454012, 0.796543002, 0.95071429, 0.183434784, 0.731993914, 0.779690981],
}


def big_row() -> np.ndarray:
    return np.array([(i * 7919) % 1000 for i in range(5000)], dtype=np.float32) / np.float32(100) - np.float32(5)


@pytest.mark.parametrize("seed", sorted(LIBSTDCXX_DIST_SMALL))
def test_dist_draws_match_llama_cpp(seed):
    smpl = sampling.dist(seed)
    got = []
    for _ in range(16):
        cur = TokenDataArray.from_logits(SMALL)
        smpl.apply(cur)
        got.append(cur.selected)
    assert got == LIBSTDCXX_DIST_SMALL[seed]
    smpl = sampling.dist(seed)
    got = []
    for _ in range(8):
        cur = TokenDataArray.from_logits(big_row())
        smpl.apply(cur)
        got.append(cur.selected)
        np.testing.assert_allclose(cur.p.sum(), 1.0, atol=1e-5)
    assert got == LIBSTDCXX_DIST_BIG[seed]


@pytest.mark.parametrize("seed", sorted(LIBSTDCXX_DISCRETE_4321))
def test_mirostat_v2_draws_match_libstdcxx_discrete_distribution(seed):
    smpl = sampling.mirostat_v2(seed, tau=10.0, eta=0.0)   # mu = 20 keeps all four tokens
    got = []
    for _ in range(12):
        cur = candidates([0.4, 0.3, 0.2, 0.1])
        smpl.apply(cur)
        got.append(cur.selected)
    assert got == LIBSTDCXX_DISCRETE_4321[seed]


@pytest.mark.parametrize("seed", sorted(LIBSTDCXX_UNIFORM_FLOAT))
def test_xtc_fires_when_the_uniform_float_draw_is_at_most_p(seed):
    probability = 0.7
    smpl = sampling.xtc(probability, 0.15, 1, seed)
    for chance in LIBSTDCXX_UNIFORM_FLOAT[seed]:
        cur = candidates([0.4, 0.3, 0.2, 0.1])
        smpl.apply(cur)
        fired = cur.size == 2
        assert fired == (chance <= probability)


DIST_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    from llm.sampling import samplers as sampling

    class Row:
        def __init__(self, logits): self.logits = logits
        def get_logits_ith(self, i): return self.logits

    logits = np.random.default_rng(7).normal(0.0, 1.0, 50000).astype(np.float32)
    chain = sampling.SamplerChain([sampling.penalties(16, 1.3, 0.1, 0.1), sampling.top_k(200),
                                   sampling.temp(1.5), sampling.dist(int(sys.argv[1]))])
    print(json.dumps([chain.sample(Row(logits), -1) for _ in range(24)]))
""")


@pytest.mark.slow   # two fresh interpreters
def test_dist_seed_gives_the_same_tokens_in_two_processes():
    def tokens_from_subprocess(seed: int) -> list[int]:
        out = subprocess.run([sys.executable, "-c", DIST_SCRIPT, str(seed)], check=True, capture_output=True,
                             text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
        return json.loads(out.stdout)

    first, second = tokens_from_subprocess(99), tokens_from_subprocess(99)
    assert first == second
    assert len(set(first)) > 10                         # really sampling, not a constant
    assert tokens_from_subprocess(100) != first


# --- seeds, reset, clone ----------------------------------------------------------------------

def test_default_seed_means_a_random_seed():
    a, b = sampling.dist(sampling.LLAMA_DEFAULT_SEED), sampling.dist(sampling.LLAMA_DEFAULT_SEED)
    c = sampling.dist(sampling.LLAMA_DEFAULT_SEED)
    assert len({a.seed_cur, b.seed_cur, c.seed_cur}) > 1
    chain = sampling.SamplerChain([sampling.top_k(5), a])
    assert chain.get_seed() == a.seed_cur
    assert sampling.SamplerChain([sampling.greedy()]).get_seed() == sampling.LLAMA_DEFAULT_SEED


def draws(smpl: sampling.Sampler, n: int) -> list[int]:
    out = []
    for _ in range(n):
        cur = TokenDataArray.from_logits(SMALL)
        smpl.apply(cur)
        out.append(cur.selected)
    return out


def test_reset_reseeds_and_clone_copies_the_state():
    smpl = sampling.dist(5)
    first = draws(smpl, 10)
    smpl.reset()
    assert draws(smpl, 10) == first
    twin = smpl.clone()
    assert draws(twin, 10) == draws(smpl, 10)


def test_chain_clone_and_reset_cover_every_sampler():
    chain = sampling.SamplerChain([sampling.penalties(8, 2.0, 0.0, 0.0), sampling.dist(11)])
    ctx = Row(np.array(SMALL, dtype=np.float32))
    first = [chain.sample(ctx, -1) for _ in range(12)]
    twin = chain.clone()
    assert [twin.sample(ctx, -1) for _ in range(8)] == [chain.sample(ctx, -1) for _ in range(8)]
    chain.reset()
    assert chain.samplers[0].token_count == {}
    assert [chain.sample(ctx, -1) for _ in range(12)] == first


# --- further cases from each sampler's definition -------------------------------------------

class Row:
    """A stand-in for llm.Context: the same logits for every index."""

    def __init__(self, logits: np.ndarray) -> None:
        self.logits = logits
        self.asked: list[int] = []

    def get_logits_ith(self, i: int) -> np.ndarray:
        self.asked.append(i)
        return self.logits


def test_greedy_picks_the_first_maximum():
    cur = TokenDataArray.from_logits([1.0, 3.0, -2.0, 3.0])
    sampling.greedy().apply(cur)
    assert cur.selected == 1


def test_top_k_on_a_large_row_matches_a_full_sort_with_ties():
    rng = np.random.default_rng(3)
    logits = np.round(rng.normal(0, 3, 262144), 1).astype(np.float32)   # many ties
    for k in (1, 40, 256, 5000):
        cur = TokenDataArray.from_logits(logits)
        sampling.top_k(k).apply(cur)
        expected = np.argsort(-logits, kind="stable")[:k]
        assert cur.sorted
        np.testing.assert_array_equal(cur.ids, expected)


def _top_k_rows():
    rng = np.random.default_rng(5)
    yield rng.normal(0, 3, 49152).astype(np.float32)
    yield np.round(rng.normal(0, 1, 49152), 0).astype(np.float32)              # a few values, all tied
    masked = rng.normal(0, 1, 49152).astype(np.float32)
    masked[rng.random(49152) < 0.999] = -np.inf                               # a grammar's mask: ~50 left
    yield masked
    yield np.full(3000, -np.inf, np.float32)
    yield np.sort(rng.normal(0, 1, 5000).astype(np.float32))                  # ascending: the worst order
    yield rng.normal(0, 1, 7).astype(np.float32)
    tail = rng.normal(0, 1, 50021).astype(np.float32)
    tail[-20:] += 10                                                           # the best after the last group
    yield tail


@pytest.mark.parametrize("native_on", ["1", "0"])
def test_top_k_order_is_a_stable_descending_sort(native_on, monkeypatch):
    """_top_k_order in C (ggmlx.native.top_k, when built) and in numpy: the first k positions of a
    stable descending sort, ties by position, -inf completing a row with fewer finite values."""
    from ggmlx import native
    from llm.sampling.samplers import _top_k_order
    monkeypatch.setenv("GGMLX_NATIVE", native_on)
    if native_on == "1" and native.top_k(np.zeros(2, np.float32), 1) is None:
        pytest.skip("the native library is not built")
    for row in _top_k_rows():
        for k in (1, 3, 40, 64, 1000):
            if k >= row.size:
                continue
            np.testing.assert_array_equal(_top_k_order(row, k), np.argsort(-row, kind="stable")[:k])


def test_a_view_of_logits_samples_as_a_copy():
    """view_logits leaves the row alone: a first top-k takes its candidates from the row, a
    sampler that reads the whole array gets a copy; the tokens and arrays match from_logits'."""
    rng = np.random.default_rng(6)
    row = rng.normal(0, 3, 49152).astype(np.float32)
    before = row.copy()
    for chain in (lambda: [sampling.top_k(40), sampling.top_p(0.9, 1), sampling.dist(3)],
                  lambda: [sampling.logit_bias(row.size, {7: 50.0}), sampling.top_k(5), sampling.dist(3)],
                  lambda: [sampling.temp(0.7), sampling.dist(3)]):
        view, copied = TokenDataArray.view_logits(row), TokenDataArray.from_logits(row)
        for cur in (view, copied):
            for smpl in chain():
                smpl.apply(cur)
        assert view.selected == copied.selected and view.sorted == copied.sorted
        for name in ("ids", "logits", "p"):
            np.testing.assert_array_equal(getattr(view, name), getattr(copied, name))
        np.testing.assert_array_equal(row, before)
    with pytest.raises(ValueError, match="NaN"):
        TokenDataArray.view_logits(np.array([0.0, np.nan], np.float32))


@pytest.mark.parametrize("p", [0.5, 0.95, 0.9999])
def test_top_p_on_a_large_unsorted_row(p):
    rng = np.random.default_rng(4)
    logits = rng.normal(0, 0.5, 20000).astype(np.float32)      # flat: 256 candidates are not enough
    cur = TokenDataArray.from_logits(logits)
    sampling.top_p(p, 1).apply(cur)
    order = np.argsort(-logits, kind="stable")
    e = np.exp(logits - logits.max())
    cum = np.cumsum((e / e.sum(dtype=np.float32))[order], dtype=np.float32)
    n = int(np.flatnonzero(cum >= np.float32(p))[0]) + 1
    np.testing.assert_array_equal(cur.ids, order[:n])


def test_top_p_min_keep():
    cur = run(P4, sampling.top_p(0.1, 3))
    check(cur, [0.44444, 0.33333, 0.22222])


def test_min_p_falls_back_to_sorting_when_too_few_survive():
    cur = candidates(P4)
    sampling.min_p(0.76, 3).apply(cur)
    assert cur.sorted and list(cur.ids) == [3, 2, 1]


def test_typical_min_keep():
    cur = run([0.97, 0.01, 0.01, 0.01], sampling.typical(0.5, 2), then_dist=False)
    assert cur.size == 2 and cur.ids[0] == 0


def test_temp_divides_logits():
    cur = candidates(P4)
    sampling.temp(0.5).apply(cur)
    np.testing.assert_allclose(cur.logits, np.log(np.float32(P4)) / 0.5, rtol=1e-6)


def test_temp_ext_dynamic_temperature():
    t, delta, exponent = 1.0, 0.5, 2.0
    cur = candidates(P4)
    sampling.temp_ext(t, delta, exponent).apply(cur)
    p = np.array(sorted(P4, reverse=True))
    entropy = -(p * np.log(p)).sum()
    dyn_temp = (t - delta) + 2 * delta * (entropy / math.log(4)) ** exponent
    expected = p ** (1 / dyn_temp) / (p ** (1 / dyn_temp)).sum()
    assert list(cur.ids) == [3, 2, 1, 0]
    np.testing.assert_allclose(cur.p, expected, atol=1e-5)
    np.testing.assert_allclose(cur.logits, np.log(p) / dyn_temp, atol=1e-5)


def test_xtc_respects_min_keep_and_thresholds_above_half():
    cur = run([0.4, 0.3, 0.2, 0.1], sampling.xtc(1.0, 0.09, 2, 0), then_dist=False)
    assert cur.size == 4     # removing 3 would leave 1 < min_keep
    cur = run([0.6, 0.4], sampling.xtc(1.0, 0.55, 0, 0), then_dist=False)
    assert cur.size == 2


def test_top_n_sigma_ignores_minus_infinity():
    logits = np.array([-np.inf, 1.0, 2.0, 3.0, 4.0], dtype=np.float32)
    cur = TokenDataArray.from_logits(logits)
    sampling.top_n_sigma(1.0).apply(cur)
    valid = logits[1:]
    cut = valid.max() - valid.std()
    np.testing.assert_array_equal(np.isfinite(cur.logits), np.r_[False, valid >= cut])


def test_mirostat_estimates_zipf_exponent_and_updates_mu():
    n_vocab, s, tau, eta = 1000, 1.2, 3.0, 0.1
    probs = 1.0 / np.arange(1, n_vocab + 1) ** s
    probs = (probs / probs.sum()).astype(np.float32)
    smpl = sampling.mirostat(n_vocab, 1, tau, eta, 100)
    cur = candidates(probs)
    smpl.apply(cur)
    eps = s - 1
    k = ((eps * 2 ** (2 * tau)) / (1 - n_vocab ** -eps)) ** (1 / s)
    assert cur.size == int(k)
    np.testing.assert_array_equal(cur.ids, np.arange(int(k)))
    surprise = -math.log2(cur.p[cur.selected])
    assert float(smpl.mu) == pytest.approx(2 * tau - eta * (surprise - tau), rel=1e-6)
    smpl.reset()
    assert float(smpl.mu) == 2 * tau


def test_mirostat_v2_truncates_by_surprise():
    smpl = sampling.mirostat_v2(3, tau=1.1, eta=0.5)      # mu = 2.2: keep p >= 2 ** -2.2 = 0.218
    cur = candidates([0.05, 0.3, 0.25, 0.4])
    smpl.apply(cur)
    assert list(cur.ids) == [3, 1, 2]
    np.testing.assert_allclose(cur.p, np.array([0.4, 0.3, 0.25]) / 0.95, atol=1e-6)
    surprise = -math.log2(cur.p[cur.selected])
    assert float(smpl.mu) == pytest.approx(2.2 - 0.5 * (surprise - 1.1), rel=1e-6)


def test_penalties_window_forgets_old_tokens():
    smpl = sampling.penalties(3, 1.0, 1.0, 0.0)
    for token in [0, 0, 1, 2, 2]:
        smpl.accept(token)
    assert smpl.token_count == {1: 1, 2: 2}
    cur = TokenDataArray.from_logits(np.zeros(4))
    smpl.apply(cur)
    np.testing.assert_array_equal(cur.logits, [0.0, -1.0, -2.0, 0.0])
    assert not cur.sorted


def test_penalties_find_tokens_after_reordering():
    smpl = sampling.penalties(8, 2.0, 0.0, 0.5)
    for token in [7, 3]:
        smpl.accept(token)
    cur = TokenDataArray.from_logits(np.arange(10, dtype=np.float32))
    sampling.top_k(5).apply(cur)                   # ids 9, 8, 7, 6, 5: positions != ids now
    smpl.apply(cur)
    assert list(cur.ids) == [9, 8, 7, 6, 5]
    np.testing.assert_allclose(cur.logits, [9.0, 8.0, 7.0 / 2 - 0.5, 6.0, 5.0])


def test_logit_bias_direct_and_after_reordering():
    bias = sampling.logit_bias(10, {2: 5.0, 9: -np.inf, 4: -1.0})
    cur = TokenDataArray.from_logits(np.zeros(10))
    bias.apply(cur)
    assert cur.logits[2] == 5.0 and cur.logits[9] == -np.inf and cur.logits[4] == -1.0
    cur = TokenDataArray.from_logits(np.arange(10, dtype=np.float32))
    sampling.top_k(6).apply(cur)
    bias.apply(cur)
    expected = {9: -np.inf, 8: 8.0, 7: 7.0, 6: 6.0, 5: 5.0, 4: 3.0}
    assert dict(zip(cur.ids.tolist(), cur.logits.tolist(), strict=True)) == expected


def test_dry_penalty_grows_exponentially_with_repeat_length():
    smpl = sampling.Dry(1.0, 2.0, 2, 16, [], n_ctx_train=64)
    for token in [5, 6, 7, 8, 1, 5, 6, 7]:        # "5 6 7" repeats; 8 would extend it to 4
        smpl.accept(token)
    cur = TokenDataArray.from_logits(np.zeros(10))
    smpl.apply(cur)
    expected = np.zeros(10, dtype=np.float32)
    expected[8] = -(2.0 ** (3 - 2))
    np.testing.assert_array_equal(cur.logits, expected)


def test_dry_string_breakers_are_matched_against_the_vocabulary():
    pieces = [b"a", b"b", b":", b"x:", b"c", b"ab", b"end.", b"."]
    tokenized = {".": [7], "\n": []}
    smpl = sampling.dry(1.0, 1.75, 2, 64, [":", "d."], n_ctx_train=128, token_pieces=pieces,
                        tokenize=lambda s: tokenized[s])
    # ":" is inside tokens 2 and 3; "end." contains "d."; "end." has no partial start; a token
    # ending with "d" would start "d." and need the tail "." = [7]
    assert smpl.breakers == {2: [()], 3: [()], 6: [()]}
    smpl = sampling.dry(1.0, 1.75, 2, 64, ["bx"], n_ctx_train=128, token_pieces=pieces,
                        tokenize=lambda s: {"x": [4, 4]}[s])
    assert smpl.breakers == {1: [(4, 4)], 5: [(4, 4)]}


def test_dry_breaker_stops_the_repeat_as_in_test_sampling():
    pieces = [b"a", b"b", b"c", b"\n", b"d"]
    smpl = sampling.dry(1.0, 1.1, 2, 6, ["\n"], n_ctx_train=128, token_pieces=pieces)
    for token in [0, 1, 3, 4, 0, 1]:
        smpl.accept(token)
    check(run([0.2] * 5, smpl), [0.2] * 5)


def test_dry_needs_the_vocabulary_only_when_enabled():
    assert not sampling.dry(0.0, 1.75, 2, 64, n_ctx_train=0).enabled
    with pytest.raises(ValueError, match="token_pieces"):
        sampling.dry(0.8, 1.75, 2, 64, n_ctx_train=128)
    with pytest.raises(ValueError, match="tokenize"):
        sampling.dry(0.8, 1.75, 2, 64, ["ab"], n_ctx_train=128, token_pieces=[b"a"])
    with pytest.raises(ValueError, match="n_ctx_train"):
        sampling.dry(0.8, 1.75, 2, -1, [], n_ctx_train=0)


# --- the chain ---------------------------------------------------------------------------------

def test_chain_sample_reads_the_row_and_accepts_into_every_sampler():
    pen = sampling.penalties(4, 1.0, 0.0, 100.0)
    chain = sampling.SamplerChain().add(pen).add(sampling.greedy())
    ctx = Row(np.array([0.0, 5.0, 4.0, 3.0], dtype=np.float32))
    assert [chain.sample(ctx, 2) for _ in range(3)] == [1, 2, 3]
    assert ctx.asked == [2, 2, 2]
    assert pen.token_count == {1: 1, 2: 1, 3: 1}
    assert chain.perf()["n_sample"] == 3


def test_chain_without_a_selecting_sampler_is_an_error():
    chain = sampling.SamplerChain([sampling.top_k(2)])
    with pytest.raises(ValueError, match="no token selected"):
        chain.sample(Row(np.zeros(4, dtype=np.float32)), -1)


def test_chain_remove():
    chain = sampling.SamplerChain([sampling.top_k(2), sampling.greedy()])
    assert chain.remove(0).name == "top-k"
    assert [s.name for s in chain.samplers] == ["greedy"]
    with pytest.raises(IndexError):
        chain.remove(3)


def test_default_chain_matches_llama_cpp_common_defaults():
    chain = sampling.SamplerChain.default(seed=1, n_vocab=262144)
    assert [s.name for s in chain.samplers] == [
        "penalties", "dry", "top-n-sigma", "top-k", "typical", "top-p", "min-p", "xtc", "temp-ext", "dist"]
    top_k, top_p, min_p, temp = chain.samplers[3], chain.samplers[5], chain.samplers[6], chain.samplers[8]
    f32 = [float(np.float32(x)) for x in (0.95, 0.05, 0.8)]      # held as float, as in llama.cpp
    assert (top_k.k, top_p.p, min_p.p, temp.t, temp.delta) == (40, *f32, 0.0)
    logits = np.random.default_rng(0).normal(0, 2, 262144).astype(np.float32)
    top40 = set(np.argsort(-logits)[:40].tolist())
    tokens = [chain.sample(Row(logits), -1) for _ in range(20)]
    assert set(tokens) <= top40


def test_from_params_variants():
    params = sampling.SamplingParams(seed=3, mirostat=2, logit_bias={1: -np.inf})
    chain = sampling.SamplerChain.from_params(params, n_vocab=8)
    assert [s.name for s in chain.samplers] == ["logit-bias", "temp", "mirostat-v2"]
    chain = sampling.SamplerChain.from_params(sampling.SamplingParams(seed=3, mirostat=1), n_vocab=8)
    assert [s.name for s in chain.samplers] == ["temp", "mirostat"]
    chain = sampling.SamplerChain.from_params(sampling.SamplingParams(samplers=("top_k", "temperature")), n_vocab=8)
    assert [s.name for s in chain.samplers] == ["top-k", "temp-ext", "dist"]
    with pytest.raises(ValueError, match="unknown sampler type"):
        sampling.SamplerChain.from_params(sampling.SamplingParams(samplers=("top_z",)), n_vocab=8)
    with pytest.raises(ValueError, match="mirostat"):
        sampling.SamplerChain.from_params(sampling.SamplingParams(mirostat=3), n_vocab=8)


@pytest.mark.parametrize("make, name", [
    (lambda: sampling.top_k(1.5), "top_k: k"),                      # not an integer
    (lambda: sampling.top_p(0.9, -1), "top_p: min_keep"),           # a size_t
    (lambda: sampling.min_p("0.1"), "min_p: p"),                    # not a number
    (lambda: sampling.temp(float("nan")), "temp: t"),              # NaN means nothing anywhere
    (lambda: sampling.xtc(float("nan"), 0.1), "xtc: p"),
    (lambda: sampling.mirostat(0, 1, 5.0, 0.1), "mirostat: n_vocab"),
    (lambda: sampling.penalties(64, 0.0, 0.0, 0.0), "penalties: repeat"),  # divides by zero
    # llama.cpp keeps no DRY history here and throws on the first accept
    (lambda: sampling.Dry(0.8, 1.75, 2, -2, n_ctx_train=8), "dry: penalty_last_n"),
    (lambda: sampling.logit_bias(10, {10: 1.0}), "logit_bias: token 10"),
    (lambda: sampling.dist(1.5), "dist: seed"),
])
def test_invalid_parameters_name_the_parameter(make, name):
    with pytest.raises(ValueError, match=name):
        make()


def test_from_logits_copies_and_checks_the_row():
    row = np.array([1.0, 2.0], dtype=np.float32)
    cur = TokenDataArray.from_logits(row)
    sampling.logit_bias(2, {0: 1.0}).apply(cur)
    sampling.penalties(2, 2.0, 0.0, 0.0).apply(cur)
    assert cur.logits.tolist() == [2.0, 2.0]
    assert row.tolist() == [1.0, 2.0]
    with pytest.raises(ValueError, match="logits"):
        TokenDataArray.from_logits(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="logits"):
        TokenDataArray.from_logits([])

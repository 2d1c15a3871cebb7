"""Speculative decoding (llm.speculative) on a tiny generated model: prompt lookup and a
draft model give greedy output token-identical to plain decoding, rejected drafts leave
no cells behind, and the n-gram lookup proposes what followed the last match."""
from __future__ import annotations

import itertools

import pytest
from tiny_model import TinySpec, prompt_tokens, write_model

import llm
from llm.generation.speculative import DraftModel, PromptLookup, Speculative, draft_lengths
from llm.sampling.samplers import SamplerChain, SamplingParams

N_CTX = 256


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("spec") / "tiny.gguf", TinySpec(arch="llama", n_layer=2, seed=5))


@pytest.fixture(scope="module")
def target(path) -> llm.LLM:
    return llm.LLM(str(path), n_ctx=N_CTX)


def repetitive_prompt() -> list[int]:
    block = prompt_tokens(24, seed=7)
    return block + block + block[:6]


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    pl = PromptLookup(max_ngram_size=2, num_pred_tokens=3)
    assert pl.draft([5, 6, 7, 8, 9, 5, 6], 10) == [7, 8, 9]
    assert pl.draft([1, 2, 3, 1, 4, 2, 3, 1, 5, 3, 1], 10) == [5, 3, 1]      # latest match of (3, 1)
    assert pl.draft([1, 2, 9, 2], 10) == [9, 2]                               # falls back to 1-grams
    assert pl.draft([1, 2, 3, 4], 10) == [] and pl.draft([7], 10) == []
    assert pl.draft([5, 6, 7, 8, 9, 5, 6], 2) == [7, 8]
    with pytest.raises(ValueError, match="max_ngram_size"):
        PromptLookup(max_ngram_size=0)


def test_prompt_lookup_keeps_its_place_in_a_copy_with_an_edit():
    src = [99, 50, 10, 11, 12, 13, 14, 15, 16]
    pl = PromptLookup(num_pred_tokens=3)
    seq = src + [0, 10]
    assert pl.draft(seq, 3) == [11, 12, 13]
    seq += [11, 99]                 # 11 kept, then the copy edits 12 into 99
    assert pl.draft(seq, 3) == [13, 14, 15]      # past the edited token, not what followed the other 99
    assert PromptLookup(num_pred_tokens=3).draft(seq, 3) == [50, 10, 11]     # no pointer: the latest match
    assert pl.draft([7] + seq, 3) == [50, 10, 11]     # another sequence: the pointer is dropped


def test_draft_lengths_fill_power_of_two_ubatches():
    assert draft_lengths(16) == [1, 3, 7, 15] and draft_lengths(7) == [1, 3, 7] and draft_lengths(0) == []


class WrongDrafter:
    """Proposes, after each output token, tokens the target will not sample next."""
    def __init__(self, plain: list[int], n_prompt: int, n_vocab: int):
        self.plain, self.n_prompt, self.n_vocab = plain, n_prompt, n_vocab

    def draft(self, tokens: list[int], n_max: int) -> list[int]:
        i = len(tokens) - self.n_prompt
        return [(self.plain[i] + 1) % self.n_vocab if i < len(self.plain) else 0] * n_max


@pytest.mark.slow
def test_rejected_drafts_shrink_and_pause_drafting(target):
    prompt = repetitive_prompt()
    plain = target.generate(prompt, max_tokens=32, temperature=0.0).tokens
    ctx = llm.Context(target.model, n_ctx=N_CTX)
    assert ctx.decode(llm.Batch(prompt, logits=[i == len(prompt) - 1 for i in range(len(prompt))])) == 0
    greedy = SamplerChain.from_params(SamplingParams(temp=0.0), n_vocab=target.model.n_vocab)
    spec = Speculative(ctx, greedy, WrongDrafter(plain, len(prompt), target.model.n_vocab))
    out = list(itertools.islice(spec.tokens(prompt), 32))
    assert out == plain and spec.stats.n_accepted == 0 and spec.stats.n_steps == 31
    # drafts of 7, 3, 1 tokens, then one token after pauses of 1, 2, 4, 8 steps (then 16)
    assert spec.stats.n_drafted == 7 + 3 + 1 + 4


@pytest.mark.slow
def test_prompt_lookup_greedy_is_identical_and_accepts(target):
    prompt = repetitive_prompt()
    plain = target.generate(prompt, max_tokens=40, temperature=0.0)
    spec = target.generate(prompt, max_tokens=40, temperature=0.0, speculative="prompt-lookup")
    assert spec.tokens == plain.tokens and spec.text == plain.text
    t = spec.timings
    assert t["spec_drafted"] > 0 and t["spec_steps"] < len(spec.tokens)
    # the cache holds exactly the prompt and the decoded output, nothing rejected
    assert target.ctx.memory.seq_pos_max(0) + 1 == len(target._cached)


@pytest.mark.slow
def test_draft_model_greedy_is_identical(path, target):
    draft = llm.LLM(str(path), n_ctx=N_CTX)     # the same weights: every draft is accepted
    prompt = prompt_tokens(20, seed=9)
    plain = target.generate(prompt, max_tokens=24, temperature=0.0)
    spec = target.generate(prompt, max_tokens=24, temperature=0.0, speculative=draft)
    assert spec.tokens == plain.tokens
    assert spec.timings["spec_accepted"] == spec.timings["spec_drafted"] > 0
    again = target.generate(prompt, max_tokens=24, temperature=0.0, speculative=DraftModel(draft.ctx))
    assert again.tokens == plain.tokens


@pytest.mark.slow
def test_stop_mid_step_keeps_the_cache_consistent(target):
    prompt = repetitive_prompt()
    spec = target.generate(prompt, max_tokens=5, temperature=0.0, speculative="prompt-lookup")
    assert len(spec.tokens) == 5
    assert target.ctx.memory.seq_pos_max(0) + 1 == len(target._cached) <= len(prompt) + 5
    plain = target.generate(prompt, max_tokens=8, temperature=0.0)
    assert plain.tokens[:5] == spec.tokens


@pytest.mark.slow
def test_sampling_runs_and_bad_values_fail(target):
    out = target.generate(repetitive_prompt(), max_tokens=16, temperature=0.8, seed=3, speculative="prompt-lookup")
    assert len(out.tokens) == 16
    with pytest.raises(ValueError, match="speculative"):
        target.generate([1, 2, 3], max_tokens=2, speculative="lookahead")
    with pytest.raises(ValueError, match="speculative"):
        target.generate([1, 2, 3], max_tokens=2, speculative=3)


@pytest.mark.slow
def test_verification_graphs_compile_before_the_first_token(tmp_path):
    """The verification ubatches (2, 4, 8, 16 tokens, every row's logits) are reserved with
    the generation: nothing compiles once tokens flow."""
    m = llm.LLM(str(write_model(tmp_path / "t3.gguf", TinySpec(arch="llama", n_layer=3, seed=2))), n_ctx=N_CTX)
    chunks = m.stream(repetitive_prompt(), max_tokens=40, temperature=0.0, speculative="prompt-lookup")
    next(chunks)
    before = m.ctx.perf()["n_compiles"]
    assert before >= 5          # prefill, decode and the four verification shapes (fresh signatures)
    last = list(chunks)[-1].completion
    assert m.ctx.perf()["n_compiles"] == before and last.timings["spec_drafted"] > 0

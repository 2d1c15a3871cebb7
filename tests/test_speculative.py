"""Speculative decoding (llm.speculative) on a tiny generated model: prompt lookup and a
draft model give greedy output token-identical to plain decoding, rejected drafts leave
no cells behind, and the n-gram lookup proposes what followed the last match."""
from __future__ import annotations

import pytest
from tiny_model import TinySpec, prompt_tokens, write_model

import llm
from llm.speculative import DraftModel, PromptLookup

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


def test_stop_mid_step_keeps_the_cache_consistent(target):
    prompt = repetitive_prompt()
    spec = target.generate(prompt, max_tokens=5, temperature=0.0, speculative="prompt-lookup")
    assert len(spec.tokens) == 5
    assert target.ctx.memory.seq_pos_max(0) + 1 == len(target._cached) <= len(prompt) + 5
    plain = target.generate(prompt, max_tokens=8, temperature=0.0)
    assert plain.tokens[:5] == spec.tokens


def test_sampling_runs_and_bad_values_fail(target):
    out = target.generate(repetitive_prompt(), max_tokens=16, temperature=0.8, seed=3, speculative="prompt-lookup")
    assert len(out.tokens) == 16
    with pytest.raises(ValueError, match="speculative"):
        target.generate([1, 2, 3], max_tokens=2, speculative="lookahead")
    with pytest.raises(ValueError, match="speculative"):
        target.generate([1, 2, 3], max_tokens=2, speculative=3)

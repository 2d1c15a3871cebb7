"""LLM.trace over a prompt with an image: the text graph's captures at the image's positions,
the encoder's nodes (capture_encoder) and Trace.image_attention, on the gemma3 fixture pair
(tests/data/mtmd/, llama.cpp's last logits in gemma3.npz; see test_mtmd.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import llm
from llm import mtmd
from llm.generation.batcher import MEDIA_PLACEHOLDER

DATA = Path(__file__).resolve().parent / "data" / "mtmd"
MODEL, MMPROJ = DATA / "gemma3.gguf", DATA / "gemma3.mmproj.gguf"
IMAGE = DATA / "test-image.png"
PROMPT = f"Look at this: {mtmd.default_marker()} What is in the picture?"      # make_mmproj.PROMPTS[0]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vlm():
    return llm.LLM(MODEL, mmproj=MMPROJ, n_ctx=256)


@pytest.fixture(scope="module")
def tr(vlm):
    return vlm.trace(PROMPT, images=[IMAGE], capture=["inp_embd", "l_out-*", "kq_soft_max-*"],
                     capture_encoder=["Vcur-*", "kq_soft_max-*", "kqv_out-*", "layer_out-*"])


def image_chunk(vlm) -> mtmd.InputChunk:
    return next(c for c in vlm.media_prompt(PROMPT, [IMAGE]) if c.type == "image")


def test_the_trace_reads_the_prompt_as_llamacpp_does(vlm, tr):
    """The traced prompt's last logits are llama.cpp's (mtmd_helper_eval_chunks, stored), its
    rows one per token with a placeholder at each image token."""
    ref = dict(np.load(DATA / "gemma3.npz"))
    assert len(tr.tokens) == int(ref["0_n_past"]) == tr.logits.shape[0]
    last = tr.logits[-1].astype(np.float64)
    assert np.abs(last - ref["0_logits"]).max() / np.abs(ref["0_logits"]).max() < 1e-3
    (m,) = tr.media
    assert m.n_tokens == 16 and tr.tokens[m.start:m.start + m.n_tokens] == [MEDIA_PLACEHOLDER] * 16
    # the image's rows of inp_embd are the encoder's output, the text rows the token embeddings
    assert np.array_equal(tr["inp_embd"][m.start:m.start + m.n_tokens], m.embd)


def test_text_attention_rows_sum_to_one_and_the_image_is_read_non_causally(tr):
    (m,) = tr.media
    for il in tr.layers("kq_soft_max"):
        p = tr[f"kq_soft_max-{il}"]               # [n_head, n_tokens, n_kv]
        assert p.shape == (4, len(tr.tokens), len(tr.tokens))
        assert np.allclose(p.sum(axis=-1), 1.0, atol=1e-5)
        first = m.start            # an image token sees the later image tokens (gemma3: non-causal)...
        assert p[:, first, first + 1:m.start + m.n_tokens].sum() > 0
        assert p[:, m.start - 1, m.start:].sum() == 0      # ...a text token sees nothing after itself


def test_encoder_captures_are_the_encoders_own_values(vlm, tr):
    """The captured run's output equals encode_chunk's (the plain cached graph); the attention
    rows over the 256 patches sum to 1, and kqv_out is those probabilities times Vcur."""
    (m,) = tr.media
    assert np.allclose(m.embd, vlm.mtmd.encode_chunk(image_chunk(vlm)), rtol=0, atol=1e-6)
    hp = vlm.mtmd.clip.hparams
    n_patches = (hp.image_size // hp.patch_size) ** 2
    assert set(m.names) == {f"{n}-{il}" for n in ("Vcur", "kq_soft_max", "kqv_out", "layer_out") for il in (0, 1)}
    for il in range(hp.n_layer):
        p, v = m[f"kq_soft_max-{il}"], m[f"Vcur-{il}"]
        assert p.shape == (hp.n_head, n_patches, n_patches) and v.shape == (n_patches, hp.n_head, hp.d_head)
        assert np.allclose(p.sum(axis=-1), 1.0, atol=1e-5)
        kqv = np.concatenate([p[h] @ v[:, h, :] for h in range(hp.n_head)], axis=1)
        assert np.allclose(m[f"kqv_out-{il}"], kqv, atol=1e-4)
    assert m["layer_out-1"].shape == (n_patches, hp.n_embd)
    with pytest.raises(KeyError, match="ffn_out-0"):
        m["ffn_out-0"]


def test_a_capture_runs_the_encoder_for_a_cached_image(vlm):
    """The embedding cache answers a plain trace; a capture request runs the encoder (once)
    and leaves the cached embeddings as they were."""
    cached = vlm.mtmd.encode_chunk(image_chunk(vlm))
    n = vlm.mtmd.n_encode
    plain = vlm.trace(PROMPT, images=[IMAGE])
    assert vlm.mtmd.n_encode == n and plain.media[0].values == {}
    captured = vlm.trace(PROMPT, images=[IMAGE], capture_encoder="layer_out-0")
    assert vlm.mtmd.n_encode == n + 1 and captured.media[0]["layer_out-0"].shape == (256, 32)
    assert vlm.mtmd.encode_chunk(image_chunk(vlm)) is cached and vlm.mtmd.n_encode == n + 1
    assert np.array_equal(plain.logits, captured.logits)


def test_image_attention_is_the_grid_of_a_tokens_attention_row(tr):
    (m,) = tr.media
    assert m.grid == (4, 4)         # 64 x 64 pixels, 16 patches a side pooled by 4
    p0, p1 = tr["kq_soft_max-0"], tr["kq_soft_max-1"]
    row = slice(m.start, m.start + m.n_tokens)
    one = tr.image_attention(-1, layer=1, head=2)
    assert one.shape == (4, 4) and np.allclose(one.ravel(), p1[2, -1, row])
    mean = tr.image_attention(len(tr.tokens) - 1)
    assert np.allclose(mean.ravel(), (p0[:, -1, row].mean(0) + p1[:, -1, row].mean(0)) / 2)
    assert 0 < mean.sum() <= 1


def test_logit_lens_over_the_image_positions(tr):
    (m,) = tr.media
    pos = list(range(m.start, m.start + m.n_tokens))
    part, whole = tr.logit_lens(top_k=3, positions=pos), tr.logit_lens(top_k=3)
    assert part.top_ids.shape == (2, 16, 3) and part.positions == pos
    assert np.array_equal(part.top_ids, whole.top_ids[:, m.start:m.start + m.n_tokens])
    with pytest.raises(ValueError, match=r"positions \[99\] are outside the trace's 50 positions"):
        tr.logit_lens(positions=[1, 99])


def test_bad_input_is_a_typed_error_naming_the_argument(vlm, tr):
    n = len(tr.tokens)
    with pytest.raises(ValueError, match=rf"token {n} is outside the trace's {n} positions"):
        tr.image_attention(n)
    with pytest.raises(ValueError, match=rf"token {-n - 1} is outside"):
        tr.image_attention(-n - 1)
    with pytest.raises(ValueError, match="image 1 is outside the trace's 1 media chunks"):
        tr.image_attention(-1, image=1)
    with pytest.raises(ValueError, match=r"layer 5 was not captured; kq_soft_max layers: \[0, 1\]"):
        tr.image_attention(-1, layer=5)
    with pytest.raises(ValueError, match=r"head 4 is outside \[0, 4\)"):
        tr.image_attention(-1, head=4)
    text = vlm.trace("What is in the picture?", capture=["kq_soft_max-*"])
    with pytest.raises(ValueError, match="image: the trace holds no image"):
        text.image_attention(-1)
    no_attn = vlm.trace(PROMPT, images=[IMAGE])
    with pytest.raises(ValueError, match=r"needs captured kq_soft_max-\* nodes"):
        no_attn.image_attention(-1)
    with pytest.raises(ValueError, match="capture_encoder: the prompt holds no image"):
        vlm.trace("no image here", images=[], capture_encoder=["layer_out-*"])
    with pytest.raises(ValueError, match="capture_encoder: no node matches 'l_out-0'; close names: .*layer_out"):
        vlm.trace(PROMPT, images=[IMAGE], capture_encoder=["l_out-0"])
    with pytest.raises(mtmd.MediaError, match="1 media marker .* but 0 images"):
        vlm.trace(PROMPT, images=[])
    with pytest.raises(ValueError, match="prompt must be a str"):
        vlm.trace([1, 2, 3], images=[IMAGE])
    with pytest.raises(ValueError, match="images need a vision projector"):
        llm.LLM(MODEL, n_ctx=64).trace(PROMPT, images=[IMAGE])


def test_an_intervention_on_inp_embd_cannot_reach_the_images_rows(vlm):
    with pytest.raises(ValueError, match="interventions: an image's tokens .* no inp_embd"):
        vlm.trace(PROMPT, images=[IMAGE], interventions={"inp_embd": lambda x: x})
    assert vlm.trace("after an error", capture=["l_out-1"])["l_out-1"].shape[0] > 0


def test_the_overlay_figure(tr):
    import matplotlib
    matplotlib.use("Agg")
    import llm.plot
    ax = llm.plot.image_attention(tr, -1, layer=0)
    assert len(ax.images) == 2 and ax.images[1].get_array().shape == (4, 4)
    assert ax.images[0].get_array().shape == (64, 64, 3)


@pytest.mark.parametrize("name, grids", [("qwen2.5vl", [(3, 4)]), ("idefics3", [(4, 4)] * 5)])
def test_mrope_and_sliced_images(name, grids):
    """qwen2.5vl: 12 tokens at 2-D positions, the grid its ImageTokens' ny x nx; idefics3: four
    slices and the overview, one MediaTrace each. Last logits are llama.cpp's either way."""
    vlm = llm.LLM(DATA / f"{name}.gguf", mmproj=DATA / f"{name}.mmproj.gguf", n_ctx=256)
    ref = dict(np.load(DATA / f"{name}.npz"))
    tr = vlm.trace(PROMPT, images=[IMAGE], capture=["kq_soft_max-*"], capture_encoder=["kq_soft_max-0"])
    assert np.abs(tr.logits[-1] - ref["0_logits"]).max() / np.abs(ref["0_logits"]).max() < 1e-3
    assert [m.grid for m in tr.media] == grids
    for k, m in enumerate(tr.media):
        assert tr.image_attention(-1, image=k).shape == m.grid
        assert tr.tokens[m.start:m.start + m.n_tokens] == [MEDIA_PLACEHOLDER] * m.n_tokens
        assert np.allclose(m["kq_soft_max-0"].sum(axis=-1), 1.0, atol=1e-5)


def test_a_sounds_encoder_is_traced_too():
    """An audio mmproj (ultravox): the Whisper encoder's nodes are captured per audio chunk;
    the sound has no image grid, named as such."""
    alm = llm.LLM(DATA / "ultravox.gguf", mmproj=DATA / "ultravox.mmproj.gguf", n_ctx=512)
    tr = alm.trace(f"Listen: {mtmd.default_marker()} What is it?", images=[DATA / "test-sound.wav"],
                   capture=["kq_soft_max-*"], capture_encoder=["kq_soft_max-0", "layer_out-1"])
    (m,) = tr.media
    assert m.chunk.type == "audio" and m["kq_soft_max-0"].shape[1:] == (1500, 1500)
    assert np.allclose(m["kq_soft_max-0"].sum(axis=-1), 1.0, atol=1e-5)
    assert np.allclose(m.embd, alm.mtmd.encode_chunk(m.chunk), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"image 0 is a sound's chunk \(audio\): it has no image grid"):
        tr.image_attention(-1)

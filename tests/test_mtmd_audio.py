"""llm.mtmd's audio path (Whisper log-mel front end, the Whisper encoder, the ultravox, qwen2a
and voxtral projectors) against llama.cpp's stored output.

tests/data/mtmd/ultravox.*, qwen2a.* and voxtral.* (benchmarks/reference/make_mmproj.py
ultravox qwen2a voxtral): a tiny text model (llama; qwen2; llama), its audio mmproj, and
llama.cpp's decoded samples, chunks, audio embeddings and last logits for two prompts: the
committed 0.4 s 16 kHz mono test sound, and a 22.05 kHz stereo sound rebuilt from its seed
(resampled and mixed down by the decoder).
"""
from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest
from test_mtmd import gen, rel, rewrite_mmproj

import llm
from llm import mtmd
from llm.errors import ModelLoadError
from llm.mtmd import audio

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "mtmd"
MODEL, MMPROJ = DATA / "ultravox.gguf", DATA / "ultravox.mmproj.gguf"
SOUND = DATA / "test-sound.wav"
TOL = 1e-3          # relative: max |ours - llama.cpp| / max |llama.cpp|


PROJECTORS = ["ultravox", "qwen2a", "voxtral"]
# a 30 s chunk: 1500 positions stacked by 8; averaged in pairs; averaged in pairs and stacked by 4
N_TOKENS = {"ultravox": 187, "qwen2a": 750, "voxtral": 187}


@pytest.fixture(scope="module")
def ref() -> dict:
    return dict(np.load(DATA / "ultravox.npz"))


@pytest.fixture(scope="module", params=PROJECTORS)
def each(request) -> tuple:
    """(name, model, its MtmdContext, llama.cpp's arrays) per audio projector fixture."""
    name = request.param
    model = llm.load_model(DATA / f"{name}.gguf")
    return name, model, mtmd.init_from_file(DATA / f"{name}.mmproj.gguf", model), dict(np.load(DATA / f"{name}.npz"))


@pytest.fixture(scope="module")
def sounds() -> list[mtmd.Bitmap]:
    return [mtmd.Bitmap.from_file(SOUND), mtmd.Bitmap.from_bytes(gen().stereo_sound_bytes(), "stereo")]


@pytest.fixture(scope="module")
def model():
    return llm.load_model(MODEL)


@pytest.fixture(scope="module")
def mctx(model):
    return mtmd.init_from_file(MMPROJ, model)


def prompt_chunks(mctx, sounds, k: int) -> list[mtmd.InputChunk]:
    text, which = gen().AUDIO_PROMPTS[k]
    return mctx.tokenize(text, [sounds[i] for i in which])


def new_ctx(model, name: str = "ultravox") -> llm.Context:
    n = gen().N_CTX_OF.get(name, gen().N_CTX)
    return llm.Context(model, n_ctx=n, n_batch=n, n_ubatch=n, flash_attn=False)


# ---- decoding and the spectrogram ---------------------------------------------------------


def test_decoded_samples_equal_llamacpps(sounds, ref):
    """The same miniaudio: 16-bit mono at 16 kHz exactly, 22.05 kHz stereo after its mix and
    resampler within float rounding."""
    assert sounds[0].is_audio and (sounds[0].nx, sounds[0].ny) == (6400, 1)
    assert np.array_equal(sounds[0].data, ref["samples_0"])
    assert sounds[1].data.shape == ref["samples_1"].shape
    assert np.abs(sounds[1].data - ref["samples_1"]).max() < 1e-6
    assert mtmd.Bitmap.from_array(ref["samples_0"].astype(np.float64)).id == sounds[0].id
    # the length mtmd-helper keeps (ma_calculate_frame_count_after_resampling), not what the
    # resampler gives: 279034 samples from llama.cpp's tools/mtmd/test-2.mp3 (44.1 kHz), one less
    assert audio.frames_after_resampling(16000, 22050, 6615) == ref["samples_1"].size == 4800
    assert audio.frames_after_resampling(16000, 44100, 769089) == 279034


def test_the_spectrogram_is_cut_into_30_s_chunks():
    """30 s of padding follow the sound, so n seconds give floor(n / 30) + 1 chunks of 3000
    frames (the last partial one dropped); a sound shorter than half a window is padded."""
    filters = audio.mel_filters(80)
    assert filters.shape == (80, 201) and (filters >= 0).all()
    for seconds, n_chunks in ((0.005, 1), (29.9, 1), (30.0, 2), (65.0, 3)):
        x = np.sin(np.arange(int(seconds * audio.SAMPLE_RATE)) * 0.05).astype(np.float32)
        chunks = audio.whisper_chunks(x, filters)
        assert [c.shape for c in chunks] == [(80, 3000)] * n_chunks, seconds
    mel = chunks[0]
    # clamped 8 below the maximum, then (x + 4) / 4: values span at most 2
    assert mel.max() - mel.min() <= 2.0 + 1e-6


# ---- against llama.cpp -------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 1])
def test_chunks_and_embeddings_equal_llamacpp(each, sounds, k):
    """No text marks an ultravox sound, <|audio_bos|> and <|audio_eos|> a qwen2a one,
    [BEGIN_AUDIO] goes before a voxtral one; a 30 s chunk is 1500 encoder positions, stacked 8 at
    a time (187 tokens: ggml's padding quirk drops the last 4 positions at this width, as at
    Ultravox's 1280), averaged in pairs (750) or both, stacked by 4 (187)."""
    name, _, mctx, ref = each
    chunks = prompt_chunks(mctx, sounds, k)
    types = {"text": 0, "image": 1, "audio": 2}
    assert [types[c.type] for c in chunks] == list(ref[f"{k}_types"])
    assert [c.n_tokens for c in chunks] == list(ref[f"{k}_n_tokens"])
    assert [c.n_pos for c in chunks] == list(ref[f"{k}_n_pos"])
    for i, c in enumerate(chunks):
        if c.type == "text":
            assert c.tokens == list(ref[f"{k}_text_{i}"])
        else:
            embd = mctx.encode_chunk(c)
            assert embd.shape == ref[f"{k}_embd_{i}"].shape == (N_TOKENS[name], 64)
            assert rel(embd, ref[f"{k}_embd_{i}"]) < TOL          # at most 1.5e-5 (ultravox)


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 1])
def test_eval_chunks_logits_and_n_past_equal_llamacpp(each, sounds, k):
    name, model, mctx, ref = each
    ctx = new_ctx(model, name)
    n_past = mctx.eval_chunks(ctx, prompt_chunks(mctx, sounds, k))
    assert n_past == int(ref[f"{k}_n_past"])
    assert rel(ctx.get_logits_ith(-1), ref[f"{k}_logits"]) < TOL      # at most 4.6e-7 (voxtral)


@pytest.mark.slow
def test_a_31_s_sound_is_two_chunks_as_llamacpps(model, mctx, ref):
    """30 s of padding follow the sound: 31 s make two full spectrogram chunks, two audio chunks
    of 187 tokens each (the second 1 s of sound, then silence), evaluated one after the other."""
    text, _ = gen().LONG_PROMPT
    long = mtmd.Bitmap.from_bytes(gen().long_sound_bytes(), "long.wav")
    chunks = mctx.tokenize(text, [long])
    assert [c.type for c in chunks] == ["text", "audio", "audio", "text"]
    assert [c.n_tokens for c in chunks] == list(ref["2_n_tokens"]) == [10, 187, 187, 4]
    assert chunks[1].id == chunks[2].id == long.id and chunks[1].key != chunks[2].key
    for i in (1, 2):
        assert rel(mctx.encode_chunk(chunks[i]), ref[f"2_embd_{i}"]) < TOL
    ctx = new_ctx(model)
    assert mctx.eval_chunks(ctx, chunks) == int(ref["2_n_past"]) == 388
    assert rel(ctx.get_logits_ith(-1), ref["2_logits"]) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("suffix", ["", "-f16"])
def test_qwen25o_reads_an_image_and_a_sound_in_one_prompt(suffix):
    """qwen2.5o (Qwen2.5-Omni) holds a qwen2.5vl vision encoder and a qwen2a audio encoder in
    one file (mtmd's ctx_v and ctx_a): the image between <|vision_start|> and <|vision_end|> at
    2-D M-RoPE positions (12 tokens in 4 positions), the sound between <|audio_bos|> and
    <|audio_eos|> at 1-D ones in every section (750)."""
    model = llm.load_model(DATA / "qwen2.5o.gguf")
    mctx = mtmd.init_from_file(DATA / f"qwen2.5o{suffix}.mmproj.gguf", model)
    ref = dict(np.load(DATA / f"qwen2.5o{suffix}.npz"))
    assert mctx.support_vision() and mctx.support_audio()
    assert (mctx.projector.name, mctx.projector_a.name) == ("qwen2.5vl_merger", "qwen2a")
    media = [mtmd.Bitmap.from_file(p) for p in gen().IMAGES] + [mtmd.Bitmap.from_file(SOUND)]
    text, which = gen().OMNI_PROMPTS[0]
    chunks = mctx.tokenize(text, [media[i] for i in which])
    types = {"text": 0, "image": 1, "audio": 2}
    assert [types[c.type] for c in chunks] == list(ref["0_types"]) == [0, 1, 0, 2, 0]
    assert [c.n_tokens for c in chunks] == list(ref["0_n_tokens"])
    assert [c.n_pos for c in chunks] == list(ref["0_n_pos"]) == [9, 4, 12, 750, 3]
    for i, c in enumerate(chunks):
        if c.type == "text":
            assert c.tokens == list(ref[f"0_text_{i}"])
        elif c.type == "audio" or not suffix:          # the F16 image is qwen2.5vl's test (9.4e-4 here)
            assert rel(mctx.encode_chunk(c), ref[f"0_embd_{i}"]) < TOL        # image 2.9e-4, sound 2.9e-6
    assert chunks[3].image.decoder_pos(21).tolist() == [list(range(21, 771))] * 4
    ctx = new_ctx(model, "qwen2.5o")
    assert mctx.eval_chunks(ctx, chunks) == int(ref["0_n_past"]) == 778
    assert rel(ctx.get_logits_ith(-1), ref["0_logits"]) < TOL                  # 3.1e-6 (F16: 2.5e-5)


@pytest.mark.slow
def test_a_mixed_mmproj_with_an_unsupported_audio_encoder_reads_images(tmp_path, caplog):
    """Vision and audio encoders named apart (clip.vision / clip.audio.projector_type), the audio
    one not supported here (qwen3a): the images are still read, with a warning."""
    mixed = rewrite_mmproj(DATA / "qwen2.5o.mmproj.gguf", tmp_path / "mixed.mmproj.gguf",
                           drop_key="clip.projector_type", set_kv={"clip.vision.projector_type": "qwen2.5vl_merger",
                                                                   "clip.audio.projector_type": "qwen3a"})
    mctx = mtmd.init_from_file(mixed, llm.load_model(DATA / "qwen2.5o.gguf"))
    assert mctx.support_vision() and not mctx.support_audio()
    assert "its audio encoder ('qwen3a') is not supported; it reads images only" in caplog.text
    with pytest.raises(mtmd.MediaError, match=r"is a sound; the 'qwen2.5vl_merger' projector reads images"):
        mctx.tokenize(mtmd.default_marker(), [mtmd.Bitmap.from_file(SOUND)])


@pytest.mark.slow
@pytest.mark.parametrize("name", PROJECTORS)
def test_an_f16_mmproj_equals_llamacpp(sounds, name):
    model = llm.load_model(DATA / f"{name}.gguf")
    mctx = mtmd.init_from_file(DATA / f"{name}-f16.mmproj.gguf", model)
    ref = dict(np.load(DATA / f"{name}-f16.npz"))
    chunks = prompt_chunks(mctx, sounds, 0)
    for i, c in enumerate(chunks):
        if c.type == "audio":
            assert rel(mctx.encode_chunk(c), ref[f"0_embd_{i}"]) < TOL
    ctx = new_ctx(model, name)
    assert mctx.eval_chunks(ctx, chunks) == int(ref["0_n_past"])
    assert rel(ctx.get_logits_ith(-1), ref["0_logits"]) < TOL


@pytest.mark.slow
def test_encoder_nodes_carry_clip_cpps_names(mctx):
    g = mctx.graph(3000, 80)
    names = {n.name for n in g.gf.nodes} | {g.inp_raw.name}
    assert g.inp_raw.ne == (3000, 80, 1, 1)
    for il in (0, 1):
        assert {f"{n}-{il}" for n in ("layer_inp_normed", "Qcur", "Kcur", "Vcur", "kqv_out", "attn_out", "ffn_inp",
                                      "ffn_inp_normed", "ffn_up", "ffn_up_b", "ffn_gelu_erf", "ffn_down", "ffn_out",
                                      "layer_out")} <= names
    assert {"inp_raw", "after_conv1d", "pos_embed", "after_transformer", "after_stacked", "projected"} <= names


@pytest.mark.slow
def test_a_stack_llamacpp_would_miscount_is_refused(model, tmp_path):
    """Stacking 1500 positions of 40 by 9 gives 166 rows (GGML_PAD's mask), clip_n_output_tokens
    counts 167 and llama.cpp aborts: refused at load."""
    bad = rewrite_mmproj(MMPROJ, tmp_path / "stack9.mmproj.gguf", set_kv={"clip.audio.projector.stack_factor": 9})
    with pytest.raises(ModelLoadError, match="of 40 by 9 gives 166 tokens, llama.cpp counts 167"):
        mtmd.init_from_file(bad, model)


@pytest.mark.slow
def test_qwen2a_averages_positions_in_pairs_before_its_post_ln():
    """nn.AvgPool1d(2, 2) between the last layer and the post-LN: 1500 positions -> 750."""
    model = llm.load_model(DATA / "qwen2a.gguf")
    g = mtmd.init_from_file(DATA / "qwen2a.mmproj.gguf", model).graph(3000, 80)
    by_name = {n.name: n for n in g.gf.nodes}
    assert by_name["layer_out-1"].ne[:2] == (32, 1500) and by_name["after_transformer"].ne[:2] == (32, 750)
    assert g.out is not None and g.out.ne[:2] == (64, 750) and "after_stacked" not in by_name


# ---- bad input ---------------------------------------------------------------------------


def test_corrupt_truncated_and_unknown_sounds_are_media_errors(monkeypatch):
    wav = SOUND.read_bytes()
    with pytest.raises(mtmd.MediaError, match=r"half.wav: the WAV is truncated: its data chunk declares 12800 bytes"):
        mtmd.Bitmap.from_bytes(wav[: len(wav) // 2], "half.wav")
    with pytest.raises(mtmd.MediaError, match="the WAV has no data chunk"):
        mtmd.Bitmap.from_bytes(wav[:12] + bytes(100), "garbage.wav")
    with pytest.raises(mtmd.MediaError, match="cannot decode the audio"):
        mtmd.Bitmap.from_bytes(b"fLaC" + bytes(60), "bad.flac")
    with pytest.raises(mtmd.MediaError, match="sound.ogg: not an image in a known format, nor WAV / MP3 / FLAC"):
        mtmd.Bitmap.from_bytes(b"OggS" + bytes(60), "sound.ogg")
    monkeypatch.setattr(audio, "MAX_SECONDS", 0.25)
    with pytest.raises(mtmd.MediaError, match="over the limit of 0.25 s .refused before decoding"):
        mtmd.Bitmap.from_bytes(wav, "long.wav")
    with pytest.raises(mtmd.MediaError, match="float samples"):
        mtmd.Bitmap.from_array(np.zeros(100, np.int16))
    with pytest.raises(mtmd.MediaError, match="NaN"):
        mtmd.Bitmap.from_array(np.full(100, np.nan, np.float32))


@pytest.mark.slow
def test_images_and_sounds_go_to_their_own_projectors(mctx, sounds):
    img = mtmd.Bitmap.from_file(DATA / "test-image.png")
    with pytest.raises(mtmd.MediaError, match=r"bitmaps\[0\] is an image; the 'ultravox' projector reads sounds"):
        mctx.tokenize(f"{mtmd.default_marker()} x", [img])
    vision = mtmd.init_from_file(DATA / "mlp.mmproj.gguf", llm.load_model(DATA / "mlp.gguf"))
    with pytest.raises(mtmd.MediaError, match=r"bitmaps\[0\] is a sound; the 'mlp' projector reads images"):
        vision.tokenize(f"{mtmd.default_marker()} x", [sounds[0]])
    with pytest.raises(ModelLoadError, match="feeds gemma3, llama text models"):
        mtmd.init_from_file(MMPROJ, llm.load_model(ROOT / "tests" / "data" / "fixtures" / "smollm3-F32.gguf"))


# ---- the API -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def alm():
    return llm.LLM(MODEL, mmproj=MMPROJ, n_ctx=256)


@pytest.mark.slow
def test_generate_and_chat_with_a_sound_start_with_llamacpps_greedy_token(alm, ref):
    text, _ = gen().AUDIO_PROMPTS[0]
    c = alm.generate(text, images=[SOUND], max_tokens=1, temperature=0)
    assert c.tokens == [int(ref["0_logits"].argmax())] and c.n_prompt_tokens == int(ref["0_n_past"])
    n = alm.mtmd.n_encode
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(SOUND.read_bytes()).decode(),
                                                   "format": "wav"}}
    chat = alm.chat([{"role": "user", "content": [{"type": "text", "text": "What is this? "}, part]}],
                    max_tokens=2, temperature=0)
    assert chat.n_completion_tokens == 2 and alm.mtmd.n_encode == n      # the same sound: its embeddings cached
    samples = mtmd.Bitmap.from_file(SOUND).data
    again = alm.generate(text, images=[samples.astype(np.float64)], max_tokens=1, temperature=0)   # a float array
    assert again.tokens == c.tokens and alm.mtmd.n_encode == n
    bad = {"type": "input_audio", "input_audio": {"data": "%%", "format": "wav"}}
    with pytest.raises(mtmd.MediaError, match=r"messages\[0\].content\[0\]: the input_audio data is not valid base64"):
        alm.chat([{"role": "user", "content": [bad]}])
    with pytest.raises(mtmd.MediaError, match="format 'ogg'"):
        alm.chat([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "ogg"}}]}])


@pytest.mark.slow
def test_the_cli_generates_about_a_sound(alm, capsys):
    from llm import cli
    rc = cli.main(["generate", "-m", str(MODEL), "--mmproj", str(MMPROJ), "--audio", str(SOUND), "-p", "What is it?",
                   "-n", "3", "--temp", "0", "-c", "256"])
    out = capsys.readouterr()
    want = alm.generate(mtmd.default_marker() + "What is it?", images=[SOUND], max_tokens=3, temperature=0)
    assert rc == 0 and out.out == want.text + "\n"
    assert cli.main(["generate", "-m", str(MODEL), "--audio", str(SOUND), "-p", "x"]) == 2
    assert "--audio needs --mmproj" in capsys.readouterr().err


@pytest.mark.slow
def test_the_server_answers_input_audio_parts_as_the_librarys_chat(alm):
    import openai
    from starlette.testclient import TestClient

    from llm.serving.app import create_app
    from llm.serving.engine import Engine
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(SOUND.read_bytes()).decode(),
                                                   "format": "wav"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this? "}, part]}]
    want = alm.chat(messages, max_tokens=4, temperature=0)
    alm.reset()
    engine = Engine(alm.ctx, alm.vocab, n_slots=1, mtmd=alm.mtmd).start()
    try:
        with TestClient(create_app(alm, engine, model_name="ultravox")) as http_client:
            c = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http_client, max_retries=0)
            r = c.chat.completions.create(model="ultravox", messages=messages, max_tokens=4, temperature=0)
            assert r.choices[0].message.content == want.text and r.usage.prompt_tokens == want.n_prompt_tokens
            assert http_client.get("/props").json()["modalities"] == {"vision": False, "audio": True}
            for bad, message in (({"data": "UklGRg==", "format": "ogg"}, "an input_audio part must be"),
                                 ({"data": "%%", "format": "wav"}, "base64 is invalid"),
                                 ({"data": base64.b64encode(b"RIFF\0\0\0\0WAVE").decode(), "format": "wav"},
                                  "no data chunk")):
                with pytest.raises(openai.BadRequestError) as e:
                    c.chat.completions.create(model="ultravox", max_tokens=1, messages=[
                        {"role": "user", "content": [{"type": "text", "text": "x"},
                                                     {"type": "input_audio", "input_audio": bad}]}])
                assert e.value.param == "messages[0].content[1]" and message in e.value.message, e.value.body
    finally:
        engine.stop()
        alm.reset()
